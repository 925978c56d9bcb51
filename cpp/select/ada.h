// Ada-KV's split of a layer's selection budget over its KV heads (Feng et al., "Ada-KV", 2024): a head
// whose attention is concentrated needs few blocks, one whose attention is spread needs many. The rule is
// tests/test_selection.py's ada_budgets_reference (exact fractions), exactly (the tests compare the two):
//
//   T = min(total, every set's candidates); share s_i = set i's candidates among the best T of all sets'
//   scores (equal scores: the lower set, then the earlier candidate); b_i = s_i (1 - alpha) + u_i, the
//   uniform part alpha T split evenly but never past a set's own candidates (what a capped set cannot take
//   goes evenly to the others); every set gets floor(b_i), and the T - sum floor(b_i) left go one each to
//   the largest fractional parts (equal parts: the lower set).
//
// alpha = num / den, and the arithmetic is on integers over the denominator den * (sets not capped), so
// the rounding never depends on float error. Every candidate counts towards its set's cap, whatever its
// score (Python leaves -inf scores out: they mark non-candidates there); NaN scores rank as -inf (as top k
// ranks them). Over int8_candidates the scores are the int8 copy's, as the cut that follows.
#pragma once

#include <cstdint>
#include <vector>

#include "select/request.h"

namespace ktq {

// scores: every set's candidate scores, set after set (set s holds counts[s] of them, in candidate order);
// total >= 0, 0 <= num <= den, 1 <= den <= kAdaMaxDen. out: [n_sets] budgets summing to min(total, sum
// counts), each in [0, counts[s]]. scratch: reused between calls.
void ada_budgets(int n_sets, const int64_t* counts, const float* scores, int64_t total, int64_t num, int64_t den,
                 int32_t* out, std::vector<float>& scratch);

inline constexpr int64_t kAdaMaxDen = 1000000;  // alpha's denominator (Python reads alpha as the nearest such fraction)

// A selection's Ada-KV workspace: fill `scores` and `counts` with every set's candidate scores (set after
// set), then split() the request's sum of k by them into [n_sets] budgets (valid until the next split).
struct AdaSplit {
  std::vector<float> scores;
  std::vector<int64_t> counts;
  const int32_t* split(const SelectRequest& req);

 private:
  std::vector<float> scratch_;
  std::vector<int32_t> k_;
};

}  // namespace ktq
