// AVX2 kernels of the int8 prefill GEMM (gemm_int8.h): the tile with maddubs (gemm_int8_tile.h) and the panels'
// unpacking. Compiled with -mavx2 -mfma -mf16c.
//
// Measured on this Zen 4 (one thread, T = 512, the K-quant shapes of tools/bench_gemm_int8.py): 16 rows x 3 tokens ran
// 97 GMAC/s on Q4_K, 8 rows x 4 tokens 90, 8 rows x 6 tokens 90. GCC unrolling the W steps in full spilled the
// int16 sums (47 GMAC/s); two steps at a time keep every sum in a register. The 32-value types' offset term as one
// fnmadd of two precomputed floats (KPanel::dm, KAct::sx) instead of integer sums of mins: SmolLM2's Q4_1 shapes
// at T = 512, one thread on an AMD EPYC host (2026-11-28, medians of 4 alternating runs, old / new): 960x576 49.8 /
// 53.1 GMAC/s, 3072x576 45.2 / 56.8, 576x1536 48.4 / 62.6.
#include <cstddef>
#include <cstring>

#include "gemm/avx2_blocks.h"
#include "gemm/gemm_int8.h"
#include "gemm/gemm_int8_tile.h"

namespace ktq {

namespace {

// maddubs: sixteen int16 pair sums a register, added in int16 over W steps (W = the panel's steps: the most whose
// sum cannot leave int16), then one madd with the scales.
struct Maddubs {
  static constexpr bool kUnrollAll = false;
  static __m256i step(__m256i part, __m256i w, __m256i x) { return _mm256_add_epi16(part, _mm256_maddubs_epi16(w, x)); }
  static __m256i widen(__m256i part, __m256i sv) { return _mm256_madd_epi16(part, sv); }
  static __m256i widen1(__m256i part) { return _mm256_madd_epi16(part, _mm256_set1_epi16(1)); }
};

// ---- unpacking (gemm_int8_unpack_avx2) ----

// The 32 codes of sub-block j (32 values) of scaled block s of a row of type t, in element order: the same
// values as the scalar twin's block_codes.
// Bytes of one scaled block of type t (this file's own: ggml_blocks.h's inline functions have external linkage,
// and a copy compiled here with -mavx2 could be the one the plain-flag files link to).
int64_t block_bytes(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return sizeof(BlockQ4_K);
    case GgmlType::Q5_K: return sizeof(BlockQ5_K);
    case GgmlType::Q6_K: return sizeof(BlockQ6_K);
    case GgmlType::Q4_0: return sizeof(BlockQ4_0);
    case GgmlType::Q4_1: return sizeof(BlockQ4_1);
    case GgmlType::Q5_0: return sizeof(BlockQ5_0);
    default: return sizeof(BlockQ5_1);
  }
}

// kT: the panel's one type (a GgmlType), each function then compiled for it alone; -1: each row's own type t.
template <int kT>
inline GgmlType type_of(GgmlType t) {
  if constexpr (kT >= 0) return GgmlType(kT);
  return t;
}

template <int kT>
inline __attribute__((always_inline)) __m256i sub_codes(GgmlType t, const uint8_t* row, int64_t s, int j) {
  t = type_of<kT>(t);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  switch (t) {
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {  // sub-blocks 2c and 2c + 1: the low and high nibbles of qs[32c .. 32c + 32)
      const bool q5 = t == GgmlType::Q5_K;
      const uint8_t* b = row + s * (q5 ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
      const __m256i v = avx2::loadu256(b + (q5 ? offsetof(BlockQ5_K, qs) : offsetof(BlockQ4_K, qs)) + 32 * (j / 2));
      __m256i c = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
      if (q5) {  // bit j of qh[l]: the fifth bit of element l
        const __m256i bit = _mm256_set1_epi8(char(1 << j));
        const __m256i hb = _mm256_cmpeq_epi8(_mm256_and_si256(avx2::loadu256(b + offsetof(BlockQ5_K, qh)), bit), bit);
        c = _mm256_or_si256(c, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
      }
      return c;
    }
    case GgmlType::Q6_K: {  // half j / 4, k = j % 4: low four bits from ql, the top two from qh >> 2k
      const uint8_t* b = row + s * sizeof(BlockQ6_K);
      const int half = j / 4, k = j % 4;
      const __m256i lo = avx2::loadu256(b + offsetof(BlockQ6_K, ql) + 64 * half + 32 * (k % 2));
      const __m256i hi = avx2::loadu256(b + offsetof(BlockQ6_K, qh) + 32 * half);
      const __m256i l4 = _mm256_and_si256(k < 2 ? lo : _mm256_srli_epi16(lo, 4), m4);
      const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), _mm256_set1_epi8(3));
      return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4));
    }
    case GgmlType::Q4_0: return avx2::nibbles32(row + s * sizeof(BlockQ4_0) + offsetof(BlockQ4_0, qs));
    case GgmlType::Q4_1: return avx2::nibbles32(row + s * sizeof(BlockQ4_1) + offsetof(BlockQ4_1, qs));
    case GgmlType::Q5_0: {
      const uint8_t* b = row + s * sizeof(BlockQ5_0);
      return _mm256_or_si256(avx2::nibbles32(b + offsetof(BlockQ5_0, qs)),
                             _mm256_and_si256(avx2::bits32(b + offsetof(BlockQ5_0, qh)), _mm256_set1_epi8(16)));
    }
    default: {  // Q5_1
      const uint8_t* b = row + s * sizeof(BlockQ5_1);
      return _mm256_or_si256(avx2::nibbles32(b + offsetof(BlockQ5_1, qs)),
                             _mm256_and_si256(avx2::bits32(b + offsetof(BlockQ5_1, qh)), _mm256_set1_epi8(16)));
    }
  }
}

