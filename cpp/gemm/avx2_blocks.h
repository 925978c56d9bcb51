// Helpers of the block GEMV's AVX2 kernels (gemv_*_avx2.cpp). Include only from *_avx2.cpp files (built with
// -mavx2 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace ktq::avx2 {

// Software prefetch of the weight stream, for long rows only (the dispatcher picks the kernels built with it for
// in >= kGemvStreamIn): every cache line of a block, kPrefetchBytes ahead, non-temporal. Measured on Zen 4, one
// thread, weights from DRAM, calls of both kinds interleaved in one process: with in = 18944 (19 KB of int8 x a
// row) the streamed weights evict x from L1 and a row-at-a-time kernel ran at half the speed of short rows
// (wrapping x to 4 KB restored it); prefetching every line NTA, so that the weights leave L1 first, made Q4_K
// 4048 -> 3292 us, Q6_K 6880 -> 5054, Q8_0 7244 -> 6280, Q5_0 6147 -> 4503 ([3584 x 18944]). Prefetching some
// lines only (one per 144-byte Q4_K block) was worse than none (6.6 against 9.7 GB/s). With in = 8960, 4864 and
// 3584 the prefetch cost 2-15%: those rows stream well with the hardware prefetchers alone.
constexpr int64_t kPrefetchBytes = 2048;

template <int kBlockBytes>
inline void prefetch_block(const void* block) {
  const char* p = static_cast<const char*>(block) + kPrefetchBytes;
  for (int off = 0; off < kBlockBytes; off += 64) _mm_prefetch(p + off, _MM_HINT_NTA);
}

// Float rows: one line of 64 bytes at p (called once per 64 bytes).
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

// 16 bytes of nibbles -> 32 bytes: the low nibbles (values 0..15), then the high ones (values 16..31).
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i v = loadu128(p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
}

// 32 bits (little-endian) -> 32 bytes, 0xFF where the bit is set: byte j picks byte j / 8 of the word, sets every
// bit but bit j % 8, and compares with all ones.
inline __m256i bits32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(v)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  return _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));
}

// The 12 packed bytes of a Q4_K/Q5_K super-block -> [sc0..sc7 | mn0..mn7] as int16 (unpack_k_scales on the three
// little-endian words w0 w1 w2, in vector registers: scalar stores reloaded as one vector would stall the load).
//   sc0..3 = w0 & 63, mn0..3 = w1 & 63, sc4..7 = (w2 & 15) | (w0 >> 6) << 4, mn4..7 = (w2 >> 4 & 15) | (w1 >> 6) << 4
// (per byte). The 16-byte load reads 4 bytes past the scales, inside the block.
inline __m256i scales_mins(const uint8_t* packed) {
  const __m128i v = loadu128(packed);
  const __m128i m6 = _mm_set1_epi8(0x3f), m4 = _mm_set1_epi8(0x0f), m2 = _mm_set1_epi8(0x03);
  const __m128i low6 = _mm_and_si128(v, m6);                                             // [sc0..3, mn0..3, .]
  const __m128i top2 = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(v, 6), m2), 4);        // [w0's, w1's, .]
  const __m128i w2 = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0xAA), _mm_setr_epi32(0, 4, 0, 0));  // [w2, w2 >> 4, .]
  const __m128i high = _mm_or_si128(_mm_and_si128(w2, m4), top2);                        // [sc4..7, mn4..7, .]
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi32(low6, high));
}

}  // namespace ktq::avx2
