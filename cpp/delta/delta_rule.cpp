// The gated delta rule over every value head (delta_rule.h): one task a head, the AVX2 or scalar kernel.
#include "delta/delta_rule.h"

#include <stdexcept>
#include <string>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "delta/delta_kernels.h"

namespace ktq {

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                      float* o, int T, int Hk, int Hv, int Dk, int Dv, int n_threads, bool grouped) {
  if (T < 1 || Hk < 1 || Hv < 1 || Dk < 1 || Dv < 1 || Hv % Hk || Dv > kMaxDeltaValueDim)
    throw std::invalid_argument("gated_delta_rule: T=" + std::to_string(T) + ", Hk=" + std::to_string(Hk) +
                                ", Hv=" + std::to_string(Hv) + ", Dk=" + std::to_string(Dk) + ", Dv=" +
                                std::to_string(Dv) + ": sizes >= 1, Hv a multiple of Hk, Dv <= " +
                                std::to_string(kMaxDeltaValueDim));
  const bool wide = use_avx2();
  ThreadPool::global().parallel_for(Hv, n_threads, [&](int64_t hv) {
    const int kh = grouped ? int(hv / (Hv / Hk)) : int(hv % Hk);
    DeltaHead h{q + int64_t(kh) * Dk, k + int64_t(kh) * Dk, v + hv * Dv, g + hv, beta + hv,
                S + hv * Dk * Dv, o + hv * Dv, int64_t(Hk) * Dk, int64_t(Hk) * Dk, int64_t(Hv) * Dv,
                int64_t(Hv) * Dv, Hv};
    if (wide)
      avx2::delta_rule_head(h, T, Dk, Dv);
    else
      scalar::delta_rule_head(h, T, Dk, Dv);
  });
}

}  // namespace ktq
