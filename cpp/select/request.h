// What a selection is asked for and what it gives: the request (k per set, exclusions, candidate lists), the
// selected block sets an attention reads, and the stage timings of the call.
#pragma once

#include <chrono>
#include <cstdint>
#include <iterator>

namespace ktq {

// SHARED: one block set for every KV head (scores summed over the heads); SEPARATE: one set per KV head.
enum class HeadMode : int { SHARED = 0, SEPARATE = 1 };
inline constexpr const char* kHeadModeNames[] = {"SHARED", "SEPARATE"};  // in enum order
static_assert(std::size(kHeadModeNames) == size_t(HeadMode::SEPARATE) + 1);

// Which blocks to keep (all pointers borrowed for the call). n_sets = 1 (SHARED) or KVH (SEPARATE).
struct SelectRequest {
  HeadMode mode = HeadMode::SEPARATE;
  const int32_t* k_per_set = nullptr;  // [n_sets] blocks to keep per set
  const int64_t* exclude = nullptr;    // [n_exclude, 2] half-open block ranges [b0, b1), never selected
  int n_exclude = 0;
  const int32_t* allowed = nullptr;  // [n_sets, allowed_cols] candidate block ids, -1 = padding; null = all
  int allowed_cols = 0;
  // Ada-KV (SEPARATE): the sets' k are split anew from their sum by every set's scores (select/ada.h), with
  // the uniform floor share alpha = ada_num / ada_den; a set may then keep up to that sum.
  bool ada = false;
  int64_t ada_num = 0, ada_den = 1;
  // A second stage (kvstore/rerank.h): the anchors pick rerank x k blocks of each set, and the k of those that
  // hold the most attention mass for the query (QK over their keys, no V) are kept. 1 = the anchors' top k.
  int rerank = 1;
};

// Dual chunk attention (ktquest/models/dual_chunk.py): a query comes in n = 3 rotations, q [3, H, D] (intra,
// successive, inter), and every key is scored and attended with the one its chunk calls for: keys before `succ`
// the inter rotation, [succ, intra) the successive one, from `intra` on the intra one. The bounds are block ids
// for the selection and the attention, token positions for SnapKV. n = 1: one rotation, q [H, D], for every key.
struct QueryVariants {
  int n = 1;
  int64_t succ = 0, intra = 0;

  int of(int64_t x) const { return n == 1 || x >= intra ? 0 : x >= succ ? 1 : 2; }
  // The first id past x whose variant differs from x's (a huge value where none does).
  int64_t end_of(int64_t x) const {
    if (n == 1 || x >= intra) return INT64_MAX;
    return x >= succ ? intra : succ;
  }
};

// Selected blocks: [n_sets, cols], ascending ids then -1 padding; n_sets = 1 means "every KV head".
struct BlockSets {
  const int32_t* ids = nullptr;
  int n_sets = 1;
  int cols = 0;
};

// Wall time of the stages of the last select/attend call, seconds.
// With cached candidates (SnapKV's preselection) a set is scored and cut in one task: topk_s is then the
// top-k part of those tasks spread over the threads, score_s the rest of the pass. In select_attend those
// tasks share the attention's dispatch: score_s and topk_s are their task times over the threads, attend_s
// the rest of the call.
// With the hierarchical index (index_group) score_s is the group bounds' pass and topk_s the pruned walk
// (the visited groups' block scores and the top k).
// With a second stage (SelectRequest::rerank) rerank_s is its time (the picks' QK and the cut by mass).
struct StageTiming {
  double score_s = 0, topk_s = 0, attend_s = 0, rerank_s = 0;
};

// What the last selection without a candidate list scored: group bounds (summed over sets; 0 without the
// index), blocks (anchor rows scored, per set, summed over sets) and candidate blocks (summed over sets).
struct IndexStats {
  int64_t groups = 0, blocks_scored = 0, candidates = 0;
};

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace ktq
