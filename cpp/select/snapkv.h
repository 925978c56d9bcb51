// SnapKV's block scores over the store's keys, in place (Li et al. 2024): the queries of the prompt's last W
// tokens score every key by their softmax attention (each query over the keys it sees, causally), summed over
// the window, max-pooled along the tokens, merged over each KV head's query group (mean or max), then summed
// per block. What ktquest/kv/selection.py's torch twin (snapkv_token_scores, block_scores_from_tokens)
// computes, without an fp32 copy of the keys: each task decodes a run of one KV head's keys into a transposed
// fp32 panel in its thread's scratch.
//
// Two passes over the keys: the log-sum-exp of every query row (up to 64 tasks per KV head, each over runs of
// 256 keys, their partials merged in task order), then the probabilities of the keys that the scored blocks and their pooling
// reach (tasks of whole blocks, each pooled with a halo of p = pool / 2 keys either side and summed into its
// own blocks). Task boundaries depend only on the request, so any thread count gives the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "kvstore/layout.h"
#include "select/request.h"

namespace ktq {

struct SnapKVRequest {
  const float* q = nullptr;  // [var.n, W, H, D] fp32, unscaled (after RoPE): the window's queries
  int W = 0, H = 0;
  int64_t q_pos0 = 0;    // position of query 0: query w sees keys [0, q_pos0 + w]
  int64_t n_keys = 0;    // the keys scored and normalised over: [0, n_keys), q_pos0 + W <= n_keys <= length
  int64_t n_blocks = 0;  // blocks scored: [0, n_blocks), n_blocks <= ceil(n_keys / block_size)
  int pool = 7;          // max-pooling kernel (odd)
  bool max_merge = false;  // the query group's merge: mean (false) or max
  // Dual chunk attention (request.h), bounds in tokens: each key is scored by the rotation of the window's
  // queries its chunk calls for (the window's queries all in one chunk).
  QueryVariants var;
};

class SnapKVScorer {
 public:
  explicit SnapKVScorer(const StoreLayout& lay) : lay_(lay) {}

  // Throws std::invalid_argument naming the field unless r fits layer L (H a multiple of KVH, W x H / KVH <=
  // 2^14, the window inside [0, n_keys), n_keys within the layer, blocks within the keys, pool odd and <= 255)
  // and q is finite.
  void check(const StoreLayer& L, const SnapKVRequest& r) const;
  // out [KVH, n_blocks]: each block's score per KV head (a block past n_keys' last token sums what it has).
  void run(const StoreLayer& L, const SnapKVRequest& r, float* out);

 private:
  const StoreLayout& lay_;
  std::vector<float> q_;     // [V, KVH, G W, D] scaled rows (g, w) of each KV head, per query rotation
  std::vector<float> part_;  // pass 1 partials: [KVH, tasks, 2, G W] (m, l)
  std::vector<float> lse_;   // [KVH, G W]
  std::vector<float> sum_;   // [G W] the merge's sums
};

}  // namespace ktq
