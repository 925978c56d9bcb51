// Building blocks of the AVX2 attention kernels, shared by attn_kernels_avx2.cpp (runs of tiles),
// attn_wide_avx2.cpp (many query rows) and select/score_kernels_avx2.cpp (FIXED/DYNAMIC scores are logits over
// anchor rows). Include it only from *_avx2.cpp files (built with -mavx2 -mfma -mf16c).
//
// Register blocking: K rows are decoded 8 values at a time and multiplied into NG query heads at once
// (the KV head's GQA group), so every K/V byte is read and converted once per group, not per head.
// Several rows (logits) or column chunks (values) are in flight together so the FMA chains overlap.
//
// The helpers have internal linkage, as they had when they lived in one file: each kernel file compiles its
// own copies with its own inlining, and none is shared across files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "attn/attn_kernels.h"

namespace ktq::avx2 {

// ---- the wide path (attn_wide_avx2.cpp) ----
// attend_tiles for G >= 2 D + kWideRows query rows of one KV head (a prefill chunk's T*G queries): the run's
// K/V decoded once into fp32 scratch, then GEMM-style register tiles of kWideRows query rows.
constexpr int kWideRows = 6;
void attend_tiles_wide(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                       float* l, float* acc, const Tiles* next);

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (Cephes polynomial, ~1 ulp); x < -87.3 (incl. -inf) gives exactly 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

// ---- GEMM register tiles (attn_wide_avx2.cpp, select/snapkv_kernels_avx2.cpp) ----

// c [R, N] (+)= a [R, K] . b [K, N] (row strides lda, ldb, ldc; N a multiple of 8), 16 columns at a time: per k,
// two b loads and R broadcasts of a feed 2R FMAs. The wide attention's logits are q . kt (K = D, N = ss), its
// values p . vf (K = rows, N = D) added to acc; SnapKV's scores are q . kt.
template <int R, int NV, bool Add>
__attribute__((always_inline)) inline void wide_tile(const float* a, int lda, int K, const float* b, int ldb,
                                                     float* c, int ldc) {
  __m256 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = Add ? _mm256_loadu_ps(c + r * ldc + 8 * v) : _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m256 bv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + size_t(k) * ldb + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 ab = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(ab, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + r * ldc + 8 * v, acc[r][v]);
}

template <int R, bool Add>
__attribute__((always_inline)) inline void wide_gemm(const float* a, int lda, int K, const float* b, int ldb, int N,
                                                     float* c, int ldc) {
  int j = 0;
  for (; j + 16 <= N; j += 16) wide_tile<R, 2, Add>(a, lda, K, b + j, ldb, c + j, ldc);
  if (j < N) wide_tile<R, 1, Add>(a, lda, K, b + j, ldb, c + j, ldc);  // 8 columns left
}

// ---- row decoders: 8 fp32 values of chunk c (elements 8c .. 8c+7) of one stored row ----

// kGroupScale: one scale per 32 values (chunks 4j .. 4j+3), which raw() leaves out; the values loop applies it
// to the row's probability once per group instead of once per chunk.
struct DecF32 {
  static constexpr bool kGroupScale = false;
  static __m256 load(const uint8_t* row, const float*, int c) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8 * c);
  }
};
struct DecF16 {
  static constexpr bool kGroupScale = false;
  static __m256 load(const uint8_t* row, const float*, int c) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
  }
};
struct DecBF16 {
  static constexpr bool kGroupScale = false;
  static __m256 load(const uint8_t* row, const float*, int c) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
};
struct DecQ8 {
  static constexpr bool kGroupScale = true;
  static __m256 raw(const uint8_t* row, int c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c))));
  }
  static __m256 load(const uint8_t* row, const float* sc, int c) {
    return _mm256_mul_ps(_mm256_set1_ps(sc[c >> 2]), raw(row, c));
  }
};
struct DecQ4 {
  // Group g = c / 4 is 16 bytes: chunks 0, 1 are the low nibbles of bytes 0-7, 8-15; chunks 2, 3 the high.
  static constexpr bool kGroupScale = true;
  static __m256 raw(const uint8_t* row, int c) {
    const int sub = c & 3;
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (c >> 2) * 16 + (sub & 1) * 8));
    if (sub >= 2) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), _mm256_set1_epi32(8)));
  }
  static __m256 load(const uint8_t* row, const float* sc, int c) {
    return _mm256_mul_ps(_mm256_set1_ps(sc[c >> 2]), raw(row, c));
  }
};

