// AVX2 twin of the top-k kernel (contract in topk.h); compiled with -mavx2 -mfma -mf16c, called only when
// use_avx2(). Scalar twin: topk.cpp.
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "select/topk.h"

namespace ktq::avx2 {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}  // namespace

int64_t top_k(const float* v, int64_t n, int64_t k, const int32_t* ids, int32_t* out, int32_t* keys) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  const __m256 ninf = _mm256_set1_ps(kNegInf), zero = _mm256_setzero_ps();
  const __m256i low31 = _mm256_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // topk_order_key, 8 at a time
    __m256 x = _mm256_loadu_ps(v + i);
    x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    x = _mm256_andnot_ps(_mm256_cmp_ps(x, zero, _CMP_EQ_OQ), x);
    const __m256i b = _mm256_castps_si256(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + i),
                        _mm256_xor_si256(b, _mm256_and_si256(_mm256_srai_epi32(b, 31), low31)));
  }
  for (; i < n; ++i) keys[i] = topk_order_key(v[i]);
  const int64_t n8 = n & ~int64_t(7);
  auto count_ge = [&](int32_t t) {  // n - #(keys < t): cmpgt gives -1 per lane where t > key
    const __m256i tv = _mm256_set1_epi32(t);
    __m256i lt = _mm256_setzero_si256();
    for (int64_t j = 0; j < n8; j += 8)
      lt = _mm256_add_epi32(lt, _mm256_cmpgt_epi32(tv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + j))));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lt);
    int64_t below = 0;
    for (int j = 0; j < 8; ++j) below -= lanes[j];
    for (int64_t j = n8; j < n; ++j) below += keys[j] < t;
    return n - below;
  };
  const int32_t kth = topk_kth_key(k, count_ge);
  return topk_keep(keys, n, k, kth, k - (kth == INT32_MAX ? 0 : count_ge(kth + 1)), ids, out);
}

}  // namespace ktq::avx2
