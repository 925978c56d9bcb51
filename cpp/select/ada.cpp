// Ada-KV budgets (ada.h).
#include "select/ada.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace ktq {

void ada_budgets(int n_sets, const int64_t* counts, const float* scores, int64_t total, int64_t num, int64_t den,
                 int32_t* out, std::vector<float>& scratch) {
  if (n_sets < 1) throw std::invalid_argument("ada_budgets: need at least one set, got " + std::to_string(n_sets));
  if (total < 0) throw std::invalid_argument("ada_budgets: total must be >= 0, got " + std::to_string(total));
  if (den < 1 || den > kAdaMaxDen || num < 0 || num > den)
    throw std::invalid_argument("ada_budgets: alpha = " + std::to_string(num) + "/" + std::to_string(den) +
                                " must lie in [0, 1] with a denominator in [1, " + std::to_string(kAdaMaxDen) + "]");
  int64_t n_all = 0;
  for (int s = 0; s < n_sets; ++s) n_all += counts[s];
  const int64_t T = std::min(total, n_all);
  std::fill(out, out + n_sets, 0);
  if (T == 0) return;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto val = [](float x) { return std::isnan(x) ? kNegInf : x; };

  // 1. Shares of the best T: every score above the T-th best, then the equal ones in set and candidate order.
  scratch.resize(size_t(n_all));
  for (int64_t i = 0; i < n_all; ++i) scratch[i] = val(scores[i]);
  std::nth_element(scratch.begin(), scratch.begin() + (T - 1), scratch.end(), std::greater<float>());
  const float v = scratch[T - 1];
  std::vector<int64_t> share(n_sets, 0);
  int64_t above = 0;
  for (int64_t i = 0, s = 0, end = counts[0]; i < n_all; ++i) {
    while (i == end) end += counts[++s];
    if (val(scores[i]) > v) ++share[s], ++above;
  }
  int64_t ties = T - above;  // equal to the T-th best: the first ones in set, then candidate, order
  for (int64_t i = 0, s = 0, end = counts[0]; i < n_all && ties > 0; ++i) {
    while (i == end) end += counts[++s];
    if (val(scores[i]) == v) ++share[s], --ties;
  }

  // 2. Water-filling of the uniform part: room_i = cap_i - s_i (1 - alpha) = R_i / den; in ascending room
  // (then set) order a set whose room is below the level left / n_left takes its room (it ends at its cap).
  const int64_t keep = den - num;  // den (1 - alpha)
  std::vector<int64_t> R(n_sets);
  std::vector<int> order(n_sets);
  for (int s = 0; s < n_sets; ++s) R[s] = counts[s] * den - share[s] * keep;
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return R[a] != R[b] ? R[a] < R[b] : a < b; });
  int64_t left = num * T;  // den * (uniform part not yet given)
  int64_t n_left = n_sets;
  std::vector<char> capped(n_sets, 0);
  for (int s : order) {
    if (R[s] * n_left >= left) break;  // room >= level: this set and every later one take the level
    capped[s] = 1;
    left -= R[s];
    --n_left;
  }

  // 3. Budgets over the denominator den * n_left: a capped set's is its cap (s_i (1 - alpha) + room_i), the
  // others' s_i keep n_left + left; floors, then the largest remainders.
  const int64_t q = den * std::max<int64_t>(n_left, 1);
  std::vector<int64_t> rem(n_sets, 0);
  int64_t given = 0;
  for (int s = 0; s < n_sets; ++s) {
    int64_t b;
    if (capped[s]) {
      b = counts[s];
    } else {
      const int64_t x = share[s] * keep * n_left + left;
      b = x / q;
      rem[s] = x % q;
    }
    out[s] = int32_t(b);
    given += b;
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rem[a] > rem[b]; });
  for (int64_t i = 0; i < T - given; ++i) ++out[order[i]];
}

const int32_t* AdaSplit::split(const SelectRequest& req) {
  const int n_sets = int(counts.size());
  int64_t total = 0;
  for (int s = 0; s < n_sets; ++s) total += req.k_per_set[s];
  k_.resize(n_sets);
  ada_budgets(n_sets, counts.data(), scores.data(), total, req.ada_num, req.ada_den, k_.data(), scratch_);
  return k_.data();
}

}  // namespace ktq
