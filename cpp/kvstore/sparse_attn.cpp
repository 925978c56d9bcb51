// The decode step of one layer: score the blocks from their anchors, keep the top-k per KV head (or
// shared), attend to the kept blocks with a split-K online softmax. Kernels: attn_kernels*.cpp.
//
// Determinism: every parallel task writes only its own outputs (scores of its blocks, a partial
// (m, l, acc) of its chunk), task boundaries depend only on the problem — never on threads_num — and
// partials are merged afterwards in chunk order. So 1, 2 or 8 threads give the same bits.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>

#include "attn/attn_kernels.h"
#include "common/cpu_features.h"
#include "attn/dense_attn.h"
#include "kvstore/kv_store.h"
#include "common/thread_pool.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kScoreBlocksPerTask = 256;  // scoring task: this many blocks of one set
constexpr int64_t kScorePrefetch = 16;        // scoring: anchors requested this many candidates ahead
constexpr int64_t kChunkTokens = 256;         // split-K: at least this many tokens per attention task. Each
                                              // task starts on a cold block, but a 1K budget over 3 KV heads
                                              // must be 4 chunks a head to share 2 threads evenly (3 tasks
                                              // leave one thread idle a third of the time): 8K decode
                                              // 87 -> 91 tok/s against 1,024-token chunks
constexpr int64_t kMaxChunksPerHead = 64;     // ... and at most this many tasks per KV head
constexpr int64_t kPartialBytes = 16 << 20;   // ... and fewer where their partials (m, l, acc) would pass
constexpr int64_t kMinChunksPerHead = 16;     // this many bytes (in L3), but never fewer than this many
                                              // (16 threads). Prefill at 16K, 512-query chunks: 250 -> 230
                                              // ms a store call against 61 tasks a head (75 MB of partials)
constexpr int64_t kRunRows = 64;              // attention: consecutive selected blocks of up to this many rows
                                              // share one softmax update (attend_tiles)
constexpr int64_t kParallelTopk = 512;        // top-k runs sets on threads from this many candidates on
// Scoring / attention use threads from this many bytes read on: below it (~8 us on one core) handing work
// to a worker costs more than it saves (workers spin between the calls of a decode step).
constexpr int64_t kParallelBytes = 128 << 10;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Per-thread kernel scratch (logits, a decoded row); grows once per worker thread.
float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

void prefetch_l2(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

}  // namespace

// ---- query preparation ----

void KVStore::check_q(const float* q, int H) const {
  const int KVH = cfg_.n_kv_heads;
  if (H < 1 || H % KVH != 0)
    throw std::invalid_argument("q has " + std::to_string(H) + " heads: must be a positive multiple of n_kv_heads=" +
                                std::to_string(KVH) + " (GQA)");
  for (int64_t i = 0; i < int64_t(H) * cfg_.head_dim; ++i)
    if (!std::isfinite(q[i]))
      throw std::invalid_argument("q contains a non-finite value at head " + std::to_string(i / cfg_.head_dim) +
                                  ", dim " + std::to_string(i % cfg_.head_dim));
}

void KVStore::prepare_query(const float* q, int H) {
  check_q(q, H);
  qraw_ = q;
  const int D = cfg_.head_dim, KVH = cfg_.n_kv_heads, G = H / KVH;
  qs_.resize(size_t(H) * D);
  const float scale = 1.f / std::sqrt(float(D));
  for (int64_t i = 0; i < int64_t(H) * D; ++i) qs_[i] = q[i] * scale;
  // Linear anchor scores fold the GQA group into one vector per KV head:
  //   QUEST  sum_g sum_d max(q_gd min_d, q_gd max_d) = sum_d (Q-_d min_d + Q+_d max_d),
  //          Q- = sum_g min(q_g, 0), Q+ = sum_g max(q_g, 0) (min_d <= max_d), laid out like [min | max];
  //   BLOCK_MAX / BLOCK_MEAN  sum_g q_g . a = (sum_g q_g) . a.
  const int L = A_ * D;
  qe_.assign(size_t(KVH) * L, 0.f);
  for (int h = 0; h < KVH; ++h)
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (size_t(h) * G + g) * D;
      float* e = qe_.data() + size_t(h) * L;
      if (cfg_.anchor_type == AnchorType::QUEST)
        for (int d = 0; d < D; ++d) {
          e[d] += std::min(qg[d], 0.f);
          e[D + d] += std::max(qg[d], 0.f);
        }
      else if (cfg_.anchor_type == AnchorType::BLOCK_MAX || cfg_.anchor_type == AnchorType::BLOCK_MEAN)
        for (int d = 0; d < D; ++d) e[d] += qg[d];
    }
}

