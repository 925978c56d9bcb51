// Sparse attention over the store's selected blocks (sparse_attn.h).
#include "kvstore/sparse_attn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "attn/attn_kernels.h"
#include "attn/merge.h"
#include "common/cpu_features.h"
#include "common/scratch.h"
#include "common/thread_pool.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunkTokens = 256;        // split-K: at least this many tokens per attention task. Each
                                             // task starts on a cold block, but a 1K budget over 3 KV heads
                                             // must be 4 chunks a head to share 2 threads evenly (3 tasks
                                             // leave one thread idle a third of the time)
constexpr int64_t kMaxChunksPerHead = 64;    // ... and at most this many tasks per KV head
constexpr int64_t kPartialBytes = 16 << 20;  // ... and fewer where their partials (m, l, acc) would pass
constexpr int64_t kMinChunksPerHead = 16;    // this many bytes (in L3: a long prefill's chunks would write
                                             // and merge tens of MB), but never fewer than this many (16
                                             // threads)
constexpr int64_t kRunRows = 64;             // consecutive selected blocks of up to this many rows share one
                                             // softmax update (attend_tiles)

}  // namespace

void SparseAttention::set_query(const float* q, int H, const QueryVariants& var) {
  const int D = lay_.cfg.head_dim;
  var_ = var;
  qs_.resize(size_t(var.n) * H * D);
  const float scale = 1.f / std::sqrt(float(D));
  for (int64_t i = 0; i < int64_t(var.n) * H * D; ++i) qs_[i] = q[i] * scale;
}

