// AVX2/FMA/F16C decode kernels (contracts in attn_kernels.h); compiled with -mavx2 -mfma -mf16c and
// called only when use_avx2() and D % 8 == 0. Scalar twins: attn_kernels.cpp.
//
// Register blocking: K rows are decoded 8 values at a time and multiplied into NG query heads at once
// (the KV head's GQA group), so every K/V byte is read and converted once per group, not per head.
// Several rows (logits) or column chunks (values) are in flight together so the FMA chains overlap.
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "attn/attn_kernels.h"

namespace ktq::avx2 {

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
// NG = 3 (GQA 9/3) takes 4 rows: an 8-row block is then two calls with 12 chains each. One layer's 384
// blocks x 8 rows, data in cache, 1 thread: 62.1 us as 3 + 3 + 1 + 1 rows, 60.4 as 3 + 3 + 2, 59.0 as 4 + 4.
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
// L2, and the current tile's loads then hit L2 (its own streamer moves them into L1). Measured on one core,
// tiles from DRAM: 54 -> 36 ns per token and KV head (G = 4, D = 128, FP16), 22 -> 18 ns (G = 3, D = 64).
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

// ---- values: acc[g, chunk c0 .. c0+NC) += sum_r p[g, r] * v_r over the rows of a run ----

// One column pass over every tile of the run: the NC x NG accumulators are loaded and stored once a run,
// not once a tile. line: the line of each next tile's rows to prefetch in this pass (or none when null).
template <class Dc, int NG, int NC>
__attribute__((always_inline)) inline void accum_cols(const Tiles& T, size_t scale_off, size_t rb, int ns, int c0,
                                                      int D, const float* p, int ps, float* acc, const Tiles* nx,
                                                      const size_t* line) {
  __m256 a[NC][NG];
#pragma GCC unroll 8
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) a[j][g] = _mm256_loadu_ps(acc + g * D + 8 * (c0 + j));
  // Grouped-scale types (Q8_0, Q4_0): a pass of NC <= 4 chunks from a multiple of NC lies in one group of
  // 4, so its scale multiplies the row's probability once per head instead of each chunk of V.
  constexpr bool fold = Dc::kGroupScale && NC <= 4;
  auto load = [&](const uint8_t* row, const float* sc, int c) {
    if constexpr (fold) return Dc::raw(row, c);
    else return Dc::load(row, sc, c);
  };
  int off = 0;
  for (int i = 0; i < T.count; ++i) {
    const uint8_t* v = T.v[i];
    const float* vsc = reinterpret_cast<const float*>(v + scale_off);
    const uint8_t* pf = line && i < nx->count ? nx->v[i] + 64 * *line : nullptr;
    const float* pi = p + off;
    for (int r = 0; r < T.n[i]; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + r * rb), kTileHint);
      __m256 pv[NG];
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) pv[g] = _mm256_broadcast_ss(pi + g * ps + r);
      if constexpr (fold) {
        const __m256 sc = _mm256_broadcast_ss(vsc + r * ns + (c0 >> 2));
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g) pv[g] = _mm256_mul_ps(pv[g], sc);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NC; ++j) {
        const __m256 vv = load(v + r * rb, vsc + r * ns, c0 + j);
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g) a[j][g] = _mm256_fmadd_ps(pv[g], vv, a[j][g]);
      }
    }
    off += T.n[i];
  }
#pragma GCC unroll 8
  for (int j = 0; j < NC; ++j)
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) _mm256_storeu_ps(acc + g * D + 8 * (c0 + j), a[j][g]);
}

// The run's values; p: the run's probabilities [NG, ps]. nx: the next run, whose V tiles stream in one line of
// each row per column pass (rows are rb bytes; tile i of the next run alongside tile i of this one).
template <class Dc, int NG>
void accum(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, const float* p, int ps, float* acc,
           const Tiles* nx) {
  constexpr int NC = kBlockCols<NG>;
  const size_t lines = nx ? (rb + 63) / 64 : 0;
  size_t pass = 0;  // column pass i prefetches line i of the next run's rows (while i < lines)
  int c = 0;
  for (; c + NC <= D / 8; c += NC, ++pass)
    accum_cols<Dc, NG, NC>(T, scale_off, rb, ns, c, D, p, ps, acc, nx, pass < lines ? &pass : nullptr);
  for (; c < D / 8; ++c, ++pass)
    accum_cols<Dc, NG, 1>(T, scale_off, rb, ns, c, D, p, ps, acc, nx, pass < lines ? &pass : nullptr);
  for (; pass < lines; ++pass)  // more lines per row than column passes (Q4_0 rows are short, FP32 long)
    for (int i = 0; i < T.count && i < nx->count; ++i)
      for (int r = 0; r < T.n[i]; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(nx->v[i] + r * rb + 64 * pass), kTileHint);
}

