// Scalar row codecs (the twins of kv_codec_avx2.cpp) and the run-time dispatch.
#include "quant/kv_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/cpu_features.h"
#include "common/enum_names.h"

namespace ktq {

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

// ---- formats ----

const char* kv_type_name(KVType t) { return enum_name(kKVTypeNames, t); }

bool kv_type_quantized(KVType t) { return t == KVType::Q8_0 || t == KVType::Q4_0; }

size_t kv_row_bytes(KVType t, int D) {
  switch (t) {
    case KVType::FP32: return size_t(D) * 4;
    case KVType::FP16:
    case KVType::BF16: return size_t(D) * 2;
    case KVType::Q8_0: return size_t(D);
    case KVType::Q4_0: return size_t(D) / 2;
  }
  return 0;
}

int kv_row_scales(KVType t, int D) { return kv_type_quantized(t) ? D / kQGroup : 0; }

// ---- scalar conversions ----

// fp32 -> fp16 with round-to-nearest-even, subnormals included (Maratyszcza's FP16 method, as in
// ggml): the float additions below do the rounding in the FPU's default mode, so the result equals
// F16C's _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) bit for bit on every finite input.
uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t exp_bits = (b >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = b & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float f16_to_f32(uint16_t h) {  // exact
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized));
  return float_of(r);
}

uint16_t f32_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_f32(uint16_t h) { return float_of(uint32_t(h) << 16); }

namespace scalar {

// ---- input ----

void input_to_f32(InType t, const void* src, size_t n, float* dst) {
  switch (t) {
    case InType::F32: std::memcpy(dst, src, n * 4); break;
    case InType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
    case InType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
  }
}

// ---- encode ----

void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales) {
  switch (t) {
    case KVType::FP32: std::memcpy(row, x, size_t(D) * 4); break;
    case KVType::FP16: {
      uint16_t* r = reinterpret_cast<uint16_t*>(row);
      for (int i = 0; i < D; ++i) r[i] = f32_to_f16(x[i]);
      break;
    }
    case KVType::BF16: {
      uint16_t* r = reinterpret_cast<uint16_t*>(row);
      for (int i = 0; i < D; ++i) r[i] = f32_to_bf16(x[i]);
      break;
    }
    case KVType::Q8_0:
      for (int g = 0; g < D / kQGroup; ++g) {
        const float* s = x + g * kQGroup;
        float amax = 0.f;
        for (int i = 0; i < kQGroup; ++i) amax = std::max(amax, std::fabs(s[i]));
        const float d = amax / 127.f;
        scales[g] = d;
        int8_t* q = reinterpret_cast<int8_t*>(row) + g * kQGroup;
        for (int i = 0; i < kQGroup; ++i) {
          // |x / d| <= 127 up to one rounding, so the clamp only guards that rounding.
          const float v = d != 0.f ? std::nearbyint(s[i] / d) : 0.f;
          q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
      }
      break;
    case KVType::Q4_0:
      for (int g = 0; g < D / kQGroup; ++g) {
        const float* s = x + g * kQGroup;
        float amax = 0.f, mx = 0.f;
        for (int i = 0; i < kQGroup; ++i)
          if (std::fabs(s[i]) > amax) amax = std::fabs(s[i]), mx = s[i];
        const float d = mx / -8.f;
        scales[g] = d;
        uint8_t q[kQGroup];
        for (int i = 0; i < kQGroup; ++i) {
          const float v = d != 0.f ? std::nearbyint(s[i] / d) + 8.f : 8.f;
          q[i] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, v)));
        }
        uint8_t* r = row + g * (kQGroup / 2);
        for (int i = 0; i < kQGroup / 2; ++i) r[i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
      }
      break;
  }
}

// ---- decode ----

void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y) {
  switch (t) {
    case KVType::FP32: std::memcpy(y, row, size_t(D) * 4); break;
    case KVType::FP16: scalar::input_to_f32(InType::F16, row, size_t(D), y); break;
    case KVType::BF16: scalar::input_to_f32(InType::BF16, row, size_t(D), y); break;
    case KVType::Q8_0:
      for (int i = 0; i < D; ++i) y[i] = scales[i / kQGroup] * float(reinterpret_cast<const int8_t*>(row)[i]);
      break;
    case KVType::Q4_0:
      for (int g = 0; g < D / kQGroup; ++g) {
        const uint8_t* r = row + g * (kQGroup / 2);
        for (int i = 0; i < kQGroup / 2; ++i) {
          y[g * kQGroup + i] = scales[g] * float(int(r[i] & 0x0F) - 8);
          y[g * kQGroup + i + 16] = scales[g] * float(int(r[i] >> 4) - 8);
        }
      }
      break;
  }
}

}  // namespace scalar

// ---- dispatch ----

void input_to_f32(InType t, const void* src, size_t n, float* dst) {
  if (use_avx2()) avx2::input_to_f32(t, src, n, dst);
  else scalar::input_to_f32(t, src, n, dst);
}

void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales) {
  if (use_avx2()) avx2::encode_row(t, x, D, row, scales);
  else scalar::encode_row(t, x, D, row, scales);
}

void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y) {
  if (use_avx2()) avx2::decode_row(t, row, scales, D, y);
  else scalar::decode_row(t, row, scales, D, y);
}

}  // namespace ktq
