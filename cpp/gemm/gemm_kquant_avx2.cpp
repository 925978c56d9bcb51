// AVX2 tile of the K-quant prefill GEMM (gemm_kquant.h): one unpacked row against up to four tokens. Per
// sub-block of 32 values the row's codes and scale lanes are loaded once and each token takes maddubs (codes x
// its int8 x: 16 pair sums) and madd with the scales (8 int32 lanes), summed in int32 over the super-block;
// each super-block is then scaled in fp32, its mins subtracted. Compiled with -mavx2 -mfma -mf16c.
#include "gemm/avx2_blocks.h"
#include "gemm/gemm_kquant.h"

namespace ktq {

namespace {

template <int kTokens>
void tile(const KPanel& p, int64_t r, const KAct& a, int64_t t0, float* y, int64_t ldy) {
  const int64_t in = p.in, nsb = in / kQK;
  const uint8_t* codes = p.codes + r * in;
  const int16_t* sv = p.sv + r * (in / 2);
  const int16_t* mi = p.mi + r * (in / 16);
  const float* d = p.d + r * nsb;
  const float* dm = p.dm + r * nsb;
  __m256 acc[kTokens];
  for (int c = 0; c < kTokens; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    __m256i isum[kTokens];
    for (int c = 0; c < kTokens; ++c) isum[c] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const int64_t off = s * kQK + 32 * j;
      const __m256i w = avx2::loadu256(codes + off);
      const __m256i scale = avx2::loadu256(sv + (s * 8 + j) * 16);
      for (int c = 0; c < kTokens; ++c) {
        const __m256i pairs = _mm256_maddubs_epi16(w, avx2::loadu256(a.q + (t0 + c) * in + off));
        isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(pairs, scale));
      }
    }
    const __m256i mins = avx2::loadu256(mi + s * 16);
    for (int c = 0; c < kTokens; ++c) {
      const float dx = a.d[(t0 + c) * nsb + s];
      const __m256i imin = _mm256_madd_epi16(mins, avx2::loadu256(a.sum16 + (t0 + c) * (in / 16) + s * 16));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_set1_ps(d[s] * dx), acc[c]);
      acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_set1_ps(dm[s] * dx), acc[c]);
    }
  }
  for (int c = 0; c < kTokens; ++c) y[c * ldy] = avx2::hsum(acc[c]);
}

}  // namespace

void gemm_kquant_tile_avx2(const KPanel& p, int64_t r, const KAct& a, int64_t t0, int nt, float* y, int64_t ldy) {
  switch (nt) {
    case 4: return tile<4>(p, r, a, t0, y, ldy);
    case 3: return tile<3>(p, r, a, t0, y, ldy);
    case 2: return tile<2>(p, r, a, t0, y, ldy);
    default: return tile<1>(p, r, a, t0, y, ldy);
  }
}

}  // namespace ktq