// ---- a run of tiles for NG <= 8 heads: logits of every row, one softmax update, then the values ----

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

template <class Dc, int NG>
void tiles_group(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, const float* q, float* s, int ss,
                 float* m, float* l, float* acc, const Tiles* nx, int bs_rows) {
  if (nx && ns)
    for (int i = 0; i < nx->count; ++i) {  // the next tiles' scales
      prefetch_lines(nx->k[i] + bs_rows * rb, size_t(bs_rows) * ns * 4);
      prefetch_lines(nx->v[i] + bs_rows * rb, size_t(bs_rows) * ns * 4);
    }
  logits<Dc, NG>(T, scale_off, rb, ns, D, q, s, ss, nx);  // tile i of the next run streams in alongside tile i
  softmax_group<NG>(s, T.rows(), ss, m, l, acc, D);
  accum<Dc, NG>(T, scale_off, rb, ns, D, s, ss, acc, nx);
  for (int i = T.count; nx && i < nx->count; ++i) {  // a longer next run (the thread's next task's first)
    prefetch_lines(nx->k[i], bs_rows * rb);
    prefetch_lines(nx->v[i], bs_rows * rb);
  }
}

// ---- a run of tiles for many query rows (a prefill chunk's T*G queries of one KV head) ----
//
// With hundreds of rows per KV head the K/V decode is worth doing once per run: K into fp32 scratch,
// transposed (kt [D, ss]), V into fp32 rows (vf [ss, D]). The logits and the values are then GEMM-style
// register tiles of kWideRows query rows: 6 rows x 16 keys (12 accumulators; per d two K loads and six q
// broadcasts feed 12 FMAs, no horizontal sums) and 6 rows x 16 columns of V the same way. The row-by-row
// path instead decoded every K/V value again for each group of 8 rows and summed every dot product
// horizontally. Used from G >= 2 D + kWideRows, where the scratch contract (G ss + D floats) already holds
// kt, vf and the logits of kWideRows rows.
constexpr int kWideRows = 6;

// c [R, N] (+)= a [R, K] . b [K, N] (row strides lda, ldb, ldc; N a multiple of 8), 16 columns at a time: per k,
// two b loads and R broadcasts of a feed 2R FMAs. The logits are q . kt (K = D, N = ss), the values p . vf
// (K = rows, N = D) added to acc.
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

template <int R>
void wide_rows(const float* q, int D, const float* kt, const float* vf, int n, int ss, float* s, float* m, float* l,
               float* acc) {
  wide_gemm<R, false>(q, D, D, kt, ss, ss, s, ss);  // logits s [R, ss]
  softmax_group<R>(s, n, ss, m, l, acc, D);
  wide_gemm<R, true>(s, ss, n, vf, D, D, acc, D);  // acc [R, D] += p . vf
}

