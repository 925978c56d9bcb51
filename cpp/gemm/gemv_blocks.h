// Decode GEMV over weight rows in their GGUF encoding, read in place from the mapped file:
//   y[T, out] = x[T, in] @ dequant(W)^T (+ bias),  W: [out, row_bytes] in one GgmlType (quant/ggml_blocks.h)
//
// Numerics. The quantized types take ggml's route: x is quantized once per call to int8 (quant/q8_act.h: groups
// of 32, or 256 for the K-quants) and each block's dot product is an integer one (AVX2: maddubs/madd), scaled
// once per block or super-block. The result is dequant(W) . dequant(q8(x)) up to fp32 rounding; the extra error
// against fp32 x is bounded in q8_act.h. F32, F16 and BF16 weights are widened to fp32 in registers and
// multiplied by fp32 x with FMA (no activation rounding; the weights' bytes bound their speed anyway).
// Why not weight-only for the quantized types too (widen each weight to fp32 and FMA with fp32 x, as the Q8_0
// split-plane GEMV of gemv.h does, exact up to fp32 rounding)? Decode is bound by instructions here, not only by
// memory: Q4_K [14336 x 4096], one token, AMD EPYC (Zen 4) with 2 cores shared with other jobs (noisy; ratios
// taken side by side in one run):
//   1 thread:  weight-only 6672 us (5.0 GB/s of weights), quantized x + maddubs 2993 us (11.0 GB/s): 2.2x
//   2 threads: weight-only 7662 us (4.3 GB/s),            quantized x + maddubs 2390 us (13.8 GB/s): 3.2x
// and llama.cpp, which decode must match on 2 cores, takes the integer route. These kernels follow ggml's x Q8
// ones; against ggml's own (its vec_dot, and the repacked q4_K_8x8 llama.cpp loads Q4_K into) side by side:
// docs/perf-log.md, 2026-11-24.
//
// Threads split the rows; each output is one row's dot product summed in a fixed order, so the result does not
// depend on the thread count. T > 1 loops over the activation rows (a few tokens; prefill has its own GEMM).
#pragma once

#include <cstdint>
#include <vector>

#include "quant/ggml_blocks.h"

