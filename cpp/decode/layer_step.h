// One long_context decode step of one layer on the CPU, in one call (ktquest/kv/long_context.py): the new
// token's K/V go into the device window buffer, the window is attended densely (attn/dense_attn.h), the
// context blocks in the store through the sparse operator (a fixed block list or a fresh selection), the two
// parts are merged exactly by their LSE (attn/merge.h), and the token is appended to the store. One native
// call instead of ~25 small torch/numpy calls a layer, whose dispatch cost more than the work.
#pragma once

#include <cstdint>

#include "kvstore/kv_store.h"
#include "select/request.h"

namespace ktq {

struct WindowView {  // one layer's window buffer: [KVH, rows, D] fp32 K and V
  float* k = nullptr;
  float* v = nullptr;
  int64_t rows = 0;   // capacity per KV head
  int64_t w0 = 0;     // the new token's row
  int64_t width = 0;  // rows [0, width) are attended (w0 < width) ...
  int64_t skip0 = 0, skip1 = 0;  // ... but [skip0, skip1): the stretch that left the local window
};

enum class StorePart : int { NONE = 0, ATTEND = 1, SELECT = 2 };

// What one layer's step attends: its window, and the store part. NONE: no context block yet; ATTEND:
// `blocks`; SELECT: `req`, the selected ids written to out_ids [n_sets, out_cols] (all pointers borrowed).
struct LayerStep {
  WindowView win;
  StorePart part = StorePart::NONE;
  BlockSets blocks{nullptr, 0, 0};
  SelectRequest req;
  int32_t* out_ids = nullptr;
  int out_cols = 0;
};

// q: [H, D] unscaled, k/v: [KVH, D] the new token (fp32); scale: the window's softmax scale (the store
// uses 1/sqrt(D)). out: [H, D]. The store is appended to only after both attentions succeeded.
// All or nothing: a non-finite scale or q, a k/v the store would refuse (non-finite, beyond kv_type, a full
// store) throw std::invalid_argument / std::length_error before anything is written; a store part that
// throws later (its block ids, a selection's k) leaves the window rows, the store and out as they were.
void layer_step(KVStore& st, int layer, const float* q, int H, const float* k, const float* v, const LayerStep& step,
                float scale, int n_threads, float* out);

}  // namespace ktq