template <class Dc>
void tiles_wide(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, int G, const float* q, float* scratch,
                int ss, float* m, float* l, float* acc, const Tiles* nx, int bs_rows) {
  float* kt = scratch;                       // [D, ss]
  float* vf = kt + size_t(D) * ss;           // [ss, D]
  float* s = vf + size_t(ss) * D;            // [kWideRows, ss]
  alignas(32) float tmp[8];
  int j = 0;
  for (int i = 0; i < T.count; ++i) {
    const float* ksc = reinterpret_cast<const float*>(T.k[i] + scale_off);
    const float* vsc = reinterpret_cast<const float*>(T.v[i] + scale_off);
    for (int r = 0; r < T.n[i]; ++r, ++j)
      for (int c = 0; c < D / 8; ++c) {
        _mm256_storeu_ps(vf + size_t(j) * D + 8 * c, Dc::load(T.v[i] + r * rb, vsc + r * ns, c));
        _mm256_store_ps(tmp, Dc::load(T.k[i] + r * rb, ksc + r * ns, c));
        for (int e = 0; e < 8; ++e) kt[size_t(8 * c + e) * ss + j] = tmp[e];
      }
  }
  const int n = j;
  for (int d = 0; d < D; ++d)
    for (int jj = n; jj < ss; ++jj) kt[size_t(d) * ss + jj] = 0.f;  // padding keys (their logits become -inf)
  // The next run's lines (K, V and their scales), spread over the row blocks: a burst would stall the core.
  struct Span {
    const uint8_t* p;
    size_t bytes;
  } spans[4 * kMaxTiles];
  int n_spans = 0;
  size_t lines = 0;
  for (int i = 0; nx && i < nx->count; ++i) {
    const size_t rows = size_t(std::max(nx->n[i], bs_rows));
    spans[n_spans++] = {nx->k[i], rows * rb};
    spans[n_spans++] = {nx->v[i], rows * rb};
    if (ns) {
      spans[n_spans++] = {nx->k[i] + bs_rows * rb, size_t(bs_rows) * ns * 4};
      spans[n_spans++] = {nx->v[i] + bs_rows * rb, size_t(bs_rows) * ns * 4};
    }
  }
  for (int i = 0; i < n_spans; ++i) lines += (spans[i].bytes + 63) / 64;
  const int blocks = (G + kWideRows - 1) / kWideRows;
  const size_t per_block = (lines + blocks - 1) / blocks;
  int span = 0;
  size_t span_off = 0;
  auto prefetch_some = [&](size_t count) {
    for (; count > 0 && span < n_spans; --count) {
      _mm_prefetch(reinterpret_cast<const char*>(spans[span].p + span_off), kTileHint);
      span_off += 64;
      if (span_off >= spans[span].bytes) ++span, span_off = 0;
    }
  };
  int g = 0;
  for (; g + kWideRows <= G; g += kWideRows) {
    prefetch_some(per_block);
    wide_rows<kWideRows>(q + size_t(g) * D, D, kt, vf, n, ss, s, m + g, l + g, acc + size_t(g) * D);
  }
  switch (G - g) {
#define KTQ_CASE(N) \
  case N: wide_rows<N>(q + size_t(g) * D, D, kt, vf, n, ss, s, m + g, l + g, acc + size_t(g) * D); break;
    KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5)
#undef KTQ_CASE
  }
  prefetch_some(lines);
}

template <class Dc>
void tiles_any(KVType t, int D, int G, const float* q, const Tiles& T, size_t scale_off, float* s, float* m, float* l,
               float* acc, const Tiles* nx) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const int ss = (T.rows() + 7) & ~7;
  const int bs_rows = int(scale_off / rb);  // rows of a full tile (the next one may be full when this is not)
  if (G >= 2 * D + kWideRows) return tiles_wide<Dc>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows);
  // Heads in batches of up to 8 (registers); larger groups re-read the tiles from L1.
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int ng = std::min(8, G - g0);
    const float* qg = q + g0 * D;
    float *mg = m + g0, *lg = l + g0, *ag = acc + g0 * D;
    const Tiles* pf = g0 == 0 ? nx : nullptr;  // prefetch once
    switch (ng) {
#define KTQ_CASE(N) \
  case N: tiles_group<Dc, N>(T, scale_off, rb, ns, D, qg, s, ss, mg, lg, ag, pf, bs_rows); break;
      KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7) KTQ_CASE(8)
#undef KTQ_CASE
    }
  }
}

}  // namespace

// ---- entry points ----

void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles* next) {
  switch (t) {
    case KVType::FP32: tiles_any<DecF32>(t, D, G, q, cur, scale_off, s, m, l, acc, next); break;
    case KVType::FP16: tiles_any<DecF16>(t, D, G, q, cur, scale_off, s, m, l, acc, next); break;
    case KVType::BF16: tiles_any<DecBF16>(t, D, G, q, cur, scale_off, s, m, l, acc, next); break;
    case KVType::Q8_0: tiles_any<DecQ8>(t, D, G, q, cur, scale_off, s, m, l, acc, next); break;
    case KVType::Q4_0: tiles_any<DecQ4>(t, D, G, q, cur, scale_off, s, m, l, acc, next); break;
  }
}

void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v) {
  Tiles cur, nx;
  cur.k[0] = k, cur.v[0] = v, cur.n[0] = n, cur.count = 1;
  nx.k[0] = next_k, nx.v[0] = next_v, nx.n[0] = n, nx.count = next_k && next_v ? 1 : 0;
  attend_tiles(t, D, G, q, cur, scale_off, s, m, l, acc, nx.count ? &nx : nullptr);
}

