#include "decode/decode_layer.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/checked.h"
#include "common/finite.h"

namespace ktq {

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float r = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

HeadShape head_shape(int n_heads, int n_kv_heads, int head_dim) {
  if (n_kv_heads < 1 || n_heads < 1 || n_heads % n_kv_heads != 0)
    throw std::invalid_argument("n_heads=" + std::to_string(n_heads) + " must be a positive multiple of n_kv_heads=" +
                                std::to_string(n_kv_heads));
  if (head_dim < 2 || head_dim % 2 != 0)
    throw std::invalid_argument("head_dim=" + std::to_string(head_dim) + " must be even and >= 2 (rotate-half RoPE)");
  const int64_t heads = checked_add<int64_t>(n_heads, 2 * int64_t(n_kv_heads), "q, k and v heads");
  return HeadShape{checked_mul<int64_t>(heads, head_dim, "wqkv rows ((n_heads + 2 n_kv_heads) x head_dim)"),
                   checked_mul<int64_t>(n_heads, head_dim, "wo columns (n_heads x head_dim)")};
}

DecodeLayer::DecodeLayer(const DecodeLayerWeights& w) : w_(w) {
  const HeadShape hs = head_shape(w.n_heads, w.n_kv_heads, w.head_dim);
  if (w.wqkv.out != hs.qkv || w.wo.in != hs.attn)
    throw std::invalid_argument("wqkv has " + std::to_string(w.wqkv.out) + " rows and wo " + std::to_string(w.wo.in) +
                                " columns: expected " + std::to_string(hs.qkv) + " and " + std::to_string(hs.attn) +
                                " for these heads");
  if (!(w.eps >= 0.f)) throw std::invalid_argument("eps=" + std::to_string(w.eps) + " must be >= 0");
  check_finite(w.eps, "eps");
  if (!w.qkv_perm.empty()) {
    if (int64_t(w.qkv_perm.size()) != hs.qkv)
      throw std::invalid_argument("qkv_perm has " + std::to_string(w.qkv_perm.size()) + " entries, wqkv " +
                                  std::to_string(hs.qkv) + " rows");
    std::vector<bool> seen(size_t(hs.qkv), false);
    for (int32_t i : w.qkv_perm) {
      if (i < 0 || i >= hs.qkv || seen[size_t(i)])
        throw std::invalid_argument("qkv_perm is not a permutation of the wqkv rows (entry " + std::to_string(i) +
                                    ")");
      seen[size_t(i)] = true;
    }
    proj_.resize(size_t(hs.qkv));
  }
  xn_.resize(size_t(w.wqkv.in));
  h_.resize(size_t(w.w_gate_up.out));
  if (w.ffn == FfnKind::MOE) {
    moe_ = std::make_unique<MoeFfn>(w.moe);  // check_moe
    if (w.moe.router.in != w.wqkv.in)
      throw std::invalid_argument("router: " + std::to_string(w.moe.router.in) + " columns, the block's dim is " +
                                  std::to_string(w.wqkv.in));
    f_.resize(size_t(w.wqkv.in));
  }
  rope_.resize(size_t(w.head_dim));
}

void DecodeLayer::qkv(const float* x, const float* cos, const float* sin, float* qkv, int n_threads) {
  this->qkv(x, 1, &cos, &sin, qkv, n_threads);
}

void DecodeLayer::out(const float* attn, float* x, int n_threads) { this->out(attn, x, 1, n_threads); }

void DecodeLayer::qkv(const float* x, int64_t T, const float* const* cos, const float* const* sin, float* qkv,
                      int n_threads) {
  const QuantMatrix& m = w_.wqkv;
  const int64_t dim = m.in, rows = m.out;
  grow(xn_, T * dim);
  for (int64_t t = 0; t < T; ++t) rms_norm(x + t * dim, w_.attn_norm, dim, w_.eps, xn_.data() + t * dim);
  if (w_.qkv_perm.empty()) {
    gemv_matrix(m, xn_.data(), T, qkv, n_threads);
  } else {
    grow(proj_, T * rows);
    gemv_matrix(m, xn_.data(), T, proj_.data(), n_threads);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < rows; ++i) qkv[t * rows + i] = proj_[size_t(t * rows + w_.qkv_perm[size_t(i)])];
  }
  const int D = w_.head_dim, half = D / 2;
  float* tmp = rope_.data();  // one head
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv + t * rows;
    if (w_.q_norm != nullptr)  // QK-norm: each head normed over its D values, before RoPE
      for (int h = 0; h < w_.n_heads; ++h) rms_norm(row + int64_t(h) * D, w_.q_norm, D, w_.eps, row + int64_t(h) * D);
    if (w_.k_norm != nullptr)
      for (int h = w_.n_heads; h < w_.n_heads + w_.n_kv_heads; ++h)
        rms_norm(row + int64_t(h) * D, w_.k_norm, D, w_.eps, row + int64_t(h) * D);
    // RoPE, rotate-half: y[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i] on each q and k head (v untouched), with
    // token t's own row.
    const float *c = cos[t], *s = sin[t];
    for (int h = 0; h < w_.n_heads + w_.n_kv_heads; ++h) {
      float* v = row + int64_t(h) * D;
      for (int i = 0; i < D; ++i) tmp[i] = v[i] * c[i] + v[(i + half) % D] * s[i];
      for (int i = 0; i < D; ++i) v[i] = tmp[i];
    }
  }
}

