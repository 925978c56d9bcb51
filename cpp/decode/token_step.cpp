// A token's long_context decode through every block (token_step.h).
#include "decode/token_step.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/dense_attn.h"
#include "common/finite.h"

namespace ktq {

void block_step(DecodeLayer& block, KVStore& st, int layer, const LayerStep& step, float* x, const float* cos,
                const float* sin, float scale, int n_threads) {
  const DecodeLayerWeights& w = block.weights();
  const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
  thread_local std::vector<float> buf;
  buf.resize(size_t(block.qkv_size() + block.attn_size()));
  float *qkv = buf.data(), *attn = qkv + block.qkv_size();  // qkv: [(H + 2 KVH) * D] rows q | k | v; attn: [H * D]
  block.qkv(x, cos, sin, qkv, n_threads);
  if (first_non_finite(qkv, int64_t(H) * D) >= 0)  // as the store would, before anything is written
    throw std::invalid_argument("layer " + std::to_string(layer) + ": q is not finite (the layer's input overflowed?)");
  layer_step(st, layer, qkv, H, qkv + int64_t(H) * D, qkv + int64_t(H + KVH) * D, step, scale, n_threads, attn);
  block.out(attn, x, n_threads);
}

void decode_token(DecodeLayer* const* blocks, const LayerStep* steps, KVStore& st, float* x, const float* cos,
                  const float* sin, float scale, int n_threads) {
  const int n = st.config().n_layers, KVH = st.config().n_kv_heads, D = st.config().head_dim;
  const int64_t dim = n > 0 ? blocks[0]->dim() : 0;
  // All or nothing: a layer that refuses the token (its q not finite, a k/v its store cannot hold) leaves its own
  // window and store as they were (layer_step); the layers before it are rolled back here (their window rows
  // put back, the token truncated from their store) and x restored. Copies of a few KiB a token.
  thread_local std::vector<float> kept;  // x [dim], then per layer the window rows at w0: [n, 2, KVH, D]
  thread_local std::vector<int64_t> len;  // [n] each layer's length before the token
  kept.resize(size_t(dim) + size_t(n) * 2 * KVH * D);
  len.resize(n);
  std::memcpy(kept.data(), x, sizeof(float) * dim);
  auto rows = [&](int i, int which, int h) {  // layer i's window row at w0 of KV head h: K (0) or V (1)
    const WindowView& w = steps[i].win;
    return (which ? w.v : w.k) + (h * w.rows + w.w0) * D;
  };
  auto saved = [&](int i, int which, int h) { return kept.data() + dim + ((size_t(i) * 2 + which) * KVH + h) * D; };
  int i = 0;
  try {
    for (; i < n; ++i) {
      len[i] = st.length(i);
      for (int which = 0; which < 2; ++which)
        for (int h = 0; h < KVH; ++h) std::memcpy(saved(i, which, h), rows(i, which, h), sizeof(float) * D);
      block_step(*blocks[i], st, i, steps[i], x, cos, sin, scale, n_threads);
    }
  } catch (...) {
    for (int j = 0; j < i; ++j) {
      st.truncate(j, len[j]);
      for (int which = 0; which < 2; ++which)
        for (int h = 0; h < KVH; ++h) std::memcpy(rows(j, which, h), saved(j, which, h), sizeof(float) * D);
    }
    std::memcpy(x, kept.data(), sizeof(float) * dim);
    throw;
  }
}

void decode_token_dense(DecodeLayer* const* blocks, const DenseKV* kv, int n_layers, int64_t pos, float* x,
                        const float* cos, const float* sin, float scale, int n_threads) {
  const int64_t dim = n_layers > 0 ? blocks[0]->dim() : 0;
  thread_local std::vector<float> buf, kept;
  kept.assign(x, x + dim);
  try {
    for (int i = 0; i < n_layers; ++i) {
      DecodeLayer& block = *blocks[i];
      const DecodeLayerWeights& w = block.weights();
      const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
      buf.resize(size_t(block.qkv_size() + block.attn_size() + H));
      float *qkv = buf.data(), *attn = qkv + block.qkv_size(), *lse = attn + block.attn_size();
      block.qkv(x, cos, sin, qkv, n_threads);
      if (first_non_finite(qkv, int64_t(H) * D) >= 0)
        throw std::invalid_argument("layer " + std::to_string(i) + ": q is not finite (the layer's input overflowed?)");
      const DenseKV& c = kv[i];
      for (int h = 0; h < KVH; ++h) {  // k, v of KV head h at row pos
        std::memcpy(c.k + (h * c.cap + pos) * D, qkv + int64_t(H + h) * D, sizeof(float) * D);
        std::memcpy(c.v + (h * c.cap + pos) * D, qkv + int64_t(H + KVH + h) * D, sizeof(float) * D);
      }
      dense_decode_attention(qkv, H, KVH, D, c.k, c.v, c.cap * D, pos + 1, scale, attn, lse, n_threads);
      block.out(attn, x, n_threads);
    }
  } catch (...) {
    std::memcpy(x, kept.data(), sizeof(float) * dim);
    throw;
  }
}

}  // namespace ktq
