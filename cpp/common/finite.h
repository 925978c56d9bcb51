// Finite-value checks of fp32 inputs: the one place that says what "not finite" is for the store's appended rows,
// a query, the decode step's q, and a scalar argument (an attention's softmax scale, a norm's eps).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace ktq {

// The first i in [0, n) with !(|x[i]| < limit) (NaN, +-inf, or a magnitude of limit or more), or -1.
inline int64_t first_not_below(const float* x, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i)
    if (!(std::fabs(x[i]) < limit)) return i;
  return -1;
}

// The first NaN or +-inf of x[0, n), or -1.
inline int64_t first_non_finite(const float* x, int64_t n) {
  return first_not_below(x, n, std::numeric_limits<float>::infinity());
}

// q: [H, D]. Throws std::invalid_argument("q contains a non-finite value at head h, dim d") at the first one.
void check_finite_q(const float* q, int64_t H, int D);

// Throws std::invalid_argument("<name>=nan is not finite") unless x is finite.
void check_finite(float x, const char* name);

}  // namespace ktq
