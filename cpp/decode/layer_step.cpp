// long_context decode step of one layer (contract in layer_step.h).
#include "decode/layer_step.h"

#include <cstring>
#include <vector>

#include "attn/dense_attn.h"
#include "attn/merge.h"
#include "common/finite.h"

namespace ktq {

void layer_step(KVStore& st, int layer, const float* q, int H, const float* k, const float* v, const LayerStep& step,
                float scale, int n_threads, float* out) {
  const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
  const WindowView& win = step.win;
  // ---- validate before writing anything: a refused step leaves the window, the store and out as they were ----
  check_finite(scale, "scale");
  check_finite_q(q, H, D);
  st.check_append(layer, k, v, InType::F32, 1, nullptr);  // non-finite k/v, or ones kv_type cannot hold; a full store
  // The token joins the window first: it attends to itself there (the store part never holds it). The rows it
  // replaces are kept and put back if the store part still refuses (its block ids, a selection's k).
  thread_local std::vector<float> kept;  // [2, KVH, D] the window rows at w0 before the step
  kept.resize(size_t(2) * KVH * D);
  for (int h = 0; h < KVH; ++h) {
    float* wk = win.k + (h * win.rows + win.w0) * D;
    float* wv = win.v + (h * win.rows + win.w0) * D;
    std::memcpy(kept.data() + size_t(h) * D, wk, sizeof(float) * D);
    std::memcpy(kept.data() + size_t(KVH + h) * D, wv, sizeof(float) * D);
    std::memcpy(wk, k + h * D, sizeof(float) * D);
    std::memcpy(wv, v + h * D, sizeof(float) * D);
  }
  thread_local std::vector<float> buf;
  buf.resize(size_t(H) * (D + 1) * 2);
  // ow, os: [H, D] the window's and the store's attention; lw, ls: [H] their LSE
  float *ow = buf.data(), *lw = ow + size_t(H) * D, *os = lw + H, *ls = os + size_t(H) * D;
  try {
    dense_decode_attention(q, H, KVH, D, win.k, win.v, win.rows * D, win.width, scale, ow, lw, n_threads, win.skip0,
                           win.skip1);
    if (step.part == StorePart::ATTEND) st.attend(layer, q, H, step.blocks, os, ls);
    else if (step.part == StorePart::SELECT)
      st.select_attend(layer, q, H, step.req, step.out_ids, step.out_cols, os, ls);
    st.append(layer, k, v, InType::F32, 1, nullptr);
  } catch (...) {
    for (int h = 0; h < KVH; ++h) {
      std::memcpy(win.k + (h * win.rows + win.w0) * D, kept.data() + size_t(h) * D, sizeof(float) * D);
      std::memcpy(win.v + (h * win.rows + win.w0) * D, kept.data() + size_t(KVH + h) * D, sizeof(float) * D);
    }
    throw;
  }
  // The window always holds the token itself, so lw is finite.
  const bool store = step.part != StorePart::NONE;
  merge_two(ow, lw, store ? os : nullptr, store ? ls : nullptr, H, D, out);
}

}  // namespace ktq
