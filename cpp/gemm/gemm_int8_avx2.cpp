// AVX2 tile of the int8 prefill GEMM (gemm_int8.h): one panel of sixteen rows (two registers of eight int32
// lanes) against up to three tokens. Per step of four values the panel's 64 code bytes are loaded once; each token
// broadcasts its four int8 x values and takes maddubs against both halves (8 rows x 2 pair sums, int16 each),
// added in int16 over W steps, then one madd with the rows' scales (one int32 lane a row), summed in int32 over
// the scaled block (256 or 32 values). Each block is then scaled in fp32 and its mins subtracted, lane by lane: the same
// operations as the scalar tile, so the same bits. Compiled with -mavx2 -mfma -mf16c.
//
// Measured on this Zen 4 (one thread, T = 512, the K-quant shapes of tools/bench_gemm_int8.py): 16 rows x 3 tokens ran
// 97 GMAC/s on Q4_K, 8 rows x 4 tokens 90, 8 rows x 6 tokens 90. GCC unrolling the W steps in full spilled the
// int16 sums (47 GMAC/s); two steps at a time keep every sum in a register. The 32-value types' offset term as one
// fnmadd of two precomputed floats (KPanel::dm, KAct::sx) instead of integer sums of mins: SmolLM2's Q4_1 shapes
// at T = 512, one thread on an AMD EPYC host (2026-11-28, medians of 4 alternating runs, old / new): 960x576 49.8 /
// 53.1 GMAC/s, 3072x576 45.2 / 56.8, 576x1536 48.4 / 62.6.
#include <cstring>

#include "gemm/avx2_blocks.h"
#include "gemm/gemm_int8.h"

namespace ktq {

namespace {

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

constexpr int kHalves = kPanelRows / 8;  // 8 rows (int32 lanes) to a register
static_assert(kTileTokens == 3, "tile_steps dispatches 1 to 3 tokens");

template <int kTokens, int kSteps, int kQB>
void tile(const KPanel& p, const KAct& a, int64_t t0, float* y, int64_t ldy, int nr) {
  const int64_t in = p.in, nsb = in / kQB;
  const int8_t* xq[kTokens];
  for (int c = 0; c < kTokens; ++c) xq[c] = a.q + (t0 + c) * in;
  __m256 acc[kHalves][kTokens];
  for (int h = 0; h < kHalves; ++h)
    for (int c = 0; c < kTokens; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    __m256i isum[kHalves][kTokens];
    for (int h = 0; h < kHalves; ++h)
      for (int c = 0; c < kTokens; ++c) isum[h][c] = _mm256_setzero_si256();
    for (int64_t q0 = s * (kQB / 4); q0 < (s + 1) * (kQB / 4); q0 += kSteps) {
      __m256i part[kHalves][kTokens];
      for (int h = 0; h < kHalves; ++h)
        for (int c = 0; c < kTokens; ++c) part[h][c] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int64_t q = q0; q < q0 + kSteps; ++q) {
        __m256i w[kHalves];
        for (int h = 0; h < kHalves; ++h) w[h] = avx2::loadu256(p.codes + (q * kHalves + h) * 32);
        for (int c = 0; c < kTokens; ++c) {
          const __m256i xb = bcast4(xq[c] + 4 * q);
          for (int h = 0; h < kHalves; ++h)
            part[h][c] = _mm256_add_epi16(part[h][c], _mm256_maddubs_epi16(w[h], xb));
        }
      }
      for (int h = 0; h < kHalves; ++h) {
        const __m256i scale = kQB == kQ32 ? _mm256_set1_epi16(1)  // (a 32-value block's scales are 1)
                                          : avx2::loadu256(p.sv + ((q0 / 4) * kHalves + h) * 16);  // step q0's group
        for (int c = 0; c < kTokens; ++c)
          isum[h][c] = _mm256_add_epi32(isum[h][c], _mm256_madd_epi16(part[h][c], scale));
      }
    }
    if constexpr (kQB == kQ32) {  // one min a block: dm x min per row (KPanel::dm) times dx x sum per token (KAct::sx)
      for (int h = 0; h < kHalves; ++h) {
        const __m256 d = _mm256_loadu_ps(p.d + (s * kHalves + h) * 8), dm = _mm256_loadu_ps(p.dm + (s * kHalves + h) * 8);
        for (int c = 0; c < kTokens; ++c) {
          const __m256 dx = _mm256_set1_ps(a.d[(t0 + c) * nsb + s]);
          acc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][c]), _mm256_mul_ps(d, dx), acc[h][c]);
          acc[h][c] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(a.sx[(t0 + c) * nsb + s]), acc[h][c]);
        }
      }
      continue;
    }
    for (int h = 0; h < kHalves; ++h) {
      const __m256 d = _mm256_loadu_ps(p.d + (s * kHalves + h) * 8), dm = _mm256_loadu_ps(p.dm + (s * kHalves + h) * 8);
      for (int c = 0; c < kTokens; ++c) {
        const int16_t* s16 = a.sum16 + (t0 + c) * (in / 16) + s * (kQB / 16);
        __m256i imin = _mm256_setzero_si256();
        for (int g2 = 0; g2 < kQB / 32; ++g2)
          imin = _mm256_add_epi32(imin, _mm256_madd_epi16(avx2::loadu256(p.mi + ((s * (kQB / 32) + g2) * kHalves + h) * 16),
                                                          bcast4(s16 + 2 * g2)));
        const __m256 dx = _mm256_set1_ps(a.d[(t0 + c) * nsb + s]);
        acc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][c]), _mm256_mul_ps(d, dx), acc[h][c]);
        acc[h][c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(dm, dx), acc[h][c]);
      }
    }
  }
  for (int c = 0; c < kTokens; ++c) {
    alignas(32) float v[kPanelRows];
    for (int h = 0; h < kHalves; ++h) _mm256_store_ps(v + 8 * h, acc[h][c]);
    std::memcpy(y + c * ldy, v, sizeof(float) * size_t(nr));
  }
}

template <int kSteps, int kQB>
void tile_steps(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  switch (nt) {
    case 3: return tile<3, kSteps, kQB>(p, a, t0, y, ldy, nr);
    case 2: return tile<2, kSteps, kQB>(p, a, t0, y, ldy, nr);
    default: return tile<1, kSteps, kQB>(p, a, t0, y, ldy, nr);
  }
}

}  // namespace

void gemm_int8_tile_avx2(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  if (p.qk == kQ32) {  // Q4_0 / Q4_1: 8 steps, Q5_0 / Q5_1: 4
    if (p.steps == 8) return tile_steps<8, kQ32>(p, a, t0, nt, nr, y, ldy);
    return tile_steps<4, kQ32>(p, a, t0, nt, nr, y, ldy);
  }
  switch (p.steps) {
    case 8: return tile_steps<8, kQK>(p, a, t0, nt, nr, y, ldy);
    case 4: return tile_steps<4, kQK>(p, a, t0, nt, nr, y, ldy);
    default: return tile_steps<2, kQK>(p, a, t0, nt, nr, y, ldy);
  }
}

}  // namespace ktq
