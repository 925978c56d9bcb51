// Activations quantized once per GEMV for the integer dot products of gemm/gemv_blocks.h (ggml's Q8_0 / Q8_K
// activations, rounded half to even by multiplying with 1 / d). x is cut into groups of `group` values,
// 32 for the 32-value block types and 256 for the K-quants, one fp32 scale each:
//   d = absmax(group) / 127,  q = round_half_even(x * (1 / d)),  |q| <= 127
//   d = 0 and q = 0 when absmax < kActTiny (1 / d would overflow; such values are zero to the dot products)
// and the integer sums of q over each 16 consecutive values (|sum| <= 16 * 127 fits int16) for the weight
// types with an offset (Q4_1, Q5_1), mins (Q4_K, Q5_K) or a bias of 32 (Q6_K). What the kernels then compute
// is dequant(w) . (d * q) exactly up to fp32 rounding; against fp32 x, the extra error of one output is at
// most sum over groups g of (d_g / 2) * sum_{i in g} |w_i|.
// Scalar and AVX2 twins give the same bits (nearbyint and cvtps_epi32 both round half to even).
#pragma once

#include <cstdint>

namespace ktq {

constexpr float kActTiny = 1e-30f;

// x: [n] -> q: [n], d: [n / group], sum16: [n / 16]   (group 32 or 256, n % group == 0)
void quantize_act(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16);

// The int16 activations of `activations: int16` (the 32-value block types' x16 kernels): groups of 32 values,
//   d = absmax(group) / 32767,  q = round_half_even(x * (1 / d)),  |q| <= 32767   (d = 0, q = 0 below kActTiny)
// and sum32 = the integer sum of q over each group. The extra error of one output against fp32 x is at most
// sum over groups g of (d_g / 2) * sum_{i in g} |w_i|: 258 times smaller than int8's.
// x: [n] -> q: [n], d: [n / 32], sum32: [n / 32]   (n % 32 == 0)
void quantize_act16(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32);

// ---- the twins, picked at run time by quantize_act ----
void quantize_act_scalar(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16);
void quantize_act_avx2(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16);
void quantize_act16_scalar(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32);
void quantize_act16_avx2(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32);

}  // namespace ktq
