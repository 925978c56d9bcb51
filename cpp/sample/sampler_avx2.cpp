// AVX2 twin of top_candidates (contract in sampler.h); compiled with -mavx2, called only when use_avx2().
// Scalar twin: sampler.cpp.
#include <immintrin.h>

#include <algorithm>

#include "sample/heap.h"
#include "sample/sampler.h"

namespace ktq::avx2 {

int64_t top_candidates(const float* logits, int64_t n, int64_t k, Candidate* out) {
  k = std::clamp<int64_t>(k, 0, n);
  if (k == 0) return 0;
  CandidateHeap heap(logits, k, out);
  int64_t i = k;
  // 8 logits against the heap's worst at once: most of a 50K vocabulary falls below it after the first few
  // hundred ids, so the loop is a compare and a movemask. The lanes that pass are offered in id order and
  // checked again against the worst as it rises, so the result is the scalar twin's.
  for (; i + 8 <= n; i += 8) {
    int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + i), _mm256_set1_ps(heap.worst()), _CMP_GT_OQ));
    while (m) {
      const int j = __builtin_ctz(unsigned(m));
      m &= m - 1;
      heap.offer(logits[i + j], int32_t(i + j));
    }
  }
  for (; i < n; ++i) heap.offer(logits[i], int32_t(i));
  return heap.sorted();
}

}  // namespace ktq::avx2