namespace ktq {

// A weight matrix [out, in] as the file stores it: one or more parts of whole rows stacked in order, each in
// its own encoding (a fused projection such as q | k | v whose tensors a Q4_K_M file quantizes differently),
// read in place; bias [out] or nullptr. Borrowed pointers: the owner keeps the mapped file alive.
struct QuantPart {
  GgmlType type = GgmlType::F32;
  const uint8_t* w = nullptr;  // [rows, ggml_row_bytes(type, in)]
  int64_t rows = 0;
};
struct QuantMatrix {
  std::vector<QuantPart> parts;
  const float* bias = nullptr;
  int64_t out = 0, in = 0;  // out = the parts' rows
  // Round x to int16 (quant/q8_act.h: quantize_act16) instead of int8 where the part's type has such kernels:
  // the 32-value block types. The K-quants and the float types are unchanged. Why: ktquest/config.py.
  bool x16 = false;
};

// y[T, out] = x[T, in] @ dequant(m)^T (+ bias): gemv_quant over every part in one threaded pass (x quantized
// once per activation group the parts need).
void gemv_matrix(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads);

// Several GEMVs of one token in one threaded pass (a MoE layer's chosen experts): y_j[out_j] = m_j x_j (+ bias_j),
// the threads split the jobs' rows taken one after the other (experts x rows), each output one row's dot
// product as gemv_matrix computes it (the same for any thread count). Borrowed pointers.
struct GemvJob {
  const QuantMatrix* m;
  const float* x;  // [m->in]
  float* y;        // [m->out]
};
void gemv_jobs(const GemvJob* jobs, int n_jobs, int n_threads);

// out[r1 - r0, in] = dequant(rows [r0, r1) of m) in fp32 (as gguf's dequantizer), rows split across threads:
// the panel a prefill chunk multiplies (ktquest/layers/linear.py). 0 <= r0 <= r1 <= m.out. With `order`
// ([m.out], a permutation), out row i is matrix row order[r0 + i] (a llama file's q/k rows gathered).
void dequantize_matrix_rows(const QuantMatrix& m, int64_t r0, int64_t r1, float* out, int n_threads,
                            const int32_t* order = nullptr);

// W: [out, ggml_row_bytes(t, in)] bytes, x: [T, in] fp32, bias: [out] or nullptr, y: [T, out] fp32.
// in % block_values(t) == 0; W's rows aligned to ggml_type_info(t).align (the binding checks both).
void gemv_quant(GgmlType t, const float* x, int64_t T, int64_t in, const uint8_t* w, int64_t out,
                const float* bias, float* y, int n_threads);

// True when type t has kernels (both twins).
bool gemv_quant_supported(GgmlType t);

// Rows of at least this many values take the AVX2 kernels that prefetch every weight line (avx2_stream; why and
// the measurements: avx2_blocks.h). 7-14B models' ffn_down rows (13824-18944) do, the other matrices do not.
constexpr int64_t kGemvStreamIn = 12288;

// ---- kernels: one row's dot product with one activation row, picked at run time ----

struct ActRow {
  const float* x;        // [in] fp32 (the float weight types read it)
  const int8_t* q;       // [in] x quantized (quant/q8_act.h; the quantized types read these four)
  const float* d;        // [in / group] its scales
  const int16_t* sum16;  // [in / 16] sums of q over 16 values
  const int16_t* sum32;  // [in / 32] and over 32 (|sum| <= 32 * 127)
  const int16_t* q16;    // [in] x quantized to int16 per 32 values (the x16 kernels read these three)
  const float* d16;      // [in / 32] its scales
  const int32_t* isum32;  // [in / 32] sums of q16 over 32
};

using RowDot = float(const uint8_t* row, const ActRow& a, int64_t in);
// One row's dot products with n (1..kDotTokens) activation rows a[0..n) at once, into out[0..n): each out[t] is
// the type's RowDot of (row, a[t]) bit for bit, the row's blocks unpacked once for all n (batched decode).
constexpr int kDotTokens = 4;
using RowDotN = void(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out);

namespace scalar {  // gemv_blocks_scalar.cpp
RowDot dot_f32, dot_f16, dot_bf16, dot_q8_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1, dot_q4_k, dot_q5_k, dot_q6_k;
}  // namespace scalar

namespace avx2 {
RowDot dot_q4_k, dot_q5_k, dot_q6_k;                      // gemv_kquants_avx2.cpp
RowDotN dot_q4_k_rows, dot_q5_k_rows, dot_q6_k_rows;
RowDot dot_q8_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1;  // gemv_q32_avx2.cpp
RowDot dot_f32, dot_f16, dot_bf16;                        // gemv_float_avx2.cpp (they always prefetch)
}  // namespace avx2

namespace scalar_x16 {  // int16 x (gemv_blocks_scalar.cpp; AVX2: gemv_q32_x16_avx2.cpp)
RowDot dot_q8_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1;
}  // namespace scalar_x16
namespace avx2_x16 {
RowDot dot_q8_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1;
RowDotN dot_q8_0_rows, dot_q4_0_rows, dot_q4_1_rows, dot_q5_0_rows, dot_q5_1_rows;
}  // namespace avx2_x16

namespace avx2_stream {  // the same with a software prefetch of every weight line, for long rows (avx2_blocks.h)
RowDot dot_q4_k, dot_q5_k, dot_q6_k;
RowDotN dot_q4_k_rows, dot_q5_k_rows, dot_q6_k_rows;
RowDot dot_q8_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1;
}  // namespace avx2_stream

}  // namespace ktq
