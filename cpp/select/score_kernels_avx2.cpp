// AVX2/FMA/F16C block-scoring kernels (contracts in score_kernels.h); compiled with -mavx2 -mfma -mf16c and
// called only when use_avx2() and D % 8 == 0. Scalar twins: score_kernels.cpp.
#include "attn/avx2_rows.h"
#include "select/score_kernels.h"

namespace ktq::avx2 {

namespace {

// A pure stream over the anchors: 4 independent FMA chains, one horizontal sum per block, and a software
// prefetch kPrefetchBytes ahead so enough cache-line misses are in flight to reach DRAM speed.
// T: float, uint16_t (fp16, one F16C conversion per 8 anchors and a stream half as long) or int8_t (a
// quarter as long; each row's sum is then multiplied by its scale[i]).
template <class T>
void score_linear_any(const T* a, int64_t n, int L, const float* qe, float* out, bool accumulate,
                      const float* scale = nullptr) {
  constexpr int64_t kPrefetchBytes = 2048;
  auto ld = [](const T* p) {
    if constexpr (sizeof(T) == 1)
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    else if constexpr (sizeof(T) == 2)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    else return _mm256_loadu_ps(p);
  };
  const char* end = reinterpret_cast<const char*>(a + n * L);
  for (int64_t i = 0; i < n; ++i) {
    const T* ai = a + i * L;
    for (const char* p = reinterpret_cast<const char*>(ai) + kPrefetchBytes;
         p < reinterpret_cast<const char*>(ai + L) + kPrefetchBytes && p < end; p += 64)
      _mm_prefetch(p, _MM_HINT_T0);
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int c = 0;
    for (; c + 32 <= L; c += 32) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c), ld(ai + c), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 8), ld(ai + c + 8), s1);
      s2 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 16), ld(ai + c + 16), s2);
      s3 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c + 24), ld(ai + c + 24), s3);
    }
    for (; c < L; c += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qe + c), ld(ai + c), s0);
    float sc = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    if constexpr (sizeof(T) == 1) sc *= scale[i];
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

}  // namespace

void score_linear(const float* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate);
}

void score_linear16(const uint16_t* a, int64_t n, int L, const float* qe, float* out, bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate);
}

void score_linear8(const int8_t* a, const float* scale, int64_t n, int L, const float* qe, float* out,
                   bool accumulate) {
  score_linear_any(a, n, L, qe, out, accumulate, scale);
}

void score_max(const float* a, const int32_t* cnt, int64_t n, int A, int D, const float* q, int G, float* out,
               bool accumulate, float* s) {
  const size_t rb = size_t(D) * 4;
  const int ss = (A + 7) & ~7;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* ai = reinterpret_cast<const uint8_t*>(a + i * int64_t(A) * D);
    const int na = cnt[i];
    Tiles T;  // the block's anchors as one tile of na rows
    T.k[0] = T.v[0] = ai, T.n[0] = na, T.count = 1;
    float sc = 0.f;
    for (int g0 = 0; g0 < G; g0 += 8) {
      const int ng = std::min(8, G - g0);
      switch (ng) {
#define KTQ_CASE(N) \
  case N: logits<DecF32, N>(T, 0, rb, 0, D, q + g0 * D, s, ss, nullptr); break;
        KTQ_CASE(1) KTQ_CASE(2) KTQ_CASE(3) KTQ_CASE(4) KTQ_CASE(5) KTQ_CASE(6) KTQ_CASE(7) KTQ_CASE(8)
#undef KTQ_CASE
      }
      for (int g = 0; g < ng; ++g) {
        float best = kNegInf;
        for (int j = 0; j < na; ++j) best = std::max(best, s[g * ss + j]);
        sc += best;
      }
    }
    out[i] = accumulate ? out[i] + sc : sc;
  }
}

}  // namespace ktq::avx2
