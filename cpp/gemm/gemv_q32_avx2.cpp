// AVX2 twins of the 32-value block types' row dot products (gemm/gemv_blocks.h; scalar: gemv_blocks_scalar.cpp),
// after ggml's x Q8_0 kernels: a block's 32 weight codes are expanded to one byte each and multiplied with the 32
// int8 activations by maddubs + madd (int32 lanes), converted and scaled by d_w * d_x once per block. Compiled
// with -mavx2 -mfma -mf16c, called only when use_avx2().
#include "gemm/avx2_blocks.h"
#include "gemm/gemv_blocks.h"

namespace ktq::avx2 {

namespace {

// Signed bytes w . x as 8 int32 lanes. maddubs needs an unsigned operand: |w| times x with w's sign (ggml's trick;
// w = -128 reads as 128 unsigned, and pairs stay within int16: 2 * 128 * 127 < 32767).
inline __m256i dot_i8(__m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// Unsigned codes (< 32) . signed x as 8 int32 lanes (pairs at most 2 * 31 * 127).
inline __m256i dot_u8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

}  // namespace

template <bool kStream>
float q8_0(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQ32; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const __m256i p = dot_i8(loadu256(b[i].qs), loadu256(a.q + i * kQ32));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d[i]), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum(acc);
}

template <bool kStream>
float q5_0(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ5_0* b = reinterpret_cast<const BlockQ5_0*>(row);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQ32; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    // (nibble | h << 4) - 16 as a signed byte: the nibble where h is set, the nibble | 0xF0 where it is not.
    const __m256i not_h = _mm256_andnot_si256(bits32(b[i].qh), _mm256_set1_epi8(char(0xF0)));
    const __m256i w = _mm256_or_si256(nibbles32(b[i].qs), not_h);
    const __m256i p = dot_i8(w, loadu256(a.q + i * kQ32));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d[i]), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum(acc);
}

template <bool kStream>
float q4_0(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ4_0* b = reinterpret_cast<const BlockQ4_0*>(row);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQ32; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const __m256i w = _mm256_sub_epi8(nibbles32(b[i].qs), _mm256_set1_epi8(8));
    const __m256i p = dot_i8(w, loadu256(a.q + i * kQ32));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d[i]), _mm256_cvtepi32_ps(p), acc);
  }
  return hsum(acc);
}

// Q4_1 / Q5_1: unsigned codes times x (maddubs directly), plus m * dx * sum(q) per block, summed apart.
template <bool kStream>
float q4_1(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ4_1* b = reinterpret_cast<const BlockQ4_1*>(row);
  __m256 acc = _mm256_setzero_ps();
  float acc_m = 0.f;
  for (int64_t i = 0; i < in / kQ32; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const __m256i p = dot_u8(nibbles32(b[i].qs), loadu256(a.q + i * kQ32));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d[i]), _mm256_cvtepi32_ps(p), acc);
    acc_m += h2f(b[i].m) * a.d[i] * float(a.sum32[i]);
  }
  return hsum(acc) + acc_m;
}

template <bool kStream>
float q5_1(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ5_1* b = reinterpret_cast<const BlockQ5_1*>(row);
  __m256 acc = _mm256_setzero_ps();
  float acc_m = 0.f;
  for (int64_t i = 0; i < in / kQ32; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const __m256i h = _mm256_and_si256(bits32(b[i].qh), _mm256_set1_epi8(0x10));
    const __m256i p = dot_u8(_mm256_or_si256(nibbles32(b[i].qs), h), loadu256(a.q + i * kQ32));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d[i]), _mm256_cvtepi32_ps(p), acc);
    acc_m += h2f(b[i].m) * a.d[i] * float(a.sum32[i]);
  }
  return hsum(acc) + acc_m;
}

// ---- the kernels without and with the weight prefetch of long rows ----

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return q8_0<false>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return q5_0<false>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return q4_0<false>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return q4_1<false>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return q5_1<false>(row, a, in); }

}  // namespace ktq::avx2

namespace ktq::avx2_stream {

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q8_0<true>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q5_0<true>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q4_0<true>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q4_1<true>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q5_1<true>(row, a, in); }

}  // namespace ktq::avx2_stream