// ---- candidates ----

void KVStore::build_runs(int64_t nb, int n_sets, const SelectRequest* req) {
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

// ---- scoring and top-k ----

namespace {

// Heap order: a better block (higher score, then the lower id) sorts below, so heap[0] is the worst kept.
// A strict total order on distinct ids: the top-k set is unique, whatever the order of the offers.
inline bool heap_less(const KVStore::Cand& a, const KVStore::Cand& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

}  // namespace

void KVStore::score_linear_rows(const uint8_t* a, int64_t n, int h, float* out, bool accumulate,
                                const float* scale8) const {
  const int L = A_ * cfg_.head_dim;
  const float* qe = qe_.data() + size_t(h) * L;
  const bool simd = use_avx2() && cfg_.head_dim % 8 == 0;
  const auto* a8 = reinterpret_cast<const int8_t*>(a);
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const auto* a32 = reinterpret_cast<const float*>(a);
  if (scale8 && simd) avx2::score_linear8(a8, scale8, n, L, qe, out, accumulate);
  else if (scale8) scalar::score_linear8(a8, scale8, n, L, qe, out, accumulate);
  else if (a16_ && simd) avx2::score_linear16(a16, n, L, qe, out, accumulate);
  else if (a16_) scalar::score_linear16(a16, n, L, qe, out, accumulate);
  else if (simd) avx2::score_linear(a32, n, L, qe, out, accumulate);
  else scalar::score_linear(a32, n, L, qe, out, accumulate);
}

// scores: [n_sets, nb]; only the candidates of runs_ are written. Scoring reads the A*D anchor floats
// of each candidate block and KV head, nothing else (never K or V).
void KVStore::score_runs(const Layer& L, int H, HeadMode mode, float* scores) {
  const int D = cfg_.head_dim, KVH = cfg_.n_kv_heads, G = H / KVH, A = A_;
  const int64_t nb = (L.len + cfg_.block_size - 1) / cfg_.block_size;
  const int n_sets = int(runs_.size());
  const bool simd = use_avx2() && D % 8 == 0;
  const bool linear = linear_anchors(cfg_.anchor_type);
  // out[0, n) (+)= scores of blocks [b, b + n) for KV head h.
  auto score_run = [&](int h, int64_t b, int64_t n, float* out, bool accumulate) {
    if (linear) {
      score_linear_rows(anchor_bytes(L, h, b), n, h, out, accumulate);
    } else {
      const float* a = anchor_at(L, h, b);
      const int32_t* cnt = L.n_anchor + h * max_blocks_ + b;
      const float* qh = qraw_ + size_t(h) * G * D;
      float* s = thread_scratch(size_t(G) * ((A + 7) & ~7) + D);
      if (simd) avx2::score_max(a, cnt, n, A, D, qh, G, out, accumulate, s);
      else scalar::score_max(a, cnt, n, A, D, qh, G, out, accumulate, s);
    }
  };
  // Tasks: kScoreBlocksPerTask candidates of one set each (a fixed split: thread-count independent).
  task_start_.assign(1, 0);
  for (int s = 0; s < n_sets; ++s)
    task_start_.push_back(task_start_.back() +
                          (runs_[s].prefix.back() + kScoreBlocksPerTask - 1) / kScoreBlocksPerTask);
  int64_t n_cand = 0;
  for (int s = 0; s < n_sets; ++s) n_cand += runs_[s].prefix.back();
  const int64_t bytes = n_cand * (mode == HeadMode::SHARED ? KVH : 1) * A * D * anchor_elem_bytes();
  const int threads = bytes >= kParallelBytes ? cfg_.threads_num : 1;
  const size_t row_bytes = size_t(A) * D * anchor_elem_bytes();
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
        for (int h = h0; h < h1; ++h) prefetch_l2(anchor_bytes(L, h, b), row_bytes);
      }
    };
    prefetch_to(i0 + kScorePrefetch);
    for (int64_t i = i0; i < i1; ++r) {  // candidates [i, j) lie in run r
      const int64_t off = i - R.prefix[r], j = std::min(i1, R.prefix[r + 1]);
      const int64_t b = R.start[r] + off;
      if (j - i < kScorePrefetch) prefetch_to(j + kScorePrefetch);
      else pi = std::max(pi, j);  // a long run: the kernel streams it
      for (int h = h0; h < h1; ++h) score_run(h, b, j - i, out + b, h > h0);
      i = j;
    }
  });
}

