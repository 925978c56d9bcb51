// Decode attention over a dense fp32 KV cache (mode: dense on the CPU): every query head of one token
// against the first n rows of its KV head. Same kernels and split-K as the store's sparse attention
// (attn_kernels.h): the rows are cut into tiles of kDenseTile, each task folds a fixed run of tiles
// into a partial (m, l, acc), and partials are merged in task order (merge.h), so 1 or N threads give the
// same bits. It streams K/V at DRAM speed where torch's SDPA reads a decode step's K/V several times slower.
#pragma once

#include <cstdint>

namespace ktq {

// q: [H, D] (unscaled), k/v: [KVH, head_stride] fp32 rows of D (head h's row r at h * head_stride + r * D),
// rows [0, n) valid per head except [skip0, skip1) (a stale stretch of a window buffer; 0, 0 = none),
// H % KVH == 0 (GQA: query head i reads KV head i / (H / KVH)).
// out: [H, D] = softmax(q k^T * scale) v; lse: [H] the log-sum-exp of the scaled logits.
void dense_decode_attention(const float* q, int H, int KVH, int D, const float* k, const float* v,
                            int64_t head_stride, int64_t n, float scale, float* out, float* lse, int n_threads,
                            int64_t skip0 = 0, int64_t skip1 = 0);

}  // namespace ktq
