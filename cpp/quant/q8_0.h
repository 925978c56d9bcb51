// Q8_0 weights (the format gemv_q8_0 reads, gemm/gemv.h): int8 values in groups of kQGroup along a row, one fp32
// scale per group:
//   d = absmax(group) / 127,  q = round_half_even(x * (1 / d))  (q = 0 when d = 0),  w' = d * q
// Scalar and AVX2 twins give the same bits (nearbyint and cvtps_epi32 both round half to even).
// Unlike the KV store's Q8_0 rows (kv_codec.h), which divide by d, the weights multiply by the reciprocal (the
// two roundings can differ in the last bit of x / d): two codecs on one group size.
#pragma once

#include <cstdint>

#include "quant/qgroup.h"

namespace ktq {

// Quantize n values (n % kQGroup == 0).  src: [n] -> q: [n], d: [n / kQGroup]
void quantize_q8_0(const float* src, int64_t n, int8_t* q, float* d);

// ---- the twins, picked at run time by quantize_q8_0 ----
void quantize_q8_0_scalar(const float* src, int64_t n, int8_t* q, float* d);
void quantize_q8_0_avx2(const float* src, int64_t n, int8_t* q, float* d);

}  // namespace ktq
