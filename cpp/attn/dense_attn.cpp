// Dense decode attention over fp32 rows (dense_attn.h).
#include "attn/dense_attn.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/attn_kernels.h"
#include "attn/merge.h"
#include "common/cpu_features.h"
#include "common/thread_pool.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kDenseTile = 64;            // rows per attend_tile call
constexpr int64_t kTaskRows = 512;        // split-K: at least this many rows per task
constexpr int64_t kMaxTasksPerHead = 16;  // ... and at most this many tasks per KV head
// Threads only from this many bytes read on (below it a wake-up costs more than it saves).
constexpr int64_t kParallelBytes = 512 << 10;

}  // namespace

void dense_decode_attention(const float* q, int H, int KVH, int D, const float* k, const float* v,
                            int64_t head_stride, int64_t n, float scale, float* out, float* lse, int n_threads,
                            int64_t skip0, int64_t skip1) {
  const int G = H / KVH;
  // q scaled once: attend_tile takes q * scale.  qs: [H, D]
  std::vector<float> qs(size_t(H) * D);
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q[i] * scale;
  // The rows to read as (up to) two segments, each cut into tasks of whole tiles: [0, skip0), [skip1, n).
  if (skip1 <= skip0) skip0 = skip1 = n;
  const int64_t seg[2][2] = {{0, std::min(skip0, n)}, {std::min(skip1, n), n}};
  const int64_t n_rows = seg[0][1] - seg[0][0] + seg[1][1] - seg[1][0];
  const int64_t tiles_max = (n_rows + kDenseTile - 1) / kDenseTile;
  // As many tasks per head as kTaskRows and kMaxTasksPerHead call for, the tiles spread evenly over them:
  // 528 window rows are 5 + 4 tiles, not 8 + 1 (a task of 16 rows beside ones of 512 leaves a thread idle).
  const int64_t min_tiles = std::max((kTaskRows + kDenseTile - 1) / kDenseTile,
                                     (tiles_max + kMaxTasksPerHead - 1) / kMaxTasksPerHead);
  const int64_t n_split = std::max<int64_t>(1, (tiles_max + min_tiles - 1) / min_tiles);
  const int64_t tiles_per_task = std::max<int64_t>(1, (tiles_max + n_split - 1) / n_split);
  const int64_t rows_per_task = tiles_per_task * kDenseTile;
  std::vector<int64_t> task_row0;  // first row of each task of one head (the same for every head)
  std::vector<int64_t> task_row1;
  for (const auto& sg : seg)
    for (int64_t r = sg[0]; r < sg[1]; r += rows_per_task) {
      task_row0.push_back(r);
      task_row1.push_back(std::min(sg[1], r + rows_per_task));
    }
  const int64_t tasks_per_head = int64_t(task_row0.size());
  std::vector<int64_t> tstart(KVH + 1);
  for (int h = 0; h <= KVH; ++h) tstart[h] = h * tasks_per_head;
  const size_t pstride = size_t(G) * (D + 2);  // partial: m [G], l [G], acc [G, D]
  std::vector<float> part(size_t(KVH * tasks_per_head) * pstride);
  const bool simd = use_avx2() && D % 8 == 0;
  const size_t row_bytes = size_t(D) * sizeof(float);
  const int threads = int64_t(KVH) * n_rows * int64_t(row_bytes) * 2 >= kParallelBytes ? n_threads : 1;
  ThreadPool::global().parallel_for(KVH * tasks_per_head, threads, [&](int64_t task) {
    const int h = int(task / tasks_per_head);
    const int64_t r0 = task_row0[task % tasks_per_head], r1 = task_row1[task % tasks_per_head];
    float* m = part.data() + task * pstride;
    float* l = m + G;
    float* acc = l + G;
    std::fill(m, m + G, kNegInf);
    std::fill(l, l + G + size_t(G) * D, 0.f);
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(G) * kDenseTile + D);
    const auto* kh = reinterpret_cast<const uint8_t*>(k + h * head_stride);
    const auto* vh = reinterpret_cast<const uint8_t*>(v + h * head_stride);
    const float* qh = qs.data() + size_t(h) * G * D;
    for (int64_t r = r0; r < r1; r += kDenseTile) {
      const int rows = int(std::min<int64_t>(kDenseTile, r1 - r));
      const size_t off = size_t(r) * row_bytes, next = off + kDenseTile * row_bytes;
      const uint8_t* nk = r + kDenseTile < r1 ? kh + next : nullptr;
      const uint8_t* nv = r + kDenseTile < r1 ? vh + next : nullptr;
      if (simd) avx2::attend_tile(KVType::FP32, D, G, qh, kh + off, vh + off, 0, rows, scratch.data(), m, l, acc, nk, nv);
      else scalar::attend_tile(KVType::FP32, D, G, qh, kh + off, vh + off, 0, rows, scratch.data(), m, l, acc, nk, nv);
    }
  });
  merge_partials(part.data(), tstart.data(), KVH, G, D, out, lse);
}

}  // namespace ktq
