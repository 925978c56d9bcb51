// AVX2 twin of gemv.cpp's row kernel; compiled with -mavx2 -mfma -mf16c, called only when use_avx2().
#include <immintrin.h>

#include "gemm/gemv.h"

namespace ktq {

namespace {

// Software prefetch distance of the GEMV's weight stream, bytes (a few rows ahead).
constexpr int64_t kPrefetchBytes = 2048;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int8 weights at p, widened to fp32.
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Sum over one group of 32: w[0:32] . x[0:32] as 8 fp32 lanes.
inline __m256 group_dot(const int8_t* w, __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  __m256 s = _mm256_mul_ps(widen8(w), x0);
  s = _mm256_fmadd_ps(widen8(w + 8), x1, s);
  s = _mm256_fmadd_ps(widen8(w + 16), x2, s);
  return _mm256_fmadd_ps(widen8(w + 24), x3, s);
}

}  // namespace

static_assert(kQGroup == 32, "group_dot reads one group as four vectors of 8");

void gemv_q8_0_rows_avx2(const float* x, int64_t in, const int8_t* qw, const float* dw, const float* bias,
                         float* y, int64_t o0, int64_t o1) {
  const int64_t ng = in / kQGroup;
  // One row at a time, so the weights [o0, o1) x [in] are read as one forward stream (four rows at a
  // time shared the loads of x but read four interleaved streams, and with short rows, 576 bytes for the
  // bundled model, the hardware prefetcher never caught up). x is in L1, so reloading it per row costs
  // little. The prefetch kPrefetchBytes ahead may run past the last row: a prefetch never faults. It is
  // non-temporal: a decode step streams every weight once (the bundled model's 143 MB outgrow the L3), so
  // they need not displace what is reused from token to token, the KV windows, anchors and selected blocks.
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* w = qw + o * in;
    const float* d = dw + o * ng;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains: even and odd groups
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) {
      const int64_t off = g * kQGroup;
      _mm_prefetch(reinterpret_cast<const char*>(w + off) + kPrefetchBytes, _MM_HINT_NTA);
      const __m256 s0 = group_dot(w + off, _mm256_loadu_ps(x + off), _mm256_loadu_ps(x + off + 8),
                                  _mm256_loadu_ps(x + off + 16), _mm256_loadu_ps(x + off + 24));
      const __m256 s1 = group_dot(w + off + 32, _mm256_loadu_ps(x + off + 32), _mm256_loadu_ps(x + off + 40),
                                  _mm256_loadu_ps(x + off + 48), _mm256_loadu_ps(x + off + 56));
      acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(d + g), acc0);
      acc1 = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(d + g + 1), acc1);
    }
    if (g < ng) {
      const int64_t off = g * kQGroup;
      const __m256 s0 = group_dot(w + off, _mm256_loadu_ps(x + off), _mm256_loadu_ps(x + off + 8),
                                  _mm256_loadu_ps(x + off + 16), _mm256_loadu_ps(x + off + 24));
      acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(d + g), acc0);
    }
    y[o] = hsum(_mm256_add_ps(acc0, acc1)) + (bias ? bias[o] : 0.f);
  }
}

}  // namespace ktq
