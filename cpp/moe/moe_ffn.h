// A mixture-of-experts FFN for one decode token (Qwen3-MoE, Qwen2-MoE: ktquest/models/ffn.py's MoEFeedForward),
// on the experts' weights in their GGUF encoding, read in place:
//
//   p = softmax(router xn)                      router: [E, dim], p in fp32 (the max subtracted before exp)
//   ids = the k largest p, ties to the lower id  (ktquest's route(): a stable descending sort)
//   w = p[ids] / sum(p[ids]) if norm_topk else p[ids]
//   y = sum_j w_j down_{ids_j}(silu(gate_{ids_j} xn) * up_{ids_j} xn)   [+ sigmoid(shared_gate . xn) shared(xn)]
//
// Only the chosen experts' rows are read: each expert is a QuantMatrix pointing at its rows of the stacked
// tensor (gate | up as two parts, down), so an unused expert's pages of the mapped file are never touched. The
// chosen experts' gate | up GEMVs run in one threaded pass over experts x rows (gemm/gemv_blocks.h: gemv_jobs),
// then their down GEMVs in another (with the shared expert's where there is one); the weighted sum adds the k
// outputs in their routing order, so the result does not depend on the thread count. The kernels are
// gemv_blocks.h's (AVX2 and their scalar twins, picked at run time).
#pragma once

#include <cstdint>
#include <vector>

#include "gemm/gemv_blocks.h"

namespace ktq {

struct MoeWeights {
  QuantMatrix router;                  // [E, dim]
  std::vector<QuantMatrix> gate_up;    // [E]: expert e's [2 * ffn_e, dim], rows gate | up
  std::vector<QuantMatrix> down;       // [E]: expert e's [dim, ffn_e]
  int n_used = 0;                      // k, 1 <= k <= E
  bool norm_topk = false;
  // The shared expert (Qwen2-MoE), or empty (out == 0): gate | up [2 * ffn_s, dim], down [dim, ffn_s], its gate [dim]
  QuantMatrix shared_gate_up, shared_down;
  const float* shared_gate = nullptr;
};

// Throws std::invalid_argument naming the part unless every expert is [2 * ffn_e, dim] / [dim, ffn_e] alike, the
// router [E, dim], 1 <= n_used <= E, and the shared expert (when present) is [2 * ffn_s, dim] / [dim, ffn_s].
void check_moe(const MoeWeights& w, int64_t dim);

// logits [E] -> ids [k] (best first, ties to the lower id) and their weights [k] (softmax over all E in fp32,
// renormalized over the k where norm).
void moe_route(const float* logits, int E, int k, bool norm, int32_t* ids, float* weights);

class MoeFfn {
 public:
  explicit MoeFfn(const MoeWeights& w);  // check_moe(w, w.router.in)
  // xn [dim] (the normed residual) -> y [dim]; ids/weights [k] of the route taken (may be nullptr).
  void run(const float* xn, float* y, int n_threads, int32_t* ids = nullptr, float* weights = nullptr);
  const MoeWeights& weights() const { return w_; }

 private:
  MoeWeights w_;
  std::vector<float> logits_, wts_, h_, out_;  // [E]; [k]; [k + 1, 2 * ffn]; [k + 1, dim]
  std::vector<int32_t> ids_;                   // [k]
  std::vector<GemvJob> jobs_;                  // [k + 1]
};

}  // namespace ktq
