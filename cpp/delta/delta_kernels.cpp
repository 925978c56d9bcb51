// Scalar twin of the gated delta rule (delta_kernels.h).
#include "delta/delta_kernels.h"

#include <cmath>
#include <vector>

namespace ktq::scalar {

void delta_rule_head(const DeltaHead& h, int T, int Dk, int Dv) {
  std::vector<float> kv(Dv), sq(Dv);
  for (int t = 0; t < T; ++t) {
    const float* q = h.q + t * h.qs;
    const float* k = h.k + t * h.ks;
    const float* v = h.v + t * h.vs;
    float* o = h.o + t * h.os;
    const float a = std::exp(h.g[t * h.gs]);
    const float beta = h.beta[t * h.gs];
    float kq = 0.f;
    for (int j = 0; j < Dv; ++j) kv[j] = sq[j] = 0.f;
    for (int i = 0; i < Dk; ++i) {
      const float* row = h.S + int64_t(i) * Dv;
      kq += k[i] * q[i];
      for (int j = 0; j < Dv; ++j) {
        kv[j] += k[i] * row[j];
        sq[j] += q[i] * row[j];
      }
    }
    for (int j = 0; j < Dv; ++j) {
      const float d = beta * (v[j] - a * kv[j]);
      o[j] = a * sq[j] + kq * d;
      kv[j] = d;  // (kv now holds d)
    }
    for (int i = 0; i < Dk; ++i) {
      float* row = h.S + int64_t(i) * Dv;
      for (int j = 0; j < Dv; ++j) row[j] = a * row[j] + k[i] * kv[j];
    }
  }
}

}  // namespace ktq::scalar
