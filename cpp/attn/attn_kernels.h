// Kernels of the decode step on raw pointers: block scoring and one-block attention.
// Scalar twins in attn_kernels.cpp, AVX2/FMA/F16C versions in attn_kernels_avx2.cpp (D % 8 == 0);
// sparse_attn.cpp picks one per call from use_avx2().
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

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

// score_linear: linear block scores (QUEST / BLOCK_MAX / BLOCK_MEAN): out[i] (+)= dot(qe, a[i]).
//   a: [n, L] fp32 anchors, qe: [L] the KV head's scoring vector.
// score_linear16: the same over fp16 anchors (a: [n, L] IEEE halves), half the bytes to stream.
// score_linear8: the same over int8 anchors with one scale per row (a: [n, L], scale: [n]):
//   out[i] (+)= scale[i] * dot(qe, a[i]); a quarter of fp32's bytes (cached candidates, int8_candidates).

// score_max: max-over-anchors block scores (FIXED / DYNAMIC): out[i] (+)= sum_g max_{j < cnt[i]} dot(q_g, a[i, j]).
//   a: [n, A, D] fp32, cnt: [n] (>= 1), q: [G, D] unscaled, s: scratch of G * round_up(A, 8) + D floats.

// top_k: the ids of the k largest of v[0, n) (0 <= k <= n), written to out in input order; returns how many
// (min(k, n)). NaN counts as -inf and -0 as +0; of values equal to the k-th largest, the first ones in input
// order are kept. ids: [n] the id of each value, or null for the index itself. keys: n int32 scratch.
// Both twins find the k-th largest the same way: the largest order key T with at least k keys >= T, built
// bit by bit (32 counting passes, branch-free, vectorised), then one branch-free compaction pass.

// top_k's order key: an int32 whose signed order is the float order (NaN -> -inf's key, -0 -> +0's).
inline int32_t topk_order_key(float x) {
  if (x != x) x = -std::numeric_limits<float>::infinity();
  if (x == 0.f) x = 0.f;
  int32_t b;
  std::memcpy(&b, &x, 4);
  return b < 0 ? b ^ 0x7fffffff : b;  // negatives: larger magnitude, smaller key
}

// The k-th largest key (1 <= k <= n): the largest T with count_ge(T) >= k, from the top bit down.
template <class CountGe>
int32_t topk_kth_key(int64_t k, CountGe count_ge) {
  uint32_t t = 0;  // T in unsigned order (signed key ^ 0x80000000)
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t c = t | (1u << bit);
    if (count_ge(int32_t(c ^ 0x80000000u)) >= k) t = c;
  }
  return int32_t(t ^ 0x80000000u);
}

// top_k's last pass, shared by both twins: in input order every key above kth and the first `ties` equal to
// it (branch-free; out[m] is written only while m < k, so out needs room for k ids).
inline int64_t topk_keep(const int32_t* keys, int64_t n, int64_t k, int32_t kth, int64_t ties, const int32_t* ids,
                         int32_t* out) {
  int64_t m = 0;
  for (int64_t i = 0; i < n && m < k; ++i) {
    const int64_t eq = (keys[i] == kth) & (ties > 0);
    ties -= eq;
    out[m] = ids ? ids[i] : int32_t(i);
    m += (keys[i] > kth) | eq;
  }
  return m;
}

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
                  float* l, float* acc, const Tiles* next);
void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v);
void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s);
int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys);
}  // namespace scalar

namespace avx2 {  // require D % 8 == 0
void attend_tiles(KVType t, int D, int G, const float* q, const Tiles& cur, size_t scale_off, float* s, float* m,
                  float* l, float* acc, const Tiles* next);
void attend_tile(KVType t, int D, int G, const float* q, const uint8_t* k, const uint8_t* v, size_t scale_off,
                 int n, float* s, float* m, float* l, float* acc, const uint8_t* next_k, const uint8_t* next_v);
void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out, bool accumulate);
void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s);
int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys);
}  // namespace avx2

}  // namespace ktq
