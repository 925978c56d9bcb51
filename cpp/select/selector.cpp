// Block selection of one layer (selector.h): candidates, scores, top k.
#include "select/selector.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>

#include "common/cpu_features.h"
#include "common/scratch.h"
#include "common/thread_pool.h"
#include "select/score_kernels.h"
#include "select/topk.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kScoreBlocksPerTask = 256;  // scoring task: this many blocks of one set
constexpr int64_t kScorePrefetch = 16;        // scoring: anchors requested this many candidates ahead
constexpr int64_t kParallelTopk = 512;        // top-k runs sets on threads from this many candidates on

}  // namespace

// ---- the query ----

void BlockSelector::set_query(const float* q, int H, const QueryVariants& var) {
  qraw_ = q;
  var_ = var;
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, L = lay_.A * D;
  qe_.assign(size_t(var.n) * KVH * L, 0.f);
  if (lay_.cfg.index_group > 0) qb_.assign(size_t(var.n) * KVH * 3 * D, 0.f);
  for (int v = 0; v < var.n; ++v) fold_query(q + size_t(v) * H * D, H, v);
}

void BlockSelector::fold_query(const float* q, int H, int v) {
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, G = H / KVH;
  // Linear anchor scores fold the GQA group into one vector per KV head:
  //   QUEST  sum_g sum_d max(q_gd min_d, q_gd max_d) = sum_d (Q-_d min_d + Q+_d max_d),
  //          Q- = sum_g min(q_g, 0), Q+ = sum_g max(q_g, 0) (min_d <= max_d), laid out like [min | max];
  //   BLOCK_MAX / BLOCK_MEAN  sum_g q_g . a = (sum_g q_g) . a.
  const int L = lay_.A * D;
  float* qe = qe_.data() + size_t(v) * KVH * L;
  for (int h = 0; h < KVH; ++h)
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (size_t(h) * G + g) * D;
      float* e = qe + size_t(h) * L;
      if (lay_.cfg.anchor_type == AnchorType::QUEST)
        for (int d = 0; d < D; ++d) {
          e[d] += std::min(qg[d], 0.f);
          e[D + d] += std::max(qg[d], 0.f);
        }
      else if (lay_.cfg.anchor_type == AnchorType::BLOCK_MAX || lay_.cfg.anchor_type == AnchorType::BLOCK_MEAN)
        for (int d = 0; d < D; ++d) e[d] += qg[d];
    }
  if (lay_.cfg.index_group > 0) set_index_query(q, H, v);
  // QUEST's centre share: (1 - c) [Q- | Q+] + c [Q/2 | Q/2], Q = Q- + Q+, scores (1 - c) bound + c q.centre.
  // It is at most the bound (the centre lies between min and max): the index's bound vectors stay valid.
  const float c = lay_.cfg.quest_centre;
  if (lay_.cfg.anchor_type == AnchorType::QUEST && c != 0.f)
    for (int h = 0; h < KVH; ++h) {
      float* e = qe + size_t(h) * L;
      for (int d = 0; d < D; ++d) {
        const float half = 0.5f * (e[d] + e[D + d]);
        e[d] = (1.f - c) * e[d] + c * half;
        e[D + d] = (1.f - c) * e[D + d] + c * half;
      }
    }
}

void BlockSelector::set_index_query(const float* q, int H, int v) {
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, G = H / KVH;
  const int L = lay_.A * D;
  // The index's bound vectors (index/group_bounds.h), [Q- | Q+ | W = Q+ - Q-] per KV head: QUEST's are its
  // scoring vector itself; BLOCK_* split theirs by sign; FIXED/DYNAMIC sum each query head's split.
  for (int h = 0; h < KVH; ++h) {
    float *qn = qb_.data() + (size_t(v) * KVH + h) * 3 * D, *qp = qn + D, *w = qp + D;
    const float* e = qe_.data() + (size_t(v) * KVH + h) * L;
    switch (lay_.cfg.anchor_type) {
      case AnchorType::QUEST: std::copy(e, e + 2 * D, qn); break;
      case AnchorType::BLOCK_MAX:
      case AnchorType::BLOCK_MEAN:
        for (int d = 0; d < D; ++d) qn[d] = std::min(e[d], 0.f), qp[d] = std::max(e[d], 0.f);
        break;
      case AnchorType::FIXED:
      case AnchorType::DYNAMIC:
        for (int g = 0; g < G; ++g)
          for (int d = 0; d < D; ++d) {
            const float x = q[(size_t(h) * G + g) * D + d];
            qn[d] += std::min(x, 0.f), qp[d] += std::max(x, 0.f);
          }
        break;
    }
    for (int d = 0; d < D; ++d) w[d] = qp[d] - qn[d];
  }
}

