// AVX2 weight-only twins of the 32-value block types' row dot products (gemm/gemv_blocks.h, "fp32 x"): a block's
// 32 codes are expanded to bytes as in gemv_q32_avx2.cpp, widened to fp32 and multiplied with the unrounded x by
// FMA; the block's sum is scaled by d once (and m * sum(x) added for Q4_1 / Q5_1). No activation rounding: the
// result is dequant(W) . x up to fp32 rounding. Scalar twins: gemv_blocks_scalar.cpp (scalar_fx).
#include "gemm/avx2_blocks.h"
#include "gemm/gemv_blocks.h"

namespace ktq::avx2_fx {

namespace {

using avx2::bits32;
using avx2::h2f;
using avx2::hsum;
using avx2::loadu256;
using avx2::nibbles32;

inline __m256 widen(__m128i b8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)); }

// sum_j w[j] x[j] over one block's 32 values as 8 fp32 lanes; xs: sum_j x[j] as 8 lanes.
inline __m256 block_dot(__m256i w, const float* x) {
  const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  __m256 s = _mm256_mul_ps(widen(lo), _mm256_loadu_ps(x));
  s = _mm256_fmadd_ps(widen(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), s);
  s = _mm256_fmadd_ps(widen(hi), _mm256_loadu_ps(x + 16), s);
  return _mm256_fmadd_ps(widen(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), s);
}

inline __m256 block_sum(const float* x) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                       _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
}

// The codes of block i of each type (Q4_1 / Q5_1: unsigned, their offset m added apart).
inline __m256i codes(const BlockQ8_0& b) { return loadu256(b.qs); }
inline __m256i codes(const BlockQ4_0& b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
inline __m256i codes(const BlockQ4_1& b) { return nibbles32(b.qs); }
inline __m256i codes(const BlockQ5_0& b) {
  return _mm256_or_si256(nibbles32(b.qs), _mm256_andnot_si256(bits32(b.qh), _mm256_set1_epi8(char(0xF0))));
}
inline __m256i codes(const BlockQ5_1& b) {
  return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(bits32(b.qh), _mm256_set1_epi8(0x10)));
}

template <class Block, bool kOffset>
float dot(const uint8_t* row, const ActRow& a, int64_t in) {
  const Block* b = reinterpret_cast<const Block*>(row);
  __m256 acc = _mm256_setzero_ps(), acc_m = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQ32; ++i) {
    const float* x = a.x + i * kQ32;
    acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d)), block_dot(codes(b[i]), x), acc);
    if constexpr (kOffset) acc_m = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].m)), block_sum(x), acc_m);
  }
  return hsum(_mm256_add_ps(acc, acc_m));
}

}  // namespace

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ8_0, false>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ4_0, false>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ4_1, true>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ5_0, false>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ5_1, true>(row, a, in); }

}  // namespace ktq::avx2_fx
