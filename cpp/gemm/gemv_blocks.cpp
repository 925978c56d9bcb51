// Block GEMV: the kernel tables, the activation quantization and the threaded row split (gemm/gemv_blocks.h).
#include "gemm/gemv_blocks.h"

#include <algorithm>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "gemm/row_tiles.h"
#include "quant/q8_act.h"

namespace ktq {

namespace {

struct Kernels {
  RowDot* scalar;
  RowDot* avx2;
  RowDot* avx2_stream;  // avx2 with the weight prefetch of long rows
  int group;            // values per activation scale (0: the kernels read fp32 x; kX16: int16 x per 32)
  RowDotN* avx2_n = nullptr;  // avx2 (and its streaming twin) on several activation rows at once, where written
  RowDotN* avx2_stream_n = nullptr;
};

// The int16-activation kernels of the 32-value block types (group kX16); {} for the others.
constexpr int kX16 = -32;  // Kernels::group of the x16 kernels: int16 x in groups of 32

Kernels x16_kernels(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: return {scalar_x16::dot_q8_0, avx2_x16::dot_q8_0, avx2_x16::dot_q8_0, kX16,
                               avx2_x16::dot_q8_0_rows, avx2_x16::dot_q8_0_rows};
    case GgmlType::Q4_0: return {scalar_x16::dot_q4_0, avx2_x16::dot_q4_0, avx2_x16::dot_q4_0, kX16,
                               avx2_x16::dot_q4_0_rows, avx2_x16::dot_q4_0_rows};
    case GgmlType::Q4_1: return {scalar_x16::dot_q4_1, avx2_x16::dot_q4_1, avx2_x16::dot_q4_1, kX16,
                               avx2_x16::dot_q4_1_rows, avx2_x16::dot_q4_1_rows};
    case GgmlType::Q5_0: return {scalar_x16::dot_q5_0, avx2_x16::dot_q5_0, avx2_x16::dot_q5_0, kX16,
                               avx2_x16::dot_q5_0_rows, avx2_x16::dot_q5_0_rows};
    case GgmlType::Q5_1: return {scalar_x16::dot_q5_1, avx2_x16::dot_q5_1, avx2_x16::dot_q5_1, kX16,
                               avx2_x16::dot_q5_1_rows, avx2_x16::dot_q5_1_rows};
    default: return {nullptr, nullptr, nullptr, 0, nullptr, nullptr};
  }
}

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
    case GgmlType::Q4_K: return {scalar::dot_q4_k, avx2::dot_q4_k, avx2_stream::dot_q4_k, kQK, avx2::dot_q4_k_rows,
                                 avx2_stream::dot_q4_k_rows};
    case GgmlType::Q5_K: return {scalar::dot_q5_k, avx2::dot_q5_k, avx2_stream::dot_q5_k, kQK, avx2::dot_q5_k_rows,
                                 avx2_stream::dot_q5_k_rows};
    case GgmlType::Q6_K: return {scalar::dot_q6_k, avx2::dot_q6_k, avx2_stream::dot_q6_k, kQK, avx2::dot_q6_k_rows,
                                 avx2_stream::dot_q6_k_rows};
  }
  return {nullptr, nullptr, nullptr, 0};
}

// The quantized activations of the calling thread, grown once: q [T, in], d [T, in / group], sum16 [T, in / 16],
// sum32 [T, in / 32] (int8), or q16 [T, in], d [T, in / 32], isum32 [T, in / 32] (int16).
struct ActScratch {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sum16, sum32, q16;
  std::vector<int32_t> isum32;
};

template <class V>
void grow(V& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
}

}  // namespace

bool gemv_quant_supported(GgmlType t) { return kernels(t).scalar != nullptr; }

