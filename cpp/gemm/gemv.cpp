// Q8_0 GEMV: the scalar twin and the threaded dispatch (AVX2 twin: gemv_avx2.cpp).
#include "gemm/gemv.h"

#include <algorithm>

#include "common/cpu_features.h"
#include "common/thread_pool.h"

namespace ktq {

// ---- scalar twins ----

void gemv_q8_0_rows_scalar(const float* x, int64_t in, const int8_t* qw, const float* dw, const float* bias,
                           float* y, int64_t o0, int64_t o1) {
  const int64_t ng = in / kQGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* w = qw + o * in;
    float acc = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.f;
      for (int i = 0; i < kQGroup; ++i) s += float(w[g * kQGroup + i]) * x[g * kQGroup + i];
      acc += s * dw[o * ng + g];
    }
    y[o] = acc + (bias ? bias[o] : 0.f);
  }
}

// ---- dispatch ----

void gemv_q8_0(const float* x, int64_t T, int64_t in, const int8_t* qw, const float* dw, int64_t out,
               const float* bias, float* y, int n_threads) {
  const bool avx2 = use_avx2();
  // Two contiguous row ranges per thread: each thread then reads long forward streams that the
  // prefetchers follow (small chunks claimed in turn made each thread's reads jump every few KiB, and two
  // threads then read the bundled model's lm_head slower than one). The ranges depend on n_threads, the
  // result does not: output o is row o's dot products summed in a fixed order.
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(int64_t(n_threads) * 2, out / 64));
  const int64_t rows_per_task = (out + n_tasks - 1) / n_tasks;
  auto task = [&](int64_t c) {
    const int64_t o0 = std::min(out, c * rows_per_task), o1 = std::min(out, o0 + rows_per_task);
    // T > 1 (a few tokens): every activation row over 64 weight rows while they are in L1/L2.
    for (int64_t r0 = o0; r0 < o1; r0 += 64) {
      const int64_t r1 = std::min(o1, r0 + 64);
      for (int64_t t = 0; t < T; ++t) {
        if (avx2) gemv_q8_0_rows_avx2(x + t * in, in, qw, dw, bias, y + t * out, r0, r1);
        else gemv_q8_0_rows_scalar(x + t * in, in, qw, dw, bias, y + t * out, r0, r1);
      }
    }
  };
  ThreadPool::global().parallel_for(n_tasks, n_threads, task);
}

}  // namespace ktq
