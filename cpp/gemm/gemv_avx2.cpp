// AVX2 twins of gemv.cpp's kernels; compiled with -mavx2 -mfma -mf16c, called only when use_avx2().
#include <immintrin.h>

#include <cmath>

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

void quantize_q8_0_avx2(const float* src, int64_t n, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < n / kQ8Group; ++g) {
    const float* s = src + g * kQ8Group;
    __m256 v0 = _mm256_loadu_ps(s), v1 = _mm256_loadu_ps(s + 8), v2 = _mm256_loadu_ps(s + 16),
           v3 = _mm256_loadu_ps(s + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dg = amax / 127.f;
    const float inv = dg != 0.f ? 1.f / dg : 0.f;
    d[g] = dg;
    const __m256 vi = _mm256_set1_ps(inv);
    // cvtps_epi32 rounds half to even (default MXCSR), matching the scalar nearbyint.
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
    // packs work within 128-bit lanes: fix the order with a final permute.
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kQ8Group), p);
  }
}

void gemv_q8_0_rows_avx2(const float* x, int64_t in, const int8_t* qw, const float* dw, const float* bias,
                         float* y, int64_t o0, int64_t o1) {
  const int64_t ng = in / kQ8Group;
  // One row at a time, so the weights [o0, o1) x [in] are read as one forward stream. (Four rows at a
  // time shared the loads of x but read four interleaved streams; with short rows, 576 bytes for the
  // bundled model, the hardware prefetcher never caught up: 5 GB/s from DRAM instead of 11+.) x is in
  // L1, so reloading it per row costs little. The prefetch kPrefetchBytes ahead may run past the last
  // row: a prefetch never faults. It is non-temporal: a decode step streams every weight once (the
  // bundled model's 143 MB outgrow the L3), so they need not displace what is reused from token to
  // token, the KV windows, anchors and selected blocks. Side by side at 8K (snapkv, 2 threads, 6 runs
  // each): 90.7 -> 96.1 tok/s; at 1K 105.3 -> 103.1, within the noise.
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* w = qw + o * in;
    const float* d = dw + o * ng;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // two chains: even and odd groups
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) {
      const int64_t off = g * kQ8Group;
      _mm_prefetch(reinterpret_cast<const char*>(w + off) + kPrefetchBytes, _MM_HINT_NTA);
      const __m256 s0 = group_dot(w + off, _mm256_loadu_ps(x + off), _mm256_loadu_ps(x + off + 8),
                                  _mm256_loadu_ps(x + off + 16), _mm256_loadu_ps(x + off + 24));
      const __m256 s1 = group_dot(w + off + 32, _mm256_loadu_ps(x + off + 32), _mm256_loadu_ps(x + off + 40),
                                  _mm256_loadu_ps(x + off + 48), _mm256_loadu_ps(x + off + 56));
      acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(d + g), acc0);
      acc1 = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(d + g + 1), acc1);
    }
    if (g < ng) {
      const int64_t off = g * kQ8Group;
      const __m256 s0 = group_dot(w + off, _mm256_loadu_ps(x + off), _mm256_loadu_ps(x + off + 8),
                                  _mm256_loadu_ps(x + off + 16), _mm256_loadu_ps(x + off + 24));
      acc0 = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(d + g), acc0);
    }
    y[o] = hsum(_mm256_add_ps(acc0, acc1)) + (bias ? bias[o] : 0.f);
  }
}

}  // namespace ktq
