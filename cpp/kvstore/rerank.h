// The store's second stage of selection (SelectRequest::rerank = R > 1): the anchors pick R k blocks of each set,
// then each of those blocks is weighed by the attention mass it holds for this query, and the k heaviest are
// kept. The anchors' scores are bounds (QUEST) or summaries (BLOCK_*) of q . k over a block; what they lose at a
// small budget is the order among the blocks they keep (docs/accuracy.md, the budget curve): at 2% of a 32K
// context QUEST's picks hold 0.48 of the attention mass, the best blocks 0.67, QUEST's top 4k by mass 0.58.
//
// A block's mass: its keys' log-sum-exp for each query head (attn_kernels.h tiles_lse: QK over the tile, no V),
// each head's shares over the set's R k candidates (exp(lse - the head's LSE over them)), summed over the set's
// query heads (SEPARATE: the G heads of its KV head; SHARED: every head, each against its KV head's tile). So
// every query head weighs the same, however peaked its attention. The cost: QK over R k blocks a set.
//
// Ada-KV (SelectRequest::ada): the first stage splits R times the budget; the second splits the budget itself by
// the masses (select/ada.h over the candidates' masses, which are comparable across sets: each set's sum to its
// query heads), then keeps each set's heaviest.
//
// Determinism: every task (a KV head's chunk of candidates) writes only its own blocks' LSEs, chunk boundaries
// depend only on the selection, and each set's masses are summed in one task in candidate order: any thread
// count gives the same picks. Equal masses: the lower block id.
#pragma once

#include <cstdint>
#include <vector>

#include "kvstore/cand_cache.h"
#include "kvstore/layout.h"
#include "select/ada.h"
#include "select/request.h"

namespace ktq {

class MassRerank {
 public:
  explicit MassRerank(const StoreLayout& lay) : lay_(lay) {}

  // The first stage's request: req's with R times each set's k (into this object; valid until the next call).
  const SelectRequest& widen(const SelectRequest& req, int n_sets, int R);
  // Room the first stage's picks need per set, for an output with out_cols columns for k (at most nb).
  static int wide_cols(int out_cols, int R, int64_t nb);
  // q [var.n, H, D] unscaled (checked by the caller); kept scaled for run().
  void set_query(const float* q, int H, const QueryVariants& var);
  // wide [n_sets, wide_cols]: the first stage's picks (ascending valid ids, then -1). Writes out_ids [n_sets,
  // out_cols]: of each set's picks the req.k_per_set[s] (Ada-KV: the split of their sum by mass) of largest
  // mass, ascending, -1 padded. t.rerank_s. kvc: the picks are kvc's candidates, whose K tiles are read from its
  // compact copy (caches->tile; copied: copy_tiles) instead of the store's.
  void run(const StoreLayer& L, int H, const SelectRequest& req, int n_sets, const int32_t* wide, int wide_cols,
           int32_t* out_ids, int out_cols, StageTiming& t, const CandCaches* caches = nullptr,
           const CandCache* kvc = nullptr);
  // The mass the last run gave block b of set s (one of its first-stage picks; else -inf). Needs wide as run saw it.
  double mass_of(int s, int32_t b) const;

 private:
  const StoreLayout& lay_;
  QueryVariants var_;
  SelectRequest wide_req_;
  std::vector<int32_t> wide_k_;      // [n_sets] R k
  std::vector<float> qs_;            // [V, H, D] q / sqrt(D)
  std::vector<int64_t> count_;       // [n_sets] the first stage's picks per set
  std::vector<int64_t> task_start_;  // [KVH + 1] each KV head's chunk tasks
  std::vector<float> lse_;           // [n_sets, wide_cols, heads per set] each pick's LSE per query head
  AdaSplit ada_;                     // the candidates' masses (set after set) and their counts
  std::vector<std::pair<double, int32_t>> order_;  // [n_sets, wide_cols] (mass, id) per set
  std::vector<double> mass_;                       // [n_sets, wide_cols] the picks' masses, in wide's order
  const int32_t* wide_ = nullptr;                  // the last run's
  int wide_cols_ = 0;
};

}  // namespace ktq
