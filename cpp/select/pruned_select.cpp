// Block selection through the hierarchical index (selector.h, index/group_bounds.h): every group's bound,
// then per set a walk that scores a group's candidate blocks only while its bound can still reach the k-th
// best score: first in descending bound (a few k blocks: the k-th score of the best groups, or the whole
// answer), then the remaining groups in memory order, skipping each whose bound is below the k-th score
// known. The picks equal the flat scan's (select_runs).
//
// Exactness. A group's fp32 bound B and magnitude T (index/bound_kernels.h) become a bound of every fp32
// score the flat path computes for its blocks: B + c * T + e in fp64, where c covers the relative rounding
// of that score, of B and of the query's fold (each a sum of at most n_terms products: |fl(sum) - sum| <=
// n u sum |terms| <= n u T, u = 2^-24, doubled for slack) and e the absolute error of subnormal products.
// A T that is not below 2^100 (an overflow, an empty group's +-inf rows) gives no bound: +inf, visited.
// A group is skipped only when its bound is *strictly* below the k-th best score of k blocks already scored
// (the set's, or a chunk's own): each of its blocks is then strictly worse than k blocks, so it is in no top
// k, whatever the tie rule (a group whose bound equals that score is visited: its blocks could tie and win on
// a lower id). Every block of the top k is thus scored and kept by the heap of its phase or chunk (the best k
// under the flat path's strict order: higher score, then the lower id; NaN as -inf), and the merge of those
// heaps keeps the same k, ascending as the flat path writes them.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/cpu_features.h"
#include "common/scratch.h"
#include "common/thread_pool.h"
#include "index/bound_kernels.h"
#include "select/selector.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kBoundGroupsPerTask = 512;  // bound task: this many groups of one KV head
constexpr double kNoBoundMag = 0x1p100;       // T from here on (or NaN): no bound
constexpr int64_t kParallelWalk = 512;        // sets walk on threads from this many candidates on (as top-k)
constexpr int64_t kSeedBlocks = 4;            // phase 1 scores this many times k blocks (then phase 2)
constexpr int64_t kWalkBlocksPerTask = 1 << 16;  // phase 2 task: the groups of this many blocks of one set
constexpr size_t kJumpPrefetch = 2048;        // phase 2: bytes of a group after a gap requested ahead
constexpr int64_t kJumpsAhead = 4;            // phase 2: groups after a gap requested ahead
constexpr int64_t kRunBlocks = 256;           // phase 2: adjacent groups scored in one pass, up to these blocks

struct HeapLess {  // select_runs' order: a better block (higher score, then the lower id) sorts below
  bool operator()(const BlockSelector::Cand& a, const BlockSelector::Cand& b) const {
    return a.score > b.score || (a.score == b.score && a.id < b.id);
  }
};

// A k-heap over h[0, k): the best k offered under HeapLess, h[0] the worst kept (a functor, not a function
// pointer: the heap's sifts inline their comparisons).
struct TopK {
  BlockSelector::Cand* h;
  int64_t n, k;
  float floor = -std::numeric_limits<float>::infinity();  // a score strictly below it is in no top k
  bool full() const { return n == k; }
  double kth() const { return h[0].score; }
  void offer(const BlockSelector::Cand& c) {
    if (n == k) {  // full: every kept block is >= floor, so the k-th alone decides (a predictable branch)
      if (k > 0 && HeapLess()(c, h[0])) {
        std::pop_heap(h, h + n, HeapLess());
        h[n - 1] = c;
        std::push_heap(h, h + n, HeapLess());
      }
    } else if (!(c.score < floor)) {
      h[n++] = c;
      std::push_heap(h, h + n, HeapLess());
    }
  }
};

struct GroupFirst {  // phase 1's visiting order: the greater bound first, then the lower group
  bool operator()(const std::pair<double, int32_t>& a, const std::pair<double, int32_t>& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};

}  // namespace

