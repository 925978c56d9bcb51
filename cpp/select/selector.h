// Block selection in one layer of the store: a request's candidate blocks as runs of ids, their scores from
// the anchors (never K or V), and the top k of each set. The candidate cache (kvstore/cand_cache.h) does the
// same for preselected candidates from its compact copy, with this selector's scoring vectors.
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

  // q: [H, D] unscaled (checked by the caller), borrowed until the call's selection is done: the scoring
  // vectors of the linear anchors, and q itself for FIXED/DYNAMIC.
  void set_query(const float* q, int H);
  // The candidates of n_sets sets among nb blocks: req's allowed lists (checked) or every block, less req's
  // exclusion ranges (checked; req may be null: every block).
  void build_runs(int64_t nb, int n_sets, const SelectRequest* req);
  const std::vector<Runs>& runs() const { return runs_; }
  // scores: [n_sets, nb]; only the candidates of runs() are written. Reads the A*D anchors of each candidate
  // block and KV head, nothing else.
  void score_runs(const StoreLayer& L, int H, HeadMode mode, float* scores);
  // out[0, n) (+)= linear scores (QUEST / BLOCK_*) of n consecutive anchor rows at a, for KV head h; int8
  // rows (a candidate cache of int8_candidates) when scale8 is given, their scales.
  void score_linear_rows(const uint8_t* a, int64_t n, int h, float* out, bool accumulate,
                         const float* scale8 = nullptr) const;
  // The top k of each set of runs() (built for req) into out_ids [n_sets, out_cols], ascending ids then -1;
  // t.score_s and t.topk_s.
  void select_runs(const StoreLayer& L, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                   StageTiming& t);

 private:
  const StoreLayout& lay_;
  std::vector<float> qe_;                          // [KVH, A*D] per-head scoring vectors (QUEST/BLOCK_*)
  const float* qraw_ = nullptr;                    // [H, D] the caller's q (FIXED/DYNAMIC scoring), this call only
  std::vector<std::pair<int64_t, int64_t>> excl_;  // merged exclusion ranges
  std::vector<int32_t> ids_;                       // allowed ids, sorted
  std::vector<Runs> runs_;                         // [n_sets]
  std::vector<int64_t> task_start_;                // scoring tasks per set
  std::vector<float> scores_;                      // [n_sets, n_blocks]
  std::vector<Cand> heap_;                         // top-k heaps, [n_sets, kcap]
  std::vector<float> topv_;                        // top-k: score copies, [n_sets, candidates]
  std::vector<int32_t> topids_;                    // top-k: their block ids, [n_sets, candidates]
  std::vector<int32_t> topkeys_;                   // top-k: top_k's scratch keys, [n_sets, candidates]
};

// Checks k per set against the output's room (count(s): the set's candidates); returns the largest
// number of blocks a set keeps, and in *keep_all whether every set keeps all of its candidates.
template <class Count>
int64_t check_k(const SelectRequest& req, int n_sets, int out_cols, Count count, bool* keep_all) {
  int64_t kcap = 0;
  *keep_all = true;
  for (int s = 0; s < n_sets; ++s) {
    if (req.k_per_set[s] < 0)
      throw std::invalid_argument("k must be >= 0, got " + std::to_string(req.k_per_set[s]) + " for set " +
                                  std::to_string(s));
    const int64_t need = std::min<int64_t>(req.k_per_set[s], count(s));
    if (need > out_cols)
      throw std::invalid_argument("the output has room for " + std::to_string(out_cols) + " blocks per set, set " +
                                  std::to_string(s) + " selects " + std::to_string(need));
    kcap = std::max(kcap, need);
    *keep_all = *keep_all && req.k_per_set[s] >= count(s);
  }
  return kcap;
}

}  // namespace ktq
