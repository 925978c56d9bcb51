// Scalar dequantization of ggml-encoded rows (quant/ggml_blocks.h). The operations and their order are those of
// gguf's Python dequantizer (fp32 products, no fused multiply-add: this file is built without -mfma), so the
// results are bit-identical to it.
#include <cstring>

#include "quant/ggml_blocks.h"
#include "quant/kv_codec.h"

namespace ktq {

namespace {

inline float h2f(uint16_t h) { return f16_to_f32(h); }

// ---- the 32-value block types ----

void deq_q8_0(const BlockQ8_0* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += kQ32) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < 32; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

void deq_q4_0(const BlockQ4_0* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += kQ32) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float((b[i].qs[j] & 15) - 8);
      y[j + 16] = d * float((b[i].qs[j] >> 4) - 8);
    }
  }
}

void deq_q4_1(const BlockQ4_1* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += kQ32) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(b[i].qs[j] & 15) + m;
      y[j + 16] = d * float(b[i].qs[j] >> 4) + m;
    }
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void deq_q5_0(const BlockQ5_0* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += kQ32) {
    const float d = h2f(b[i].d);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float(int((b[i].qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
      y[j + 16] = d * float(int((b[i].qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
    }
  }
}

void deq_q5_1(const BlockQ5_1* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, y += kQ32) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * float((b[i].qs[j] & 15) | ((qh >> j) & 1) << 4) + m;
      y[j + 16] = d * float((b[i].qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
  }
}

// ---- K-quants ----

// Q4_K / Q5_K: w = d * sc[s] * code - dmin * mn[s] per sub-block s of 32 (k_code).
template <class Block>
void deq_q45_k(const Block* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    uint8_t sc[16];
    unpack_k_scales(b[i].scales, sc);
    for (int s = 0; s < 8; ++s, y += 32) {
      const float dl = d * float(sc[s]), ml = dmin * float(sc[8 + s]);
      for (int l = 0; l < 32; ++l) y[l] = dl * float(k_code(b[i], s, l)) - ml;
    }
  }
}

void deq_q6_k(const BlockQ6_K* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d);
    for (int half = 0; half < 2; ++half, y += 128) {
      const uint8_t* ql = b[i].ql + 64 * half;
      const uint8_t* qh = b[i].qh + 32 * half;
      const int8_t* sc = b[i].scales + 8 * half;
      for (int l = 0; l < 32; ++l) {
        const int q[4] = {(ql[l] & 15) | ((qh[l] >> 0) & 3) << 4, (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4,
                          (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4, (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4};
        for (int k = 0; k < 4; ++k) y[l + 32 * k] = (d * float(sc[l / 16 + 2 * k])) * float(q[k] - 32);
      }
    }
  }
}

}  // namespace

void dequantize_row(GgmlType t, const uint8_t* row, int64_t in, float* y) {
  const int64_t nb = in / ggml_type_info(t).block_values;
  switch (t) {
    case GgmlType::F32: std::memcpy(y, row, size_t(in) * 4); break;
    case GgmlType::F16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < in; ++i) y[i] = f16_to_f32(h[i]);
      break;
    }
    case GgmlType::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < in; ++i) y[i] = bf16_to_f32(h[i]);
      break;
    }
    case GgmlType::Q8_0: deq_q8_0(reinterpret_cast<const BlockQ8_0*>(row), nb, y); break;
    case GgmlType::Q4_0: deq_q4_0(reinterpret_cast<const BlockQ4_0*>(row), nb, y); break;
    case GgmlType::Q4_1: deq_q4_1(reinterpret_cast<const BlockQ4_1*>(row), nb, y); break;
    case GgmlType::Q5_0: deq_q5_0(reinterpret_cast<const BlockQ5_0*>(row), nb, y); break;
    case GgmlType::Q5_1: deq_q5_1(reinterpret_cast<const BlockQ5_1*>(row), nb, y); break;
    case GgmlType::Q4_K: deq_q45_k(reinterpret_cast<const BlockQ4_K*>(row), nb, y); break;
    case GgmlType::Q5_K: deq_q45_k(reinterpret_cast<const BlockQ5_K*>(row), nb, y); break;
    case GgmlType::Q6_K: deq_q6_k(reinterpret_cast<const BlockQ6_K*>(row), nb, y); break;
  }
}

}  // namespace ktq
