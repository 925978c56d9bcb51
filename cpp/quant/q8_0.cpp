// Q8_0 weight quantization: the scalar twin and the run-time dispatch (AVX2 twin: q8_0_avx2.cpp).
#include "quant/q8_0.h"

#include <algorithm>
#include <cmath>

#include "common/cpu_features.h"

namespace ktq {

void quantize_q8_0_scalar(const float* src, int64_t n, int8_t* q, float* d) {
  for (int64_t g = 0; g < n / kQGroup; ++g) {
    const float* s = src + g * kQGroup;
    float amax = 0.f;
    for (int i = 0; i < kQGroup; ++i) amax = std::max(amax, std::fabs(s[i]));
    const float dg = amax / 127.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    // nearbyint rounds half to even in the default FP environment, like _mm256_cvtps_epi32.
    for (int i = 0; i < kQGroup; ++i) q[g * kQGroup + i] = static_cast<int8_t>(std::nearbyint(s[i] * inv));
  }
}

void quantize_q8_0(const float* src, int64_t n, int8_t* q, float* d) {
  if (use_avx2()) quantize_q8_0_avx2(src, n, q, d);
  else quantize_q8_0_scalar(src, n, q, d);
}

}  // namespace ktq
