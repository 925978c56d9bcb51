// Block selection in one layer of the store: a request's candidate blocks as runs of ids, their scores from
// the anchors (never K or V), and the top k of each set. The candidate cache (kvstore/cand_cache.h) does the
// same for preselected candidates from its compact copy, with this selector's scoring vectors.
//
// With the hierarchical index (StoreConfig::index_group > 0) a selection without a candidate list scores
// the group bounds first and then only the blocks of groups that may hold a top-k block
// (pruned_select.cpp): the same picks as the flat scan. Candidate lists (SnapKV) and block_scores stay flat.
//
// Determinism: every scoring task writes only its own blocks' scores, task boundaries depend only on the
// problem (never on threads_num), and each set's top k is one task; 1, 2 or 8 threads give the same ids.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvstore/layout.h"
#include "select/ada.h"
#include "select/request.h"

namespace ktq {

class BlockSelector {
 public:
  struct Cand {  // a top-k candidate: higher score wins, then the lower block id
    float score;
    int32_t id;
  };
  // Candidate blocks of one set as runs of consecutive ids: [start[i], start[i] + len[i]), ascending;
  // prefix[i] = candidates before run i (prefix.back() = all of them).
  struct Runs {
    std::vector<int32_t> start, len;
    std::vector<int64_t> prefix;
    template <class F>
    void each(F&& f) const {  // f(block id) for every candidate, ascending
      for (size_t r = 0; r < start.size(); ++r)
        for (int32_t b = start[r]; b < start[r] + len[r]; ++b) f(b);
    }
  };

  explicit BlockSelector(const StoreLayout& lay) : lay_(lay) {}

  // q: [var.n, H, D] unscaled (checked by the caller), borrowed until the call's selection is done: the
  // scoring vectors of the linear anchors, and q itself for FIXED/DYNAMIC. var: which rotation scores which
  // block (dual chunk attention; request.h), kept until the next set_query.
  void set_query(const float* q, int H, const QueryVariants& var = {});
  // The candidates of n_sets sets among nb blocks: req's allowed lists (checked) or every block, less req's
  // exclusion ranges (checked; req may be null: every block).
  void build_runs(int64_t nb, int n_sets, const SelectRequest* req);
  const std::vector<Runs>& runs() const { return runs_; }
  // scores: [n_sets, nb]; only the candidates of runs() are written. Reads the A*D anchors of each candidate
  // block and KV head, nothing else.
  void score_runs(const StoreLayer& L, int H, HeadMode mode, float* scores);
  // out[0, n) (+)= linear scores (QUEST / BLOCK_*) of n consecutive anchor rows at a, for KV head h, by the
  // query rotation v; int8 rows (a candidate cache of int8_candidates) when scale8 is given, their scales.
  void score_linear_rows(const uint8_t* a, int64_t n, int h, float* out, bool accumulate,
                         const float* scale8 = nullptr, int v = 0) const;
  const QueryVariants& variants() const { return var_; }
  // The top k of each set of runs() (built for req) into out_ids [n_sets, out_cols], ascending ids then -1;
  // t.score_s and t.topk_s. Through the hierarchical index when the store has one and req no candidate list.
  void select_runs(const StoreLayer& L, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                   StageTiming& t);
  // What the last select_runs scored (IndexStats).
  const IndexStats& index_stats() const { return stats_; }
  // The score select_runs gives block b in set s of `mode` (SHARED: summed over the KV heads). Needs
  // set_query; thread-safe between calls that share that query.
  float score_block(const StoreLayer& L, int H, HeadMode mode, int s, int32_t b) const;
  // Whether select_runs walks the index (default) or scans every block as a store without one does, over
  // the same anchors and with the same picks (for measuring one against the other on one store).
  void set_walk_index(bool on) { walk_index_ = on; }
  // The hierarchical index's bound of each group of the layer's blocks for each set of `mode` (n_sets = 1 or
  // KVH): out [n_sets, n_groups] fp64, at least the fp32 score select_runs computes for any block of the group
  // (+inf: no bound). Needs index_group > 0 and set_query.
  void group_bounds(const StoreLayer& L, int H, HeadMode mode, double* out);

