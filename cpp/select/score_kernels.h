// Block-scoring kernels on raw pointers: a block's score from its anchors and the query. Scalar twins in
// score_kernels.cpp, AVX2/FMA/F16C versions in score_kernels_avx2.cpp (D % 8 == 0); the selector
// (selector.cpp) and the candidate cache pick one per call from use_avx2().
#pragma once

#include <cstdint>

namespace ktq {

// ---- contracts (both twins) ----
//
// score_linear: linear block scores (QUEST / BLOCK_MAX / BLOCK_MEAN): out[i] (+)= dot(qe, a[i]).
//   a: [n, L] fp32 anchors, qe: [L] the KV head's scoring vector.
// score_linear16: the same over fp16 anchors (a: [n, L] IEEE halves), half the bytes to stream.
// score_linear8: the same over int8 anchors with one scale per row (a: [n, L], scale: [n]):
//   out[i] (+)= scale[i] * dot(qe, a[i]); a quarter of fp32's bytes (cached candidates, int8_candidates).
//
// score_max: max-over-anchors block scores (FIXED / DYNAMIC): out[i] (+)= sum_g max_{j < cnt[i]} dot(q_g, a[i, j]).
//   a: [n, A, D] fp32, cnt: [n] (>= 1), q: [G, D] unscaled, s: scratch of G * round_up(A, 8) + D floats.
//   The AVX2 twin computes the dots with the attention's logits kernel (attn/avx2_rows.h).

namespace scalar {
void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s);
}  // namespace scalar

namespace avx2 {  // require D % 8 == 0
void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s);
}  // namespace avx2

}  // namespace ktq
