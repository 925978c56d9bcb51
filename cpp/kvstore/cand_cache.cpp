// The store's candidate caches (cand_cache.h): building and extending a layer's copies, and the selection
// over them.
#include "kvstore/cand_cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "select/topk.h"

namespace ktq {

CandLayout::CandLayout(const StoreLayout& lay, HeadMode mode)
    : n_sets(mode == HeadMode::SHARED ? 1 : lay.cfg.n_kv_heads),
      heads(mode == HeadMode::SHARED ? lay.cfg.n_kv_heads : 1),
      row(size_t(lay.A) * lay.cfg.head_dim * (lay.cfg.int8_candidates ? 1 : lay.anchor_elem_bytes())),
      scaled(lay.cfg.int8_candidates),
      tiles(2 * lay.tile_bytes) {}

size_t CandLayout::bytes(int64_t room) const {
  auto mul = [](size_t a, size_t b) { return checked_mul(a, b, "candidate copy bytes"); };
  auto add = [](size_t a, size_t b) { return checked_add(a, b, "candidate copy bytes"); };
  const size_t per = add(mul(heads, add(add(row, scaled ? 4 : 0), tiles)), 4);  // one candidate of one set
  return mul(mul(n_sets, size_t(room)), per);
}

size_t candidate_copy_bytes(const StoreConfig& c, HeadMode mode, int64_t room) {
  const StoreLayout lay(c);
  if (room < 0) throw std::invalid_argument("candidate room must be >= 0, got " + std::to_string(room));
  if (!linear_anchors(c.anchor_type)) return 0;
  return checked_mul<size_t>(CandLayout(lay, mode).bytes(room), c.n_layers, "candidate copy bytes");
}

CandCaches::CandCaches(const StoreLayout& lay) : lay_(lay), cand_(size_t(lay.cfg.n_layers)) {}

size_t CandCaches::nbytes() const {
  size_t total = 0;
  for (const CandCache& C : cand_)
    total += C.anchors.size() + C.scales.size() * 4 + C.ids.size() * 4 + C.kv.size();
  return total;
}

// ---- building ----

// scale = max |x| / 127, nudged up until 127 * scale >= max |x|, so every rounded value fits in [-127, 127].
// QUEST's row is [min (D), max (D)]: min elements are rounded down and max elements up (then x <= q * scale
// for a max, >= for a min, checked in fp32), so sum_d max(q_d min_d, q_d max_d) over the int8 bounds is >=
// the score over the stored ones for every q: still an upper bound of q.k. Other linear anchors: nearest.
void CandCaches::quantize_anchor_row(const uint8_t* src, int8_t* dst, float* scale) const {
  const int L = lay_.A * lay_.cfg.head_dim;
  thread_local std::vector<float> x;
  x.resize(L);
  if (lay_.a16) decode_row(KVType::FP16, src, nullptr, L, x.data());
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
  const bool quest = lay_.cfg.anchor_type == AnchorType::QUEST;
  for (int i = 0; i < L; ++i) {
    float r = x[i] / s;
    if (!quest) {
      r = std::nearbyint(r);
    } else if (i < lay_.cfg.head_dim) {  // min: q * s <= x
      r = std::floor(r);
      while (r > -127.f && r * s > x[i]) r -= 1.f;
    } else {  // max: q * s >= x
      r = std::ceil(r);
      while (r < 127.f && r * s < x[i]) r += 1.f;
    }
    dst[i] = int8_t(std::clamp(r, -127.f, 127.f));
  }
}

CandCache* CandCaches::lookup(const StoreLayer& L, int layer, int64_t nb, int n_sets, const SelectRequest& req,
                              BlockSelector& sel) {
  key_.clear();
  key_.push_back(int64_t(req.mode));
  key_.push_back(req.allowed_cols);
  key_.insert(key_.end(), req.allowed, req.allowed + int64_t(n_sets) * req.allowed_cols);
  key_.push_back(req.n_exclude);
  key_.insert(key_.end(), req.exclude, req.exclude + 2 * int64_t(req.n_exclude));
  CandCache& C = cand_[layer];
  // Hit: the same request on the same blocks. The layer only grew since (a truncate bumps gen), so the
  // candidates are still in range and still full blocks.
  if (C.valid && C.gen == L.gen && C.key == key_) return &C;
  C.valid = false;
  sel.build_runs(nb, n_sets, &req);  // validates the ids
  int64_t max_id = -1, need = 0;  // highest candidate id; most candidates of a set
  for (const BlockSelector::Runs& R : sel.runs()) {
    if (!R.start.empty()) max_id = std::max<int64_t>(max_id, R.start.back() + R.len.back() - 1);
    need = std::max(need, R.prefix.back());
  }
  if (max_id >= L.len / lay_.cfg.block_size) return nullptr;  // a partial block's anchors still change
  const CandLayout shape(lay_, req.mode);
  const int heads = shape.heads;
  const size_t row = shape.row;
  // A decode step's request changes whenever a block leaves the local window: that block joins the
  // candidates (after every one of them) and the exclusion moves. Then every set's old candidates are the
  // prefix of its new ones, and only the new ones' anchors are copied (a full block's anchors never change;
  // a truncate bumps gen), where a rebuild would copy every candidate's anchors again, every few tokens.
  bool extend = C.built && C.gen == L.gen && C.mode == req.mode && int64_t(C.count.size()) == n_sets &&
                need <= C.stride;
  for (int s = 0; extend && s < n_sets; ++s) {
    const int32_t* old = C.ids.data() + s * C.stride;
    int64_t n = 0;
    extend = C.count[s] <= sel.runs()[s].prefix.back();
    sel.runs()[s].each([&](int32_t b) {
      if (n < C.count[s] && old[n] != b) extend = false;
      ++n;
    });
  }
  if (!extend) {
    C.built = false;
    C.mode = req.mode;
    C.stride = candidate_room(need);
    C.ids.assign(size_t(n_sets) * C.stride, -1);
    C.count.assign(n_sets, 0);
    C.anchors.resize(size_t(n_sets) * heads * C.stride * row);
    C.kv_count.assign(n_sets, 0);  // copy_tiles copies them all again
    if (shape.scaled) C.scales.resize(size_t(n_sets) * heads * C.stride);
  }
  for (int s = 0; s < n_sets; ++s) {
    int64_t n = 0;
    sel.runs()[s].each([&](int32_t b) {
      if (n >= C.count[s]) {
        ++copies_;
        C.ids[s * C.stride + n] = b;
        for (int j = 0; j < heads; ++j) {
          const int h = heads == 1 ? s : j;
          const size_t at = (size_t(s) * heads + j) * C.stride + n;
          if (shape.scaled)
            quantize_anchor_row(lay_.anchor_bytes(L, h, b), reinterpret_cast<int8_t*>(C.anchors.data() + at * row),
                                C.scales.data() + at);
          else
            std::memcpy(C.anchors.data() + at * row, lay_.anchor_bytes(L, h, b), row);
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

// ---- selection ----

bool CandCaches::prepare(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols, int* threads) {
  const CandLayout shape(lay_, C.mode);
  const int n_sets = int(C.count.size()), heads = shape.heads;
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
  const int64_t bytes = n_cand * heads * int64_t(shape.row);
  *threads = bytes >= kParallelBytes ? lay_.cfg.threads_num : 1;
  return true;
}

void CandCaches::select_set(const CandCache& C, const SelectRequest& req, const BlockSelector& sel, int s,
                            int32_t* out_ids, int out_cols) {
  const int64_t n = C.count[s], k = std::min<int64_t>(req.k_per_set[s], n);
  if (k >= n || k == 0) return cut_set(C, s, k, out_ids, out_cols);
  score_set(C, sel, s);
  cut_set(C, s, k, out_ids, out_cols);
}

void CandCaches::score_set(const CandCache& C, const BlockSelector& sel, int s) {
  const auto t0 = Clock::now();
  const CandLayout shape(lay_, C.mode);
  const int heads = shape.heads;
  const size_t row = shape.row;
  float* sc = cscores_.data() + s * C.stride;
  const int32_t* ids = C.ids.data() + s * C.stride;  // ascending
  const QueryVariants& var = sel.variants();
  for (int64_t i = 0; i < C.count[s];) {  // pieces of candidates that one query rotation scores (dual chunk)
    const int64_t e = std::lower_bound(ids + i, ids + C.count[s], var.end_of(ids[i])) - ids;
    for (int j = 0; j < heads; ++j) {  // SHARED: every head's score summed in head order, as score_runs does
      const size_t at = (size_t(s) * heads + j) * C.stride + i;
      sel.score_linear_rows(C.anchors.data() + at * row, e - i, heads == 1 ? s : j, sc + i, j > 0,
                            shape.scaled ? C.scales.data() + at : nullptr, var.of(ids[i]));
    }
    i = e;
  }
  score_task_s_[s] = seconds_since(t0);
}

void CandCaches::cut_set(const CandCache& C, int s, int64_t k, int32_t* out_ids, int out_cols) {
  const auto t0 = Clock::now();
  const int64_t n = C.count[s];
  int32_t* row_out = out_ids + s * int64_t(out_cols);
  int32_t* slot_out = slots_.data() + s * int64_t(out_cols);  // positions in the set's candidates
  if (k >= n || k == 0) {  // all of them or none: no scores needed
    if (k > 0) std::copy(C.ids.begin() + s * C.stride, C.ids.begin() + s * C.stride + n, row_out);
    std::iota(slot_out, slot_out + k, 0);
    std::fill(row_out + k, row_out + out_cols, -1);
    return;
  }
  const int64_t m = (use_avx2() ? avx2::top_k : scalar::top_k)(cscores_.data() + s * C.stride, n, k, nullptr,
                                                                slot_out, topkeys_.data() + s * C.stride);
  for (int64_t i = 0; i < m; ++i) row_out[i] = C.ids[s * C.stride + slot_out[i]];
  std::fill(row_out + m, row_out + out_cols, -1);
  topk_task_s_[s] = seconds_since(t0);
}

void CandCaches::select(const CandCache& C, const SelectRequest& req, const BlockSelector& sel, int32_t* out_ids,
                        int out_cols, StageTiming& t) {
  const auto t0 = Clock::now();
  const int n_sets = int(C.count.size());
  int threads = 1;
  if (!prepare(C, req, out_ids, out_cols, &threads)) {
    t.score_s = 0;
    t.topk_s = seconds_since(t0);
    return;
  }
  if (!req.ada) {
    ThreadPool::global().parallel_for(n_sets, threads,
                                      [&](int64_t s) { select_set(C, req, sel, int(s), out_ids, out_cols); });
  } else {  // Ada-KV: every set's scores, the budgets from all of them, then each set's top k
    ThreadPool::global().parallel_for(n_sets, threads, [&](int64_t s) { score_set(C, sel, int(s)); });
    ada_.scores.clear();
    ada_.counts = C.count;
    for (int s = 0; s < n_sets; ++s) {
      const auto row = cscores_.begin() + s * C.stride;
      ada_.scores.insert(ada_.scores.end(), row, row + C.count[s]);
    }
    const int32_t* k = ada_.split(req);
    ThreadPool::global().parallel_for(n_sets, threads, [&](int64_t s) { cut_set(C, int(s), k[s], out_ids, out_cols); });
  }
  // The two stages share the pass: top-k's share is its tasks' time over the threads, scoring the rest.
  const double total = seconds_since(t0);
  double topk = 0;
  for (double x : topk_task_s_) topk += x;
  t.topk_s = std::min(total, topk / std::min<int64_t>(threads, n_sets));
  t.score_s = total - t.topk_s;
}

void CandCaches::set_slots(const CandCache& C, int s, const int32_t* row, int cols) {
  const int32_t* ids = C.ids.data() + s * C.stride;
  int32_t* slot = slots_.data() + s * int64_t(cols);
  for (int i = 0; i < cols && row[i] >= 0; ++i)
    slot[i] = int32_t(std::lower_bound(ids, ids + C.count[s], row[i]) - ids);
}

const int64_t* CandCaches::head_counts(const CandCache& C, const SelectRequest& req) {
  const int KVH = lay_.cfg.n_kv_heads;
  head_counts_.resize(KVH);
  for (int h = 0; h < KVH; ++h) {
    const int s = req.mode == HeadMode::SHARED ? 0 : h;
    head_counts_[h] = std::min<int64_t>(req.k_per_set[s], C.count[s]);
  }
  return head_counts_.data();
}

// ---- the K/V copies ----

void CandCaches::copy_tiles(const StoreLayer& L, CandCache& C) {
  const CandLayout shape(lay_, C.mode);
  const int n_sets = int(C.count.size()), heads = shape.heads;
  const size_t bytes = size_t(n_sets) * heads * C.stride * shape.tiles;
  if (C.kv.size() != bytes) {
    C.kv = MappedBuffer(bytes);
    C.kv_count.assign(n_sets, 0);
  }
  for (int s = 0; s < n_sets; ++s) {
    copies_ += uint64_t(C.count[s] - std::min(C.kv_count[s], C.count[s]));
    for (int64_t n = C.kv_count[s]; n < C.count[s]; ++n)
      for (int j = 0; j < heads; ++j)  // a (head, block)'s K and V tiles are adjacent in the store
        std::memcpy(tile(C, s, j, n), lay_.k_tile(L, heads == 1 ? s : j, C.ids[s * C.stride + n]), shape.tiles);
    C.kv_count[s] = C.count[s];
  }
}

}  // namespace ktq