// Checks k per set against the output's room (count(s): the set's candidates); returns the largest
// number of blocks a set keeps, and in *keep_all whether every set keeps all of its candidates.
namespace {
template <class Count>
int64_t check_k(const SelectRequest& req, int n_sets, int out_cols, Count count, bool* keep_all) {
  int64_t kcap = 0;
  *keep_all = true;
  for (int s = 0; s < n_sets; ++s) {
    if (req.k_per_set[s] < 0)
      throw std::invalid_argument("k must be >= 0, got " + std::to_string(req.k_per_set[s]) + " for set " +
                                  std::to_string(s));
    const int64_t need = std::min<int64_t>(req.k_per_set[s], count(s));
    if (need > out_cols)
      throw std::invalid_argument("the output has room for " + std::to_string(out_cols) + " blocks per set, set " +
                                  std::to_string(s) + " selects " + std::to_string(need));
    kcap = std::max(kcap, need);
    *keep_all = *keep_all && req.k_per_set[s] >= count(s);
  }
  return kcap;
}
}  // namespace

// ---- cached candidates ----

size_t KVStore::cand_row_bytes() const {
  return size_t(A_) * cfg_.head_dim * (cfg_.int8_candidates ? 1 : anchor_elem_bytes());
}

// scale = max |x| / 127, nudged up until 127 * scale >= max |x|, so every rounded value fits in [-127, 127].
// QUEST's row is [min (D), max (D)]: min elements are rounded down and max elements up (then x <= q * scale
// for a max, >= for a min, checked in fp32), so sum_d max(q_d min_d, q_d max_d) over the int8 bounds is >=
// the score over the stored ones for every q: still an upper bound of q.k. Other linear anchors: nearest.
void KVStore::quantize_anchor_row(const uint8_t* src, int8_t* dst, float* scale) const {
  const int L = A_ * cfg_.head_dim;
  thread_local std::vector<float> x;
  x.resize(L);
  if (a16_) decode_row(KVType::FP16, src, nullptr, L, x.data());
  else std::memcpy(x.data(), src, size_t(L) * 4);
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  float s = amax / 127.f;
  while (s * 127.f < amax) s = std::nextafter(s, std::numeric_limits<float>::infinity());
  *scale = s;
  if (s == 0.f) {  // an all-zero row
    std::memset(dst, 0, size_t(L));
    return;
  }
  const bool quest = cfg_.anchor_type == AnchorType::QUEST;
  for (int i = 0; i < L; ++i) {
    float r = x[i] / s;
    if (!quest) {
      r = std::nearbyint(r);
    } else if (i < cfg_.head_dim) {  // min: q * s <= x
      r = std::floor(r);
      while (r > -127.f && r * s > x[i]) r -= 1.f;
    } else {  // max: q * s >= x
      r = std::ceil(r);
      while (r < 127.f && r * s < x[i]) r += 1.f;
    }
    dst[i] = int8_t(std::clamp(r, -127.f, 127.f));
  }
}