// ---- candidates ----

void BlockSelector::build_runs(int64_t nb, int n_sets, const SelectRequest* req) {
  // Exclusion ranges, clamped to [0, nb), sorted and merged.
  excl_.clear();
  if (req)
    for (int i = 0; i < req->n_exclude; ++i) {
      const int64_t b0 = req->exclude[2 * i], b1 = req->exclude[2 * i + 1];
      if (b0 < 0 || b1 < b0)
        throw std::invalid_argument("exclude range (" + std::to_string(b0) + ", " + std::to_string(b1) +
                                    ") is invalid: need 0 <= b0 <= b1 (half-open block range)");
      if (std::min(b1, nb) > b0) excl_.emplace_back(b0, std::min(b1, nb));
    }
  std::sort(excl_.begin(), excl_.end());
  size_t m = 0;
  for (size_t i = 0; i < excl_.size(); ++i) {
    if (m > 0 && excl_[i].first <= excl_[m - 1].second)
      excl_[m - 1].second = std::max(excl_[m - 1].second, excl_[i].second);
    else
      excl_[m++] = excl_[i];
  }
  excl_.resize(m);

  runs_.resize(n_sets);
  for (int s = 0; s < n_sets; ++s) {
    Runs& R = runs_[s];
    R.start.clear();
    R.len.clear();
    R.prefix.assign(1, 0);
    auto add = [&](int64_t b, int64_t n) {  // append [b, b + n), merging with the previous run
      if (n <= 0) return;
      if (!R.start.empty() && R.start.back() + R.len.back() == b) R.len.back() += int32_t(n);
      else R.start.push_back(int32_t(b)), R.len.push_back(int32_t(n));
    };
    if (req && req->allowed) {
      const int32_t* row = req->allowed + int64_t(s) * req->allowed_cols;
      ids_.clear();
      for (int i = 0; i < req->allowed_cols; ++i) {
        if (row[i] == -1) continue;  // padding
        if (row[i] < 0 || row[i] >= nb)
          throw std::out_of_range("allowed block id " + std::to_string(row[i]) + " (set " + std::to_string(s) +
                                  ") is out of range: the layer has " + std::to_string(nb) + " blocks");
        ids_.push_back(row[i]);
      }
      // The decode loop passes ascending lists (preselected ids, then the blocks that entered later): only
      // sort what is not already strictly ascending.
      if (std::adjacent_find(ids_.begin(), ids_.end(), std::greater_equal<int32_t>()) != ids_.end()) {
        std::sort(ids_.begin(), ids_.end());
        ids_.erase(std::unique(ids_.begin(), ids_.end()), ids_.end());
      }
      size_t e = 0;
      for (int32_t b : ids_) {
        while (e < excl_.size() && excl_[e].second <= b) ++e;
        if (e < excl_.size() && excl_[e].first <= b) continue;
        add(b, 1);
      }
    } else {
      int64_t b = 0;
      for (const auto& [e0, e1] : excl_) add(b, e0 - b), b = e1;
      add(b, nb - b);
    }
    for (size_t i = 0; i < R.len.size(); ++i) R.prefix.push_back(R.prefix.back() + R.len[i]);
  }
}

// ---- scoring ----

