// AVX2/FMA gated delta rule (delta_kernels.h). Compiled with -mavx2 -mfma -mf16c.
//
// The value dims run along the vectors: a pass over S's rows accumulates kv and sq 8 value dims at a time (a
// block of up to 64 dims in registers: 2 x 8 accumulators), then a second pass updates the rows. A head's S
// (64 KB at 128 x 128) stays in L2 from one token to the next.
#include <immintrin.h>

#include <cmath>

#include "delta/delta_kernels.h"

namespace ktq::avx2 {

namespace {

constexpr int kVec = 8;
constexpr int kBlock = 8;  // vectors of value dims a pass keeps in registers (64 dims)

// kv, sq [n vectors] over rows i of S for the value dims [j0, j0 + 8n): kv = S^T k, sq = S^T q.
template <int N>
inline void dots(const float* S, int Dk, int Dv, int j0, const float* k, const float* q, float* kv, float* sq) {
  __m256 ak[N], aq[N];
  for (int n = 0; n < N; ++n) ak[n] = aq[n] = _mm256_setzero_ps();
  for (int i = 0; i < Dk; ++i) {
    const float* row = S + int64_t(i) * Dv + j0;
    const __m256 vk = _mm256_set1_ps(k[i]), vq = _mm256_set1_ps(q[i]);
    for (int n = 0; n < N; ++n) {
      const __m256 s = _mm256_loadu_ps(row + n * kVec);
      ak[n] = _mm256_fmadd_ps(vk, s, ak[n]);
      aq[n] = _mm256_fmadd_ps(vq, s, aq[n]);
    }
  }
  for (int n = 0; n < N; ++n) {
    _mm256_storeu_ps(kv + j0 + n * kVec, ak[n]);
    _mm256_storeu_ps(sq + j0 + n * kVec, aq[n]);
  }
}

void all_dots(const float* S, int Dk, int Dv, const float* k, const float* q, float* kv, float* sq) {
  int j = 0;
  for (; j + kBlock * kVec <= Dv; j += kBlock * kVec) dots<kBlock>(S, Dk, Dv, j, k, q, kv, sq);
  switch ((Dv - j) / kVec) {
#define KTQ_CASE(N) \
  case N: dots<N>(S, Dk, Dv, j, k, q, kv, sq); break;
    KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7)
#undef KTQ_CASE
  }
  for (int jt = Dv - (Dv % kVec); jt < Dv; ++jt) {  // the scalar tail
    float a = 0.f, b = 0.f;
    for (int i = 0; i < Dk; ++i) {
      a += k[i] * S[int64_t(i) * Dv + jt];
      b += q[i] * S[int64_t(i) * Dv + jt];
    }
    kv[jt] = a;
    sq[jt] = b;
  }
}

}  // namespace

void delta_rule_head(const DeltaHead& h, int T, int Dk, int Dv) {
  alignas(32) float kv[1024], sq[1024];  // (Dv <= 1024: delta_rule.cpp checks)
  const int vec_end = Dv - Dv % kVec;
  for (int t = 0; t < T; ++t) {
    const float* q = h.q + t * h.qs;
    const float* k = h.k + t * h.ks;
    const float* v = h.v + t * h.vs;
    float* o = h.o + t * h.os;
    const float a = std::exp(h.g[t * h.gs]);
    const float beta = h.beta[t * h.gs];
    float kq = 0.f;
    for (int i = 0; i < Dk; ++i) kq += k[i] * q[i];
    all_dots(h.S, Dk, Dv, k, q, kv, sq);
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(beta), vkq = _mm256_set1_ps(kq);
    int j = 0;
    for (; j < vec_end; j += kVec) {
      const __m256 d = _mm256_mul_ps(vb, _mm256_fnmadd_ps(va, _mm256_loadu_ps(kv + j), _mm256_loadu_ps(v + j)));
      _mm256_storeu_ps(o + j, _mm256_fmadd_ps(vkq, d, _mm256_mul_ps(va, _mm256_loadu_ps(sq + j))));
      _mm256_storeu_ps(kv + j, d);
    }
    for (; j < Dv; ++j) {
      const float d = beta * (v[j] - a * kv[j]);
      o[j] = a * sq[j] + kq * d;
      kv[j] = d;
    }
    for (int i = 0; i < Dk; ++i) {
      float* row = h.S + int64_t(i) * Dv;
      const __m256 vk = _mm256_set1_ps(k[i]);
      int jj = 0;
      for (; jj < vec_end; jj += kVec)
        _mm256_storeu_ps(row + jj, _mm256_fmadd_ps(vk, _mm256_loadu_ps(kv + jj),
                                                   _mm256_mul_ps(va, _mm256_loadu_ps(row + jj))));
      for (; jj < Dv; ++jj) row[jj] = a * row[jj] + k[i] * kv[jj];
    }
  }
}

}  // namespace ktq::avx2
