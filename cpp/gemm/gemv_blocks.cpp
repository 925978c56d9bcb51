// Block GEMV: the kernel tables, the activation quantization and the threaded row split (gemm/gemv_blocks.h).
#include "gemm/gemv_blocks.h"

#include <algorithm>
#include <vector>

#include "common/cpu_features.h"
#include "gemm/row_tiles.h"
#include "quant/q8_act.h"

namespace ktq {

namespace {

struct Kernels {
  RowDot* scalar;
  RowDot* avx2;
  RowDot* avx2_stream;  // avx2 with the weight prefetch of long rows
  int group;            // values per activation scale (0: the kernels read fp32 x)
};

Kernels kernels(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return {scalar::dot_f32, avx2::dot_f32, avx2::dot_f32, 0};
    case GgmlType::F16: return {scalar::dot_f16, avx2::dot_f16, avx2::dot_f16, 0};
    case GgmlType::BF16: return {scalar::dot_bf16, avx2::dot_bf16, avx2::dot_bf16, 0};
    case GgmlType::Q8_0: return {scalar::dot_q8_0, avx2::dot_q8_0, avx2_stream::dot_q8_0, kQ32};
    case GgmlType::Q4_0: return {scalar::dot_q4_0, avx2::dot_q4_0, avx2_stream::dot_q4_0, kQ32};
    case GgmlType::Q4_1: return {scalar::dot_q4_1, avx2::dot_q4_1, avx2_stream::dot_q4_1, kQ32};
    case GgmlType::Q5_0: return {scalar::dot_q5_0, avx2::dot_q5_0, avx2_stream::dot_q5_0, kQ32};
    case GgmlType::Q5_1: return {scalar::dot_q5_1, avx2::dot_q5_1, avx2_stream::dot_q5_1, kQ32};
    case GgmlType::Q4_K: return {scalar::dot_q4_k, avx2::dot_q4_k, avx2_stream::dot_q4_k, kQK};
    case GgmlType::Q5_K: return {scalar::dot_q5_k, avx2::dot_q5_k, avx2_stream::dot_q5_k, kQK};
    case GgmlType::Q6_K: return {scalar::dot_q6_k, avx2::dot_q6_k, avx2_stream::dot_q6_k, kQK};
  }
  return {nullptr, nullptr, nullptr, 0};
}

// The quantized activations of the calling thread, grown once: q [T, in], d [T, in / group], sum16 [T, in / 16],
// sum32 [T, in / 32].
struct ActScratch {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sum16, sum32;
};

}  // namespace

bool gemv_quant_supported(GgmlType t) { return kernels(t).scalar != nullptr; }

void gemv_quant(GgmlType t, const float* x, int64_t T, int64_t in, const uint8_t* w, int64_t out,
                const float* bias, float* y, int n_threads) {
  const Kernels k = kernels(t);
  const bool use_avx = use_avx2();
  RowDot* dot = !use_avx ? k.scalar : in >= kGemvStreamIn ? k.avx2_stream : k.avx2;
  const int64_t row_bytes = ggml_row_bytes(t, in);

  // x quantized once per call (T rows), read by every thread.
  thread_local ActScratch s;
  if (k.group > 0) {
    if (int64_t(s.q.size()) < T * in) s.q.resize(size_t(T * in));
    if (int64_t(s.d.size()) < T * in / k.group) s.d.resize(size_t(T * in / k.group));
    if (int64_t(s.sum16.size()) < T * in / 16) s.sum16.resize(size_t(T * in / 16));
    if (int64_t(s.sum32.size()) < T * in / 32) s.sum32.resize(size_t(T * in / 32));
    for (int64_t r = 0; r < T; ++r)
      quantize_act(x + r * in, in, k.group, s.q.data() + r * in, s.d.data() + r * (in / k.group),
                   s.sum16.data() + r * (in / 16));
    for (int64_t j = 0; j < T * in / 32; ++j) s.sum32[j] = int16_t(s.sum16[2 * j] + s.sum16[2 * j + 1]);
  }
  // The pointers are taken here: a thread_local named inside the task would be each worker's own (empty) one.
  const int8_t* q = s.q.data();
  const float* d = s.d.data();
  const int16_t* sum16 = s.sum16.data();
  const int16_t* sum32 = s.sum32.data();
  auto act = [&](int64_t r) -> ActRow {
    if (k.group == 0) return {x + r * in, nullptr, nullptr, nullptr, nullptr};
    return {x + r * in, q + r * in, d + r * (in / k.group), sum16 + r * (in / 16), sum32 + r * (in / 32)};
  };

  for_row_tiles(T, out, n_threads, [&](int64_t r, int64_t r0, int64_t r1) {
    const ActRow a = act(r);
    float* yr = y + r * out;
    for (int64_t o = r0; o < r1; ++o) yr[o] = dot(w + o * row_bytes, a, in) + (bias ? bias[o] : 0.f);
  });
}

}  // namespace ktq
