// Scalar twin of the group bound kernel (bound_kernels.h): plain loops; also the path for head_dim % 8 != 0
// and for KTQUEST_FORCE_SCALAR=1.
#include "index/bound_kernels.h"

#include <algorithm>
#include <cmath>

#include "quant/kv_codec.h"

namespace ktq::scalar {

void score_bounds(const uint16_t* rows, int64_t n, int D, const float* qb, float* bound, float* mag) {
  const float *qn = qb, *qp = qb + D, *w = qb + 2 * D;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t *mn = rows + i * 2 * D, *mx = mn + D;
    float b = 0.f, m = 0.f;
    for (int d = 0; d < D; ++d) {
      const float lo = f16_to_f32(mn[d]), hi = f16_to_f32(mx[d]);
      b += qn[d] * lo + qp[d] * hi;
      m += w[d] * std::max(std::fabs(lo), std::fabs(hi));
    }
    bound[i] = b;
    mag[i] = m;
  }
}

}  // namespace ktq::scalar
