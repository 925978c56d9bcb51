// Scalar twin of the group bound kernel (bound_kernels.h): plain loops; also the path for head_dim % 8 != 0
// and for KTQUEST_FORCE_SCALAR=1.
#include "index/bound_kernels.h"

#include <algorithm>
#include <cmath>

namespace ktq::scalar {

void score_bounds(const float* rows, int64_t n, int D, const float* qb, float* bound, float* mag) {
  const float *qn = qb, *qp = qb + D, *w = qb + 2 * D;
  for (int64_t i = 0; i < n; ++i) {
    const float *mn = rows + i * 2 * D, *mx = mn + D;
    float b = 0.f, m = 0.f;
    for (int d = 0; d < D; ++d) {
      b += qn[d] * mn[d] + qp[d] * mx[d];
      m += w[d] * std::max(std::fabs(mn[d]), std::fabs(mx[d]));
    }
    bound[i] = b;
    mag[i] = m;
  }
}

}  // namespace ktq::scalar
