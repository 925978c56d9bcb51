// A token's decode through every block (token_step.h).
#include "decode/token_step.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/dense_attn.h"
#include "common/finite.h"

namespace ktq {

namespace {

// A DENSE layer's attention: k/v of the token at row w0, then q over rows [0, w0] but the skipped stretch.
// qkv: [(H + 2 KVH) * D] rows q | k | v; attn: [H * D]; lse: [H] scratch.
void dense_step(const DecodeLayerWeights& w, const DenseStep& d, const float* qkv, float scale, int n_threads,
                float* attn, float* lse) {
  const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
  for (int h = 0; h < KVH; ++h) {  // k, v of KV head h at row w0
    std::memcpy(d.k + (h * d.rows + d.w0) * D, qkv + int64_t(H + h) * D, sizeof(float) * D);
    std::memcpy(d.v + (h * d.rows + d.w0) * D, qkv + int64_t(H + KVH + h) * D, sizeof(float) * D);
  }
  dense_decode_attention(qkv, H, KVH, D, d.k, d.v, d.rows * D, d.w0 + 1, scale, attn, lse, n_threads, d.skip0,
                         d.skip1);
}

}  // namespace

void decode_token(DecodeLayer* const* blocks, const TokenLayer* layers, int n_layers, KVStore* st, float* x,
                  const float* cos, const float* sin, float scale, int n_threads) {
  const int64_t dim = n_layers > 0 ? blocks[0]->dim() : 0;
  // x [dim], then per STORE layer its window rows at w0 before the token: [2, KVH, D] each (a few KiB a token)
  thread_local std::vector<float> kept, buf;
  thread_local std::vector<int64_t> len;  // per layer: its store layer's length before the token (STORE)
  size_t room = size_t(dim);
  for (int i = 0; i < n_layers; ++i)
    if (layers[i].kind == LayerKind::STORE)
      room += size_t(2) * blocks[i]->weights().n_kv_heads * blocks[i]->weights().head_dim;
  kept.resize(room);
  len.assign(size_t(n_layers), 0);
  std::memcpy(kept.data(), x, sizeof(float) * dim);
  // layer i's window rows at w0 (STORE): K (which 0) or V (1) of KV head h, in the buffer and as kept
  auto row = [&](int i, int which, int h) {
    const WindowView& w = layers[i].step.win;
    return (which ? w.v : w.k) + (h * w.rows + w.w0) * blocks[i]->weights().head_dim;
  };
  thread_local std::vector<size_t> saved_at;  // per STORE layer: where its rows are kept
  saved_at.assign(size_t(n_layers), 0);
  auto saved = [&](int i, int which, int h) {
    const int KVH = blocks[i]->weights().n_kv_heads, D = blocks[i]->weights().head_dim;
    return kept.data() + saved_at[i] + (size_t(which) * KVH + h) * D;
  };
  int i = 0;
  try {
    size_t at = size_t(dim);
    for (; i < n_layers; ++i) {
      DecodeLayer& block = *blocks[i];
      const TokenLayer& L = layers[i];
      const DecodeLayerWeights& w = block.weights();
      const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
      buf.resize(size_t(block.qkv_size() + block.attn_size() + H));
      float *qkv = buf.data(), *attn = qkv + block.qkv_size(), *lse = attn + block.attn_size();
      block.qkv(x, cos + int64_t(L.rope) * D, sin + int64_t(L.rope) * D, qkv, n_threads);
      if (first_non_finite(qkv, int64_t(H) * D) >= 0)  // as the store would, before anything is written
        throw std::invalid_argument("layer " + std::to_string(i) + ": q is not finite (the layer's input overflowed?)");
      if (L.kind == LayerKind::DENSE) {
        dense_step(w, L.dense, qkv, scale, n_threads, attn, lse);
      } else {
        saved_at[i] = at;
        at += size_t(2) * KVH * D;
        len[i] = st->length(L.store_layer);
        for (int which = 0; which < 2; ++which)
          for (int h = 0; h < KVH; ++h) std::memcpy(saved(i, which, h), row(i, which, h), sizeof(float) * D);
        layer_step(*st, L.store_layer, qkv, H, qkv + int64_t(H) * D, qkv + int64_t(H + KVH) * D, L.step, scale,
                   n_threads, attn);
      }
      block.out(attn, x, n_threads);
    }
  } catch (...) {
    for (int j = 0; j < i; ++j) {
      if (layers[j].kind != LayerKind::STORE) continue;
      st->truncate(layers[j].store_layer, len[j]);
      const int KVH = blocks[j]->weights().n_kv_heads, D = blocks[j]->weights().head_dim;
      for (int which = 0; which < 2; ++which)
        for (int h = 0; h < KVH; ++h) std::memcpy(row(j, which, h), saved(j, which, h), sizeof(float) * D);
    }
    std::memcpy(x, kept.data(), sizeof(float) * dim);
    throw;
  }
}

}  // namespace ktq
