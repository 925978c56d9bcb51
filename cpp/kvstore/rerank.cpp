// The store's second stage of selection (rerank.h).
#include "kvstore/rerank.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>

#include "attn/attn_kernels.h"
#include "common/cpu_features.h"
#include "common/scratch.h"
#include "common/thread_pool.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunkBlocks = 32;  // candidates per task (a fixed split: thread-count independent)
constexpr int64_t kRunRows = 64;      // consecutive candidates of up to this many rows share one kernel call

}  // namespace

const SelectRequest& MassRerank::widen(const SelectRequest& req, int n_sets, int R) {
  wide_k_.resize(n_sets);
  for (int s = 0; s < n_sets; ++s)
    wide_k_[s] = int32_t(std::min<int64_t>(int64_t(req.k_per_set[s]) * R, INT32_MAX));  // (k < 0: check_k says so)
  wide_req_ = req;
  wide_req_.k_per_set = wide_k_.data();
  return wide_req_;
}

int MassRerank::wide_cols(int out_cols, int R, int64_t nb) {
  return int(std::max<int64_t>(out_cols, std::min<int64_t>(int64_t(out_cols) * R, nb)));
}

void MassRerank::set_query(const float* q, int H, const QueryVariants& var) {
  const int D = lay_.cfg.head_dim;
  var_ = var;
  qs_.resize(size_t(var.n) * H * D);
  const float scale = 1.f / std::sqrt(float(D));
  for (int64_t i = 0; i < int64_t(var.n) * H * D; ++i) qs_[i] = q[i] * scale;
}

