// AVX2 twins of the float weight types' row dot products (gemm/gemv_blocks.h; scalar: gemv_blocks_scalar.cpp):
// F16 (F16C) and BF16 (a 16-bit shift) widened to fp32 in registers, FMA with fp32 x; four chains of 8 lanes,
// then 8 at a time, then the last in % 8 values one by one. Compiled with -mavx2 -mfma -mf16c, called only when
// use_avx2().
#include "gemm/avx2_blocks.h"
#include "gemm/gemv_blocks.h"
#include "quant/kv_codec.h"

namespace ktq::avx2 {

namespace {

struct F32 {
  static __m256 load8(const uint8_t* w, int64_t i) { return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + i); }
  static float load1(const uint8_t* w, int64_t i) { return reinterpret_cast<const float*>(w)[i]; }
  static constexpr int kBytes = 4;
};
struct F16 {
  static __m256 load8(const uint8_t* w, int64_t i) { return _mm256_cvtph_ps(loadu128(w + 2 * i)); }
  static float load1(const uint8_t* w, int64_t i) { return h2f(reinterpret_cast<const uint16_t*>(w)[i]); }
  static constexpr int kBytes = 2;
};
struct BF16 {
  static __m256 load8(const uint8_t* w, int64_t i) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(loadu128(w + 2 * i)), 16));
  }
  static float load1(const uint8_t* w, int64_t i) { return bf16_to_f32(reinterpret_cast<const uint16_t*>(w)[i]); }
  static constexpr int kBytes = 2;
};

template <class W>
float dot_float(const uint8_t* w, const float* x, int64_t in) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    prefetch_weights(w + i * W::kBytes);
    if (W::kBytes == 4) prefetch_weights(w + i * W::kBytes + 64);  // 128 bytes an iteration
    a0 = _mm256_fmadd_ps(W::load8(w, i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(W::load8(w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(W::load8(w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(W::load8(w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= in; i += 8) a0 = _mm256_fmadd_ps(W::load8(w, i), _mm256_loadu_ps(x + i), a0);
  float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < in; ++i) acc += W::load1(w, i) * x[i];
  return acc;
}

}  // namespace

float dot_f32(const uint8_t* row, const ActRow& a, int64_t in) { return dot_float<F32>(row, a.x, in); }
float dot_f16(const uint8_t* row, const ActRow& a, int64_t in) { return dot_float<F16>(row, a.x, in); }
float dot_bf16(const uint8_t* row, const ActRow& a, int64_t in) { return dot_float<BF16>(row, a.x, in); }

}  // namespace ktq::avx2