// ---- logits: s[g * ss + r] = dot(q_g, k_r) for NT rows from r0 ----

// out[i] = the sum of the 8 lanes of a[i], i < N: one hadd tree per 8 vectors instead of N horizontal sums.
template <int N>
inline void hsum_n(const __m256* a, float* out) {
  if constexpr (N > 8) {
    hsum_n<8>(a, out);
    hsum_n<N - 8>(a + 8, out + 8);
  } else {
    const __m256 z = _mm256_setzero_ps();
    auto at = [&](int i) { return i < N ? a[i] : z; };
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(at(0), at(1)), _mm256_hadd_ps(at(2), at(3)));
    const __m256 u1 = N > 4 ? _mm256_hadd_ps(_mm256_hadd_ps(at(4), at(5)), _mm256_hadd_ps(at(6), at(7))) : z;
    // u0 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], u1 likewise for a4..a7
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, sum);
    for (int i = 0; i < N; ++i) out[i] = tmp[i];
  }
}

// The same tree as hsum_n, its sums left in a vector: lane i = the sum of a[i] (8 vectors), or the low
// 128 bits for 4 vectors. Stored straight into the logits rows, without hsum_n's scalar copies.
inline __m256 hsum8_vec(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline __m128 hsum4_vec(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
}

// Register blocking per query-group size: NB * NG accumulators in flight (8-12 of the 16 ymm registers),
// enough independent FMA chains to cover the FMA latency. NB = rows (logits) or 8-column chunks (values).
// NG = 3 (GQA 9/3) takes 4 rows: an 8-row block is then two calls with 12 chains each (faster than 3 + 3 + 2
// rows, with data in cache).
template <int NG>
constexpr int kBlockRows = NG == 1 ? 8 : NG == 2 ? 4 : NG == 3 ? 4 : NG == 4 ? 2 : 1;
template <int NG>
constexpr int kBlockCols = NG == 1 ? 8 : NG == 2 ? 4 : NG == 3 ? 4 : NG == 4 ? 2 : 1;

// Software prefetch of the next tile, spread over this one's work: its K rows alongside the logits of the
// same rows, its V rows one cache line per row and column pass alongside the values. Issued in one burst,
// the prefetches would stall the core as soon as its miss buffers are full (the instruction then waits),
// serialising compute behind memory; spread out, the next block streams in while this one is computed.
// Into L2 (T1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers for the whole DRAM
// round trip, so a tile's worth of them (256-512 lines) still stalls the FMAs; L2 prefetches queue at the
// L2, and the current tile's loads then hit L2 (its own streamer moves them into L1).
constexpr _mm_hint kTileHint = _MM_HINT_T1;
inline void prefetch_lines(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), kTileHint);
}

template <class Dc, int NG, int NT>
__attribute__((always_inline)) inline void logits_rows(const uint8_t* k, const float* ksc, size_t rb, int ns, int r0,
                                                       int D, const float* q, float* s, int ss) {
  __m256 acc[NG * NT];  // head-major: acc[g * NT + r], so a head's NT row sums come out side by side
#pragma GCC unroll 32
  for (int i = 0; i < NG * NT; ++i) acc[i] = _mm256_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    __m256 qv[NG];
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      qv[g] = _mm256_loadu_ps(q + g * D + 8 * c);
      asm("" : "+x"(qv[g]));  // keep q in a register: one load per chunk, not one per FMA
    }
#pragma GCC unroll 8
    for (int r = 0; r < NT; ++r) {
      const __m256 kv = Dc::load(k + (r0 + r) * rb, ksc + (r0 + r) * ns, c);
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) acc[g * NT + r] = _mm256_fmadd_ps(qv[g], kv, acc[g * NT + r]);
    }
  }
  // 8 or 4 rows: each head's sums are one vector store into its logits row (two heads per hadd tree of 4
  // rows). Fewer rows (a block's left-overs): hsum_n and scalar stores.
  if constexpr (NT == 8) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) _mm256_storeu_ps(s + g * ss + r0, hsum8_vec(acc + g * 8));
  } else if constexpr (NT == 4) {
#pragma GCC unroll 8
    for (int g = 0; g + 2 <= NG; g += 2) {
      const __m256 v = hsum8_vec(acc + g * 4);
      _mm_storeu_ps(s + g * ss + r0, _mm256_castps256_ps128(v));
      _mm_storeu_ps(s + (g + 1) * ss + r0, _mm256_extractf128_ps(v, 1));
    }
    if constexpr (NG % 2) _mm_storeu_ps(s + (NG - 1) * ss + r0, hsum4_vec(acc + (NG - 1) * 4));
  } else {
    float sums[NG * NT];
    hsum_n<NG * NT>(acc, sums);
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
      for (int r = 0; r < NT; ++r) s[g * ss + r0 + r] = sums[g * NT + r];
  }
}

