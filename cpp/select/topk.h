// The top-k kernel on raw pointers: the ids of the k largest scores. Scalar twin in topk.cpp, AVX2 in
// topk_avx2.cpp; callers pick one per call from use_avx2().
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace ktq {

// ---- contract (both twins) ----
//
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

namespace scalar {
int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys);
}  // namespace scalar

namespace avx2 {
int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys);
}  // namespace avx2

}  // namespace ktq