void BlockSelector::score_linear_rows(const uint8_t* a, int64_t n, int h, float* out, bool accumulate,
                                      const float* scale8, int v) const {
  const int L = lay_.A * lay_.cfg.head_dim;
  const float* qe = qe_.data() + (size_t(v) * lay_.cfg.n_kv_heads + h) * L;
  const bool simd = use_avx2() && lay_.cfg.head_dim % 8 == 0;
  const auto* a8 = reinterpret_cast<const int8_t*>(a);
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const auto* a32 = reinterpret_cast<const float*>(a);
  if (scale8 && simd) avx2::score_linear8(a8, scale8, n, L, qe, out, accumulate);
  else if (scale8) scalar::score_linear8(a8, scale8, n, L, qe, out, accumulate);
  else if (lay_.a16 && simd) avx2::score_linear16(a16, n, L, qe, out, accumulate);
  else if (lay_.a16) scalar::score_linear16(a16, n, L, qe, out, accumulate);
  else if (simd) avx2::score_linear(a32, n, L, qe, out, accumulate);
  else scalar::score_linear(a32, n, L, qe, out, accumulate);
}

void BlockSelector::score_blocks(const StoreLayer& L, int H, int h, int64_t b, int64_t n, float* out,
                                 bool accumulate) const {
  // With dual chunk attention, each piece of [b, b + n) with the query rotation its blocks call for
  for (const int64_t end = b + n; b < end;) {
    const int64_t e = std::min(end, var_.end_of(b));
    score_piece(L, H, h, b, e - b, var_.of(b), out, accumulate);
    out += e - b;
    b = e;
  }
}

void BlockSelector::score_piece(const StoreLayer& L, int H, int h, int64_t b, int64_t n, int v, float* out,
                                bool accumulate) const {
  if (linear_anchors(lay_.cfg.anchor_type))
    return score_linear_rows(lay_.anchor_bytes(L, h, b), n, h, out, accumulate, nullptr, v);
  const int D = lay_.cfg.head_dim, G = H / lay_.cfg.n_kv_heads, A = lay_.A;
  const float* a = lay_.anchor_at(L, h, b);
  const int32_t* cnt = L.n_anchor + h * lay_.max_blocks + b;
  const float* qh = qraw_ + (size_t(v) * H + size_t(h) * G) * D;
  float* s = thread_scratch(size_t(G) * ((A + 7) & ~7) + D);
  if (use_avx2() && D % 8 == 0) avx2::score_max(a, cnt, n, A, D, qh, G, out, accumulate, s);
  else scalar::score_max(a, cnt, n, A, D, qh, G, out, accumulate, s);
}

float BlockSelector::score_block(const StoreLayer& L, int H, HeadMode mode, int s, int32_t b) const {
  if (mode == HeadMode::SEPARATE) {
    float v = 0.f;
    score_blocks(L, H, s, b, 1, &v, false);
    return v;
  }
  float v = 0.f;  // SHARED: every head's score summed in head order, as score_runs does
  for (int h = 0; h < lay_.cfg.n_kv_heads; ++h) score_blocks(L, H, h, b, 1, &v, h > 0);
  return v;
}

