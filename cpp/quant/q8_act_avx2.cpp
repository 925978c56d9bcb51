// AVX2 twin of q8_act.cpp's quantize_act_scalar; compiled with -mavx2 -mfma -mf16c, called only when use_avx2().
#include <immintrin.h>

#include "quant/q8_act.h"

namespace ktq {

namespace {

// max |s[i]| over n values (n % 8 == 0).
inline float absmax(const float* s, int n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(s + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

}  // namespace

void quantize_act_avx2(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16) {
  for (int64_t g = 0; g < n / group; ++g) {
    const float* s = x + g * group;
    const float amax = absmax(s, group);
    const float dg = amax >= kActTiny ? amax / 127.f : 0.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    const __m256 vi = _mm256_set1_ps(inv);
    for (int i = 0; i < group; i += 32) {
      // cvtps_epi32 rounds half to even (default MXCSR), matching the scalar nearbyint.
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i), vi));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i + 8), vi));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i + 16), vi));
      const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i + 24), vi));
      // packs work within 128-bit lanes: fix the order with a final permute.
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * group + i), p);
    }
  }
  // Sums of 16: bias the bytes to unsigned (xor 0x80 adds 128 to each) and let psadbw add 8 at a time.
  const __m128i bias = _mm_set1_epi8(char(0x80)), zero = _mm_setzero_si128();
  for (int64_t k = 0; k < n / 16; ++k) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * k)), bias);
    const __m128i s = _mm_sad_epu8(v, zero);
    sum16[k] = static_cast<int16_t>(_mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128);
  }
}

void quantize_act16_avx2(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32) {
  for (int64_t g = 0; g < n / 32; ++g) {
    const float* s = x + g * 32;
    const float amax = absmax(s, 32);
    const float dg = amax >= kActTiny ? amax / 32767.f : 0.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i acc = _mm256_setzero_si256();
    for (int i = 0; i < 32; i += 16) {
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i), vi));
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s + i + 8), vi));
      acc = _mm256_add_epi32(acc, _mm256_add_epi32(i0, i1));
      // packs works within 128-bit lanes: (i0 lo, i1 lo, i0 hi, i1 hi) -> fix the order with a permute.
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32 + i), p);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sum32[g] = _mm_cvtsi128_si32(s4);
  }
}

}  // namespace ktq
