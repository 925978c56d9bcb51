#include "decode/decode_layer.h"

#include <cmath>

#include "gemm/gemv.h"

namespace ktq {

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float r = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

DecodeLayer::DecodeLayer(const DecodeLayerWeights& w)
    : w_(w), xn_(size_t(w.wqkv.in)), h_(size_t(w.w_gate_up.out)) {}

void DecodeLayer::qkv(const float* x, const float* cos, const float* sin, float* qkv, int n_threads) {
  const Q8Matrix& m = w_.wqkv;
  rms_norm(x, w_.attn_norm, m.in, w_.eps, xn_.data());
  gemv_q8_0(xn_.data(), 1, m.in, m.q, m.d, m.out, m.bias, qkv, n_threads);
  // RoPE, rotate-half: y[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i] on each q and k head (v untouched).
  const int D = w_.head_dim, half = D / 2;
  float tmp[1024];  // one head (head_dim <= 1024, checked by the binding)
  for (int h = 0; h < w_.n_heads + w_.n_kv_heads; ++h) {
    float* v = qkv + int64_t(h) * D;
    for (int i = 0; i < D; ++i) tmp[i] = v[i] * cos[i] + v[(i + half) % D] * sin[i];
    for (int i = 0; i < D; ++i) v[i] = tmp[i];
  }
}

void DecodeLayer::out(const float* attn, float* x, int n_threads) {
  const int64_t dim = w_.wo.out, ffn = w_.w_down.in;
  // x += Wo attn (xn_ holds the projection, then the normed residual)
  gemv_q8_0(attn, 1, w_.wo.in, w_.wo.q, w_.wo.d, dim, w_.wo.bias, xn_.data(), n_threads);
  for (int64_t i = 0; i < dim; ++i) x[i] += xn_[i];
  rms_norm(x, w_.ffn_norm, dim, w_.eps, xn_.data());
  gemv_q8_0(xn_.data(), 1, dim, w_.w_gate_up.q, w_.w_gate_up.d, 2 * ffn, w_.w_gate_up.bias, h_.data(), n_threads);
  for (int64_t i = 0; i < ffn; ++i) {  // h[:ffn] = silu(gate) * up
    const float g = h_[i];
    h_[i] = g / (1.f + std::exp(-g)) * h_[ffn + i];
  }
  gemv_q8_0(h_.data(), 1, ffn, w_.w_down.q, w_.w_down.d, dim, w_.w_down.bias, xn_.data(), n_threads);
  for (int64_t i = 0; i < dim; ++i) x[i] += xn_[i];
}

}  // namespace ktq
