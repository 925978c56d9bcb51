// The bounded heap both top_candidates twins share (sampler.h): the k best candidates seen so far, the worst
// at the front.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "sample/sampler.h"

namespace ktq {

class CandidateHeap {
 public:
  // Starts with ids [0, k) of logits (NaN as -inf); out: room for k candidates, the heap's storage.
  CandidateHeap(const float* logits, int64_t k, Candidate* out) : h_(out), k_(k) {
    for (int64_t i = 0; i < k; ++i)
      h_[i] = {logits[i] == logits[i] ? logits[i] : -std::numeric_limits<float>::infinity(), int32_t(i)};
    std::make_heap(h_, h_ + k_, ranks_before);  // "largest" by ranks_before = the worst, at h_[0]
  }
  float worst() const { return h_[0].logit; }
  // id must exceed every id offered before: then it ranks before the worst exactly when its logit is greater
  // (NaN never is).
  void offer(float logit, int32_t id) {
    if (!(logit > h_[0].logit)) return;
    std::pop_heap(h_, h_ + k_, ranks_before);
    h_[k_ - 1] = {logit, id};
    std::push_heap(h_, h_ + k_, ranks_before);
  }
  // The candidates best first; returns k.
  int64_t sorted() {
    std::sort_heap(h_, h_ + k_, ranks_before);
    return k_;
  }

 private:
  Candidate* h_;
  int64_t k_;
};

}  // namespace ktq