void BlockSelector::group_bounds(const StoreLayer& L, int H, HeadMode mode, double* out) {
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, qg = H / KVH, V = var_.n;
  const int64_t ng = lay_.n_groups(lay_.n_blocks(L)), G = lay_.cfg.index_group;
  // With dual chunk attention a group's bound is the greatest of the rotations its blocks are scored by
  // (each rotation's bound is at least its blocks' scores), so the rotations' bounds [V, KVH, ng] are made
  // first; a group of one rotation takes that rotation's.
  // ---- every (rotation, head, group)'s fp32 bound and magnitude: fixed tasks of kBoundGroupsPerTask groups ----
  gbound_.resize(size_t(V) * KVH * ng);
  gmag_.resize(size_t(V) * KVH * ng);
  const int64_t tasks_per_head = (ng + kBoundGroupsPerTask - 1) / kBoundGroupsPerTask;
  const int64_t bytes = int64_t(KVH) * ng * 2 * D * 2;
  const bool simd = use_avx2() && D % 8 == 0;
  ThreadPool::global().parallel_for(V * KVH * tasks_per_head, bytes >= kParallelBytes ? lay_.cfg.threads_num : 1,
                                    [&](int64_t task) {
    const int vh = int(task / tasks_per_head), h = vh % KVH;
    const int64_t g0 = (task % tasks_per_head) * kBoundGroupsPerTask, n = std::min(kBoundGroupsPerTask, ng - g0);
    const float* qb = qb_.data() + size_t(vh) * 3 * D;
    float *bo = gbound_.data() + vh * ng + g0, *mo = gmag_.data() + vh * ng + g0;
    if (simd) avx2::score_bounds(lay_.bound_at(L, h, g0), n, D, qb, bo, mo);
    else scalar::score_bounds(lay_.bound_at(L, h, g0), n, D, qb, bo, mo);
  });
  // ---- per set: B + c T + e summed over the set's heads, in fp64 ----
  // The margin (see the top): the flat score's terms (A*D, or D per FIXED/DYNAMIC dot plus qg maxima), the
  // bound's 2*D, the query fold's qg, SHARED's sum over KVH heads.
  // QUEST's centre share adds three roundings to each element of the query's fold.
  const int n_terms = lay_.A * D + 3 * D + 2 * qg + KVH + 8 + (lay_.cfg.quest_centre != 0.f ? 3 : 0);
  const double rel = 2.0 * n_terms * 0x1p-24, abs_err = n_terms * 0x1p-140;
  const bool shared = mode == HeadMode::SHARED;
  for (int s = 0; s < (shared ? 1 : KVH); ++s) {
    const int h0 = shared ? 0 : s, h1 = shared ? KVH : s + 1;
    for (int64_t g = 0; g < ng; ++g) {
      double best = -kInf;
      // the rotations of the group's blocks [g G, (g + 1) G): from its first block's, piece by piece
      for (int64_t b = g * G; b < (g + 1) * G; b = var_.end_of(b)) {
        const size_t at = size_t(var_.of(b)) * KVH;
        double bnd = 0;
        for (int h = h0; h < h1 && bnd < kInf; ++h) {
          const double mag = gmag_[(at + h) * ng + g];
          bnd = mag < kNoBoundMag ? bnd + double(gbound_[(at + h) * ng + g]) + rel * mag + abs_err : kInf;
        }
        best = std::isnan(bnd) ? kInf : std::max(best, bnd);
      }
      out[s * ng + g] = best;
    }
  }
}