// v[i] = dwords a[i][0..8) -> v[k] = a[0..8)[k].
inline void transpose8(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
    v[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
  }
}

}  // namespace

void gemm_int8_tile_avx2(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  if (p.qk == kQ32) {  // Q4_0 / Q4_1: 8 steps, Q5_0 / Q5_1: 4
    if (p.steps == 8) return tile_steps<Maddubs, 8, kQ32>(p, a, t0, nt, nr, y, ldy);
    return tile_steps<Maddubs, 4, kQ32>(p, a, t0, nt, nr, y, ldy);
  }
  switch (p.steps) {
    case 8: return tile_steps<Maddubs, 8, kQK>(p, a, t0, nt, nr, y, ldy);
    case 4: return tile_steps<Maddubs, 4, kQK>(p, a, t0, nt, nr, y, ldy);
    default: return tile_steps<Maddubs, 2, kQK>(p, a, t0, nt, nr, y, ldy);
  }
}

namespace {

// A row's scales for one scaled block, as the panel lays them out: its 16-value groups' scales, one dword each
// (the int16 twice: madd's pair), groups 0-7 and 8-15, and its pairs of groups' mins (KPanel::mi), one dword a
// pair; d and dm. The same values as the scalar twin's block_scales (K-quants only).
struct RowScales {
  __m256i g0, g1, mi;
  float d, dm;
};

template <int kT>
inline __attribute__((always_inline)) RowScales k_row_scales(GgmlType t, const uint8_t* row, int64_t s) {
  t = type_of<kT>(t);
  if (t == GgmlType::Q6_K) {  // int8 scales, one a group; min 32 x the scale
    const auto& b = reinterpret_cast<const BlockQ6_K*>(row)[s];
    const __m256i sc = _mm256_cvtepi8_epi16(avx2::loadu128(b.scales));  // 16 int16
    const __m128i lo = _mm256_castsi256_si128(sc), hi = _mm256_extracti128_si256(sc, 1);
    const float d = avx2::h2f(b.d);
    return {_mm256_set_m128i(_mm_unpackhi_epi16(lo, lo), _mm_unpacklo_epi16(lo, lo)),
            _mm256_set_m128i(_mm_unpackhi_epi16(hi, hi), _mm_unpacklo_epi16(hi, hi)), _mm256_slli_epi16(sc, 5), d, d};
  }
  // Q4_K / Q5_K: a sub-block's scale and min on both of its groups (d and dmin lead both blocks)
  const uint8_t* b = row + s * (t == GgmlType::Q5_K ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
  const __m256i sm = avx2::scales_mins(b + offsetof(BlockQ4_K, scales));  // [sc0..7 | mn0..7] int16
  const __m256i sc = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(sm));
  const __m256i mn = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1));
  const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
  uint16_t dd[2];
  std::memcpy(dd, b, 4);
  return {_mm256_permutevar8x32_epi32(sc2, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
          _mm256_permutevar8x32_epi32(sc2, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)),
          _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16)), avx2::h2f(dd[0]), avx2::h2f(dd[1])};
}

inline void store_dwords(int16_t* p, int64_t dword, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 2 * dword), v);
}

