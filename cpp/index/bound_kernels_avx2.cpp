// AVX2/FMA/F16C group bound kernel (contract in bound_kernels.h); compiled with -mavx2 -mfma -mf16c and called only
// when use_avx2() and D % 8 == 0. Scalar twin: bound_kernels.cpp.
#include "attn/avx2_rows.h"
#include "index/bound_kernels.h"

namespace ktq::avx2 {

void score_bounds(const uint16_t* rows, int64_t n, int D, const float* qb, float* bound, float* mag) {
  // A stream of 2*D halves per group (one F16C conversion per 8; the hardware prefetcher follows the
  // stream), two FMA chains for the bound and one for the magnitude.
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto ld = [](const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  const float *qn = qb, *qp = qb + D, *w = qb + 2 * D;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t *mn = rows + i * 2 * D, *mx = mn + D;
    __m256 b0 = _mm256_setzero_ps(), b1 = b0, m0 = b0;
    for (int d = 0; d < D; d += 8) {
      const __m256 lo = ld(mn + d), hi = ld(mx + d);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(qn + d), lo, b0);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp + d), hi, b1);
      const __m256 big = _mm256_max_ps(_mm256_and_ps(lo, abs_mask), _mm256_and_ps(hi, abs_mask));
      m0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + d), big, m0);
    }
    bound[i] = hsum(_mm256_add_ps(b0, b1));
    mag[i] = hsum(m0);
  }
}

}  // namespace ktq::avx2