void BlockSelector::score_runs(const StoreLayer& L, int H, HeadMode mode, float* scores) {
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, A = lay_.A;
  const int64_t nb = lay_.n_blocks(L);
  const int n_sets = int(runs_.size());
  // Tasks: kScoreBlocksPerTask candidates of one set each (a fixed split: thread-count independent).
  task_start_.assign(1, 0);
  for (int s = 0; s < n_sets; ++s)
    task_start_.push_back(task_start_.back() +
                          (runs_[s].prefix.back() + kScoreBlocksPerTask - 1) / kScoreBlocksPerTask);
  int64_t n_cand = 0;
  for (int s = 0; s < n_sets; ++s) n_cand += runs_[s].prefix.back();
  const int64_t bytes = n_cand * (mode == HeadMode::SHARED ? KVH : 1) * A * D * lay_.anchor_elem_bytes();
  const int threads = bytes >= kParallelBytes ? lay_.cfg.threads_num : 1;
  const size_t row_bytes = size_t(A) * D * lay_.anchor_elem_bytes();
  ThreadPool::global().parallel_for(task_start_.back(), threads, [&](int64_t task) {
    const int s = int(std::upper_bound(task_start_.begin(), task_start_.end(), task) - task_start_.begin()) - 1;
    const Runs& R = runs_[s];
    const int64_t i0 = (task - task_start_[s]) * kScoreBlocksPerTask;
    const int64_t i1 = std::min(R.prefix.back(), i0 + kScoreBlocksPerTask);
    float* out = scores + s * nb;
    // SHARED sums every KV head's score (in head order); SEPARATE scores the set's own head.
    const int h0 = mode == HeadMode::SHARED ? 0 : s, h1 = mode == HeadMode::SHARED ? KVH : s + 1;
    size_t r = std::upper_bound(R.prefix.begin(), R.prefix.end(), i0) - R.prefix.begin() - 1;
    // Scattered candidates (preselected blocks) are short runs: the kernels' own prefetch stays inside a
    // run, so a cursor kScorePrefetch candidates ahead requests the next runs' anchors (one (h, block)
    // row is A*D elements) while this one is scored; a dependent miss per run otherwise.
    size_t pr = r;
    int64_t pi = i0;
    auto prefetch_to = [&](int64_t upto) {
      for (; pi < std::min(upto, i1); ++pi) {
        while (R.prefix[pr + 1] <= pi) ++pr;
        const int64_t b = R.start[pr] + (pi - R.prefix[pr]);
        for (int h = h0; h < h1; ++h) prefetch_l2(lay_.anchor_bytes(L, h, b), row_bytes);
      }
    };
    prefetch_to(i0 + kScorePrefetch);
    for (int64_t i = i0; i < i1; ++r) {  // candidates [i, j) lie in run r
      const int64_t off = i - R.prefix[r], j = std::min(i1, R.prefix[r + 1]);
      const int64_t b = R.start[r] + off;
      if (j - i < kScorePrefetch) prefetch_to(j + kScorePrefetch);
      else pi = std::max(pi, j);  // a long run: the kernel streams it
      for (int h = h0; h < h1; ++h) score_blocks(L, H, h, b, j - i, out + b, h > h0);
      i = j;
    }
  });
}

// ---- top-k ----

