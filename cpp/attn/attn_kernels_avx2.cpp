// AVX2/FMA/F16C attention kernels (contracts in attn_kernels.h): a run of tiles for up to 8 query heads at a
// time, its logits, one softmax update and its values. Compiled with -mavx2 -mfma -mf16c and called only when
// use_avx2() and D % 8 == 0. Scalar twins: attn_kernels.cpp; building blocks: avx2_rows.h; many query rows:
// attn_wide_avx2.cpp.
#include <cmath>

#include "attn/avx2_rows.h"

namespace ktq::avx2 {

namespace {

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

// Each tile's log-sum-exp per head from the run's probabilities p [NG, ss] (relative to the updated max m):
// tl[i * stride + g] = m_g + log sum_r p[g, r] over tile i's rows (-inf for none).
template <int NG>
void tile_lse_group(const Tiles& T, const float* p, int ss, const float* m, float* tl, int stride) {
  int off = 0;
  for (int i = 0; i < T.count; ++i) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      float sum = 0.f;
      for (int r = 0; r < T.n[i]; ++r) sum += p[g * ss + off + r];
      tl[size_t(i) * stride + g] = sum > 0.f ? m[g] + std::log(sum) : kNegInf;
    }
    off += T.n[i];
  }
}

template <class Dc, int NG>
void tiles_group(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, const float* q, float* s, int ss,
                 float* m, float* l, float* acc, const Tiles* nx, int bs_rows, float* tl, int tl_stride) {
  if (nx && ns)
    for (int i = 0; i < nx->count; ++i) {  // the next tiles' scales
      prefetch_lines(nx->k[i] + bs_rows * rb, size_t(bs_rows) * ns * 4);
      prefetch_lines(nx->v[i] + bs_rows * rb, size_t(bs_rows) * ns * 4);
    }
  logits<Dc, NG>(T, scale_off, rb, ns, D, q, s, ss, nx);  // tile i of the next run streams in alongside tile i
  softmax_group<NG>(s, T.rows(), ss, m, l, acc, D);
  if (tl) tile_lse_group<NG>(T, s, ss, m, tl, tl_stride);
  accum<Dc, NG>(T, scale_off, rb, ns, D, s, ss, acc, nx);
  for (int i = T.count; nx && i < nx->count; ++i) {  // a longer next run (the thread's next task's first)
    prefetch_lines(nx->k[i], bs_rows * rb);
    prefetch_lines(nx->v[i], bs_rows * rb);
  }
}

template <class Dc>
void tiles_any(KVType t, int D, int G, const float* q, const Tiles& T, size_t scale_off, float* s, float* m, float* l,
               float* acc, const Tiles* nx, float* tl) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const int ss = (T.rows() + 7) & ~7;
  const int bs_rows = int(scale_off / rb);  // rows of a full tile (the next one may be full when this is not)
  // Heads in batches of up to 8 (registers); larger groups re-read the tiles from L1.
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int ng = std::min(8, G - g0);
    const float* qg = q + g0 * D;
    float *mg = m + g0, *lg = l + g0, *ag = acc + g0 * D;
    const Tiles* pf = g0 == 0 ? nx : nullptr;  // prefetch once
    switch (ng) {
#define KTQ_CASE(N) \
  case N: tiles_group<Dc, N>(T, scale_off, rb, ns, D, qg, s, ss, mg, lg, ag, pf, bs_rows, tl ? tl + g0 : nullptr, G); \
    break;
      KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7) KTQ_CASE(8)
#undef KTQ_CASE
    }
  }
}

// ---- tile LSEs alone (tiles_lse): the run's logits, each head's run max and exps, then each tile's sum ----