void DecodeLayer::out(const float* attn, float* x, int64_t T, int n_threads) {
  const int64_t dim = w_.wo.out, ffn = w_.w_down.in;
  grow(xn_, T * dim);
  float* xn = xn_.data();
  // x += Wo attn (xn holds the projection, then the normed residual)
  gemv_matrix(w_.wo, attn, T, xn, n_threads);
  for (int64_t t = 0; t < T; ++t) {
    float *a = xn + t * dim, *xt = x + t * dim;
    if (w_.post_attn_norm != nullptr) rms_norm(a, w_.post_attn_norm, dim, w_.eps, a);
    for (int64_t i = 0; i < dim; ++i) xt[i] += a[i];
    rms_norm(xt, w_.ffn_norm, dim, w_.eps, a);
  }
  if (w_.ffn == FfnKind::MOE) {  // (the experts a token picks are its own: one token at a time)
    for (int64_t t = 0; t < T; ++t) {
      float* xt = x + t * dim;
      moe_->run(xn + t * dim, f_.data(), n_threads);
      if (w_.post_ffn_norm != nullptr) rms_norm(f_.data(), w_.post_ffn_norm, dim, w_.eps, f_.data());
      for (int64_t i = 0; i < dim; ++i) xt[i] += f_[i];
    }
    return;
  }
  grow(h_, T * 2 * ffn);
  grow(g_, T * ffn);
  gemv_matrix(w_.w_gate_up, xn, T, h_.data(), n_threads);
  for (int64_t t = 0; t < T; ++t) {
    const float* h = h_.data() + t * 2 * ffn;  // [gate | up]
    float* g = g_.data() + t * ffn;
    if (w_.ffn == FfnKind::SWIGLU) {
      for (int64_t i = 0; i < ffn; ++i) g[i] = h[i] / (1.f + std::exp(-h[i])) * h[ffn + i];  // silu(gate) * up
    } else {
      for (int64_t i = 0; i < ffn; ++i) {  // gelu_tanh(gate) * up (torch's approximate="tanh")
        const float v = h[i];
        const float th = std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v));  // sqrt(2/pi)
        g[i] = 0.5f * v * (1.f + th) * h[ffn + i];
      }
    }
  }
  gemv_matrix(w_.w_down, g_.data(), T, xn, n_threads);
  for (int64_t t = 0; t < T; ++t) {
    float *f = xn + t * dim, *xt = x + t * dim;
    if (w_.post_ffn_norm != nullptr) rms_norm(f, w_.post_ffn_norm, dim, w_.eps, f);
    for (int64_t i = 0; i < dim; ++i) xt[i] += f[i];
  }
}

void DecodeLayer::grow(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
}

}  // namespace ktq
