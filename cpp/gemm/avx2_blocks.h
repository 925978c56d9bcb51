// Helpers of the block GEMV's AVX2 kernels (gemv_*_avx2.cpp). Include only from *_avx2.cpp files (built with
// -mavx2 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace ktq::avx2 {

// Software prefetch distance of the weight stream, bytes (a few KiB ahead, as gemv_avx2.cpp). Non-temporal: a
// decode step streams every weight once; they need not displace what is reused from token to token.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_weights(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_NTA);
}

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i loadu128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

}  // namespace ktq::avx2
