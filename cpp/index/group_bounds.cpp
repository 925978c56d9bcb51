// Keeping the hierarchical index's group bounds up to date (group_bounds.h).
#include "index/group_bounds.h"

#include <algorithm>
#include <limits>

#include "common/scratch.h"
#include "quant/kv_codec.h"

namespace ktq {

namespace {

// x rounded to fp16 toward -inf (down) or +inf (up): the nearest half, stepped once when it lies on the wrong
// side (fp16 bits are ordered by magnitude within a sign; -0 steps down to the smallest negative subnormal).
uint16_t f16_directed(float x, bool up) {
  uint16_t h = f32_to_f16(x);
  const float v = f16_to_f32(h);
  if (up ? v >= x : v <= x) return h;
  const bool neg = h & 0x8000, zero = (h & 0x7fff) == 0;
  if (zero) return up ? 0x0001 : 0x8001;
  return (neg == up) ? h - 1 : h + 1;  // toward zero if (negative, up) or (positive, down), else away
}

// Merge block b's valid anchor rows of head h into the group row g: [2, D] = min row, max row.
void merge_block(const StoreLayout& lay, const StoreLayer& L, int h, int64_t b, float* g, float* work) {
  const int D = lay.cfg.head_dim, A = lay.A;
  const float* a;  // [A, D] fp32
  if (lay.a16) {   // fp16 anchors: exact in fp32, the values the scorer reads
    decode_row(KVType::FP16, reinterpret_cast<const uint8_t*>(lay.anchor16_at(L, h, b)), nullptr, A * D, work);
    a = work;
  } else {
    a = lay.anchor_at(L, h, b);
  }
  float *mn = g, *mx = g + D;
  if (lay.cfg.anchor_type == AnchorType::QUEST) {  // a: [min | max]
    for (int d = 0; d < D; ++d) mn[d] = std::min(mn[d], a[d]), mx[d] = std::max(mx[d], a[D + d]);
    return;
  }
  const int cnt = L.n_anchor[h * lay.max_blocks + b];  // valid anchors (FIXED / DYNAMIC partial blocks: fewer)
  for (int j = 0; j < cnt; ++j)
    for (int d = 0; d < D; ++d) mn[d] = std::min(mn[d], a[j * D + d]), mx[d] = std::max(mx[d], a[j * D + d]);
}

}  // namespace

void update_group_bounds(const StoreLayout& lay, const StoreLayer& L, int h, int64_t b_lo, int64_t old_nb,
                         int64_t nb, bool widened) {
  const int64_t G = lay.cfg.index_group;
  if (G == 0 || nb <= b_lo) return;
  const int D = lay.cfg.head_dim;
  float* work = thread_scratch(size_t(lay.A + 2) * D);  // [A, D] a block's decoded fp16 anchors, [2, D] a row
  float* row = work + size_t(lay.A) * D;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t g = b_lo / G; g * G < nb; ++g) {
    const int64_t g0 = g * G, g1 = std::min(nb, g0 + G);
    uint16_t* stored = lay.bound_at(L, h, g);  // [2, D] fp16
    int64_t from = g0;
    if (widened && g0 < old_nb) {
      from = std::max(g0, b_lo);  // the group's bounds already hold [g0, from) and the old hull of `from`
      for (int c = 0; c < 2 * D; ++c) row[c] = f16_to_f32(stored[c]);
    } else {
      std::fill(row, row + D, kInf);
      std::fill(row + D, row + 2 * D, -kInf);
    }
    for (int64_t b = from; b < g1; ++b) merge_block(lay, L, h, b, row, work);
    for (int d = 0; d < D; ++d) stored[d] = f16_directed(row[d], false), stored[D + d] = f16_directed(row[D + d], true);
  }
}

}  // namespace ktq
