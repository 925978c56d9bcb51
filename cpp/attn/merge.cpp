// LSE merges (merge.h).
#include "attn/merge.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace ktq {

void merge_partials(const float* part, const int64_t* tstart, int KVH, int G, int D, float* out, float* lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const size_t pstride = size_t(G) * (D + 2);
  for (int h = 0; h < KVH; ++h)
    for (int g = 0; g < G; ++g) {
      float* o = out + (size_t(h) * G + g) * D;
      std::fill(o, o + D, 0.f);
      float M = kNegInf;
      for (int64_t t = tstart[h]; t < tstart[h + 1]; ++t) M = std::max(M, part[t * pstride + g]);
      if (M == kNegInf) {  // nothing attended for this head
        lse[h * G + g] = kNegInf;
        continue;
      }
      // out = sum_i w_i acc_i / sum_i w_i l_i with w_i = e^(m_i - M) <= 1: no overflow.
      float sum = 0.f;
      for (int64_t t = tstart[h]; t < tstart[h + 1]; ++t) {
        const float* P = part + t * pstride;
        const float w = std::exp(P[g] - M);
        sum += w * P[G + g];
        const float* a = P + 2 * G + size_t(g) * D;
        for (int d = 0; d < D; ++d) o[d] += w * a[d];
      }
      for (int d = 0; d < D; ++d) o[d] /= sum;
      lse[h * G + g] = M + std::log(sum);
    }
}

void merge_two(const float* a, const float* lse_a, const float* b, const float* lse_b, int H, int D, float* out) {
  for (int h = 0; h < H; ++h) {
    // b weighs 1 / (1 + exp(lse_a - lse_b)) (0 when it attended no row: lse_b = -inf).
    const float wb = !b || std::isinf(lse_b[h]) ? 0.f : 1.f / (1.f + std::exp(lse_a[h] - lse_b[h]));
    const float wa = 1.f - wb;
    for (int d = 0; d < D; ++d) out[h * D + d] = wa * a[h * D + d] + (wb == 0.f ? 0.f : wb * b[h * D + d]);
  }
}

}  // namespace ktq
