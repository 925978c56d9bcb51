// AVX2/F16C twins of kv_codec.cpp; compiled with -mavx2 -mfma -mf16c, called only when use_avx2().
// Every function gives the scalar twin's bits: tails (n % 8) go through the scalar code itself.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "quant/kv_codec.h"

namespace ktq::avx2 {

namespace {

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// bf16 = (u + 0x7fff + ((u >> 16) & 1)) >> 16, as the scalar f32_to_bf16.
inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  // packus works per 128-bit lane: [a0..a3 b0..b3 | a4..a7 b4..b7] -> pick a0..a7.
  const __m256i p = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 floats of one group -> 32 int32 of round_half_even(x / d) (+ offset), clamped to [lo, hi].
inline void quant_group(const float* s, float d, float offset, float lo, float hi, __m256i out[4]) {
  const __m256 vd = _mm256_set1_ps(d), voff = _mm256_set1_ps(offset);
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  for (int j = 0; j < 4; ++j) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(s + 8 * j), vd), kRne);
    v = _mm256_min_ps(vhi, _mm256_max_ps(vlo, _mm256_add_ps(v, voff)));
    out[j] = _mm256_cvtps_epi32(v);  // exact: v is already an integer
  }
}

}  // namespace

// ---- input ----

void input_to_f32(InType t, const void* src, size_t n, float* dst) {
  if (t == InType::F32) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  size_t i = 0;
  if (t == InType::F16)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_f16(s + i));
  else
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16(s + i));
  scalar::input_to_f32(t, s + i, n - i, dst + i);
}

// ---- encode ----

void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales) {
  int i = 0;
  switch (t) {
    case KVType::FP32: std::memcpy(row, x, size_t(D) * 4); return;
    case KVType::FP16: {
      uint16_t* r = reinterpret_cast<uint16_t*>(row);
      for (; i + 8 <= D; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), kRne));
      for (; i < D; ++i) r[i] = f32_to_f16(x[i]);
      return;
    }
    case KVType::BF16: {
      uint16_t* r = reinterpret_cast<uint16_t*>(row);
      for (; i + 8 <= D; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(r + i), to_bf16(_mm256_loadu_ps(x + i)));
      for (; i < D; ++i) r[i] = f32_to_bf16(x[i]);
      return;
    }
    case KVType::Q8_0: {
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (int g = 0; g < D / kQGroup; ++g) {
        const float* s = x + g * kQGroup;
        __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(s));
        for (int j = 1; j < 4; ++j) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(s + 8 * j)));
        const float d = hmax(m) / 127.f;
        scales[g] = d;
        int8_t* q = reinterpret_cast<int8_t*>(row) + g * kQGroup;
        if (d == 0.f) {
          std::memset(q, 0, kQGroup);
          continue;
        }
        __m256i v[4];
        quant_group(s, d, 0.f, -127.f, 127.f, v);
        // int32 -> int8 (values fit): packs work per lane, the permute restores the order.
        const __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
      }
      return;
    }
    case KVType::Q4_0:
      for (int g = 0; g < D / kQGroup; ++g) {
        const float* s = x + g * kQGroup;
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(s));
        for (int j = 1; j < 4; ++j) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(s + 8 * j)));
        const float amax = hmax(m);
        float mx = 0.f;  // the first value of largest magnitude, like the scalar twin
        for (int j = 0; j < kQGroup; ++j)
          if (std::fabs(s[j]) == amax) {
            mx = s[j];
            break;
          }
        const float d = mx / -8.f;
        scales[g] = d;
        uint8_t* r = row + g * (kQGroup / 2);
        if (d == 0.f) {
          std::memset(r, 0x88, kQGroup / 2);
          continue;
        }
        __m256i v[4];
        quant_group(s, d, 8.f, 0.f, 15.f, v);
        // Elements 0..15 in v[0], v[1]; 16..31 in v[2], v[3]: byte i = q[i] | q[i + 16] << 4.
        const __m256i lo = _mm256_or_si256(v[0], _mm256_slli_epi32(v[2], 4));
        const __m256i hi = _mm256_or_si256(v[1], _mm256_slli_epi32(v[3], 4));
        const __m256i p16 = _mm256_packus_epi32(lo, hi);  // [lo0-3 hi0-3 | lo4-7 hi4-7]
        const __m256i p8 = _mm256_packus_epi16(p16, p16);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r), _mm256_castsi256_si128(ordered));
      }
      return;
  }
}

// ---- decode ----

void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y) {
  switch (t) {
    case KVType::FP32: std::memcpy(y, row, size_t(D) * 4); return;
    case KVType::FP16: avx2::input_to_f32(InType::F16, row, size_t(D), y); return;
    case KVType::BF16: avx2::input_to_f32(InType::BF16, row, size_t(D), y); return;
    case KVType::Q8_0:
      for (int i = 0; i < D; i += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_set1_ps(scales[i / kQGroup]), v));
      }
      return;
    case KVType::Q4_0:
      for (int g = 0; g < D / kQGroup; ++g) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * (kQGroup / 2)));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        const __m256i eight = _mm256_set1_epi32(8);
        const __m256 d = _mm256_set1_ps(scales[g]);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int j = 0; j < 4; ++j) {
          const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[j]), eight);
          _mm256_storeu_ps(y + g * kQGroup + 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
      }
      return;
  }
}

}  // namespace ktq::avx2
