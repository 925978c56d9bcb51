// Scalar twins of the decode kernels (attn_kernels.h): plain loops, std::exp, same contracts as the
// AVX2 versions; also the path for head_dim % 8 != 0 and for KTQUEST_FORCE_SCALAR=1.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attn/attn_kernels.h"

namespace ktq::scalar {

namespace {

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// ---- attention ----

void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t*, const uint8_t*) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const float* ksc = reinterpret_cast<const float*>(k + scale_off);
  const float* vsc = reinterpret_cast<const float*>(v + scale_off);
  float* row = s + size_t(G) * n;  // row: [D] one decoded K or V row; s: [G, n] logits, then p
  for (int r = 0; r < n; ++r) {
    scalar::decode_row(t, k + r * rb, ksc + r * ns, D, row);
    for (int g = 0; g < G; ++g) s[g * n + r] = dot(q + g * D, row, D);
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * n;
    float mb = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < n; ++r) mb = std::max(mb, sg[r]);
    const float m_new = std::max(m[g], mb);
    // Rescale what was accumulated under the old max (exp(-inf) = 0 on the first block).
    const float alpha = std::exp(m[g] - m_new);
    m[g] = m_new;
    float sum = 0.f;
    for (int r = 0; r < n; ++r) sum += (sg[r] = std::exp(sg[r] - m_new));
    l[g] = l[g] * alpha + sum;
    if (alpha != 1.f)
      for (int d = 0; d < D; ++d) acc[g * D + d] *= alpha;
  }
  for (int r = 0; r < n; ++r) {
    scalar::decode_row(t, v + r * rb, vsc + r * ns, D, row);
    for (int g = 0; g < G; ++g) {
      const float p = s[g * n + r];
      float* ag = acc + g * D;
      for (int d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
}

void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles*) {
  // The same online softmax, one tile at a time (equal up to rounding to one update over all rows).
  for (int i = 0; i < cur.count; ++i)
    attend_tile(t, D, G, q, cur.k[i], cur.v[i], scale_off, cur.n[i], s, m, l, acc, nullptr, nullptr);
}

// ---- scoring ----

void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  for (int64_t i = 0; i < n; ++i) {
    const float sc = dot(qe, a + i * L, L);
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  for (int64_t i = 0; i < n; ++i) {
    float sc = 0.f;
    for (int c = 0; c < L; ++c) sc += qe[c] * f16_to_f32(a[i * L + c]);
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out,
                   bool accumulate) {
  for (int64_t i = 0; i < n; ++i) {
    float sc = 0.f;
    for (int c = 0; c < L; ++c) sc += qe[c] * float(a[i * L + c]);
    sc *= scale[i];
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float*) {
  for (int64_t i = 0; i < n; ++i) {
    float sc = 0.f;
    for (int g = 0; g < G; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < cnt[i]; ++j) best = std::max(best, dot(q + g * D, a + (i * A + j) * D, D));
      sc += best;
    }
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

// ---- top-k ----

int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  for (int64_t i = 0; i < n; ++i) keys[i] = topk_order_key(v[i]);
  auto count_ge = [&](int32_t t) {
    int32_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += keys[i] >= t;
    return int64_t(c);
  };
  const int32_t kth = topk_kth_key(k, count_ge);
  return topk_keep(keys, n, k, kth, k - (kth == INT32_MAX ? 0 : count_ge(kth + 1)), ids, out);
}

}  // namespace ktq::scalar
