// The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) on raw pointers, one value head over a run of tokens.
// Scalar twin in delta_kernels.cpp, AVX2/FMA in delta_kernels_avx2.cpp; delta_rule.cpp picks one per call from
// use_avx2() and runs the heads in parallel.
//
// For each token t, with S the head's state [Dk, Dv] (fp32, row i = key dim i), a = exp(g[t]):
//
//     kv = a S^T k_t,  sq = a S^T q_t          (one read of S)
//     d  = beta[t] (v_t - kv)
//     o_t = sq + (k_t . q_t) d                 (= S'^T q_t with S' below)
//     S  = a S + k_t d^T                       (one read-modify-write of S)
//
// q_t, k_t [Dk] (l2-normed; q scaled by 1/sqrt(Dk) already), v_t, o_t [Dv]; successive tokens' q, k are qs, ks
// floats apart, v's vs, o's os, g's and beta's gs.
#pragma once

#include <cstdint>

namespace ktq {

struct DeltaHead {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  float* S;  // [Dk, Dv], updated in place
  float* o;
  int64_t qs, ks, vs, os, gs;  // strides between tokens
};

namespace scalar {
void delta_rule_head(const DeltaHead& h, int T, int Dk, int Dv);
}  // namespace scalar

namespace avx2 {  // any Dv (8 value dims a vector, a scalar tail)
void delta_rule_head(const DeltaHead& h, int T, int Dk, int Dv);
}  // namespace avx2

}  // namespace ktq
