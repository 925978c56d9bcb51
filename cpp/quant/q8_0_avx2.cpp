// AVX2 twin of q8_0.cpp's quantize_q8_0_scalar; compiled with -mavx2 -mfma -mf16c, called only when use_avx2().
#include <immintrin.h>

#include "quant/q8_0.h"

namespace ktq {

static_assert(kQGroup == 32, "one group is four vectors of 8");

void quantize_q8_0_avx2(const float* src, int64_t n, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < n / kQGroup; ++g) {
    const float* s = src + g * kQGroup;
    __m256 v0 = _mm256_loadu_ps(s), v1 = _mm256_loadu_ps(s + 8), v2 = _mm256_loadu_ps(s + 16),
           v3 = _mm256_loadu_ps(s + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dg = amax / 127.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    const __m256 vi = _mm256_set1_ps(inv);
    // cvtps_epi32 rounds half to even (default MXCSR), matching the scalar nearbyint.
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
    // packs work within 128-bit lanes: fix the order with a final permute.
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kQGroup), p);
  }
}

}  // namespace ktq
