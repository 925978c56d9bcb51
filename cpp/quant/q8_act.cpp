// Activation quantization for the block GEMV: the scalar twin and the run-time dispatch (AVX2: q8_act_avx2.cpp).
#include "quant/q8_act.h"

#include <algorithm>
#include <cmath>

#include "common/cpu_features.h"

namespace ktq {

void quantize_act_scalar(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16) {
  for (int64_t g = 0; g < n / group; ++g) {
    const float* s = x + g * group;
    float amax = 0.f;
    for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(s[i]));
    const float dg = amax >= kActTiny ? amax / 127.f : 0.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    // nearbyint rounds half to even in the default FP environment, like _mm256_cvtps_epi32.
    for (int i = 0; i < group; ++i) q[g * group + i] = static_cast<int8_t>(std::nearbyint(s[i] * inv));
  }
  for (int64_t k = 0; k < n / 16; ++k) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[k * 16 + i];
    sum16[k] = static_cast<int16_t>(s);
  }
}

void quantize_act16_scalar(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32) {
  for (int64_t g = 0; g < n / 32; ++g) {
    const float* s = x + g * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(s[i]));
    const float dg = amax >= kActTiny ? amax / 32767.f : 0.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[g * 32 + i] = static_cast<int16_t>(std::nearbyint(s[i] * inv));
      sum += q[g * 32 + i];
    }
    sum32[g] = sum;
  }
}

void quantize_act16(const float* x, int64_t n, int16_t* q, float* d, int32_t* sum32) {
  if (use_avx2()) quantize_act16_avx2(x, n, q, d, sum32);
  else quantize_act16_scalar(x, n, q, d, sum32);
}

void quantize_act(const float* x, int64_t n, int group, int8_t* q, float* d, int16_t* sum16) {
  if (use_avx2()) quantize_act_avx2(x, n, group, q, d, sum16);
  else quantize_act_scalar(x, n, group, q, d, sum16);
}

}  // namespace ktq