 private:
  // out[0, n) (+)= the scores of blocks [b, b + n) for KV head h: the one scoring path of every selection
  // (each block by the query rotation var_ gives it: score_piece, blocks of one rotation).
  void score_blocks(const StoreLayer& L, int H, int h, int64_t b, int64_t n, float* out, bool accumulate) const;
  void score_piece(const StoreLayer& L, int H, int h, int64_t b, int64_t n, int v, float* out, bool accumulate) const;
  // One rotation's scoring vectors (qe_, and the index's qb_) from q [H, D].
  void fold_query(const float* q, int H, int v);
  void set_index_query(const float* q, int H, int v);
  // select_runs through the index (pruned_select.cpp); kcap: the largest k of a set (check_k).
  void select_pruned(const StoreLayer& L, int H, const SelectRequest& req, int64_t kcap, int32_t* out_ids,
                     int out_cols, StageTiming& t);

  const StoreLayout& lay_;
  bool walk_index_ = true;                         // set_walk_index
  QueryVariants var_;                              // the query's rotations (set_query)
  std::vector<float> qe_;                          // [V, KVH, A*D] per-head scoring vectors (QUEST/BLOCK_*)
  std::vector<float> qb_;                          // [V, KVH, 3, D] per-head group bound vectors (Q-, Q+, W)
  const float* qraw_ = nullptr;                    // [V, H, D] the caller's q (FIXED/DYNAMIC scoring), this call only
  std::vector<std::pair<int64_t, int64_t>> excl_;  // merged exclusion ranges
  std::vector<int32_t> ids_;                       // allowed ids, sorted
  std::vector<Runs> runs_;                         // [n_sets]
  std::vector<int64_t> task_start_;                // scoring tasks per set
  std::vector<float> scores_;                      // [n_sets, n_blocks]
  std::vector<Cand> heap_;                         // top-k heaps, [n_sets, kcap]
  std::vector<float> topv_;                        // top-k: score copies, [n_sets, candidates]
  std::vector<int32_t> topids_;                    // top-k: their block ids, [n_sets, candidates]
  std::vector<int32_t> topkeys_;                   // top-k: top_k's scratch keys, [n_sets, candidates]
  std::vector<float> gbound_, gmag_;               // index: score_bounds' outputs, [V, KVH, n_groups]
  std::vector<double> gsets_;                      // index: each set's group bounds, [n_sets, n_groups]
  std::vector<std::pair<double, int32_t>> gorder_;  // index: (bound, group) in phase 1's order, [n_sets, n_groups]
  std::vector<uint8_t> seen_;                      // index: groups phase 1 scored, [n_sets, n_groups]
  std::vector<int64_t> set_n_, set_scored_;        // index: per set, phase 1's kept and scored blocks
  std::vector<uint8_t> set_done_;                  // index: per set, phase 1 found the top k
  std::vector<int64_t> chunk_task_;                // index: phase 2 chunks, set * chunks_per_set + chunk
  std::vector<Cand> chunk_heap_;                   // index: phase 2 chunks' top k, [n_chunks, kcap]
  std::vector<int64_t> chunk_n_, chunk_scored_;    // index: per chunk, kept and scored blocks
  AdaSplit ada_;                                   // Ada-KV: the candidates' scores and the sets' budgets
  IndexStats stats_;
};

// Checks k per set against the output's room (count(s): the set's candidates); returns the largest
// number of blocks a set keeps, and in *keep_all whether every set keeps all of its candidates. With
// req.ada a set keeps up to the sum of k (at most its candidates), and all keep all when that sum covers them.
template <class Count>
int64_t check_k(const SelectRequest& req, int n_sets, int out_cols, Count count, bool* keep_all) {
  int64_t total = 0, n_all = 0;
  for (int s = 0; s < n_sets; ++s) {
    if (req.k_per_set[s] < 0)
      throw std::invalid_argument("k must be >= 0, got " + std::to_string(req.k_per_set[s]) + " for set " +
                                  std::to_string(s));
    total += req.k_per_set[s];
    n_all += count(s);
  }
  int64_t kcap = 0;
  *keep_all = !req.ada || total >= n_all;
  for (int s = 0; s < n_sets; ++s) {
    const int64_t need = std::min<int64_t>(req.ada ? total : req.k_per_set[s], count(s));
    if (need > out_cols)
      throw std::invalid_argument("the output has room for " + std::to_string(out_cols) + " blocks per set, set " +
                                  std::to_string(s) + " selects " + std::to_string(need));
    kcap = std::max(kcap, need);
    if (!req.ada) *keep_all = *keep_all && req.k_per_set[s] >= count(s);
  }
  return kcap;
}

}  // namespace ktq
