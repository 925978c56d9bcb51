// Attention kernels on raw pointers: one block tile, or a run of tiles, folded into an online-softmax state.
// Scalar twins in attn_kernels.cpp, AVX2/FMA/F16C versions in attn_kernels_avx2.cpp and attn_wide_avx2.cpp
// (D % 8 == 0); callers (kvstore/sparse_attn.cpp, dense_attn.cpp) pick one per call from use_avx2().
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant/kv_codec.h"

namespace ktq {

// ---- contracts (both twins) ----
//
// attend_tile: attention of G query heads of one KV head to n rows (one block tile, n <= block_size), folded into a
// running online-softmax state (flash-decoding partial):
//   q:   [G, D]  already scaled by 1 / sqrt(D)
//   k,v: tiles: n rows of kv_row_bytes(t, D), then (Q8_0/Q4_0) fp32 scales [*, D/32] at scale_off
//   m:   [G] running max of the logits (-inf before the first row), l: [G] sum of exp(logit - m),
//   acc: [G, D] sum of exp(logit - m) * v (unnormalised)
//   s:   scratch, at least G * round_up(n, 8) + D floats
//   next_k, next_v: the next block's tiles (same layout), prefetched while this one is computed (may be null)
// Subtracting the running max before exp keeps every exp argument <= 0: no overflow for any logit.

// attend_tiles: attend_tile over up to kMaxTiles tiles (consecutive selected blocks of one KV head) with one
// online-softmax update for all their rows: the max / exp / rescale work, ~90 vector ops per head and
// update, is paid once per run instead of once per tile (a third of the work for 16-row tiles at D = 64).
//   cur:  the tiles; s: scratch, at least G * round_up(cur.rows(), 8) + D floats
//   next: the next run (prefetched while this one is computed; may be null)
// Results equal attend_tile over the tiles in order up to rounding. The AVX2 twin, from G >= 2 D + 6 (a prefill
// chunk's queries), decodes the run's K/V once into fp32 inside s, which the contract's size already allows.
//
// tile_lse (both, optional): [count, G] (attend_tile: [G]) gets each tile's own log-sum-exp of its rows' logits
// per query head, log sum_r exp(q_g . k_r) (-inf for none), from which a caller weighs a block's share of the
// attention once the final LSE is known (exp(tile_lse - lse)). A call that asks for it takes the row-by-row path.

// tiles_lse: tile_lse alone (the logits of a run's rows, no softmax state, no values): [cur.count, G] each tile's
// log sum_r exp(q_g . k_r) per query head, its exps taken against the run's largest logit of the head; a term
// below exp(-87.33654) (the fp32 range) counts 0 in both twins, so a tile whose every logit lies that far below
// the run's largest gets -inf (its share of any softmax with that key is below 1e-38), as does an empty tile.
//   s: scratch, at least G * round_up(cur.rows(), 8) + D floats
//   next: the next run, whose K tiles are prefetched alongside this one's logits (may be null)
// The store's second stage of selection (kvstore/rerank.h) weighs blocks by it before any of them is attended.

constexpr int kMaxTiles = 8;
struct Tiles {
  const uint8_t* k[kMaxTiles];
  const uint8_t* v[kMaxTiles];
  int n[kMaxTiles];  // rows of each tile (only a layer's last block is partial)
  int count = 0;
  int rows() const {
    int r = 0;
    for (int i = 0; i < count; ++i) r += n[i];
    return r;
  }
};

namespace scalar {
void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles* next, float* tile_lse = nullptr);
void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v,
                 float* tile_lse = nullptr);
void tiles_lse(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* tile_lse,
               const Tiles* next = nullptr);
}  // namespace scalar

namespace avx2 {  // require D % 8 == 0
void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles* next, float* tile_lse = nullptr);
void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v,
                 float* tile_lse = nullptr);
void tiles_lse(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* tile_lse,
               const Tiles* next = nullptr);
}  // namespace avx2

}  // namespace ktq
