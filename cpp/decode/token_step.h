// A token's decode on the CPU, top to bottom, as plain C++: for each layer, the block's qkv stage
// (decode_layer.h), the layer's attention on its q/k/v (long_context: layer_step.h; dense: the whole cache,
// attn/dense_attn.h), and the block's out stage; x is carried from layer to layer. The binding only checks
// the arguments, builds the LayerSteps and calls these without the GIL.
#pragma once

#include "decode/decode_layer.h"
#include "decode/layer_step.h"
#include "kvstore/kv_store.h"

namespace ktq {

// One block of layer `layer` of the store: qkv of x (cos/sin: [D] the token's RoPE row), q checked finite
// (std::invalid_argument before anything is written, as the store would), layer_step, out; x [dim] is
// updated in place to the block's output. The layer's heads must match the store's.
void block_step(DecodeLayer& block, KVStore& st, int layer, const LayerStep& step, float* x, const float* cos,
                const float* sin, float scale, int n_threads);

// The whole token: block_step(*blocks[i], st, i, steps[i], ...) for i = 0 .. n_layers - 1 of the store.
// A step's blocks may be an earlier step's out_ids: they are read after that step wrote them.
// All or nothing: when a layer throws, the layers before it are rolled back (their window rows and store
// lengths as before the token) and x is restored, then the error propagates.
void decode_token(DecodeLayer* const* blocks, const LayerStep* steps, KVStore& st, float* x, const float* cos,
                  const float* sin, float scale, int n_threads);

// One layer's dense KV cache: K and V [KVH, cap, D] fp32, head-major (ktquest/kv/dense.py).
struct DenseKV {
  float* k = nullptr;
  float* v = nullptr;
  int64_t cap = 0;
};

// The whole token on dense caches: for i = 0 .. n_layers - 1, blocks[i]'s qkv stage, k/v written at row pos of
// kv[i], attention over rows [0, pos] (scale), the out stage. pos < cap. A layer whose q is not finite throws
// std::invalid_argument; x is then restored (rows written at pos are past the cache's length: harmless).
void decode_token_dense(DecodeLayer* const* blocks, const DenseKV* kv, int n_layers, int64_t pos, float* x,
                        const float* cos, const float* sin, float scale, int n_threads);

}  // namespace ktq
