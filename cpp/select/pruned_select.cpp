// Block selection through the hierarchical index (selector.h, index/group_bounds.h): every group's bound,
// then per set a walk over the groups in descending bound that scores a group's candidate blocks only while
// its bound can still reach the k-th best score found. The picks equal the flat scan's (select_runs).
//
// Exactness. A group's fp32 bound B and magnitude T (index/bound_kernels.h) become a bound of every fp32
// score the flat path computes for its blocks: B + c * T + e in fp64, where c covers the relative rounding
// of that score, of B and of the query's fold (each a sum of at most n_terms products: |fl(sum) - sum| <=
// n u sum |terms| <= n u T, u = 2^-24, doubled for slack) and e the absolute error of subnormal products.
// A T that is not below 2^100 (an overflow, an empty group's +-inf rows) gives no bound: +inf, visited.
// The walk stops at the first group whose bound is *strictly* below the k-th best score kept: every block
// left is then strictly worse than k kept blocks, so it is in no top k, whatever the tie rule; a group whose
// bound equals the k-th score is visited (its blocks could tie and win on a lower id). Within the visited
// blocks the k-heap keeps the top k under the flat path's strict order (higher score, then the lower id;
// NaN as -inf), so the set is the same, ascending as the flat path writes it.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/cpu_features.h"
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

inline bool heap_less(const BlockSelector::Cand& a, const BlockSelector::Cand& b) {  // as select_runs'
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

// Group heap order: the greater bound on top, then the lower group (a fixed visiting order).
inline bool group_less(const std::pair<double, int32_t>& a, const std::pair<double, int32_t>& b) {
  return a.first < b.first || (a.first == b.first && a.second > b.second);
}

}  // namespace