void MassRerank::run(const StoreLayer& L, int H, const SelectRequest& req, int n_sets, const int32_t* wide,
                     int wide_cols, int32_t* out_ids, int out_cols, StageTiming& t, const CandCaches* caches,
                     const CandCache* kvc) {
  const auto t0 = Clock::now();
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, G = H / KVH, bs = lay_.cfg.block_size;
  const int hps = n_sets == 1 ? H : G;  // query heads per set
  const int64_t nb = lay_.n_blocks(L);
  count_.assign(n_sets, 0);
  int64_t n_picks = 0;
  for (int s = 0; s < n_sets; ++s) {
    const int32_t* row = wide + int64_t(s) * wide_cols;
    while (count_[s] < wide_cols && row[count_[s]] >= 0) ++count_[s];
    n_picks += count_[s];
  }
  // 1. Every pick's LSE per query head: tasks of kChunkBlocks picks of one KV head (SHARED: each KV head reads
  //    the one set's picks).
  lse_.resize(size_t(n_sets) * wide_cols * hps);
  std::vector<int64_t>& tstart = task_start_;
  tstart.assign(KVH + 1, 0);
  for (int h = 0; h < KVH; ++h) tstart[h + 1] = tstart[h] + (count_[n_sets == 1 ? 0 : h] + kChunkBlocks - 1) / kChunkBlocks;
  const int64_t n_tasks = tstart[KVH];
  const int64_t per_run = std::clamp<int64_t>(kRunRows / bs, 1, kMaxTiles);
  const bool simd = use_avx2() && D % 8 == 0;
  const KVType kt = lay_.cfg.kv_type;
  const int64_t reads = (n_sets == 1 ? KVH : 1) * n_picks * int64_t(lay_.tile_bytes);
  const int threads = reads >= kParallelBytes ? lay_.cfg.threads_num : 1;
  ThreadPool::global().parallel_for(n_tasks, threads, [&](int64_t task) {
    const int h = int(std::upper_bound(tstart.begin(), tstart.end(), task) - tstart.begin()) - 1;
    const int s = n_sets == 1 ? 0 : h;
    const int32_t* row = wide + int64_t(s) * wide_cols;
    const int64_t j0 = (task - tstart[h]) * kChunkBlocks, j1 = std::min(count_[s], j0 + kChunkBlocks);
    float* scratch = thread_scratch(size_t(G) * ((per_run * bs + 7) & ~7) + D + size_t(kMaxTiles) * G);
    float* tl = scratch + size_t(G) * ((per_run * bs + 7) & ~7) + D;  // [run tiles, G]
    // A run: consecutive picks (any ids) from j, of one query rotation, up to per_run of them; returns the rotation.
    auto fill = [&](Tiles& run, int64_t j) {
      run.count = 0;
      if (j >= j1) return 0;
      const int64_t v_end = var_.end_of(row[j]);
      const int32_t* cand = kvc ? kvc->ids.data() + s * kvc->stride : nullptr;  // (ascending)
      for (int64_t i = j; i < j1 && run.count < per_run && row[i] < v_end; ++i) {
        const int64_t b = row[i];
        run.k[run.count] = kvc ? caches->tile(*kvc, s, kvc->mode == HeadMode::SHARED ? h : 0,
                                              std::lower_bound(cand, cand + kvc->count[s], row[i]) - cand)
                               : lay_.k_tile(L, h, b);
        run.v[run.count] = nullptr;
        run.n[run.count++] = b == nb - 1 ? int(L.len - b * bs) : bs;  // the last block may be partial
      }
      return var_.of(row[j]);
    };
    Tiles cur, nxt;
    int vc = fill(cur, j0);
    for (int i = 0; i < cur.count; ++i) prefetch_l2(cur.k[i], lay_.tile_bytes);  // (the next runs: by the kernel)
    for (int64_t j = j0; j < j1;) {
      const int vn = fill(nxt, j + cur.count);
      const float* q = qs_.data() + (size_t(vc) * H + size_t(h) * G) * D;
      const Tiles* pf = nxt.count ? &nxt : nullptr;
      if (simd) avx2::tiles_lse(kt, D, G, q, cur, lay_.scale_off, scratch, tl, pf);
      else scalar::tiles_lse(kt, D, G, q, cur, lay_.scale_off, scratch, tl, pf);
      for (int i = 0; i < cur.count; ++i)
        std::copy(tl + size_t(i) * G, tl + size_t(i + 1) * G,
                  lse_.data() + (size_t(s) * wide_cols + j + i) * hps + (n_sets == 1 ? h * G : 0));
      j += cur.count;
      cur = nxt;
      vc = vn;
    }
  });
  // 2. Each set's masses: per query head, its shares over the set's picks, summed over the set's heads.
  order_.resize(size_t(n_sets) * wide_cols);
  ThreadPool::global().parallel_for(n_sets, std::min(threads, n_sets), [&](int64_t s) {
    const int64_t c = count_[s];
    auto* ord = order_.data() + s * wide_cols;
    float* ls = lse_.data() + size_t(s) * wide_cols * hps;  // [c, hps]: each pick's LSE, then its exp share
    float* m = thread_scratch(2 * size_t(hps));             // per head: the largest LSE, then 1 / sum
    float* sum = m + hps;
    std::fill(m, m + hps, kNegInf);
    std::fill(sum, sum + hps, 0.f);
    for (int64_t j = 0; j < c; ++j)
      for (int g = 0; g < hps; ++g) m[g] = std::max(m[g], ls[j * hps + g]);
    // (m is finite: a pick's tile has a key. A share past fp32's range counts 0, as in tiles_lse: so every pick
    // that far below the heaviest weighs 0, whichever run it was scored in, and ties go to the lower id.)
    for (int64_t j = 0; j < c; ++j)
      for (int g = 0; g < hps; ++g) {
        const float x = ls[j * hps + g] - m[g];
        sum[g] += (ls[j * hps + g] = x < -87.33654f ? 0.f : std::exp(x));
      }
    for (int g = 0; g < hps; ++g) m[g] = 1.f / sum[g];
    for (int64_t j = 0; j < c; ++j) {
      float w = 0.f;
      for (int g = 0; g < hps; ++g) w += ls[j * hps + g] * m[g];
      ord[j] = {double(w), wide[s * wide_cols + j]};
    }
  });
  mass_.resize(order_.size());
  for (int s = 0; s < n_sets; ++s)
    for (int64_t j = 0; j < count_[s]; ++j) mass_[s * wide_cols + j] = order_[s * wide_cols + j].first;
  wide_ = wide, wide_cols_ = wide_cols;
  // 3. How many each set keeps: its k (at most its picks), or with Ada-KV the split of their sum by mass.
  const int32_t* keep = req.k_per_set;
  if (req.ada) {
    ada_.scores.clear();
    ada_.counts.assign(count_.begin(), count_.end());
    for (int s = 0; s < n_sets; ++s)
      for (int64_t j = 0; j < count_[s]; ++j) ada_.scores.push_back(float(order_[s * wide_cols + j].first));
    keep = ada_.split(req);
  }
  for (int s = 0; s < n_sets; ++s) {
    auto* ord = order_.data() + s * wide_cols;
    const int64_t k = std::min<int64_t>({keep[s], count_[s], out_cols});
    std::partial_sort(ord, ord + k, ord + count_[s], [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    int32_t* out = out_ids + int64_t(s) * out_cols;
    for (int64_t j = 0; j < k; ++j) out[j] = ord[j].second;
    std::sort(out, out + k);
    std::fill(out + k, out + out_cols, -1);
  }
  t.rerank_s = seconds_since(t0);
}

double MassRerank::mass_of(int s, int32_t b) const {
  const int32_t* row = wide_ + int64_t(s) * wide_cols_;
  const int32_t* at = std::lower_bound(row, row + count_[s], b);
  return at != row + count_[s] && *at == b ? mass_[s * int64_t(wide_cols_) + (at - row)]
                                           : -std::numeric_limits<double>::infinity();
}

}  // namespace ktq