// The logits of every row of a run: s [NG, ss], tile i's rows from the run's row offset of tile i. nx: the next
// run, whose tile i's K rows are prefetched alongside tile i's logits (null: none).
template <class Dc, int NG>
void logits(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, const float* q, float* s, int ss,
            const Tiles* nx) {
  constexpr int NT = kBlockRows<NG>;
  int off = 0;
  for (int i = 0; i < T.count; ++i) {
    const uint8_t* k = T.k[i];
    const float* ksc = reinterpret_cast<const float*>(k + scale_off);
    const uint8_t* pk = nx && i < nx->count ? nx->k[i] : nullptr;
    const int n = T.n[i];
    float* si = s + off;
    int r = 0;
    for (; r + NT <= n; r += NT) {
      if (pk) prefetch_lines(pk + r * rb, NT * rb);
      logits_rows<Dc, NG, NT>(k, ksc, rb, ns, r, D, q, si, ss);
    }
    if (pk && r < n) prefetch_lines(pk + r * rb, (n - r) * rb);  // rows left over: n % NT (a partial last block)
    if constexpr (NT > 2) {
      if (r + 2 <= n) {  // two rows left over: one call, twice the independent FMA chains of two single rows
        logits_rows<Dc, NG, 2>(k, ksc, rb, ns, r, D, q, si, ss);
        r += 2;
      }
    }
    for (; r < n; ++r) logits_rows<Dc, NG, 1>(k, ksc, rb, ns, r, D, q, si, ss);
    off += n;
  }
}

// ---- the online-softmax update of a run ----

// The online-softmax update of NG heads (NG <= 8) over a run: head g's logits of n rows at s + g * ss (the
// rest of the ss is padding, set to -inf) become exp(logit - m_new); l[g] and the accumulated values
// acc + g * D are rescaled to m_new. The heads are interleaved, so their dependency chains (the max, the
// exps, the rescale factors, all NG of those in one exp_neg) overlap instead of running one after another.
template <int NG>
inline void softmax_group(float* s, int n, int ss, float* m, float* l, float* acc, int D) {
  __m256 mx[NG], vm[NG], sum[NG];
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    for (int r = n; r < ss; ++r) s[g * ss + r] = kNegInf;  // padding rows: exp -> 0
    mx[g] = _mm256_set1_ps(kNegInf);
    sum[g] = _mm256_setzero_ps();
  }
  for (int r = 0; r < ss; r += 8)
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) mx[g] = _mm256_max_ps(mx[g], _mm256_loadu_ps(s + g * ss + r));
  alignas(32) float diff[8] = {};  // m - m_new per head (lanes past NG: 0)
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    const float m_new = std::max(m[g], hmax(mx[g]));
    diff[g] = m[g] - m_new;
    m[g] = m_new;
    vm[g] = _mm256_set1_ps(m_new);
  }
  for (int r = 0; r < ss; r += 8)
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      const __m256 pr = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + g * ss + r), vm[g]));
      _mm256_storeu_ps(s + g * ss + r, pr);
      sum[g] = _mm256_add_ps(sum[g], pr);
    }
  // Rescale what was accumulated under the old max (exp(-inf) = 0 on the first run).
  alignas(32) float alpha[8];
  _mm256_store_ps(alpha, exp_neg(_mm256_load_ps(diff)));
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    l[g] = l[g] * alpha[g] + hsum(sum[g]);
    if (alpha[g] != 1.f) {
      const __m256 va = _mm256_set1_ps(alpha[g]);
      float* ag = acc + g * D;
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(ag + d, _mm256_mul_ps(va, _mm256_loadu_ps(ag + d)));
    }
  }
}

}  // namespace
}  // namespace ktq::avx2