template <class Dc, int NG>
void lse_group(const Tiles& T, size_t scale_off, size_t rb, int ns, int D, const float* q, float* s, int ss, float* tl,
               int tl_stride, const Tiles* nx) {
  if (nx && ns)
    for (int i = 0; i < nx->count; ++i)  // the next tiles' scales (their rows stream in with this run's logits)
      prefetch_lines(nx->k[i] + scale_off, size_t(scale_off / rb) * ns * 4);
  logits<Dc, NG>(T, scale_off, rb, ns, D, q, s, ss, nx);
  const int n = T.rows();
  float m[NG];
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    float* sg = s + g * ss;
    for (int r = n; r < ss; ++r) sg[r] = kNegInf;  // padding rows: exp -> 0
    __m256 mx = _mm256_set1_ps(kNegInf);
    for (int r = 0; r < ss; r += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + r));
    m[g] = hmax(mx);  // (finite: every tile has a key)
    const __m256 vm = _mm256_set1_ps(m[g]);
    for (int r = 0; r < ss; r += 8) _mm256_storeu_ps(sg + r, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sg + r), vm)));
  }
  tile_lse_group<NG>(T, s, ss, m, tl, tl_stride);
}

template <class Dc>
void lse_any(KVType t, int D, int G, const float* q, const Tiles& T, size_t scale_off, float* s, float* tl,
             const Tiles* nx) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const int ss = (T.rows() + 7) & ~7;
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int ng = std::min(8, G - g0);
    const float* qg = q + g0 * D;
    switch (ng) {
#define KTQ_CASE(N) \
  case N: lse_group<Dc, N>(T, scale_off, rb, ns, D, qg, s, ss, tl + g0, G, g0 == 0 ? nx : nullptr); break;
      KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7) KTQ_CASE(8)
#undef KTQ_CASE
    }
  }
}

}  // namespace

// ---- entry points ----

void tiles_lse(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* tile_lse,
               const Tiles* next) {
  switch (t) {
    case KVType::FP32: lse_any<DecF32>(t, D, G, q, cur, scale_off, s, tile_lse, next); break;
    case KVType::FP16: lse_any<DecF16>(t, D, G, q, cur, scale_off, s, tile_lse, next); break;
    case KVType::BF16: lse_any<DecBF16>(t, D, G, q, cur, scale_off, s, tile_lse, next); break;
    case KVType::Q8_0: lse_any<DecQ8>(t, D, G, q, cur, scale_off, s, tile_lse, next); break;
    case KVType::Q4_0: lse_any<DecQ4>(t, D, G, q, cur, scale_off, s, tile_lse, next); break;
  }
}

void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles* next, float* tile_lse) {
  if (G >= 2 * D + kWideRows && !tile_lse) return attend_tiles_wide(t, D, G, q, cur, scale_off, s, m, l, acc, next);
  switch (t) {
    case KVType::FP32: tiles_any<DecF32>(t, D, G, q, cur, scale_off, s, m, l, acc, next, tile_lse); break;
    case KVType::FP16: tiles_any<DecF16>(t, D, G, q, cur, scale_off, s, m, l, acc, next, tile_lse); break;
    case KVType::BF16: tiles_any<DecBF16>(t, D, G, q, cur, scale_off, s, m, l, acc, next, tile_lse); break;
    case KVType::Q8_0: tiles_any<DecQ8>(t, D, G, q, cur, scale_off, s, m, l, acc, next, tile_lse); break;
    case KVType::Q4_0: tiles_any<DecQ4>(t, D, G, q, cur, scale_off, s, m, l, acc, next, tile_lse); break;
  }
}

void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v,
                 float* tile_lse) {
  Tiles cur, nx;
  cur.k[0] = k, cur.v[0] = v, cur.n[0] = n, cur.count = 1;
  nx.k[0] = next_k, nx.v[0] = next_v, nx.n[0] = n, nx.count = next_k && next_v ? 1 : 0;
  attend_tiles(t, D, G, q, cur, scale_off, s, m, l, acc, nx.count ? &nx : nullptr, tile_lse);
}

}  // namespace ktq::avx2
