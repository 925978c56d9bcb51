// Scalar twins of the SnapKV score kernels (snapkv_kernels.h).
#include "select/snapkv_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ktq::scalar {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}  // namespace

void snapkv_logits(const float* q, int R, int D, const float* kt, int ss, float* s) {
  for (int r = 0; r < R; ++r) {
    float* row = s + int64_t(r) * ss;
    std::fill(row, row + ss, 0.f);
    for (int d = 0; d < D; ++d) {
      const float a = q[int64_t(r) * D + d];
      const float* k = kt + int64_t(d) * ss;
      for (int j = 0; j < ss; ++j) row[j] += a * k[j];
    }
  }
}

void snapkv_lse(const float* s, int R, int n, int ss, float* m, float* l) {
  for (int r = 0; r < R; ++r) {
    const float* row = s + int64_t(r) * ss;
    const float mx = std::max(m[r], *std::max_element(row, row + n));
    if (mx == kNegInf) continue;  // no key seen yet
    float sum = l[r] * std::exp(m[r] - mx);  // (m -inf: 0)
    for (int j = 0; j < n; ++j) sum += std::exp(row[j] - mx);
    m[r] = mx;
    l[r] = sum;
  }
}

void snapkv_probs(const float* s, int G, int W, int n, int ss, const float* lse, float* out, int os) {
  for (int g = 0; g < G; ++g) {
    float* o = out + int64_t(g) * os;
    std::fill(o, o + n, 0.f);
    for (int w = 0; w < W; ++w) {
      const int r = g * W + w;
      const float* row = s + int64_t(r) * ss;
      for (int j = 0; j < n; ++j) o[j] += std::exp(row[j] - lse[r]);
    }
  }
}

void snapkv_pool(const float* x, int G, int xs, int n, int p, bool max_merge, float* y) {
  for (int j = 0; j < n; ++j) {
    float acc = max_merge ? kNegInf : 0.f;
    for (int g = 0; g < G; ++g) {
      const float* c = x + int64_t(g) * xs + j;
      const float v = *std::max_element(c, c + 2 * p + 1);
      acc = max_merge ? std::max(acc, v) : acc + v;
    }
    y[j] = max_merge ? acc : acc / float(G);
  }
}

}  // namespace ktq::scalar
