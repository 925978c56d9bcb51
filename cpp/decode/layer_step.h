// One long_context decode step of one layer on the CPU, in one call (ktquest/long_context.py): the new
// token's K/V go into the device window buffer, the window is attended densely (dense_attn.h), the context
// blocks in the store through the sparse operator (a fixed block list or a fresh selection), the two
// parts are merged exactly by their LSE, and the token is appended to the store. Python used to do this
// in ~25 small torch/numpy calls a layer, ~150 us of dispatch per layer against ~100 us of work.
#pragma once

#include <cstdint>

#include "kvstore/kv_store.h"

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

// q: [H, D] unscaled, k/v: [KVH, D] the new token (fp32); scale: the window's softmax scale (the store
// uses 1/sqrt(D)). part NONE: no context block yet; ATTEND: `blocks`; SELECT: `req`, ids to out_ids
// [n_sets, out_cols]. out: [H, D]. The store is appended to only after both attentions succeeded.
void long_context_decode_step(KVStore& st, int layer, const float* q, int H, const float* k, const float* v,
                              const WindowView& win, float scale, int n_threads, StorePart part,
                              const BlockSets& blocks, const SelectRequest& req, int32_t* out_ids, int out_cols,
                              float* out);

}  // namespace ktq
