// SnapKV score kernels on raw pointers: the window's queries against a run of keys, the rows' log-sum-exp, the
// probabilities summed over the window, and the pooled, group-merged token scores. Scalar twins in
// snapkv_kernels.cpp, AVX2/FMA versions in snapkv_kernels_avx2.cpp; the scorer (select/snapkv.cpp) picks one per
// call from use_avx2().
#pragma once

#include <cstdint>

namespace ktq {

// ---- contracts (both twins) ----
//
// snapkv_logits: s [R, ss] = q [R, D] . kt [D, ss] (row strides D and ss; ss % 8 == 0). q is already scaled.
// snapkv_lse: each row's online log-sum-exp over its first n logits (s [R, ss]): m [R] the running max (-inf
//   before any key), l [R] the sum of exp(logit - m). A -inf logit (a key the row's query does not see) adds 0.
// snapkv_probs: out [G, os] (first n columns) = for each group g, the sum over its W rows (g W .. g W + W - 1 of
//   s [G W, ss]) of exp(logit - lse[row]): the attention the window's queries give each key.
// snapkv_pool: y [n] = over g, the mean (max_merge false) or max of max(x[g, j .. j + 2p]), x [G, xs] (column c
//   is token c - p of y's): SnapKV's max pooling of kernel 2p + 1 (-inf columns are padding), then its GQA merge.

namespace scalar {
void snapkv_logits(const float* q, int R, int D, const float* kt, int ss, float* s);
void snapkv_lse(const float* s, int R, int n, int ss, float* m, float* l);
void snapkv_probs(const float* s, int G, int W, int n, int ss, const float* lse, float* out, int os);
void snapkv_pool(const float* x, int G, int xs, int n, int p, bool max_merge, float* y);
}  // namespace scalar

namespace avx2 {  // any D (the vectors run along the keys: ss % 8 == 0)
void snapkv_logits(const float* q, int R, int D, const float* kt, int ss, float* s);
void snapkv_lse(const float* s, int R, int n, int ss, float* m, float* l);
void snapkv_probs(const float* s, int G, int W, int n, int ss, const float* lse, float* out, int os);
void snapkv_pool(const float* x, int G, int xs, int n, int p, bool max_merge, float* y);
}  // namespace avx2

}  // namespace ktq
