// GGUF weight encodings as ggml lays them out on disk (ggml-common.h), so a memory-mapped file is read in place.
// A row of `in` values is in / block_values blocks of block_bytes each, back to back; every fp16 field is an IEEE
// half. The value of element j of a block (what dequantize_row writes, bit for bit what gguf's Python
// dequantizer computes):
//   F32 / F16 / BF16  one value per element (blocks of 1)
//   Q8_0   d * qs[j]                                         (qs int8)
//   Q4_0   d * (nib(j) - 8)       nib(j) = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4
//   Q4_1   d * nib(j) + m
//   Q5_0   d * ((nib(j) | hbit(j) << 4) - 16)               hbit(j) = bit j of qh (little-endian uint32)
//   Q5_1   d * (nib(j) | hbit(j) << 4) + m
//   Q4_K   super-blocks of 256 = 8 sub-blocks of 32 with 6-bit scales sc[s] and mins mn[s] packed in 12 bytes:
//          (d * sc[s]) * q - (dmin * mn[s]); sub-blocks 2c and 2c+1 are the low and high nibbles of qs[32c .. 32c+32)
//   Q5_K   as Q4_K with a fifth bit: bit s of qh[l] is the high bit of element l of sub-block s
//   Q6_K   16 sub-blocks of 16 with int8 scales: (d * sc[s]) * (q - 32), q six bits split over ql (4) and qh (2)
// The GEMV over these rows: gemm/gemv_blocks.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/enum_names.h"

namespace ktq {

enum class GgmlType : int { F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };
// The names gguf gives these types (GGMLQuantizationType.<name>); _C.GGML_TYPES.
inline constexpr const char* kGgmlTypeNames[] = {"F32",  "F16",  "BF16", "Q8_0", "Q4_0", "Q4_1",
                                                 "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"};
constexpr int kGgmlTypeCount = int(sizeof(kGgmlTypeNames) / sizeof(kGgmlTypeNames[0]));
inline const char* ggml_type_name(GgmlType t) { return enum_name(kGgmlTypeNames, t); }

constexpr int kQK = 256;  // values per K-quant super-block
constexpr int kQ32 = 32;  // values per block of the other quantized types

// ---- blocks (fp16 fields as raw bits) ----
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
// Q6_K, per half of 128 values (ql += 64, qh += 32, sc += 8), l in [0, 32): element l + 32k takes
//   k = 0: ql[l] & 15,  k = 1: ql[l + 32] & 15,  k = 2: ql[l] >> 4,  k = 3: ql[l + 32] >> 4
// as its low four bits, (qh[l] >> 2k) & 3 as its top two, and scale sc[l / 16 + 2k].
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "ggml block sizes");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "ggml block sizes");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "ggml block sizes");
static_assert(offsetof(BlockQ6_K, d) == 208 && offsetof(BlockQ5_K, qs) == 48, "ggml field offsets");

struct GgmlTypeInfo {
  int block_values;  // values per block along a row
  int block_bytes;   // bytes per block
  int align;         // alignment the rows need (the widest field read in place)
};

constexpr GgmlTypeInfo ggml_type_info(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return {1, 4, 4};
    case GgmlType::F16:
    case GgmlType::BF16: return {1, 2, 2};
    case GgmlType::Q8_0: return {kQ32, int(sizeof(BlockQ8_0)), 2};
    case GgmlType::Q4_0: return {kQ32, int(sizeof(BlockQ4_0)), 2};
    case GgmlType::Q4_1: return {kQ32, int(sizeof(BlockQ4_1)), 2};
    case GgmlType::Q5_0: return {kQ32, int(sizeof(BlockQ5_0)), 2};
    case GgmlType::Q5_1: return {kQ32, int(sizeof(BlockQ5_1)), 2};
    case GgmlType::Q4_K: return {kQK, int(sizeof(BlockQ4_K)), 2};
    case GgmlType::Q5_K: return {kQK, int(sizeof(BlockQ5_K)), 2};
    case GgmlType::Q6_K: return {kQK, int(sizeof(BlockQ6_K)), 2};
  }
  return {1, 0, 1};
}

// Bytes of one row of `in` values (in % block_values == 0, checked by the callers).
constexpr int64_t ggml_row_bytes(GgmlType t, int64_t in) {
  return in / ggml_type_info(t).block_values * ggml_type_info(t).block_bytes;
}

// Q4_K / Q5_K: the 8 six-bit scales (sc[0..8)) and mins (sc[8..16)) of a super-block from its 12 packed bytes:
// s < 4: sc = b[s] & 63, mn = b[s + 4] & 63; s >= 4: the low four bits from b[s + 4], the top two from the spare
// bits of b[s - 4] (scale) and b[s] (min).
inline void unpack_k_scales(const uint8_t* b, uint8_t sc[16]) {
  for (int s = 0; s < 4; ++s) {
    sc[s] = b[s] & 63;
    sc[8 + s] = b[s + 4] & 63;
    sc[4 + s] = uint8_t((b[s + 8] & 15) | ((b[s] >> 6) << 4));
    sc[12 + s] = uint8_t((b[s + 8] >> 4) | ((b[s + 4] >> 6) << 4));
  }
}

// Q4_K / Q5_K: the code of element l (0..31) of sub-block s (0..7): its nibble, and for Q5_K the fifth bit from
// qh (the dequantizer, the scalar dot products and the prefill GEMM's unpacking read codes through these).
inline int k_code(const BlockQ4_K& b, int s, int l) { return (b.qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15; }
inline int k_code(const BlockQ5_K& b, int s, int l) {
  return ((b.qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15) | ((b.qh[l] >> s) & 1) << 4;
}

// One row of `in` values -> y [in] fp32 (scalar: load-time conversion and the tests' exact path).
void dequantize_row(GgmlType t, const uint8_t* row, int64_t in, float* y);

}  // namespace ktq
