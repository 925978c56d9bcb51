// Weight-only int8 GEMV for CPU decode: y[T, out] = x[T, in] @ W[out, in]^T (+ bias).
//
// W is stored Q8_0 (rounding in quant/q8_0.h): int8 values in groups of kQGroup = 32 along `in`, one fp32 scale
// per group:
//   qs:     [out, in]        int8, q = round_half_even(w * (1 / d)) with d = absmax(group) / 127
//   scales: [out, in / 32]   fp32 d
// x stays fp32 (weight-only quantization): each int8 weight is widened to fp32 in registers and
// multiplied by x with FMA; a group's sum is scaled by d once. Decode reads a quarter of fp32's bytes,
// which is what it is bound by, and the only error is the weights' rounding (at most d/2 a weight).
// Quantizing x too (ggml's Q8_0 x Q8_0 with maddubs) would be cheaper in instructions, but on the
// bundled 135M model its extra error flips greedy tokens whose logit margins are ~0.1.
#pragma once

#include <cstdint>

#include "quant/q8_0.h"

namespace ktq {

// y[t, o] = sum_g d_w[o, g] * dot(qw[o, g, :], x[t, g, :]) (+ bias[o])
// x: [T, in] fp32, qw: [out, in], dw: [out, in/32], bias: [out] or nullptr, y: [T, out].
// Rows of W are split across `n_threads` threads; every output element is computed by one thread
// in a fixed order, so the result does not depend on the thread count.
void gemv_q8_0(const float* x, int64_t T, int64_t in, const int8_t* qw, const float* dw, int64_t out,
               const float* bias, float* y, int n_threads);

// ---- kernels (rows [o0, o1) of one activation row), picked at run time ----
void gemv_q8_0_rows_scalar(const float* x, int64_t in, const int8_t* qw, const float* dw, const float* bias,
                           float* y, int64_t o0, int64_t o1);
void gemv_q8_0_rows_avx2(const float* x, int64_t in, const int8_t* qw, const float* dw, const float* bias,
                         float* y, int64_t o0, int64_t o1);

}  // namespace ktq