namespace {

// x quantized for one activation group (32 or 256, or kX16) into s, grown once.
ActScratch& quantized_act(ActScratch& s, int group, const float* x, int64_t T, int64_t in) {
  if (group == kX16) {
    grow(s.q16, T * in), grow(s.d, T * in / 32), grow(s.isum32, T * in / 32);
    for (int64_t r = 0; r < T; ++r)
      quantize_act16(x + r * in, in, s.q16.data() + r * in, s.d.data() + r * (in / 32), s.isum32.data() + r * (in / 32));
    return s;
  }
  grow(s.q, T * in), grow(s.d, T * in / group), grow(s.sum16, T * in / 16), grow(s.sum32, T * in / 32);
  for (int64_t r = 0; r < T; ++r)
    quantize_act(x + r * in, in, group, s.q.data() + r * in, s.d.data() + r * (in / group),
                 s.sum16.data() + r * (in / 16));
  for (int64_t j = 0; j < T * in / 32; ++j) s.sum32[j] = int16_t(s.sum16[2 * j] + s.sum16[2 * j + 1]);
  return s;
}

// Activation row r of a scratch as the kernels read it.
ActRow act_row(const ActScratch* s, int group, const float* x, int64_t r, int64_t in) {
  ActRow a{x + r * in, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (s == nullptr) return a;
  if (group == kX16) {
    a.q16 = s->q16.data() + r * in;
    a.d16 = s->d.data() + r * (in / 32);
    a.isum32 = s->isum32.data() + r * (in / 32);
    return a;
  }
  a.q = s->q.data() + r * in;
  a.d = s->d.data() + r * (in / group);
  a.sum16 = s->sum16.data() + r * (in / 16);
  a.sum32 = s->sum32.data() + r * (in / 32);
  return a;
}

// One part as the row loop reads it: its first row, its kernel and where its activation rows are.
struct PartPlan {
  const uint8_t* w;
  int64_t row0, row1, row_bytes;
  RowDot* dot;
  const ActScratch* act;  // nullptr: fp32 x
  int group;
  RowDotN* dot_n;  // several activation rows at once (nullptr: none; the scalar twins loop over dot)
};

// m's parts as the row loop reads them, its rows starting at row `row`; x quantized once per group the parts need
// into scratch[0] (32 values), [1] (256) or [2] (int16), before the threads start.
void plan_parts(const QuantMatrix& m, const float* x, int64_t T, int64_t row, ActScratch* scratch, bool use_avx,
                std::vector<PartPlan>& plan) {
  const int64_t in = m.in;
  const ActScratch* acts[3] = {nullptr, nullptr, nullptr};
  for (const QuantPart& p : m.parts) {
    const Kernels k16 = m.x16 ? x16_kernels(p.type) : Kernels{nullptr, nullptr, nullptr, 0};
    const Kernels k = k16.scalar ? k16 : kernels(p.type);
    const int slot = k.group == kX16 ? 2 : k.group == kQK ? 1 : 0;
    if (k.group != 0 && acts[slot] == nullptr) acts[slot] = &quantized_act(scratch[slot], k.group, x, T, in);
    RowDot* dot = !use_avx ? k.scalar : in >= kGemvStreamIn ? k.avx2_stream : k.avx2;
    RowDotN* dot_n = !use_avx ? nullptr : in >= kGemvStreamIn ? k.avx2_stream_n : k.avx2_n;
    plan.push_back({p.w, row, row + p.rows, ggml_row_bytes(p.type, in), dot, k.group != 0 ? acts[slot] : nullptr,
                    k.group, dot_n});
    row += p.rows;
  }
}

}  // namespace

void gemv_matrix(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads) {
  const int64_t in = m.in, out = m.out;
  thread_local ActScratch scratch[3];
  std::vector<PartPlan> plan;
  plan.reserve(m.parts.size());
  plan_parts(m, x, T, 0, scratch, use_avx2(), plan);
  // The pointers are taken above: a thread_local named inside the task would be each worker's own (empty) one.
  if (T > 1 && std::any_of(plan.begin(), plan.end(), [](const PartPlan& p) { return p.dot_n != nullptr; })) {
    // Several tokens (batched decode): a part with a many-row kernel reads each weight row once for up to
    // kDotTokens of them; the others loop over the tokens. Every output is what the one-token kernel gives.
    for_row_tiles(1, out, n_threads, [&](int64_t, int64_t r0, int64_t r1) {
      for (const PartPlan& p : plan) {
        const int64_t a0 = std::max(r0, p.row0), a1 = std::min(r1, p.row1);
        if (a0 >= a1) continue;
        for (int64_t t0 = 0; t0 < T; t0 += kDotTokens) {
          const int n = int(std::min<int64_t>(kDotTokens, T - t0));
          ActRow acts[kDotTokens];
          for (int k = 0; k < n; ++k) acts[k] = act_row(p.act, p.group, x, t0 + k, in);
          for (int64_t o = a0; o < a1; ++o) {
            const uint8_t* w = p.w + (o - p.row0) * p.row_bytes;
            const float b = m.bias ? m.bias[o] : 0.f;
            float v[kDotTokens];
            if (p.dot_n != nullptr) {
              p.dot_n(w, acts, n, in, v);
            } else {
              for (int k = 0; k < n; ++k) v[k] = p.dot(w, acts[k], in);
            }
            for (int k = 0; k < n; ++k) y[(t0 + k) * out + o] = v[k] + b;
          }
        }
      }
    });
    return;
  }
  for_row_tiles(T, out, n_threads, [&](int64_t r, int64_t r0, int64_t r1) {
    float* yr = y + r * out;
    for (const PartPlan& p : plan) {
      const int64_t a0 = std::max(r0, p.row0), a1 = std::min(r1, p.row1);
      if (a0 >= a1) continue;
      const ActRow a = act_row(p.act, p.group, x, r, in);
      for (int64_t o = a0; o < a1; ++o)
        yr[o] = p.dot(p.w + (o - p.row0) * p.row_bytes, a, in) + (m.bias ? m.bias[o] : 0.f);
    }
  });
}

void gemv_jobs(const GemvJob* jobs, int n_jobs, int n_threads) {
  // Every job's rows one after the other, [0, rows): one threaded pass over them all, each job's x quantized
  // once (its own scratch) before the threads start.
  thread_local std::vector<ActScratch> scratch;
  if (int64_t(scratch.size()) < 3 * int64_t(n_jobs)) scratch.resize(size_t(3) * n_jobs);
  thread_local std::vector<PartPlan> plan;
  thread_local std::vector<int64_t> first_part;  // [n_jobs + 1]: job j's parts are plan[first_part[j], first_part[j + 1])
  plan.clear();
  first_part.assign(1, 0);
  const bool use_avx = use_avx2();
  int64_t rows = 0;
  for (int j = 0; j < n_jobs; ++j) {
    plan_parts(*jobs[j].m, jobs[j].x, 1, rows, &scratch[size_t(3) * j], use_avx, plan);
    first_part.push_back(int64_t(plan.size()));
    rows += jobs[j].m->out;
  }
  const PartPlan* parts = plan.data();
  const int64_t* firsts = first_part.data();
  for_row_tiles(1, rows, n_threads, [&](int64_t, int64_t r0, int64_t r1) {
    for (int j = 0; j < n_jobs; ++j) {
      const GemvJob& job = jobs[j];
      for (int64_t i = firsts[j]; i < firsts[j + 1]; ++i) {
        const PartPlan& p = parts[i];
        const int64_t a0 = std::max(r0, p.row0), a1 = std::min(r1, p.row1);
        if (a0 >= a1) continue;
        const ActRow a = act_row(p.act, p.group, job.x, 0, job.m->in);
        const int64_t base = parts[firsts[j]].row0;  // the job's first row: y's row 0
        for (int64_t o = a0; o < a1; ++o)
          job.y[o - base] = p.dot(p.w + (o - p.row0) * p.row_bytes, a, job.m->in) +
                            (job.m->bias ? job.m->bias[o - base] : 0.f);
      }
    }
  });
}

void dequantize_matrix_rows(const QuantMatrix& m, int64_t r0, int64_t r1, float* out, int n_threads,
                            const int32_t* order) {
  const int64_t n = r1 - r0, in = m.in;
  struct Row {
    GgmlType type;
    const uint8_t* w;
  };
  auto row = [&](int64_t o) -> Row {  // matrix row o: its part's type and bytes
    for (const QuantPart& p : m.parts) {
      if (o < p.rows) return {p.type, p.w + o * ggml_row_bytes(p.type, in)};
      o -= p.rows;
    }
    return {GgmlType::F32, nullptr};  // not reached: o < m.out
  };
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(n_threads, n / 8));
  ThreadPool::global().parallel_for(n_tasks, n_threads, [&](int64_t c) {
    for (int64_t i = n * c / n_tasks; i < n * (c + 1) / n_tasks; ++i) {
      const Row r = row(order ? order[r0 + i] : r0 + i);
      dequantize_row(r.type, r.w, in, out + i * in);
    }
  });
}

void gemv_quant(GgmlType t, const float* x, int64_t T, int64_t in, const uint8_t* w, int64_t out,
                const float* bias, float* y, int n_threads) {
  QuantMatrix m;
  m.parts.push_back({t, w, out});
  m.bias = bias;
  m.out = out;
  m.in = in;
  gemv_matrix(m, x, T, y, n_threads);
}

}  // namespace ktq
