// AVX2/FMA gated delta rule (delta_kernels.h). Compiled with -mavx2 -mfma -mf16c.
//
// The rule is separable along the value dims: column j of S, kv, sq, d and o depend on column j alone (and on
// the token's scalars a = exp(g), beta and k . q). So a head runs one block of 32 value dims (4 vectors, a
// [Dk, 32] slice of S: 16 KB at Dk 128, which stays in L1) through every token, then the next block: per token
// one pass over the slice for kv and sq (8 accumulators), one update pass. A tail of Dv % 8 dims runs the
// scalar steps on its columns.
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "delta/delta_kernels.h"

namespace ktq::avx2 {

namespace {

constexpr int kVec = 8;
constexpr int kBlockVecs = 4;  // value dims a block keeps in registers: 32

// Tokens 0..T-1 through the value dims [j0, j0 + 8N) of the head: a, kq [T] the tokens' scalars.
template <int N>
void run_block(const DeltaHead& h, int T, int Dk, int Dv, int j0, const float* a, const float* kq) {
  float* S = h.S + j0;
  for (int t = 0; t < T; ++t) {
    const float* q = h.q + t * h.qs;
    const float* k = h.k + t * h.ks;
    __m256 kv[N], sq[N];
    for (int n = 0; n < N; ++n) kv[n] = sq[n] = _mm256_setzero_ps();
    for (int i = 0; i < Dk; ++i) {
      const float* row = S + int64_t(i) * Dv;
      const __m256 vk = _mm256_set1_ps(k[i]), vq = _mm256_set1_ps(q[i]);
      for (int n = 0; n < N; ++n) {
        const __m256 s = _mm256_loadu_ps(row + n * kVec);
        kv[n] = _mm256_fmadd_ps(vk, s, kv[n]);
        sq[n] = _mm256_fmadd_ps(vq, s, sq[n]);
      }
    }
    const __m256 va = _mm256_set1_ps(a[t]), vb = _mm256_set1_ps(h.beta[t * h.gs]), vkq = _mm256_set1_ps(kq[t]);
    const float* v = h.v + t * h.vs + j0;
    float* o = h.o + t * h.os + j0;
    __m256 d[N];
    for (int n = 0; n < N; ++n) {
      d[n] = _mm256_mul_ps(vb, _mm256_fnmadd_ps(va, kv[n], _mm256_loadu_ps(v + n * kVec)));
      _mm256_storeu_ps(o + n * kVec, _mm256_fmadd_ps(vkq, d[n], _mm256_mul_ps(va, sq[n])));
    }
    for (int i = 0; i < Dk; ++i) {
      float* row = S + int64_t(i) * Dv;
      const __m256 vk = _mm256_set1_ps(k[i]);
      for (int n = 0; n < N; ++n)
        _mm256_storeu_ps(row + n * kVec, _mm256_fmadd_ps(vk, d[n], _mm256_mul_ps(va, _mm256_loadu_ps(row + n * kVec))));
    }
  }
}

// The scalar steps on the value dims [j0, Dv) (the tail that is not whole vectors).
void run_tail(const DeltaHead& h, int T, int Dk, int Dv, int j0, const float* a, const float* kq) {
  for (int t = 0; t < T; ++t) {
    const float* q = h.q + t * h.qs;
    const float* k = h.k + t * h.ks;
    const float beta = h.beta[t * h.gs];
    for (int j = j0; j < Dv; ++j) {
      float kv = 0.f, sq = 0.f;
      for (int i = 0; i < Dk; ++i) {
        kv += k[i] * h.S[int64_t(i) * Dv + j];
        sq += q[i] * h.S[int64_t(i) * Dv + j];
      }
      const float d = beta * (h.v[t * h.vs + j] - a[t] * kv);
      h.o[t * h.os + j] = a[t] * sq + kq[t] * d;
      for (int i = 0; i < Dk; ++i) h.S[int64_t(i) * Dv + j] = a[t] * h.S[int64_t(i) * Dv + j] + k[i] * d;
    }
  }
}

}  // namespace

void delta_rule_head(const DeltaHead& h, int T, int Dk, int Dv) {
  thread_local std::vector<float> scalars;
  scalars.resize(2 * size_t(T));
  float* a = scalars.data();
  float* kq = a + T;
  for (int t = 0; t < T; ++t) {
    const float* q = h.q + t * h.qs;
    const float* k = h.k + t * h.ks;
    float dot = 0.f;
    for (int i = 0; i < Dk; ++i) dot += k[i] * q[i];
    a[t] = std::exp(h.g[t * h.gs]);
    kq[t] = dot;
  }
  int j = 0;
  for (; j + kBlockVecs * kVec <= Dv; j += kBlockVecs * kVec) run_block<kBlockVecs>(h, T, Dk, Dv, j, a, kq);
  switch ((Dv - j) / kVec) {
    case 1: run_block<1>(h, T, Dk, Dv, j, a, kq); break;
    case 2: run_block<2>(h, T, Dk, Dv, j, a, kq); break;
    case 3: run_block<3>(h, T, Dk, Dv, j, a, kq); break;
  }
  j = Dv - Dv % kVec;
  if (j < Dv) run_tail(h, T, Dk, Dv, j, a, kq);
}

}  // namespace ktq::avx2
