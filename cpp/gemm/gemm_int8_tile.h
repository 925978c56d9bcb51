// The int8 prefill GEMM's tile (gemm_int8.h), for the kernel files that include it (built for AVX2, and with
// AVX-VNNI): one panel of sixteen rows (two registers of eight int32 lanes) against up to three tokens. Per step of
// four values the panel's 64 code bytes are loaded once; each token broadcasts its four int8 x values and takes a
// step of Dot against both halves (8 rows, four codes a lane), kSteps steps of one scale group summed in Dot's
// accumulator, then widened with the rows' scales to int32 (one lane a row) and summed over the scaled block (256
// or 32 values). Each block is then scaled in fp32 and its mins subtracted, lane by lane: the same operations as
// the scalar tile, so the same bits whichever Dot (every integer sum is exact).
//
// Dot::step(part, w, x)  part += the four-value products of w (codes, unsigned) and x (signed) of each lane
// Dot::widen(part, sv)   part's lanes times the rows' group scales (KPanel::sv, the int16 twice a lane), int32
// Dot::widen1(part)      the same with scales of 1 (the 32-value types)
// Dot::kUnrollAll        the steps of a group unrolled in full (else two at a time)
//
// Everything here has internal linkage (and nothing from another header is called): each kernel file compiles its
// own copy with its own flags.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "gemm/gemm_int8.h"

namespace ktq {
namespace {

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

constexpr int kHalves = kPanelRows / 8;  // 8 rows (int32 lanes) to a register
static_assert(kTileTokens == 3, "tile_steps dispatches 1 to 3 tokens");

template <class Dot, int kTokens, int kSteps, int kQB>
void tile(const KPanel& p, const KAct& a, int64_t t0, float* y, int64_t ldy, int nr) {
  const int64_t in = p.in, nsb = in / kQB;
  const int8_t* xq[kTokens];
  int64_t tok[kTokens];  // the x row of each token
  for (int c = 0; c < kTokens; ++c) tok[c] = a.row(t0 + c), xq[c] = a.q + tok[c] * in;
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
      auto step = [&](int64_t q) {
        __m256i w[kHalves];
        for (int h = 0; h < kHalves; ++h) w[h] = load32(p.codes + (q * kHalves + h) * 32);
        for (int c = 0; c < kTokens; ++c) {
          const __m256i xb = bcast4(xq[c] + 4 * q);
          for (int h = 0; h < kHalves; ++h) part[h][c] = Dot::step(part[h][c], w[h], xb);
        }
      };
      if constexpr (Dot::kUnrollAll) {  // (a pragma's count cannot depend on the template)
#pragma GCC unroll 8
        for (int64_t q = q0; q < q0 + kSteps; ++q) step(q);
      } else {
#pragma GCC unroll 2
        for (int64_t q = q0; q < q0 + kSteps; ++q) step(q);
      }
      for (int h = 0; h < kHalves; ++h) {
        if constexpr (kQB == kQ32) {  // (a 32-value block's scales are 1)
          for (int c = 0; c < kTokens; ++c) isum[h][c] = _mm256_add_epi32(isum[h][c], Dot::widen1(part[h][c]));
        } else {
          const __m256i sv = load32(p.sv + ((q0 / 4) * kHalves + h) * 16);  // step q0's group
          for (int c = 0; c < kTokens; ++c) isum[h][c] = _mm256_add_epi32(isum[h][c], Dot::widen(part[h][c], sv));
        }
      }
    }
    if constexpr (kQB == kQ32) {  // one min a block: dm x min per row (KPanel::dm) times dx x sum per token (KAct::sx)
      for (int h = 0; h < kHalves; ++h) {
        const __m256 d = _mm256_loadu_ps(p.d + (s * kHalves + h) * 8), dm = _mm256_loadu_ps(p.dm + (s * kHalves + h) * 8);
        for (int c = 0; c < kTokens; ++c) {
          const __m256 dx = _mm256_set1_ps(a.d[tok[c] * nsb + s]);
          acc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][c]), _mm256_mul_ps(d, dx), acc[h][c]);
          acc[h][c] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(a.sx[tok[c] * nsb + s]), acc[h][c]);
        }
      }
      continue;
    }
    for (int h = 0; h < kHalves; ++h) {
      const __m256 d = _mm256_loadu_ps(p.d + (s * kHalves + h) * 8), dm = _mm256_loadu_ps(p.dm + (s * kHalves + h) * 8);
      for (int c = 0; c < kTokens; ++c) {
        const int16_t* s16 = a.sum16 + tok[c] * (in / 16) + s * (kQB / 16);
        __m256i imin = _mm256_setzero_si256();
        for (int g2 = 0; g2 < kQB / 32; ++g2)
          imin = _mm256_add_epi32(imin, _mm256_madd_epi16(load32(p.mi + ((s * (kQB / 32) + g2) * kHalves + h) * 16),
                                                          bcast4(s16 + 2 * g2)));
        const __m256 dx = _mm256_set1_ps(a.d[tok[c] * nsb + s]);
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

template <class Dot, int kSteps, int kQB>
void tile_steps(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  switch (nt) {
    case 3: return tile<Dot, 3, kSteps, kQB>(p, a, t0, y, ldy, nr);
    case 2: return tile<Dot, 2, kSteps, kQB>(p, a, t0, y, ldy, nr);
    default: return tile<Dot, 1, kSteps, kQB>(p, a, t0, y, ldy, nr);
  }
}

}  // namespace
}  // namespace ktq
