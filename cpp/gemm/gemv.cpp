// Q8_0 GEMV: the scalar twin and the threaded dispatch (AVX2 twin: gemv_avx2.cpp).
#include "gemm/gemv.h"

#include <algorithm>

#include "common/cpu_features.h"
#include "gemm/row_tiles.h"

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
  for_row_tiles(T, out, n_threads, [&](int64_t t, int64_t r0, int64_t r1) {
    if (avx2) gemv_q8_0_rows_avx2(x + t * in, in, qw, dw, bias, y + t * out, r0, r1);
    else gemv_q8_0_rows_scalar(x + t * in, in, qw, dw, bias, y + t * out, r0, r1);
  });
}

}  // namespace ktq
