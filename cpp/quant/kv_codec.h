// Storage formats of the KV store and the row codecs between them and fp32.
//
// One stored row is the D values of one token of one KV head:
//   FP32  D floats
//   FP16  D IEEE halves, round-to-nearest-even (F16C in the AVX2 path, a bit-identical scalar twin)
//   BF16  D bfloat16, round-to-nearest-even of the fp32 bits
//   Q8_0  D int8 in groups of kQGroup = 32 along D (quant/qgroup.h), one fp32 scale per group:
//           d = absmax(group) / 127, q = round_half_even(x / d) (q = 0 when d = 0), x' = d * q
//   Q4_0  D 4-bit values in groups of 32, one fp32 scale per group (ggml's scheme):
//           max = the group's value of largest magnitude (first one on ties), d = max / -8,
//           q = clamp(round_half_even(x / d) + 8, 0, 15) (q = 8 when d = 0), x' = d * (q - 8);
//           byte i of a group holds element i (low nibble) and element i + 16 (high nibble).
// Scales live apart from the row data (see kvstore/layout.h) so int8/nibble rows stay 32-byte aligned.
// Every codec is bit-identical between the scalar and the AVX2 path: division (not a reciprocal),
// round-half-even in both, and dequantisation as one fp32 multiply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>

#include "quant/qgroup.h"

namespace ktq {

enum class KVType : int { FP32 = 0, FP16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4 };
inline constexpr const char* kKVTypeNames[] = {"FP32", "FP16", "BF16", "Q8_0", "Q4_0"};  // in enum order
static_assert(std::size(kKVTypeNames) == size_t(KVType::Q4_0) + 1);
// dtype of tensors handed to append(): fp32, fp16 or bf16 (bf16 arrives as raw uint16 bits).
enum class InType : int { F32 = 0, F16 = 1, BF16 = 2 };

const char* kv_type_name(KVType t);
bool kv_type_quantized(KVType t);
size_t kv_row_bytes(KVType t, int D);  // data bytes of one stored row
int kv_row_scales(KVType t, int D);    // fp32 scales of one stored row (D/32 for Q8_0/Q4_0, else 0)

// ---- scalar conversions (exactly what F16C and the AVX2 code compute) ----
uint16_t f32_to_f16(float x);  // round-to-nearest-even; overflow -> inf
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float x);  // round-to-nearest-even (input must not be NaN)
float bf16_to_f32(uint16_t h);

// ---- row codecs, dispatched to the AVX2 or the scalar twin at run time ----
// src: [n] in `t` -> dst: [n] fp32
void input_to_f32(InType t, const void* src, size_t n, float* dst);
// x: [D] fp32 -> row: [kv_row_bytes] and scales: [kv_row_scales]
void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales);
// row, scales -> y: [D] fp32
void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y);

namespace scalar {
void input_to_f32(InType t, const void* src, size_t n, float* dst);
void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales);
void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y);
}  // namespace scalar

namespace avx2 {
void input_to_f32(InType t, const void* src, size_t n, float* dst);
void encode_row(KVType t, const float* x, int D, uint8_t* row, float* scales);
void decode_row(KVType t, const uint8_t* row, const float* scales, int D, float* y);
}  // namespace avx2

}  // namespace ktq
