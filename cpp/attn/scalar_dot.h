// The scalar twins' dot product: attention logits (attn_kernels.cpp) and block scores
// (select/score_kernels.cpp) sum in this one order. Include it only from files built without -mfma: there the
// compiler cannot contract s + a * b into an FMA, and the internal linkage keeps each file's own copy, so a
// file built with -mfma can never provide it.
#pragma once

namespace ktq::scalar {
namespace {

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace
}  // namespace ktq::scalar