void BlockSelector::select_pruned(const StoreLayer& L, int H, const SelectRequest& req, int64_t kcap,
                                  int32_t* out_ids, int out_cols, StageTiming& t) {
  const auto t0 = Clock::now();
  const int KVH = lay_.cfg.n_kv_heads;
  const int64_t nb = lay_.n_blocks(L), G = lay_.cfg.index_group, ng = lay_.n_groups(nb);
  const int n_sets = int(runs_.size());
  const bool shared = req.mode == HeadMode::SHARED;
  const int64_t kc = std::max<int64_t>(kcap, 1);  // heap room
  gsets_.resize(size_t(n_sets) * ng);
  group_bounds(L, H, req.mode, gsets_.data());
  const auto t1 = Clock::now();
  t.score_s = std::chrono::duration<double>(t1 - t0).count();

  // Scores the candidate blocks of set s in groups [g0, g1) (runs from the first one that ends after the first
  // block) and offers them to top; returns how many.
  auto visit = [&](int s, int64_t g0, int64_t g1, TopK& top) {
    const Runs& R = runs_[s];
    const int h0 = shared ? 0 : s, h1 = shared ? KVH : s + 1;
    const int64_t b0 = g0 * G, b1 = std::min(nb, g1 * G);
    float* sc = thread_scratch(size_t(b1 - b0));  // [b1 - b0] the blocks' scores
    int64_t scored = 0;
    size_t r = std::upper_bound(R.start.begin(), R.start.end(), int32_t(b0)) - R.start.begin();
    if (r > 0 && R.start[r - 1] + R.len[r - 1] > b0) --r;
    for (; r < R.start.size() && R.start[r] < b1; ++r) {
      const int64_t c0 = std::max<int64_t>(b0, R.start[r]), c1 = std::min<int64_t>(b1, R.start[r] + R.len[r]);
      float* out = sc + (c0 - b0);
      for (int h = h0; h < h1; ++h) score_blocks(L, H, h, c0, c1 - c0, out, h > h0);
      for (int64_t b = c0; b < c1; ++b) top.offer({std::isnan(out[b - c0]) ? kNegInf : out[b - c0], int32_t(b)});
      scored += c1 - c0;
    }
    return scored;
  };

  // ---- phase 1, per set: groups in descending bound until kSeedBlocks x k blocks are scored ----
  // Enough to find a k-th score near the final one (the threshold of phase 2), or the whole answer when
  // the next bound falls strictly below the k-th score first (then the set is done). Only the m best groups
  // are ordered (a partition, then a sort of those): past them phase 2 takes over.
  gorder_.resize(size_t(n_sets) * ng);
  seen_.assign(size_t(n_sets) * ng, 0);
  heap_.resize(size_t(n_sets) * kc);
  set_n_.assign(n_sets, 0);
  set_scored_.assign(n_sets, 0);
  set_done_.assign(n_sets, 1);
  const int walk_threads = n_sets > 1 && stats_.candidates >= kParallelWalk ? lay_.cfg.threads_num : 1;
  ThreadPool::global().parallel_for(n_sets, walk_threads, [&](int64_t s) {
    const int64_t k = std::min<int64_t>(req.k_per_set[s], runs_[s].prefix.back());
    if (k == 0) return;
    const int64_t budget = kSeedBlocks * k + G, m = std::min(ng, 2 * (budget / G) + 8);
    std::pair<double, int32_t>* go = gorder_.data() + s * ng;
    for (int64_t g = 0; g < ng; ++g) go[g] = {gsets_[s * ng + g], int32_t(g)};
    if (m < ng) std::nth_element(go, go + m, go + ng, GroupFirst());  // go[0, m): the m best, unordered
    std::sort(go, go + m, GroupFirst());
    TopK top{heap_.data() + s * kc, 0, k};
    int64_t scored = 0;
    for (int64_t i = 0;; ++i) {
      const bool below = i < m && top.full() && go[i].first < top.kth();  // strictly: no block left can enter
      if (below || i == m || scored >= budget) {  // else phase 2 takes the groups left
        set_done_[s] = below || (i == m && m == ng);
        break;
      }
      seen_[s * ng + go[i].second] = 1;
      scored += visit(int(s), go[i].second, go[i].second + 1, top);
    }
    set_n_[s] = top.n;
    set_scored_[s] = scored;
  });

  // ---- phase 2: the unfinished sets' other groups in ascending order, in fixed chunks ----
  // A chunk keeps its own top k and skips a group whose bound is strictly below the set's phase-1 k-th
  // score or its own k-th: each skipped block is strictly worse than k blocks of the set, so the union of
  // phase 1's and the chunks' top k holds the set's top k. Chunks depend on the problem only (determinism).
  // Few large chunks: each keeps its own top k, and a chunk's k-th rises more slowly than the set's would.
  const int64_t chunk_groups = std::max<int64_t>(1, kWalkBlocksPerTask / G);
  const int64_t chunks_per_set = (ng + chunk_groups - 1) / chunk_groups;
  std::vector<int64_t>& task_set = chunk_task_;  // the unfinished sets' chunks: set * chunks_per_set + chunk
  task_set.clear();
  for (int s = 0; s < n_sets; ++s)
    for (int64_t c = 0; !set_done_[s] && c < chunks_per_set; ++c) task_set.push_back(s * chunks_per_set + c);
  const int64_t n_tasks = int64_t(task_set.size());
  chunk_heap_.resize(size_t(n_tasks) * kc);
  chunk_n_.assign(n_tasks, 0);
  chunk_scored_.assign(n_tasks, 0);
  const int chunk_threads = n_tasks > 1 ? lay_.cfg.threads_num : 1;
  ThreadPool::global().parallel_for(n_tasks, chunk_threads, [&](int64_t i) {
    const int s = int(task_set[i] / chunks_per_set);
    const int64_t g0 = (task_set[i] % chunks_per_set) * chunk_groups, g1 = std::min(ng, g0 + chunk_groups);
    const int64_t k = std::min<int64_t>(req.k_per_set[s], runs_[s].prefix.back());
    const Cand* seed = heap_.data() + s * kc;
    const float floor = set_n_[s] == k ? seed[0].score : kNegInf;  // phase 1's k-th score
    const double* bound = gsets_.data() + s * ng;
    const uint8_t* seen = seen_.data() + s * ng;
    TopK top{chunk_heap_.data() + i * kc, 0, k, floor};  // blocks below phase 1's k-th never enter
    auto wanted = [&](int64_t g) {
      return !seen[g] && !(bound[g] < floor) && !(top.full() && bound[g] < top.kth());
    };
    const size_t row_bytes = size_t(lay_.A) * lay_.cfg.head_dim * lay_.anchor_elem_bytes();
    const int64_t run_groups = std::max<int64_t>(1, kRunBlocks / G);  // groups scored in one pass at most
    // Scattered groups are latency-bound: the first lines of the next kJumpsAhead groups that follow a gap
    // are requested ahead (the kernel's own prefetch then runs ahead inside each). Adjacent groups stream on
    // their own, and a burst over whole groups would stall the core on its miss buffers.
    int64_t pf = g0, pf_last = g0 - 2;  // the prefetch cursor: groups below pf examined; the last wanted one
    int64_t jumps[kJumpsAhead], n_jumps = 0, j0 = 0;  // requested gap targets not reached yet (a ring)
    auto prefetch_ahead = [&](int64_t from) {
      if (pf < from) pf = from, pf_last = from - 1;
      for (; pf < g1 && n_jumps < kJumpsAhead; ++pf) {
        if (!wanted(pf)) continue;
        if (pf != pf_last + 1) {
          for (int h = shared ? 0 : s; h < (shared ? KVH : s + 1); ++h)
            prefetch_l2(lay_.anchor_bytes(L, h, pf * G), std::min<size_t>(kJumpPrefetch, row_bytes * G));
          jumps[(j0 + n_jumps++) % kJumpsAhead] = pf;
        }
        pf_last = pf;
      }
    };
    int64_t g = g0, scored = 0;
    while (g < g1 && !wanted(g)) ++g;
    while (g < g1) {
      int64_t e = g + 1;  // a run of adjacent wanted groups: one stream
      while (e < g1 && e - g < run_groups && wanted(e)) ++e;
      while (n_jumps > 0 && jumps[j0] < e) j0 = (j0 + 1) % kJumpsAhead, --n_jumps;
      prefetch_ahead(e);
      scored += visit(s, g, e, top);
      for (g = e; g < g1 && !wanted(g); ++g) {  // the k-th may have risen
      }
    }
    chunk_n_[i] = top.n;
    chunk_scored_[i] = scored;
  });

  // ---- per set: the top k of phase 1's and its chunks' picks ----
  int64_t ti = 0;
  for (int s = 0; s < n_sets; ++s) {
    const int64_t k = std::min<int64_t>(req.k_per_set[s], runs_[s].prefix.back());
    TopK top{heap_.data() + s * kc, set_n_[s], k};
    for (; ti < n_tasks && task_set[ti] / chunks_per_set == s; ++ti) {
      const Cand* c = chunk_heap_.data() + ti * kc;
      for (int64_t j = 0; j < chunk_n_[ti]; ++j) top.offer(c[j]);
      set_scored_[s] += chunk_scored_[ti];
    }
    int32_t* row = out_ids + s * int64_t(out_cols);
    for (int64_t i = 0; i < top.n; ++i) row[i] = top.h[i].id;
    std::sort(row, row + top.n);  // ascending, as the flat path
    std::fill(row + top.n, row + out_cols, -1);
    stats_.blocks_scored += set_scored_[s];
  }
  stats_.groups = int64_t(n_sets) * ng;
  t.topk_s = seconds_since(t1);
}

}  // namespace ktq