const KVStore::CandCache* KVStore::cand_cache(const Layer& L, int layer, int64_t nb, int n_sets,
                                              const SelectRequest& req) {
  key_.clear();
  key_.push_back(int64_t(req.mode));
  key_.push_back(req.allowed_cols);
  key_.insert(key_.end(), req.allowed, req.allowed + int64_t(n_sets) * req.allowed_cols);
  key_.push_back(req.n_exclude);
  key_.insert(key_.end(), req.exclude, req.exclude + 2 * int64_t(req.n_exclude));
  if (cand_.size() != layers_.size()) cand_.resize(layers_.size());
  CandCache& C = cand_[layer];
  // Hit: the same request on the same blocks. The layer only grew since (a truncate bumps gen), so the
  // candidates are still in range and still full blocks.
  if (C.valid && C.gen == L.gen && C.key == key_) return &C;
  C.valid = false;
  build_runs(nb, n_sets, &req);  // validates the ids
  int64_t max_id = -1, need = 0;  // highest candidate id; most candidates of a set
  for (const Runs& R : runs_) {
    if (!R.start.empty()) max_id = std::max<int64_t>(max_id, R.start.back() + R.len.back() - 1);
    need = std::max(need, R.prefix.back());
  }
  if (max_id >= L.len / cfg_.block_size) return nullptr;  // a partial block's anchors still change
  const int heads = req.mode == HeadMode::SHARED ? cfg_.n_kv_heads : 1;
  const size_t row = cand_row_bytes();
  // A decode step's request changes whenever a block leaves the local window: that block joins the
  // candidates (after every one of them) and the exclusion moves. Then every set's old candidates are the
  // prefix of its new ones, and only the new ones' anchors are copied (a full block's anchors never change;
  // a truncate bumps gen). Rebuilding instead copied every candidate's anchors: 42 us a layer at 384
  // candidates x 3 heads, every 8 tokens.
  bool extend = C.built && C.gen == L.gen && C.mode == req.mode && int64_t(C.count.size()) == n_sets &&
                need <= C.stride;
  for (int s = 0; extend && s < n_sets; ++s) {
    const int32_t* old = C.ids.data() + s * C.stride;
    int64_t n = 0;
    extend = C.count[s] <= runs_[s].prefix.back();
    runs_[s].each([&](int32_t b) {
      if (n < C.count[s] && old[n] != b) extend = false;
      ++n;
    });
  }
  if (!extend) {
    C.built = false;
    C.mode = req.mode;
    C.stride = need + std::max<int64_t>(64, need / 4);  // room for the blocks that join later
    C.ids.assign(size_t(n_sets) * C.stride, -1);
    C.count.assign(n_sets, 0);
    C.anchors.resize(size_t(n_sets) * heads * C.stride * row);
    C.kv_count.assign(n_sets, 0);  // cand_tiles copies them all again
    if (cfg_.int8_candidates) C.scales.resize(size_t(n_sets) * heads * C.stride);
  }
  for (int s = 0; s < n_sets; ++s) {
    int64_t n = 0;
    runs_[s].each([&](int32_t b) {
      if (n >= C.count[s]) {
        C.ids[s * C.stride + n] = b;
        for (int j = 0; j < heads; ++j) {
          const int h = heads == 1 ? s : j;
          const size_t at = (size_t(s) * heads + j) * C.stride + n;
          if (cfg_.int8_candidates)
            quantize_anchor_row(anchor_bytes(L, h, b), reinterpret_cast<int8_t*>(C.anchors.data() + at * row),
                                C.scales.data() + at);
          else
            std::memcpy(C.anchors.data() + at * row, anchor_bytes(L, h, b), row);
        }
      }
      ++n;
    });
    C.count[s] = n;
  }
  C.built = true;
  C.key = key_;
  C.gen = L.gen;
  C.valid = true;
  return &C;
}

// select_locked over a CandCache: the same scores (same kernels on the same anchor bytes, heads summed in
// the same order) and the same top-k rule, so the same ids as the uncached path (int8_candidates: the
// scores of the int8 copy, upper bounds for QUEST, instead). One pass per set: its
// scores, then its top k (top_k: the k best in ascending id order, ties to the lower id, NaN as -inf;
// select_locked's rule), while the scores are still in L1.
bool KVStore::cached_prepare(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols,
                             int* threads) {
  const int n_sets = int(C.count.size()), heads = C.mode == HeadMode::SHARED ? cfg_.n_kv_heads : 1;
  bool keep_all;
  check_k(req, n_sets, out_cols, [&](int s) { return C.count[s]; }, &keep_all);
  slots_.resize(size_t(n_sets) * out_cols);
  if (keep_all) {
    for (int s = 0; s < n_sets; ++s) {
      int32_t* row_out = out_ids + s * int64_t(out_cols);
      std::copy(C.ids.begin() + s * C.stride, C.ids.begin() + s * C.stride + C.count[s], row_out);
      std::fill(row_out + C.count[s], row_out + out_cols, -1);
      std::iota(slots_.begin() + s * int64_t(out_cols), slots_.begin() + s * int64_t(out_cols) + C.count[s], 0);
    }
    return false;
  }
  cscores_.resize(size_t(n_sets) * std::max<int64_t>(C.stride, 1));
  topkeys_.resize(size_t(n_sets) * std::max<int64_t>(C.stride, 1));
  topk_task_s_.assign(n_sets, 0.0);
  score_task_s_.assign(n_sets, 0.0);
  int64_t n_cand = 0;
  for (int64_t c : C.count) n_cand += c;
  const int64_t bytes = n_cand * heads * int64_t(cand_row_bytes());
  *threads = bytes >= kParallelBytes ? cfg_.threads_num : 1;
  return true;
}

