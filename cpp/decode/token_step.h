// A token's decode on the CPU, top to bottom, as plain C++: for each layer, the block's qkv stage with the
// layer's RoPE row (decode_layer.h), the layer's attention on its q/k/v, and the block's out stage; x is carried
// from layer to layer. A layer attends as its TokenLayer says:
//   DENSE  a dense K/V buffer of its own (ktquest/kv/dense.py's layers, kv/sliding.py's sliding windows): the
//          token's k/v written at row w0, rows [0, w0] attended but [skip0, skip1) (attn/dense_attn.h);
//   STORE  a layer of the long-context store: its window buffer and store part (layer_step.h).
// The binding only checks the arguments, builds the TokenLayers and calls this without the GIL.
#pragma once

#include <cstdint>

#include "decode/decode_layer.h"
#include "decode/layer_step.h"
#include "kvstore/kv_store.h"

namespace ktq {

enum class LayerKind : int { DENSE = 0, STORE = 1 };

struct DenseStep {  // one layer's dense cache: K and V [KVH, rows, D] fp32, head-major
  float* k = nullptr;
  float* v = nullptr;
  int64_t rows = 0;
  int64_t w0 = 0;                // the token's row: rows [0, w0] are attended ...
  int64_t skip0 = 0, skip1 = 0;  // ... but [skip0, skip1) (the positions that left a sliding window)
};

struct TokenLayer {
  LayerKind kind = LayerKind::DENSE;
  int rope = 0;          // the layer's RoPE table: its row is cos/sin + rope * head_dim
  DenseStep dense;       // DENSE
  int store_layer = -1;  // STORE: the store's layer, and its step
  LayerStep step;
};

// The whole token: layers[i] for i = 0 .. n_layers - 1, blocks[i] its block; cos/sin: [n_tables, D] the token's
// RoPE rows. st: the store of the STORE layers (null when there are none). A STORE step's blocks may be an
// earlier step's out_ids: they are read after that step wrote them. A layer whose q is not finite throws
// std::invalid_argument before it writes anything. All or nothing: when a layer throws, the STORE layers
// before it are rolled back (their window rows and store lengths as before the token) and x is restored (a
// DENSE layer's row w0 lies past what its cache holds: nothing to undo), then the error propagates.
void decode_token(DecodeLayer* const* blocks, const TokenLayer* layers, int n_layers, KVStore* st, float* x,
                  const float* cos, const float* sin, float scale, int n_threads);

// One token of each of n_seqs sequences at once (batched decode: the server's parallel slots): sequence s's
// layers, store (null: no STORE layer) and RoPE rows [n_tables, D]; x [n_seqs, dim]. Each block's matrices are
// read once for all the tokens (DecodeLayer's T-token stages); each token attends its own sequence's cache. Token
// s's result is what decode_token gives it alone, bit for bit. All or nothing over the batch: when a layer
// throws, every sequence's STORE layers are rolled back and x restored.
struct SeqStep {
  const TokenLayer* layers = nullptr;  // [n_layers]
  KVStore* st = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
};
void decode_tokens(DecodeLayer* const* blocks, int n_layers, const SeqStep* seqs, int n_seqs, float* x, float scale,
                   int n_threads);

}  // namespace ktq
