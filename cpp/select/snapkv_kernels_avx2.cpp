// AVX2/FMA SnapKV score kernels (snapkv_kernels.h). Compiled with -mavx2 -mfma -mf16c.
//
// The logits are the wide attention's GEMM tiles (attn/avx2_rows.h): 6 query rows x 16 keys, per d two key
// loads and six broadcasts feeding 12 FMAs. The exps are avx2_rows.h's exp_neg (Cephes, ~1 ulp), 8 keys at a
// time; a scalar tail finishes a row whose length is not a multiple of 8.
#include <cmath>

#include "attn/avx2_rows.h"
#include "select/snapkv_kernels.h"

namespace ktq::avx2 {

namespace {

template <int R>
void logits_rows(const float* q, int D, const float* kt, int ss, float* s) {
  wide_gemm<R, false>(q, D, D, kt, ss, ss, s, ss);
}

}  // namespace

void snapkv_logits(const float* q, int R, int D, const float* kt, int ss, float* s) {
  int r = 0;
  for (; r + kWideRows <= R; r += kWideRows) logits_rows<kWideRows>(q + int64_t(r) * D, D, kt, ss, s + int64_t(r) * ss);
  switch (R - r) {
#define KTQ_CASE(N) \
  case N: logits_rows<N>(q + int64_t(r) * D, D, kt, ss, s + int64_t(r) * ss); break;
    KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5)
#undef KTQ_CASE
  }
}

void snapkv_lse(const float* s, int R, int n, int ss, float* m, float* l) {
  for (int r = 0; r < R; ++r) {
    const float* row = s + int64_t(r) * ss;
    __m256 vm = _mm256_set1_ps(m[r]);
    int j = 0;
    for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(row + j));
    float mx = hmax(vm);
    for (; j < n; ++j) mx = std::max(mx, row[j]);
    if (mx == kNegInf) continue;  // no key seen yet
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(row + j), vmx)));
    float sum = hsum(acc) + l[r] * std::exp(m[r] - mx);  // (m -inf: 0)
    for (; j < n; ++j) sum += std::exp(row[j] - mx);
    m[r] = mx;
    l[r] = sum;
  }
}

void snapkv_probs(const float* s, int G, int W, int n, int ss, const float* lse, float* out, int os) {
  for (int g = 0; g < G; ++g) {
    float* o = out + int64_t(g) * os;
    int j = 0;
    for (; j + 16 <= n; j += 16) {  // two vectors of keys in flight over the group's W rows
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int w = 0; w < W; ++w) {
        const int r = g * W + w;
        const float* row = s + int64_t(r) * ss + j;
        const __m256 c = _mm256_set1_ps(lse[r]);
        a0 = _mm256_add_ps(a0, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(row), c)));
        a1 = _mm256_add_ps(a1, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(row + 8), c)));
      }
      _mm256_storeu_ps(o + j, a0);
      _mm256_storeu_ps(o + j + 8, a1);
    }
    for (; j < n; ++j) {
      float acc = 0.f;
      for (int w = 0; w < W; ++w) acc += std::exp(s[int64_t(g * W + w) * ss + j] - lse[g * W + w]);
      o[j] = acc;
    }
  }
}

void snapkv_pool(const float* x, int G, int xs, int n, int p, bool max_merge, float* y) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 acc = _mm256_set1_ps(max_merge ? kNegInf : 0.f);
    for (int g = 0; g < G; ++g) {
      const float* c = x + int64_t(g) * xs + j;
      __m256 v = _mm256_loadu_ps(c);
      for (int i = 1; i <= 2 * p; ++i) v = _mm256_max_ps(v, _mm256_loadu_ps(c + i));
      acc = max_merge ? _mm256_max_ps(acc, v) : _mm256_add_ps(acc, v);
    }
    _mm256_storeu_ps(y + j, max_merge ? acc : _mm256_div_ps(acc, _mm256_set1_ps(float(G))));
  }
  if (j < n) scalar::snapkv_pool(x + j, G, xs, n - j, p, max_merge, y + j);
}

}  // namespace ktq::avx2
