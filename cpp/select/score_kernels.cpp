// Scalar twins of the block-scoring kernels (score_kernels.h): plain loops, same contracts as the AVX2
// versions; also the path for head_dim % 8 != 0 and for KTQUEST_FORCE_SCALAR=1.
#include "select/score_kernels.h"

#include <algorithm>
#include <limits>

#include "attn/scalar_dot.h"
#include "quant/kv_codec.h"

namespace ktq::scalar {

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

}  // namespace ktq::scalar
