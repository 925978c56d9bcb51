// AVX2 twins of the 32-value block types' row dot products with int16 activations (gemm/gemv_blocks.h,
// `activations: int16`): a block's 32 codes are expanded to bytes as in gemv_q32_avx2.cpp, widened to int16 and
// multiplied with x's int16 codes by madd (int32 lanes, exact: |code| <= 128, |x| <= 32767, four products a
// lane); the block's sum is scaled by d_w * d_x once (and m * d_x * sum(x codes) added for Q4_1 / Q5_1).
// Scalar twins: gemv_blocks_scalar.cpp (scalar_x16).
#include "gemm/avx2_blocks.h"
#include "gemm/gemv_blocks.h"

namespace ktq::avx2_x16 {

namespace {

using avx2::bits32;
using avx2::h2f;
using avx2::hsum;
using avx2::loadu256;
using avx2::nibbles32;

// The codes of each type's block as signed bytes (Q4_1 / Q5_1: unsigned 0..31, their offset m added apart).
inline __m256i codes(const BlockQ8_0& b) { return loadu256(b.qs); }
inline __m256i codes(const BlockQ4_0& b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
inline __m256i codes(const BlockQ4_1& b) { return nibbles32(b.qs); }
inline __m256i codes(const BlockQ5_0& b) {
  return _mm256_or_si256(nibbles32(b.qs), _mm256_andnot_si256(bits32(b.qh), _mm256_set1_epi8(char(0xF0))));
}
inline __m256i codes(const BlockQ5_1& b) {
  return _mm256_or_si256(nibbles32(b.qs), _mm256_and_si256(bits32(b.qh), _mm256_set1_epi8(0x10)));
}

// sum_j w[j] x[j] over one block: 8 int32 lanes.
inline __m256i block_dot(__m256i w, const int16_t* x) {
  const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
  const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
  return _mm256_add_epi32(_mm256_madd_epi16(lo, loadu256(x)), _mm256_madd_epi16(hi, loadu256(x + 16)));
}

template <class Block, bool kOffset>
float dot(const uint8_t* row, const ActRow& a, int64_t in) {
  const Block* b = reinterpret_cast<const Block*>(row);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // even and odd blocks: two chains
  float acc_m = 0.f;
  int64_t i = 0;
  for (; i + 1 < in / kQ32; i += 2) {
    const __m256i p0 = block_dot(codes(b[i]), a.q16 + i * kQ32);
    const __m256i p1 = block_dot(codes(b[i + 1]), a.q16 + (i + 1) * kQ32);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d16[i]), _mm256_cvtepi32_ps(p0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i + 1].d) * a.d16[i + 1]), _mm256_cvtepi32_ps(p1), acc1);
    if constexpr (kOffset)
      acc_m += h2f(b[i].m) * a.d16[i] * float(a.isum32[i]) + h2f(b[i + 1].m) * a.d16[i + 1] * float(a.isum32[i + 1]);
  }
  if (i < in / kQ32) {
    const __m256i p0 = block_dot(codes(b[i]), a.q16 + i * kQ32);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a.d16[i]), _mm256_cvtepi32_ps(p0), acc0);
    if constexpr (kOffset) acc_m += h2f(b[i].m) * a.d16[i] * float(a.isum32[i]);
  }
  return hsum(_mm256_add_ps(acc0, acc1)) + acc_m;
}

// A block's codes widened to int16 once: the two halves block_dot multiplies.
struct Wide {
  __m256i lo, hi;
};
inline Wide widen(__m256i w) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1))};
}
inline __m256i wide_dot(const Wide& w, const int16_t* x) {
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, loadu256(x)), _mm256_madd_epi16(w.hi, loadu256(x + 16)));
}

// dot for N activation rows at once (batched decode): each block's codes unpacked and widened once, each row's
// chains and offset sum as dot keeps them (out[t] is dot(row, a[t], in), bit for bit).
template <class Block, bool kOffset, int N>
void dot_n(const uint8_t* row, const ActRow* a, int64_t in, float* out) {
  const Block* b = reinterpret_cast<const Block*>(row);
  __m256 acc0[N], acc1[N];
  float acc_m[N];
  for (int t = 0; t < N; ++t) acc0[t] = _mm256_setzero_ps(), acc1[t] = _mm256_setzero_ps(), acc_m[t] = 0.f;
  int64_t i = 0;
  for (; i + 1 < in / kQ32; i += 2) {
    const Wide w0 = widen(codes(b[i])), w1 = widen(codes(b[i + 1]));
    const float d0 = h2f(b[i].d), d1 = h2f(b[i + 1].d);
    for (int t = 0; t < N; ++t) {
      const __m256i p0 = wide_dot(w0, a[t].q16 + i * kQ32);
      const __m256i p1 = wide_dot(w1, a[t].q16 + (i + 1) * kQ32);
      acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a[t].d16[i]), _mm256_cvtepi32_ps(p0), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * a[t].d16[i + 1]), _mm256_cvtepi32_ps(p1), acc1[t]);
      if constexpr (kOffset)
        acc_m[t] += h2f(b[i].m) * a[t].d16[i] * float(a[t].isum32[i]) +
                    h2f(b[i + 1].m) * a[t].d16[i + 1] * float(a[t].isum32[i + 1]);
    }
  }
  if (i < in / kQ32) {
    const Wide w0 = widen(codes(b[i]));
    for (int t = 0; t < N; ++t) {
      const __m256i p0 = wide_dot(w0, a[t].q16 + i * kQ32);
      acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(b[i].d) * a[t].d16[i]), _mm256_cvtepi32_ps(p0), acc0[t]);
      if constexpr (kOffset) acc_m[t] += h2f(b[i].m) * a[t].d16[i] * float(a[t].isum32[i]);
    }
  }
  for (int t = 0; t < N; ++t) out[t] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + acc_m[t];
}

template <class Block, bool kOffset>
void rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  switch (n) {
    case 1: dot_n<Block, kOffset, 1>(row, a, in, out); return;
    case 2: dot_n<Block, kOffset, 2>(row, a, in, out); return;
    case 3: dot_n<Block, kOffset, 3>(row, a, in, out); return;
    default: dot_n<Block, kOffset, 4>(row, a, in, out); return;
  }
}

}  // namespace

void dot_q8_0_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  rows<BlockQ8_0, false>(row, a, n, in, out);
}
void dot_q4_0_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  rows<BlockQ4_0, false>(row, a, n, in, out);
}
void dot_q4_1_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  rows<BlockQ4_1, true>(row, a, n, in, out);
}
void dot_q5_0_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  rows<BlockQ5_0, false>(row, a, n, in, out);
}
void dot_q5_1_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  rows<BlockQ5_1, true>(row, a, n, in, out);
}

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ8_0, false>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ4_0, false>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ4_1, true>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ5_0, false>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return dot<BlockQ5_1, true>(row, a, in); }

}  // namespace ktq::avx2_x16