void SparseAttention::run(const StoreLayer& L, int H, const BlockSets& bsets, bool validate, float* out, float* lse,
                          StageTiming& t, const Prologue* pre, const CandCaches* caches, const CandCache* kvc,
                          float* block_lse) {
  const auto t0 = Clock::now();
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, G = H / KVH, bs = lay_.cfg.block_size;
  const int64_t nb = lay_.n_blocks(L);
  auto row_of = [&](int h) { return bsets.ids + int64_t(bsets.n_sets == 1 ? 0 : h) * bsets.cols; };
  // Valid ids of a row: strictly ascending in [0, nb), then -1 padding only.
  std::vector<int64_t>& count = count_;  // count[h]: valid ids of head h
  count.assign(KVH, 0);
  int64_t cmax = 0;
  for (int h = 0; h < KVH; ++h) {
    const int32_t* row = row_of(h);
    int64_t c = 0;
    if (pre) c = pre->count[h];  // the rows are written by the prologue, in this call
    else
      while (c < bsets.cols && row[c] != -1) ++c;
    if (validate && (bsets.n_sets == 1 ? h == 0 : true))
      for (int64_t i = 0; i < bsets.cols; ++i) {
        if (i >= c && row[i] != -1)
          throw std::invalid_argument("block ids: -1 padding must come last (set " + std::to_string(h) + ")");
        if (i < c && (row[i] < 0 || row[i] >= nb))
          throw std::out_of_range("block id " + std::to_string(row[i]) + " is out of range: the layer has " +
                                  std::to_string(nb) + " blocks");
        if (i < c && i > 0 && row[i] <= row[i - 1])
          throw std::invalid_argument("block ids must be strictly ascending (sorted, no duplicates) per KV head, got " +
                                      std::to_string(row[i - 1]) + " then " + std::to_string(row[i]));
      }
    count[h] = c;
    cmax = std::max(cmax, c);
  }
  if (block_lse) std::fill(block_lse, block_lse + size_t(KVH) * bsets.cols * G, kNegInf);
  int64_t n_sel = 0;
  for (int h = 0; h < KVH; ++h) n_sel += count[h];
  int threads = n_sel * int64_t(lay_.tile_bytes) * 2 >= kParallelBytes ? lay_.cfg.threads_num : 1;
  const int n_pre = pre ? pre->n : 0;
  if (pre) threads = std::max(threads, pre->threads);
  // ready[s]: the prologue's set s is done (its ids are in bsets). Claimed in order, every prologue task
  // is running or done before an attention task is claimed, so a wait is at most one set's work.
  std::unique_ptr<std::atomic<int>[]> ready(n_pre ? new std::atomic<int>[n_pre] : nullptr);
  for (int s = 0; s < n_pre; ++s) ready[s].store(0, std::memory_order_relaxed);
  // Split-K: each head's blocks in chunks of cb; cb depends on the selection and the query shape only (so
  // any thread count gives the same bits). A task's partial is G (D + 2) floats: bytes in decode, but a
  // prefill chunk presents its T*G queries as the "heads", and then 64 tasks a head would write and merge
  // tens of MB per call, more as the context grows. So the partials are also capped by kPartialBytes.
  const size_t pstride = size_t(G) * (D + 2);  // partial: m [G], l [G], acc [G, D]
  const int64_t per_head = std::clamp<int64_t>(kPartialBytes / int64_t(pstride * sizeof(float) * KVH),
                                               kMinChunksPerHead, kMaxChunksPerHead);
  const int64_t cb = std::max((kChunkTokens + bs - 1) / bs, (cmax + per_head - 1) / per_head);
  std::vector<int64_t>& tstart = task_start_;  // tasks of head h: [tstart[h], tstart[h + 1])
  tstart.assign(KVH + 1, 0);
  for (int h = 0; h < KVH; ++h) tstart[h + 1] = tstart[h] + (count[h] + cb - 1) / cb;
  const int64_t n_tasks = tstart[KVH];
  part_.resize(n_tasks * pstride);
  const bool simd = use_avx2() && D % 8 == 0;
  const KVType kt = lay_.cfg.kv_type;
  const int64_t per_run = std::clamp<int64_t>(kRunRows / bs, 1, kMaxTiles);  // blocks per softmax update
  auto set_ready = [&](int h) { return !n_pre || ready[bsets.n_sets == 1 ? 0 : h].load(std::memory_order_acquire); };
  // Attention task -> its KV head and its range [j0, j1) of that head's selected blocks.
  struct Span {
    int h;
    int64_t j0, j1;
  };
  auto span_of = [&](int64_t task) {
    const int h = int(std::upper_bound(tstart.begin(), tstart.end(), task) - tstart.begin()) - 1;
    const int64_t j0 = (task - tstart[h]) * cb;
    return Span{h, j0, std::min(count[h], j0 + cb)};
  };
  // Tiles [a, a + per_run) of head h's selected blocks, ending at j1 and, with dual chunk attention, at the
  // first block of another query rotation; returns the run's rotation (the query it is attended with).
  // Cached candidates: their tiles are read from the cache's copy (always full blocks), at the slots.
  auto fill = [&](Tiles& t, int h, int64_t a, int64_t j1) {
    const int64_t set = bsets.n_sets == 1 ? 0 : h;
    const int32_t* row = row_of(h);
    const int32_t* slot = kvc ? caches->slots() + set * bsets.cols : nullptr;
    const int jh = kvc && kvc->mode == HeadMode::SHARED ? h : 0;
    const int v = a < j1 ? var_.of(row[a]) : 0;
    const int64_t v_end = a < j1 ? var_.end_of(row[a]) : 0;
    t.count = 0;
    for (int64_t j = a; j < std::min(j1, a + per_run) && row[j] < v_end; ++j, ++t.count) {
      const int64_t b = row[j];
      t.k[t.count] = kvc ? caches->tile(*kvc, int(set), jh, slot[j]) : lay_.k_tile(L, h, b);
      t.v[t.count] = t.k[t.count] + lay_.tile_bytes;
      t.n[t.count] = b == nb - 1 ? int(L.len - b * bs) : bs;  // the last block may be partial
    }
    return v;
  };
  // Tasks are claimed in order from one counter (prologue sets first), each thread running a loop of
  // claims. A thread claims its next task while it computes the last run of the current one, so that
  // task's first run streams in alongside (attend_tiles prefetches the "next" tiles it is given): without
  // this, every task would start on a cold run. Task boundaries and partials are those of the task index,
  // whichever thread runs it, so the bits do not depend on the threads. (A descheduled thread now holds
  // up the call with at most two tasks: the one it runs and the one it claimed next.)
  std::atomic<int64_t> claim{0};
  const int64_t n_all = n_pre + n_tasks;
  // Runs attention task `task`; returns the task claimed next, and in *warm whether its first run was
  // requested.
  auto attend_task = [&](int64_t task, bool* warm) -> int64_t {
    const auto [h, j0, j1] = span_of(task);
    for (int spins = 0; !set_ready(h); ++spins) {
      if (spins < 64) cpu_pause();
      else std::this_thread::yield();  // the set's thread may share this core: let it finish
    }
    float* m = part_.data() + task * pstride;
    float* l = m + G;
    float* acc = l + G;
    std::fill(m, m + G, kNegInf);
    std::fill(l, l + G + size_t(G) * D, 0.f);
    float* s = thread_scratch(size_t(G) * ((per_run * bs + 7) & ~7) + D);
    auto q_of = [&](int v) { return qs_.data() + (size_t(v) * H + size_t(h) * G) * D; };
    Tiles cur, nxt;
    int vc = fill(cur, h, j0, j1), vn = 0;
    if (!*warm)  // the first run is requested up front, unless the previous task already did
      for (int i = 0; i < cur.count; ++i) {
        prefetch_l2(cur.k[i], lay_.tile_bytes);
        prefetch_l2(cur.v[i], lay_.tile_bytes);
      }
    int64_t following = -1;
    *warm = false;
    for (int64_t j = j0; j < j1;) {
      const int64_t jn = j + cur.count;
      vn = fill(nxt, h, jn, j1);
      if (!nxt.count) {  // the last run: claim the next task, stream its first run in (if its ids are known)
        following = claim.fetch_add(1, std::memory_order_relaxed);
        if (following >= n_pre && following < n_all) {
          const Span f = span_of(following - n_pre);
          if (set_ready(f.h)) {
            fill(nxt, f.h, f.j0, f.j1);
            *warm = true;
          }
        }
      }
      float* tl = block_lse ? block_lse + (size_t(h) * bsets.cols + j) * G : nullptr;
      const float* q = q_of(vc);
      if (simd) avx2::attend_tiles(kt, D, G, q, cur, lay_.scale_off, s, m, l, acc, nxt.count ? &nxt : nullptr, tl);
      else scalar::attend_tiles(kt, D, G, q, cur, lay_.scale_off, s, m, l, acc, nxt.count ? &nxt : nullptr, tl);
      cur = nxt;  // (past the last run: the next task's first one, only streamed in)
      vc = vn;
      j = jn;
    }
    if (following < 0) following = claim.fetch_add(1, std::memory_order_relaxed);  // an empty task
    return following;
  };
  ThreadPool::global().parallel_for(std::min<int64_t>(threads, n_all), threads, [&](int64_t) {
    int64_t task = claim.fetch_add(1, std::memory_order_relaxed);
    bool warm = false;
    while (task < n_all) {
      if (task < n_pre) {
        pre->run(pre->ctx, int(task));
        ready[task].store(1, std::memory_order_release);
        task = claim.fetch_add(1, std::memory_order_relaxed);
        warm = false;
        continue;
      }
      task = attend_task(task - n_pre, &warm);
    }
  });
  merge_partials(part_.data(), tstart.data(), KVH, G, D, out, lse);  // in chunk order
  t.attend_s = seconds_since(t0);
}

}  // namespace ktq