void KVStore::cached_set(const CandCache& C, const SelectRequest& req, int s, int32_t* out_ids, int out_cols) {
  const auto t0 = Clock::now();
  const int heads = C.mode == HeadMode::SHARED ? cfg_.n_kv_heads : 1;
  const size_t row = cand_row_bytes();
  const int64_t n = C.count[s], k = std::min<int64_t>(req.k_per_set[s], n);
  int32_t* row_out = out_ids + s * int64_t(out_cols);
  int32_t* slot_out = slots_.data() + s * int64_t(out_cols);  // positions in the set's candidates
  if (k >= n || k == 0) {
    if (k > 0) std::copy(C.ids.begin() + s * C.stride, C.ids.begin() + s * C.stride + n, row_out);
    std::iota(slot_out, slot_out + k, 0);
    std::fill(row_out + k, row_out + out_cols, -1);
    return;
  }
  float* sc = cscores_.data() + s * C.stride;
  for (int j = 0; j < heads; ++j) {  // SHARED: every head's score summed in head order, as score_runs does
    const size_t at = (size_t(s) * heads + j) * C.stride;
    score_linear_rows(C.anchors.data() + at * row, n, heads == 1 ? s : j, sc, j > 0,
                      cfg_.int8_candidates ? C.scales.data() + at : nullptr);
  }
  const auto t1 = Clock::now();
  const int64_t m = (use_avx2() ? avx2::top_k : scalar::top_k)(sc, n, k, nullptr, slot_out,
                                                                topkeys_.data() + s * C.stride);
  for (int64_t i = 0; i < m; ++i) row_out[i] = C.ids[s * C.stride + slot_out[i]];
  std::fill(row_out + m, row_out + out_cols, -1);
  score_task_s_[s] = std::chrono::duration<double>(t1 - t0).count();
  topk_task_s_[s] = seconds_since(t1);
}

void KVStore::cand_tiles(const Layer& L, CandCache& C) {
  const int n_sets = int(C.count.size()), heads = C.mode == HeadMode::SHARED ? cfg_.n_kv_heads : 1;
  const size_t bytes = size_t(n_sets) * heads * C.stride * 2 * tile_bytes_;
  if (C.kv.size() != bytes) {
    C.kv = MappedBuffer(bytes);
    C.kv_count.assign(n_sets, 0);
  }
  for (int s = 0; s < n_sets; ++s) {
    for (int64_t n = C.kv_count[s]; n < C.count[s]; ++n)
      for (int j = 0; j < heads; ++j)  // a (head, block)'s K and V tiles are adjacent in the store
        std::memcpy(cand_tile(C, s, j, n), k_tile(L, heads == 1 ? s : j, C.ids[s * C.stride + n]), 2 * tile_bytes_);
    C.kv_count[s] = C.count[s];
  }
}

void KVStore::select_cached(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols) {
  const auto t0 = Clock::now();
  const int n_sets = int(C.count.size());
  int threads = 1;
  if (!cached_prepare(C, req, out_ids, out_cols, &threads)) {
    timing_.score_s = 0;
    timing_.topk_s = seconds_since(t0);
    return;
  }
  ThreadPool::global().parallel_for(n_sets, threads, [&](int64_t s) { cached_set(C, req, int(s), out_ids, out_cols); });
  // The two stages share the pass: top-k's share is its tasks' time over the threads, scoring the rest.
  const double total = seconds_since(t0);
  double topk = 0;
  for (double x : topk_task_s_) topk += x;
  timing_.topk_s = std::min(total, topk / std::min<int64_t>(threads, n_sets));
  timing_.score_s = total - timing_.topk_s;
}

