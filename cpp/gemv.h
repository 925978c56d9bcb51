// Weight-only int8 GEMV for CPU decode: y[T, out] = x[T, in] @ W[out, in]^T (+ bias).
//
// W is stored Q8_0-style: int8 values in groups of 32 along `in`, one fp32 scale per group:
//   qs:     [out, in]        int8, q = round_half_even(w / d) with d = absmax(group) / 127
//   scales: [out, in / 32]   fp32 d
// x is quantized the same way per call (per row, groups of 32), and each group's dot product is done
// in int32 (|q| <= 127, so a pair of products fits int16 in maddubs: 2*127*127 = 32258 < 32767),
// then scaled by d_w * d_x in fp32. This is ggml's Q8_0 x Q8_0 scheme: a quarter of fp32's bytes,
// which is what decode is bound by.
#pragma once

#include <cstdint>

namespace ktq {

constexpr int kQ8Group = 32;

// Quantize n values (n % 32 == 0) to int8 + one scale per group.  src: [n] -> q: [n], d: [n / 32]
void quantize_q8_0(const float* src, int64_t n, int8_t* q, float* d);

// y[t, o] = sum_g d_w[o, g] * d_x[t, g] * dot(qw[o, g, :], qx[t, g, :]) (+ bias[o])
// x: [T, in] fp32, qw: [out, in], dw: [out, in/32], bias: [out] or nullptr, y: [T, out].
// Rows of W are split across `n_threads` threads; every output element is computed by one thread
// in a fixed order, so the result does not depend on the thread count.
void gemv_q8_0(const float* x, int64_t T, int64_t in, const int8_t* qw, const float* dw, int64_t out,
               const float* bias, float* y, int n_threads);

// ---- kernels (rows [o0, o1) of one activation row), picked at run time ----
void gemv_q8_0_rows_scalar(const int8_t* qx, const float* dx, int64_t in, const int8_t* qw, const float* dw,
                           const float* bias, float* y, int64_t o0, int64_t o1);
void gemv_q8_0_rows_avx2(const int8_t* qx, const float* dx, int64_t in, const int8_t* qw, const float* dw,
                         const float* bias, float* y, int64_t o0, int64_t o1);
void quantize_q8_0_scalar(const float* src, int64_t n, int8_t* q, float* d);
void quantize_q8_0_avx2(const float* src, int64_t n, int8_t* q, float* d);

}  // namespace ktq
