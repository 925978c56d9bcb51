// LSE merges: the one place where attention results over parts of the rows are combined into the result
// over all of them. A part is (m, l, acc) in flight or (out, lse) when done; weights are exp(lse or m - max),
// at most 1, so nothing overflows.
#pragma once

#include <cstdint>

namespace ktq {

// Split-K partials of one attention (dense_attn.cpp, kvstore/sparse_attn.cpp): tasks [tstart[h], tstart[h + 1])
// of KV head h, each partial at part + task * G * (D + 2) laid out m [G], l [G], acc [G, D]; merged in task
// order. out: [KVH * G, D], lse: [KVH * G] (-inf and zeros for a head without a task or a row).
void merge_partials(const float* part, const int64_t* tstart, int KVH, int G, int D, float* out, float* lse);

// Two finished attentions of the same H query heads over disjoint rows (the long-context step's window part
// a and store part b, decode/layer_step.cpp): out [H, D] = wa * a + wb * b per head with
// wb = 1 / (1 + exp(lse_a - lse_b)) and wa = 1 - wb. Part a must have attended a row for every head (lse_a
// finite); part b may be absent (b = lse_b = null) or empty for a head (lse_b = -inf): its weight is then 0
// and its row is not read.
void merge_two(const float* a, const float* lse_a, const float* b, const float* lse_b, int H, int D, float* out);

}  // namespace ktq
