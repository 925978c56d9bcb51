// Scalar twins of the block GEMV's row dot products (gemm/gemv_blocks.h): the same integer sums per block as the
// AVX2 kernels, scaled in fp32 in a plainer order.
#include <cstring>

#include "gemm/gemv_blocks.h"
#include "quant/kv_codec.h"

namespace ktq {

namespace {

inline float h2f(uint16_t h) { return f16_to_f32(h); }

// Block i's 32 codes (the AVX2 kernels' bytes) into c.
inline void codes(const BlockQ8_0& b, int32_t* c) { for (int j = 0; j < 32; ++j) c[j] = b.qs[j]; }
inline void codes(const BlockQ4_0& b, int32_t* c) {
  for (int j = 0; j < 16; ++j) c[j] = (b.qs[j] & 15) - 8, c[j + 16] = (b.qs[j] >> 4) - 8;
}
inline void codes(const BlockQ4_1& b, int32_t* c) {
  for (int j = 0; j < 16; ++j) c[j] = b.qs[j] & 15, c[j + 16] = b.qs[j] >> 4;
}
inline uint32_t high_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return h;
}
inline void codes(const BlockQ5_0& b, int32_t* c) {
  const uint32_t h = high_bits(b.qh);
  for (int j = 0; j < 16; ++j) {
    c[j] = ((b.qs[j] & 15) | ((h >> j) & 1) << 4) - 16;
    c[j + 16] = ((b.qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - 16;
  }
}
inline void codes(const BlockQ5_1& b, int32_t* c) {
  const uint32_t h = high_bits(b.qh);
  for (int j = 0; j < 16; ++j) {
    c[j] = (b.qs[j] & 15) | ((h >> j) & 1) << 4;
    c[j + 16] = (b.qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4;
  }
}
inline float offset(const BlockQ4_1& b) { return h2f(b.m); }
inline float offset(const BlockQ5_1& b) { return h2f(b.m); }
template <class B>
inline float offset(const B&) { return 0.f; }

// A 32-value block type's row: each block's codes times x's codes (int8, or int16 with kX16) summed exactly in
// integers, scaled by d_w * d_x, plus m * d_x * sum(x codes) for Q4_1 / Q5_1 (w = d * code + m).
template <class Block, bool kX16>
float q32_dot(const uint8_t* row, const ActRow& a, int64_t in) {
  const Block* b = reinterpret_cast<const Block*>(row);
  float acc = 0.f;
  for (int64_t i = 0; i < in / kQ32; ++i) {
    int32_t c[32], dot = 0;
    codes(b[i], c);
    for (int j = 0; j < 32; ++j) dot += c[j] * (kX16 ? int32_t(a.q16[i * kQ32 + j]) : int32_t(a.q[i * kQ32 + j]));
    const float dx = kX16 ? a.d16[i] : a.d[i];
    const int32_t xsum = kX16 ? a.isum32[i] : int32_t(a.sum32[i]);
    acc += h2f(b[i].d) * dx * float(dot) + offset(b[i]) * dx * float(xsum);
  }
  return acc;
}

// Q4_K / Q5_K (activations in groups of 256: a.d[i] scales super-block i): sum_s sc[s] * (code . q8) and
// sum_s mn[s] * sum(q8) over sub-block s, scaled by d * dx and dmin * dx.
template <class Block>
float q45_k_dot(const uint8_t* row, const ActRow& a, int64_t in) {
  const Block* b = reinterpret_cast<const Block*>(row);
  float acc = 0.f;
  for (int64_t i = 0; i < in / kQK; ++i) {
    uint8_t sc[16];
    unpack_k_scales(b[i].scales, sc);
    const int8_t* q8 = a.q + i * kQK;
    const int16_t* s32 = a.sum32 + i * (kQK / 32);
    int32_t sumi = 0, summ = 0;
    for (int s = 0; s < 8; ++s) {
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) dot += k_code(b[i], s, l) * q8[32 * s + l];
      sumi += sc[s] * dot;
      summ += sc[8 + s] * s32[s];
    }
    acc += h2f(b[i].d) * a.d[i] * float(sumi) - h2f(b[i].dmin) * a.d[i] * float(summ);
  }
  return acc;
}

}  // namespace

}  // namespace ktq

namespace ktq::scalar {

// ---- K-quants (activations in groups of 256: a.d[i] scales super-block i) ----

float dot_q4_k(const uint8_t* row, const ActRow& a, int64_t in) { return q45_k_dot<BlockQ4_K>(row, a, in); }
float dot_q5_k(const uint8_t* row, const ActRow& a, int64_t in) { return q45_k_dot<BlockQ5_K>(row, a, in); }

float dot_q6_k(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row);
  float acc = 0.f;
  for (int64_t i = 0; i < in / kQK; ++i) {
    const int8_t* q8 = a.q + i * kQK;
    int32_t sumi = 0;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b[i].ql + 64 * half;
      const uint8_t* qh = b[i].qh + 32 * half;
      const int8_t* sc = b[i].scales + 8 * half;
      const int8_t* x = q8 + 128 * half;
      for (int k = 0; k < 4; ++k) {
        for (int sub = 0; sub < 2; ++sub) {  // 16 values of one scale
          int32_t dot = 0;
          for (int l = 16 * sub; l < 16 * sub + 16; ++l) {
            const int lo = k % 2 ? ql[l + 32] : ql[l];
            const int q = ((k < 2 ? lo & 15 : lo >> 4) | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
            dot += q * x[l + 32 * k];
          }
          sumi += sc[sub + 2 * k] * dot;
        }
      }
    }
    acc += h2f(b[i].d) * a.d[i] * float(sumi);
  }
  return acc;
}

// ---- 32-value blocks (activations in groups of 32: a.d[i] scales block i) ----

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ8_0, false>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ4_0, false>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ4_1, false>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ5_0, false>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ5_1, false>(row, a, in); }

// ---- float types (fp32 x; summed in double: the twin's sums are then the more exact ones) ----

float dot_f32(const uint8_t* row, const ActRow& a, int64_t in) {
  const float* w = reinterpret_cast<const float*>(row);
  double acc = 0.0;
  for (int64_t i = 0; i < in; ++i) acc += double(w[i]) * a.x[i];
  return float(acc);
}

float dot_f16(const uint8_t* row, const ActRow& a, int64_t in) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  double acc = 0.0;
  for (int64_t i = 0; i < in; ++i) acc += double(f16_to_f32(w[i])) * a.x[i];
  return float(acc);
}

float dot_bf16(const uint8_t* row, const ActRow& a, int64_t in) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
  double acc = 0.0;
  for (int64_t i = 0; i < in; ++i) acc += double(bf16_to_f32(w[i])) * a.x[i];
  return float(acc);
}

}  // namespace ktq::scalar

// ---- int16-activation twins of the 32-value block types (`activations: int16`; AVX2: gemv_q32_x16_avx2.cpp) ----

namespace ktq::scalar_x16 {

float dot_q8_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ8_0, true>(row, a, in); }
float dot_q4_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ4_0, true>(row, a, in); }
float dot_q4_1(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ4_1, true>(row, a, in); }
float dot_q5_0(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ5_0, true>(row, a, in); }
float dot_q5_1(const uint8_t* row, const ActRow& a, int64_t in) { return q32_dot<BlockQ5_1, true>(row, a, in); }

}  // namespace ktq::scalar_x16