void BlockSelector::group_bounds(const StoreLayer& L, int H, HeadMode mode, double* out) {
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, qg = H / KVH;
  const int64_t ng = lay_.n_groups(lay_.n_blocks(L));
  // ---- every (head, group)'s fp32 bound and magnitude: fixed tasks of kBoundGroupsPerTask groups ----
  gbound_.resize(size_t(KVH) * ng);
  gmag_.resize(size_t(KVH) * ng);
  const int64_t tasks_per_head = (ng + kBoundGroupsPerTask - 1) / kBoundGroupsPerTask;
  const int64_t bytes = int64_t(KVH) * ng * 2 * D * 4;
  const bool simd = use_avx2() && D % 8 == 0;
  ThreadPool::global().parallel_for(KVH * tasks_per_head, bytes >= kParallelBytes ? lay_.cfg.threads_num : 1,
                                    [&](int64_t task) {
    const int h = int(task / tasks_per_head);
    const int64_t g0 = (task % tasks_per_head) * kBoundGroupsPerTask, n = std::min(kBoundGroupsPerTask, ng - g0);
    const float* qb = qb_.data() + size_t(h) * 3 * D;
    float *bo = gbound_.data() + h * ng + g0, *mo = gmag_.data() + h * ng + g0;
    if (simd) avx2::score_bounds(lay_.bound_at(L, h, g0), n, D, qb, bo, mo);
    else scalar::score_bounds(lay_.bound_at(L, h, g0), n, D, qb, bo, mo);
  });
  // ---- per set: B + c T + e summed over the set's heads, in fp64 ----
  // The margin (see the top): the flat score's terms (A*D, or D per FIXED/DYNAMIC dot plus qg maxima), the
  // bound's 2*D, the query fold's qg, SHARED's sum over KVH heads.
  const int n_terms = lay_.A * D + 3 * D + 2 * qg + KVH + 8;
  const double rel = 2.0 * n_terms * 0x1p-24, abs_err = n_terms * 0x1p-140;
  const bool shared = mode == HeadMode::SHARED;
  for (int s = 0; s < (shared ? 1 : KVH); ++s) {
    const int h0 = shared ? 0 : s, h1 = shared ? KVH : s + 1;
    for (int64_t g = 0; g < ng; ++g) {
      double b = 0;
      for (int h = h0; h < h1 && b < kInf; ++h) {
        const double mag = gmag_[h * ng + g];
        b = mag < kNoBoundMag ? b + double(gbound_[h * ng + g]) + rel * mag + abs_err : kInf;
      }
      out[s * ng + g] = std::isnan(b) ? kInf : b;
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
  gsets_.resize(size_t(n_sets) * ng);
  group_bounds(L, H, req.mode, gsets_.data());
  const auto t1 = Clock::now();
  t.score_s = std::chrono::duration<double>(t1 - t0).count();

  // ---- per set: the walk over its groups ----
  gheap_.resize(size_t(n_sets) * ng);
  gscores_.resize(size_t(n_sets) * G);
  heap_.resize(size_t(n_sets) * std::max<int64_t>(kcap, 1));
  set_scored_.assign(n_sets, 0);
  const int walk_threads = n_sets > 1 && stats_.candidates >= kParallelWalk ? lay_.cfg.threads_num : 1;
  ThreadPool::global().parallel_for(n_sets, walk_threads, [&](int64_t s) {
    const Runs& R = runs_[s];
    const int64_t k = std::min<int64_t>(req.k_per_set[s], R.prefix.back());
    int32_t* row = out_ids + s * int64_t(out_cols);
    int64_t n = 0;
    if (k > 0) {
      const int h0 = shared ? 0 : int(s), h1 = shared ? KVH : int(s) + 1;
      std::pair<double, int32_t>* gh = gheap_.data() + s * ng;
      for (int64_t g = 0; g < ng; ++g) gh[g] = {gsets_[s * ng + g], int32_t(g)};
      std::make_heap(gh, gh + ng, group_less);
      Cand* heap = heap_.data() + s * std::max<int64_t>(kcap, 1);
      float* sc = gscores_.data() + s * G;
      int64_t left = ng, scored = 0;
      while (left > 0) {
        if (n == k && gh[0].first < double(heap[0].score)) break;  // strictly below: nothing left can enter
        const int64_t b0 = int64_t(gh[0].second) * G, b1 = std::min(nb, b0 + G);
        std::pop_heap(gh, gh + left, group_less);
        --left;
        // The group's candidates: runs from the first one that ends after b0 (runs ascending, disjoint).
        size_t r = std::upper_bound(R.start.begin(), R.start.end(), int32_t(b0)) - R.start.begin();
        if (r > 0 && R.start[r - 1] + R.len[r - 1] > b0) --r;
        for (; r < R.start.size() && R.start[r] < b1; ++r) {
          const int64_t c0 = std::max<int64_t>(b0, R.start[r]), c1 = std::min<int64_t>(b1, R.start[r] + R.len[r]);
          for (int h = h0; h < h1; ++h) score_blocks(L, H, h, c0, c1 - c0, sc, h > h0);
          scored += c1 - c0;
          for (int64_t b = c0; b < c1; ++b) {
            const Cand c{std::isnan(sc[b - c0]) ? kNegInf : sc[b - c0], int32_t(b)};
            if (n < k) {
              heap[n++] = c;
              std::push_heap(heap, heap + n, heap_less);
            } else if (heap_less(c, heap[0])) {
              std::pop_heap(heap, heap + n, heap_less);
              heap[n - 1] = c;
              std::push_heap(heap, heap + n, heap_less);
            }
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) row[i] = heap[i].id;
      std::sort(row, row + n);  // ascending, as the flat path
      set_scored_[s] = scored;
    }
    std::fill(row + n, row + out_cols, -1);
  });
  stats_.groups = int64_t(n_sets) * ng;
  for (int s = 0; s < n_sets; ++s) stats_.blocks_scored += set_scored_[s];
  t.topk_s = seconds_since(t1);
}

}  // namespace ktq