// Eight rows' scales of K-quant block s: three transposes, each register k then the eight rows' dword of group
// (or pair) k.
template <int kT>
void k_scales8(const GgmlType* types, const uint8_t* const* rows, int64_t s, int r0, const KPanelOut& out) {
  __m256i g0[8], g1[8], mi[8];
  for (int i = 0; i < 8; ++i) {
    RowScales v{_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), 0.f, 0.f};  // padding
    if (rows[r0 + i] != nullptr) v = k_row_scales<kT>(types[r0 + i], rows[r0 + i], s);
    g0[i] = v.g0, g1[i] = v.g1, mi[i] = v.mi;
    out.d[s * kPanelRows + r0 + i] = v.d, out.dm[s * kPanelRows + r0 + i] = v.dm;
  }
  transpose8(g0), transpose8(g1), transpose8(mi);
  for (int k = 0; k < 8; ++k) {
    store_dwords(out.sv, (s * 16 + k) * kPanelRows + r0, g0[k]);
    store_dwords(out.sv, (s * 16 + 8 + k) * kPanelRows + r0, g1[k]);
    store_dwords(out.mi, (s * 8 + k) * kPanelRows + r0, mi[k]);
  }
}

// A 32-value block's scales (scale 1 on both groups, one min, d and dm x the min), row by row.
void q32_scales(GgmlType t, const uint8_t* row, int64_t s, int r, const KPanelOut& out) {
  int16_t mn = 0, one = 0;
  float d = 0.f, dm = 0.f;
  if (row != nullptr) {
    const auto* b = reinterpret_cast<const uint16_t*>(row + s * block_bytes(t));  // d, then m (Q4_1 / Q5_1)
    one = 1, d = avx2::h2f(b[0]);
    if (t == GgmlType::Q4_0 || t == GgmlType::Q5_0)
      mn = t == GgmlType::Q4_0 ? 8 : 16, dm = d;
    else
      mn = 1, dm = -avx2::h2f(b[1]);
  }
  for (int g = 0; g < 2; ++g) out.sv[((2 * s + g) * kPanelRows + r) * 2] = out.sv[((2 * s + g) * kPanelRows + r) * 2 + 1] = one;
  out.mi[(s * kPanelRows + r) * 2] = out.mi[(s * kPanelRows + r) * 2 + 1] = mn;
  out.d[s * kPanelRows + r] = d, out.dm[s * kPanelRows + r] = dm * float(mn);
}


// Eight rows at a time: a sub-block of each is eight registers of eight dwords (four codes each); transposed,
// register k holds dword k of every row, the eight rows' lanes of step q0 + k in the panel (gemm_int8.h: row r's
// four values of step q at bytes (16q + r) * 4). The rows' next blocks are prefetched two blocks ahead: sixteen
// rows are sixteen streams, more than the hardware prefetchers follow (a [12288 x 4096] Q4_K matrix against 16
// tokens, one thread: 47 -> 55 GMAC/s).
template <int kT>
void unpack_panel(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk, const KPanelOut& out) {
  const int64_t nb = in / qk;
  for (int64_t s = 0; s < nb; ++s) {
    for (int r = 0; r < kPanelRows && s + 2 < nb; ++r)
      if (rows[r] != nullptr) {
        const int64_t bb = block_bytes(type_of<kT>(types[r]));
        for (int64_t off = 0; off < bb; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rows[r]) + (s + 2) * bb + off, _MM_HINT_T0);
      }
    for (int r0 = 0; r0 < kPanelRows; r0 += 8) {
      for (int j = 0; j < qk / 32; ++j) {
        __m256i v[8];
        for (int i = 0; i < 8; ++i)
          v[i] = rows[r0 + i] != nullptr ? sub_codes<kT>(types[r0 + i], rows[r0 + i], s, j) : _mm256_setzero_si256();
        transpose8(v);
        const int64_t q0 = s * (qk / 4) + 8 * j;
        for (int k = 0; k < 8; ++k)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.codes + ((q0 + k) * kPanelRows + r0) * 4), v[k]);
      }
      if (qk == kQK)
        k_scales8<kT>(types, rows, s, r0, out);
      else
        for (int i = 0; i < 8; ++i) q32_scales(types[r0 + i], rows[r0 + i], s, r0 + i, out);
    }
  }
}

}  // namespace

// A panel whose rows are all of one type (every panel but one straddling two parts of a fused matrix) takes the
// code compiled for that type: no dispatch per row and block.
void gemm_int8_unpack_avx2(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk,
                           const KPanelOut& out) {
  bool one = true;
  for (int r = 1; r < kPanelRows; ++r) one = one && (rows[r] == nullptr || types[r] == types[0]);
  if (one && rows[0] != nullptr) {
    switch (types[0]) {
      case GgmlType::Q4_K: return unpack_panel<int(GgmlType::Q4_K)>(types, rows, in, qk, out);
      case GgmlType::Q5_K: return unpack_panel<int(GgmlType::Q5_K)>(types, rows, in, qk, out);
      case GgmlType::Q6_K: return unpack_panel<int(GgmlType::Q6_K)>(types, rows, in, qk, out);
      default: break;
    }
  }
  unpack_panel<-1>(types, rows, in, qk, out);
}

}  // namespace ktq
