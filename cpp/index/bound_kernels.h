// The hierarchical index's kernel on raw pointers: the score bounds of groups of blocks from their bound
// rows (group_bounds.h). Scalar twin in bound_kernels.cpp, AVX2/FMA version in bound_kernels_avx2.cpp
// (D % 8 == 0, F16C for the rows); the pruned selection (select/pruned_select.cpp) picks one per call from use_avx2().
#pragma once

#include <cstdint>

namespace ktq {

// ---- contract (both twins) ----
//
// score_bounds: for each of n groups, rows: [n, 2, D] fp16 (the group's min row, then its max row), and one
// KV head's bound vectors qb: [3, D] = (Q- <= 0, Q+ >= 0, W = Q+ - Q-):
//   bound[i] = sum_d Q-_d gmin_d + Q+_d gmax_d     the group's bound (group_bounds.h), in fp32
//   mag[i]   = sum_d W_d max(|gmin_d|, |gmax_d|)    bounds sum_c |q_c a_c| over any member's score terms,
//                                                   so the caller can widen bound by fp32's rounding error
// Both are fp32 sums in any order: the caller's margin covers either twin. A group with an empty hull (min
// +inf, max -inf) gives a mag of inf or NaN, as does an overflow: the caller then has no bound (visits it).

namespace scalar {
void score_bounds(const uint16_t* rows, int64_t n, int D, const float* qb, float* bound, float* mag);
}  // namespace scalar

namespace avx2 {  // requires D % 8 == 0
void score_bounds(const uint16_t* rows, int64_t n, int D, const float* qb, float* bound, float* mag);
}  // namespace avx2

}  // namespace ktq
