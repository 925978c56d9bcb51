// Scalar twins of the attention kernels (attn_kernels.h): plain loops, std::exp, same contracts as the
// AVX2 versions; also the path for head_dim % 8 != 0 and for KTQUEST_FORCE_SCALAR=1.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attn/attn_kernels.h"
#include "attn/scalar_dot.h"

namespace ktq::scalar {

// ---- attention ----

void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t*, const uint8_t*, float* tile_lse) {
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
    if (tile_lse) tile_lse[g] = sum > 0.f ? m_new + std::log(sum) : -std::numeric_limits<float>::infinity();
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
                  float* l, float* acc, const Tiles*, float* tile_lse) {
  // The same online softmax, one tile at a time (equal up to rounding to one update over all rows).
  for (int i = 0; i < cur.count; ++i)
    attend_tile(t, D, G, q, cur.k[i], cur.v[i], scale_off, cur.n[i], s, m, l, acc, nullptr, nullptr,
                tile_lse ? tile_lse + size_t(i) * G : nullptr);
}

void tiles_lse(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* tile_lse,
               const Tiles*) {
  const size_t rb = kv_row_bytes(t, D);
  const int ns = kv_row_scales(t, D);
  const int n = cur.rows();
  float* row = s + size_t(G) * n;  // row: [D] one decoded K row; s: [G, n] the run's logits
  for (int i = 0, off = 0; i < cur.count; off += cur.n[i++]) {
    const float* ksc = reinterpret_cast<const float*>(cur.k[i] + scale_off);
    for (int r = 0; r < cur.n[i]; ++r) {
      scalar::decode_row(t, cur.k[i] + r * rb, ksc + r * ns, D, row);
      for (int g = 0; g < G; ++g) s[g * n + off + r] = dot(q + g * D, row, D);
    }
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < G; ++g) {
    const float* sg = s + g * n;
    float m = kNegInf;
    for (int r = 0; r < n; ++r) m = std::max(m, sg[r]);
    for (int i = 0, off = 0; i < cur.count; off += cur.n[i++]) {
      float sum = 0.f;
      for (int r = 0; r < cur.n[i]; ++r) {
        const float x = sg[off + r] - m;
        sum += x < -87.33654f ? 0.f : std::exp(x);  // (as the AVX2 exp: 0 past the fp32 range)
      }
      tile_lse[size_t(i) * G + g] = sum > 0.f ? m + std::log(sum) : kNegInf;
    }
  }
}

}  // namespace ktq::scalar
