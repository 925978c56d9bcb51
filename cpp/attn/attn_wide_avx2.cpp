// AVX2 attention for many query rows per KV head (a prefill chunk's T*G queries): attend_tiles_wide
// (avx2_rows.h), reached from attend_tiles from G >= 2 D + kWideRows. Compiled with -mavx2 -mfma -mf16c.
//
// With hundreds of rows per KV head the K/V decode is worth doing once per run: K into fp32 scratch,
// transposed (kt [D, ss]), V into fp32 rows (vf [ss, D]). The logits and the values are then GEMM-style
// register tiles of kWideRows query rows: 6 rows x 16 keys (12 accumulators; per d two K loads and six q
// broadcasts feed 12 FMAs, no horizontal sums) and 6 rows x 16 columns of V the same way. The row-by-row
// path instead decoded every K/V value again for each group of 8 rows and summed every dot product
// horizontally. Used from G >= 2 D + kWideRows, where the scratch contract (G ss + D floats) already holds
// kt, vf and the logits of kWideRows rows.
#include "attn/avx2_rows.h"

namespace ktq::avx2 {

namespace {

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

}  // namespace

void attend_tiles_wide(KVType t, int D, int G, const float* q, const Tiles& T, size_t scale_off, float* s, float* m,
                       float* l, float* acc, const Tiles* nx) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const int ss = (T.rows() + 7) & ~7;
  const int bs_rows = int(scale_off / rb);  // rows of a full tile (the next one may be full when this is not)
  switch (t) {
    case KVType::FP32: tiles_wide<DecF32>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows); break;
    case KVType::FP16: tiles_wide<DecF16>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows); break;
    case KVType::BF16: tiles_wide<DecBF16>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows); break;
    case KVType::Q8_0: tiles_wide<DecQ8>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows); break;
    case KVType::Q4_0: tiles_wide<DecQ4>(T, scale_off, rb, ns, D, G, q, s, ss, m, l, acc, nx, bs_rows); break;
  }
}

}  // namespace ktq::avx2
