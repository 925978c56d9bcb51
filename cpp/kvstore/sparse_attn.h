// Sparse attention over the store's selected blocks: every query head of one KV head against that head's
// blocks, split-K online softmax, tasks on the shared ThreadPool. Kernels: attn/attn_kernels.h.
//
// Determinism: every task writes only its own partial (m, l, acc) of its chunk of blocks, task boundaries
// depend only on the selection and the query shape (never on threads_num), and partials are merged
// afterwards in chunk order (attn/merge.h). So 1, 2 or 8 threads give the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "kvstore/cand_cache.h"
#include "kvstore/layout.h"
#include "select/request.h"

namespace ktq {

class SparseAttention {
 public:
  explicit SparseAttention(const StoreLayout& lay) : lay_(lay) {}

  // q: [var.n, H, D] unscaled (checked by the caller): kept as q / sqrt(D) for this call's attention; each
  // block is attended with the rotation var gives it (dual chunk attention, select/request.h).
  void set_query(const float* q, int H, const QueryVariants& var = {});

  // Work done in the attention's own dispatch, ahead of it: tasks [0, n) run run(ctx, s) (set s's
  // selection; must not throw), and head h's attention tasks start once its set (h, or 0 when shared) is
  // done, so the selection and the attention share one hand-off to the workers and the threads that
  // finish a set early go on attending. count [KVH]: the blocks each head will attend (known up front).
  struct Prologue {
    int n = 0;
    int threads = 1;
    const int64_t* count = nullptr;
    void (*run)(void* ctx, int s) = nullptr;
    void* ctx = nullptr;
  };

  // softmax(q K^T / sqrt(D)) V of each head over its KV head's blocks in `blocks` (validate: check the ids,
  // else they are trusted). out: [H, D], lse: [H] (-inf and a zero row for a head with no block); t.attend_s.
  // kvc: read the tiles from kvc's copy at caches->slots() (a select_attend over cached candidates).
  // block_lse (optional): [KVH, blocks.cols, G] each attended block's own log-sum-exp per query head
  // (attn_kernels.h tile_lse), -inf past a head's blocks: a block's share of head g's attention is
  // exp(block_lse - lse[g]).
  void run(const StoreLayer& L, int H, const BlockSets& blocks, bool validate, float* out, float* lse, StageTiming& t,
           const Prologue* pre = nullptr, const CandCaches* caches = nullptr, const CandCache* kvc = nullptr,
           float* block_lse = nullptr);

 private:
  const StoreLayout& lay_;
  QueryVariants var_;                // set_query's
  std::vector<float> qs_;            // [V, H, D] q / sqrt(D)
  std::vector<int64_t> count_;       // [KVH] selected blocks per head
  std::vector<int64_t> task_start_;  // [KVH + 1] each head's tasks
  std::vector<float> part_;          // split-K partials: [n_tasks, G, D + 2]
};

}  // namespace ktq
