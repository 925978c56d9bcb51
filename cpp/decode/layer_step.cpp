// long_context decode step of one layer (contract in lc_decode.h).
#include "decode/layer_step.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "attn/dense_attn.h"

namespace ktq {

void long_context_decode_step(KVStore& st, int layer, const float* q, int H, const float* k, const float* v,
                              const WindowView& win, float scale, int n_threads, StorePart part,
                              const BlockSets& blocks, const SelectRequest& req, int32_t* out_ids, int out_cols,
                              float* out) {
  const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
  // The token joins the window first: it attends to itself there (the store part never holds it).
  for (int h = 0; h < KVH; ++h) {
    std::memcpy(win.k + (h * win.rows + win.w0) * D, k + h * D, sizeof(float) * D);
    std::memcpy(win.v + (h * win.rows + win.w0) * D, v + h * D, sizeof(float) * D);
  }
  thread_local std::vector<float> buf;
  buf.resize(size_t(H) * (D + 1) * 2);
  float *ow = buf.data(), *lw = ow + size_t(H) * D, *os = lw + H, *ls = os + size_t(H) * D;
  dense_decode_attention(q, H, KVH, D, win.k, win.v, win.rows * D, win.width, scale, ow, lw, n_threads, win.skip0,
                         win.skip1);
  if (part == StorePart::ATTEND) st.attend(layer, q, H, blocks, os, ls);
  else if (part == StorePart::SELECT) st.select_attend(layer, q, H, req, out_ids, out_cols, os, ls);
  for (int h = 0; h < H; ++h) {
    // The window always holds the token itself, so lw is finite; the store part weighs
    // 1 / (1 + exp(lw - ls)) (0 when it attended no block: ls = -inf).
    const float ws = part == StorePart::NONE || std::isinf(ls[h]) ? 0.f : 1.f / (1.f + std::exp(lw[h] - ls[h]));
    const float ww = 1.f - ws;
    for (int d = 0; d < D; ++d) out[h * D + d] = ww * ow[h * D + d] + (ws == 0.f ? 0.f : ws * os[h * D + d]);
  }
  st.append(layer, k, v, InType::F32, 1, nullptr);
}

}  // namespace ktq
