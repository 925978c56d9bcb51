// A token's long_context decode through every block (token_step.h).
#include "decode/token_step.h"

#include <stdexcept>
#include <string>
#include <vector>

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
  for (int i = 0; i < st.config().n_layers; ++i) block_step(*blocks[i], st, i, steps[i], x, cos, sin, scale, n_threads);
}

}  // namespace ktq
