// One transformer block's decode step (one token) around its attention, for the CPU path with the weights
// in their GGUF encoding: ~25 small torch ops a layer, whose per-op cost outweighed the layer's GEMVs on the
// bundled model, become two native calls.
//
//   qkv stage:  xn = rmsnorm(x) * attn_norm;  qkv = Wqkv xn (+ b);  [q, k heads: rmsnorm * q_norm / k_norm];
//               RoPE on the q and k heads
//   (attention: the cache's, between the stages: dense or long-context)
//   out stage:  a = Wo attn [; a = rmsnorm(a) * post_attn_norm];  x += a;  xn = rmsnorm(x) * ffn_norm;
//               [g | u] = Wgu xn;  f = Wdown (act(g) * u) [; f = rmsnorm(f) * post_ffn_norm];  x += f
//               (act: silu for SWIGLU, tanh-GELU for GEGLU; MOE: f = the chosen experts' SwiGLUs, moe/moe_ffn.h)
//
// The same math as ktquest/models/llama.py (pre-norm residual block, SwiGLU, rotate-half RoPE whose sin
// table carries the rotate-half sign) and, with the bracketed parts and act = tanh-GELU, as
// ktquest/models/gemma3.py (QK-norm, post-norms, GeGLU), in fp32; the GEMVs are gemv_matrix's (gemm/gemv_blocks.h: deterministic,
// threaded). llama files store each q/k head's rows interleaved (ggml's RoPE); qkv_perm then gathers the
// projection into the rotate-half order before RoPE, as the model's Linear does.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gemm/gemv_blocks.h"
#include "moe/moe_ffn.h"

namespace ktq {

// The FFN's kind (ktquest/models/block.py's BlockSpec.ffn): silu(gate) * up, tanh-GELU(gate) * up, or a mixture
// of SwiGLU experts (moe/moe_ffn.h).
enum class FfnKind : int { SWIGLU = 0, GEGLU = 1, MOE = 2 };

struct DecodeLayerWeights {
  const float* attn_norm = nullptr;  // [dim]
  const float* ffn_norm = nullptr;   // [dim]
  // Optional (nullptr: absent): per-head RMSNorm of q and k before RoPE [D]; norms of the attention's and
  // the FFN's outputs before they join the residual [dim] (gemma3).
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* post_attn_norm = nullptr;
  const float* post_ffn_norm = nullptr;
  FfnKind ffn = FfnKind::SWIGLU;
  float eps = 1e-5f;
  QuantMatrix wqkv;       // [(H + 2 KVH) * D, dim]: rows q | k | v
  std::vector<int32_t> qkv_perm;  // empty, or [(H + 2 KVH) * D]: qkv[i] = projection[qkv_perm[i]]
  QuantMatrix wo;         // [dim, H * D]
  QuantMatrix w_gate_up;  // [2 * ffn, dim]: rows gate | up (SWIGLU, GEGLU)
  QuantMatrix w_down;     // [dim, ffn]
  MoeWeights moe;         // MOE: the router and the experts
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
};

// The projection sizes of a block with these heads: wqkv's (H + 2 KVH) * D rows and wo's H * D columns.
// Throws std::invalid_argument naming the argument unless n_kv_heads >= 1, n_heads is a positive multiple of
// it and head_dim is even and >= 2; std::overflow_error when a size does not fit.
struct HeadShape {
  int64_t qkv = 0, attn = 0;
};
HeadShape head_shape(int n_heads, int n_kv_heads, int head_dim);

class DecodeLayer {
 public:
  // Checks w's heads (head_shape) against its matrices, qkv_perm (a permutation of the qkv rows), eps
  // (finite, >= 0) and a MOE FFN's experts (check_moe): std::invalid_argument.
  explicit DecodeLayer(const DecodeLayerWeights& w);
  // x: [dim], cos/sin: [D] (the token's RoPE row) -> qkv: [(H + 2 KVH) * D], q and k rotated.
  void qkv(const float* x, const float* cos, const float* sin, float* qkv, int n_threads);
  // attn: [H * D] (attention output), x: [dim] updated in place to the block's output.
  void out(const float* attn, float* x, int n_threads);
  // The same for T tokens of T sequences at once (batched decode): x [T, dim], cos[t] / sin[t] token t's RoPE
  // row, qkv [T, (H + 2 KVH) * D]; attn [T, H * D]. Each matrix is read once for the T tokens (gemv_matrix with
  // T rows), and token t's result is what the one-token call gives it, bit for bit.
  void qkv(const float* x, int64_t T, const float* const* cos, const float* const* sin, float* qkv, int n_threads);
  void out(const float* attn, float* x, int64_t T, int n_threads);
  const DecodeLayerWeights& weights() const { return w_; }
  int64_t dim() const { return w_.wo.out; }        // the residual stream
  int64_t qkv_size() const { return w_.wqkv.out; }  // (H + 2 KVH) * D
  int64_t attn_size() const { return w_.wo.in; }    // H * D

 private:
  DecodeLayerWeights w_;
  static void grow(std::vector<float>& v, int64_t n);
  // normed input [T, dim]; FFN hidden [T, 2 * ffn] and its activation [T, ffn]; MOE output [dim]
  std::vector<float> xn_, h_, g_, f_;
  std::unique_ptr<MoeFfn> moe_;   // MOE
  std::vector<float> rope_;    // one head rotated [D]
  std::vector<float> proj_;    // the qkv projection before qkv_perm [T, (H + 2 KVH) * D] (llama files)
};

// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], n values (mean accumulated in double). y may be x.
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y);

}  // namespace ktq