namespace {

// A pure stream over the anchors: 4 independent FMA chains, one horizontal sum per block, and a software
// prefetch kPrefetchBytes ahead so enough cache-line misses are in flight to reach DRAM speed.
// T: float, uint16_t (fp16, one F16C conversion per 8 anchors and a stream half as long) or int8_t (a
// quarter as long; each row's sum is then multiplied by its scale[i]).
template <class T>
void score_linear_any(const T* a, int64_t n, int L, const float* qe, float* out, bool accumulate,
                      const float* scale = nullptr) {
  constexpr int64_t kPrefetchBytes = 2048;
  auto ld = [](const T* p) {
    if constexpr (sizeof(T) == 1)
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    else if constexpr (sizeof(T) == 2)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else return _mm256_loadu_ps(p);
  };
  const char* end = reinterpret_cast<const char*>(a + n * L);
  for (int64_t i = 0; i < n; ++i) {
    const T* ai = a + i * L;
    for (const char* p = reinterpret_cast<const char*>(ai) + kPrefetchBytes;
         p < reinterpret_cast<const char*>(ai + L) + kPrefetchBytes && p < end; p += 64)
      _mm_prefetch(p, _MM_HINT_T0);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int c = 0;
    for (; c + 32 <= L; c += 32) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c), ld(ai + c), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 8), ld(ai + c + 8), s1);
      s2 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 16), ld(ai + c + 16), s2);
      s3 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 24), ld(ai + c + 24), s3);
    }
    for (; c < L; c += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c), ld(ai + c), s0);
    float sc = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    if constexpr (sizeof(T) == 1) sc *= scale[i];
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

}  // namespace

void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate);
}

void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate);
}

void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out,
                   bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate, scale);
}

void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s) {
  const size_t rb = size_t(D) * 4;
  const int ss = (A + 7) & ~7;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* ai = reinterpret_cast<const uint8_t*>(a + i * int64_t(A) * D);
    const int na = cnt[i];
    Tiles T;  // the block's anchors as one tile of na rows
    T.k[0] = T.v[0] = ai, T.n[0] = na, T.count = 1;
    float sc = 0.f;
    for (int g0 = 0; g0 < G; g0 += 8) {
      const int ng = std::min(8, G - g0);
      switch (ng) {
#define KTQ_CASE(N) \
  case N: logits<DecF32, N>(T, 0, rb, 0, D, q + g0 * D, s, ss, nullptr); break;
        KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7) KTQ_CASE(8)
#undef KTQ_CASE
      }
      for (int g = 0; g < ng; ++g) {
        float best = kNegInf;
        for (int j = 0; j < na; ++j) best = std::max(best, s[g * ss + j]);
        sc += best;
      }
    }
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

// ---- top-k ----

int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  const __m256 ninf = _mm256_set1_ps(kNegInf), zero = _mm256_setzero_ps();
  const __m256i low31 = _mm256_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // topk_order_key, 8 at a time
    __m256 x = _mm256_loadu_ps(v + i);
    x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    x = _mm256_andnot_ps(_mm256_cmp_ps(x, zero, _CMP_EQ_OQ), x);
    const __m256i b = _mm256_castps_si256(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + i),
                        _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), low31)));
  }
  for (; i < n; ++i) keys[i] = topk_order_key(v[i]);
  const int64_t n8 = n & ~int64_t(7);
  auto count_ge = [&](int32_t t) {  // n - #(keys < t): cmpgt gives -1 per lane where t > key
    const __m256i tv = _mm256_set1_epi32(t);
    __m256i lt = _mm256_setzero_si256();
    for (int64_t j = 0; j < n8; j += 8)
      lt = _mm256_add_epi32(lt, _mm256_cmpgt_epi32(tv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + j))));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lt);
    int64_t below = 0;
    for (int j = 0; j < 8; ++j) below -= lanes[j];
    for (int64_t j = n8; j < n; ++j) below += keys[j] < t;
    return n - below;
  };
  const int32_t kth = topk_kth_key(k, count_ge);
  return topk_keep(keys, n, k, kth, k - (kth == INT32_MAX ? 0 : count_ge(kth + 1)), ids, out);
}

}  // namespace ktq::avx2