namespace {

// Heap order: a better block (higher score, then the lower id) sorts below, so heap[0] is the worst kept.
// A strict total order on distinct ids: the top-k set is unique, whatever the order of the offers.
inline bool heap_less(const BlockSelector::Cand& a, const BlockSelector::Cand& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

}  // namespace

void BlockSelector::select_runs(const StoreLayer& L, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                                StageTiming& t) {
  const int64_t nb = lay_.n_blocks(L);
  const int n_sets = req.mode == HeadMode::SHARED ? 1 : lay_.cfg.n_kv_heads;
  const auto t0 = Clock::now();
  bool keep_all;  // every set keeps all its candidates (SnapKV: k = the preselected blocks): no scores
  const int64_t kcap = check_k(req, n_sets, out_cols, [&](int s) { return runs_[s].prefix.back(); }, &keep_all);
  stats_ = IndexStats{};
  for (int s = 0; s < n_sets; ++s) stats_.candidates += runs_[s].prefix.back();
  if (keep_all) {
    for (int s = 0; s < n_sets; ++s) {
      int32_t* row = out_ids + s * int64_t(out_cols);
      int64_t n = 0;
      runs_[s].each([&](int32_t b) { row[n++] = b; });
      std::fill(row + n, row + out_cols, -1);
    }
    t.score_s = 0;
    t.topk_s = seconds_since(t0);
    return;
  }
  // (Ada-KV's budgets need every candidate's score: no pruning by the index)
  if (lay_.cfg.index_group > 0 && walk_index_ && !req.allowed && !req.ada)
    return select_pruned(L, H, req, kcap, out_ids, out_cols, t);
  stats_.blocks_scored = stats_.candidates;
  scores_.resize(size_t(n_sets) * nb);
  score_runs(L, H, req.mode, scores_.data());
  const int32_t* k_per_set = req.k_per_set;
  if (req.ada) {  // the sets' budgets from all their scores
    ada_.scores.clear();
    ada_.counts.resize(n_sets);
    for (int s = 0; s < n_sets; ++s) {
      const float* sc = scores_.data() + s * nb;
      runs_[s].each([&](int32_t b) { ada_.scores.push_back(sc[b]); });
      ada_.counts[s] = runs_[s].prefix.back();
    }
    k_per_set = ada_.split(req);
  }
  const auto t1 = Clock::now();
  t.score_s = std::chrono::duration<double>(t1 - t0).count();

  // Few candidates per kept block (k >= n / kHeapRatio): top_k over a copy of the candidates' scores
  // (the k-th best score in O(n) branch-free passes, then, in ascending id order, every candidate above it
  // and the first ones equal to it). Many: stream the candidates (ascending ids) through a k-heap; almost every one
  // then loses to the worst kept at the first comparison, one predictable pass. Both keep exactly the top k
  // under the strict order of heap_less (higher score, then the lower id); NaN scores count as -inf.
  constexpr int64_t kHeapRatio = 64;
  auto partition = [&](int s) {
    const int64_t n = runs_[s].prefix.back(), k = std::min<int64_t>(k_per_set[s], n);
    return k > 0 && k * kHeapRatio >= n;
  };
  int64_t room = 0;  // topv_, topids_ and topkeys_ entries per set
  for (int s = 0; s < n_sets; ++s)
    if (partition(s)) room = std::max(room, runs_[s].prefix.back());
  heap_.resize(size_t(n_sets) * std::max<int64_t>(kcap, 1));
  topv_.resize(size_t(n_sets) * room);
  topkeys_.resize(size_t(n_sets) * room);
  topids_.resize(size_t(n_sets) * room);
  // Sets on threads from a few hundred candidates on (a few microseconds per set; the workers spin between
  // the calls of a decode step, so a hand-off costs about one).
  int64_t n_cand = 0;
  for (int s = 0; s < n_sets; ++s) n_cand += runs_[s].prefix.back();
  const int topk_threads = n_sets > 1 && n_cand >= kParallelTopk ? lay_.cfg.threads_num : 1;
  ThreadPool::global().parallel_for(n_sets, topk_threads, [&](int64_t s) {
    const Runs& R = runs_[s];
    const int64_t k = std::min<int64_t>(k_per_set[s], R.prefix.back());
    const float* sc = scores_.data() + s * nb;
    int32_t* row = out_ids + s * int64_t(out_cols);
    auto score = [&](int32_t b) { return std::isnan(sc[b]) ? kNegInf : sc[b]; };
    int64_t n = 0;
    if (partition(int(s))) {
      float* v = topv_.data() + s * room;
      int32_t* ids = topids_.data() + s * room;
      int64_t c = 0;
      R.each([&](int32_t b) {
        v[c] = sc[b];  // top_k counts NaN as -inf
        ids[c++] = b;
      });
      n = (use_avx2() ? avx2::top_k : scalar::top_k)(v, c, k, ids, row, topkeys_.data() + s * room);
    } else if (k > 0) {
      Cand* heap = heap_.data() + s * std::max<int64_t>(kcap, 1);
      R.each([&](int32_t b) {
        const Cand c{score(b), b};
        if (n < k) {
          heap[n++] = c;
          std::push_heap(heap, heap + n, heap_less);
        } else if (heap_less(c, heap[0])) {
          std::pop_heap(heap, heap + n, heap_less);
          heap[n - 1] = c;
          std::push_heap(heap, heap + n, heap_less);
        }
      });
      for (int64_t i = 0; i < n; ++i) row[i] = heap[i].id;
      std::sort(row, row + n);  // ascending: the attention kernel walks memory forward
    }
    std::fill(row + n, row + out_cols, -1);
  });
  t.topk_s = seconds_since(t1);
}

}  // namespace ktq