const KVStore::CandCache* KVStore::select_locked(const Layer& L, int layer, int H, const SelectRequest& req,
                                                int32_t* out_ids, int out_cols, bool defer) {
  const int KVH = cfg_.n_kv_heads;
  const int64_t nb = (L.len + cfg_.block_size - 1) / cfg_.block_size;
  const int n_sets = req.mode == HeadMode::SHARED ? 1 : KVH;
  const bool linear = linear_anchors(cfg_.anchor_type);
  if (req.allowed && linear) {
    if (const CandCache* C = cand_cache(L, layer, nb, n_sets, req)) {
      if (defer) return C;
      select_cached(*C, req, out_ids, out_cols);
      return nullptr;
    }
  } else {
    build_runs(nb, n_sets, &req);
  }
  const auto t0 = Clock::now();
  bool keep_all;  // every set keeps all its candidates (SnapKV: k = the preselected blocks): no scores
  const int64_t kcap = check_k(req, n_sets, out_cols, [&](int s) { return runs_[s].prefix.back(); }, &keep_all);
  if (keep_all) {
    for (int s = 0; s < n_sets; ++s) {
      int32_t* row = out_ids + s * int64_t(out_cols);
      int64_t n = 0;
      runs_[s].each([&](int32_t b) { row[n++] = b; });
      std::fill(row + n, row + out_cols, -1);
    }
    timing_.score_s = 0;
    timing_.topk_s = seconds_since(t0);
    return nullptr;
  }
  scores_.resize(size_t(n_sets) * nb);
  score_runs(L, H, req.mode, scores_.data());
  const auto t1 = Clock::now();
  timing_.score_s = std::chrono::duration<double>(t1 - t0).count();

  // Few candidates per kept block (k >= n / kHeapRatio): top_k over a copy of the candidates' scores
  // (the k-th best score in O(n) branch-free passes, then, in ascending id order, every candidate above it
  // and the first ones equal to it). Many: stream the candidates (ascending ids) through a k-heap; almost every one
  // then loses to the worst kept at the first comparison, one predictable pass. Both keep exactly the top k
  // under the strict order of heap_less (higher score, then the lower id); NaN scores count as -inf.
  constexpr int64_t kHeapRatio = 64;
  auto partition = [&](int s) {
    const int64_t n = runs_[s].prefix.back(), k = std::min<int64_t>(req.k_per_set[s], n);
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
  const int topk_threads = n_sets > 1 && n_cand >= kParallelTopk ? cfg_.threads_num : 1;
  ThreadPool::global().parallel_for(n_sets, topk_threads, [&](int64_t s) {
    const Runs& R = runs_[s];
    const int64_t k = std::min<int64_t>(req.k_per_set[s], R.prefix.back());
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
  timing_.topk_s = seconds_since(t1);
  return nullptr;
}

// ---- attention ----

void KVStore::attend_locked(const Layer& L, int H, const BlockSets& bsets, bool validate, float* out, float* lse,
                            const Prologue* pre, const CandCache* kvc) {
  const auto t0 = Clock::now();
  const int D = cfg_.head_dim, KVH = cfg_.n_kv_heads, G = H / KVH, bs = cfg_.block_size;
  const int64_t nb = (L.len + bs - 1) / bs;
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
  int64_t n_sel = 0;
  for (int h = 0; h < KVH; ++h) n_sel += count[h];
  int threads = n_sel * int64_t(tile_bytes_) * 2 >= kParallelBytes ? cfg_.threads_num : 1;
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
  const KVType kt = cfg_.kv_type;
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
  // Tiles [a, a + per_run) of head h's selected blocks, ending at j1.
  // Cached candidates: their tiles are read from the cache's copy (always full blocks), at the slots.
  auto fill = [&](Tiles& t, int h, int64_t a, int64_t j1) {
    const int64_t set = bsets.n_sets == 1 ? 0 : h;
    const int32_t* row = row_of(h);
    const int32_t* slot = kvc ? slots_.data() + set * bsets.cols : nullptr;
    const int jh = kvc && kvc->mode == HeadMode::SHARED ? h : 0;
    t.count = 0;
    for (int64_t j = a; j < std::min(j1, a + per_run); ++j, ++t.count) {
      const int64_t b = row[j];
      t.k[t.count] = kvc ? cand_tile(*kvc, int(set), jh, slot[j]) : k_tile(L, h, b);
      t.v[t.count] = t.k[t.count] + tile_bytes_;
      t.n[t.count] = b == nb - 1 ? int(L.len - b * bs) : bs;  // the last block may be partial
    }
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
    const float* q = qs_.data() + size_t(h) * G * D;
    Tiles cur, nxt;
    fill(cur, h, j0, j1);
    if (!*warm)  // the first run is requested up front, unless the previous task already did
      for (int i = 0; i < cur.count; ++i) {
        prefetch_l2(cur.k[i], tile_bytes_);
        prefetch_l2(cur.v[i], tile_bytes_);
      }
    int64_t following = -1;
    *warm = false;
    for (int64_t j = j0; j < j1; j += per_run) {
      fill(nxt, h, j + per_run, j1);
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
      if (simd) avx2::attend_tiles(kt, D, G, q, cur, scale_off_, s, m, l, acc, nxt.count ? &nxt : nullptr);
      else scalar::attend_tiles(kt, D, G, q, cur, scale_off_, s, m, l, acc, nxt.count ? &nxt : nullptr);
      cur = nxt;
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
  timing_.attend_s = seconds_since(t0);
}

// ---- entry points ----

void KVStore::block_scores(int layer, const float* q, int H, HeadMode mode, float* out) {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  prepare_query(q, H);
  build_runs((L.len + cfg_.block_size - 1) / cfg_.block_size, mode == HeadMode::SHARED ? 1 : cfg_.n_kv_heads, nullptr);
  score_runs(L, H, mode, out);
}

void KVStore::select(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols) {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  prepare_query(q, H);
  select_locked(L, layer, H, req, out_ids, out_cols);
}

void KVStore::attend(int layer, const float* q, int H, const BlockSets& blocks, float* out, float* lse) {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  if (blocks.n_sets != 1 && blocks.n_sets != cfg_.n_kv_heads)
    throw std::invalid_argument("blocks: expected 1 (shared) or n_kv_heads=" + std::to_string(cfg_.n_kv_heads) +
                                " rows, got " + std::to_string(blocks.n_sets));
  prepare_query(q, H);
  timing_ = StageTiming{};
  attend_locked(L, H, blocks, true, out, lse);
}

void KVStore::select_attend(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids,
                            int out_cols, float* out, float* lse) {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  prepare_query(q, H);
  const auto t0 = Clock::now();
  const int KVH = cfg_.n_kv_heads, n_sets = req.mode == HeadMode::SHARED ? 1 : KVH;
  const BlockSets bsets{out_ids, n_sets, out_cols};
  const CandCache* C = select_locked(L, layer, H, req, out_ids, out_cols, /*defer=*/true);
  if (C) cand_tiles(L, cand_[layer]);  // the attention reads the candidates' tiles from the cache's copy
  Prologue pre;
  pre.threads = 0;  // set by cached_prepare when the sets need their pass
  if (C && !cached_prepare(*C, req, out_ids, out_cols, &pre.threads)) {  // every set keeps all its candidates
    timing_.score_s = 0;
    timing_.topk_s = seconds_since(t0);
  }
  if (!C || !pre.threads) return attend_locked(L, H, bsets, false, out, lse, nullptr, C);
  // Cached candidates (SnapKV): each set's selection runs in the attention's dispatch (Prologue).
  count_pre_.resize(KVH);
  for (int h = 0; h < KVH; ++h) {
    const int s = n_sets == 1 ? 0 : h;
    count_pre_[h] = std::min<int64_t>(req.k_per_set[s], C->count[s]);
  }
  struct Ctx {
    KVStore* st;
    const CandCache* C;
    const SelectRequest* req;
    int32_t* ids;
    int cols;
  } ctx{this, C, &req, out_ids, out_cols};
  pre.n = n_sets;
  pre.count = count_pre_.data();
  pre.ctx = &ctx;
  pre.run = [](void* p, int s) {
    auto* c = static_cast<Ctx*>(p);
    c->st->cached_set(*c->C, *c->req, s, c->ids, c->cols);
  };
  attend_locked(L, H, bsets, false, out, lse, &pre, C);
  // The stages overlap in one pass: score and top-k are their tasks' time over the threads, attend the rest.
  const int spread = std::max(1, std::min(pre.threads, n_sets));
  double score = 0, topk = 0;
  for (int s = 0; s < n_sets; ++s) {
    score += score_task_s_[s];
    topk += topk_task_s_[s];
  }
  const double total = seconds_since(t0);
  timing_.score_s = std::min(total, score / spread);
  timing_.topk_s = std::min(total - timing_.score_s, topk / spread);
  timing_.attend_s = total - timing_.score_s - timing_.topk_s;
}

}  // namespace ktq
