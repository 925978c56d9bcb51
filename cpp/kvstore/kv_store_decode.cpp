// The KV store's decode operations (kv_store.h): block scores, SnapKV's scores, select, attend and select_attend,
// each under the store's lock, handing the work to the selector, the candidate caches and the attention.
#include "kvstore/kv_store.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/finite.h"

namespace ktq {

void KVStore::check_q(const float* q, int H, const QueryVariants& var) const {
  const int KVH = lay_.cfg.n_kv_heads;
  if (H < 1 || H % KVH != 0)
    throw std::invalid_argument("q has " + std::to_string(H) + " heads: must be a positive multiple of n_kv_heads=" +
                                std::to_string(KVH) + " (GQA)");
  if (!(var.n == 1 || (var.n == 3 && 0 <= var.succ && var.succ <= var.intra)))
    throw std::invalid_argument("query rotations: " + std::to_string(var.n) + " with bounds (" +
                                std::to_string(var.succ) + ", " + std::to_string(var.intra) +
                                ") are not allowed: 1, or 3 with 0 <= succ <= intra (dual chunk attention)");
  check_finite_q(q, int64_t(var.n) * H, lay_.cfg.head_dim);
}

// ---- selection ----

bool KVStore::block_scores(int layer, const float* q, int H, HeadMode mode, int64_t nb, float* out,
                           const QueryVariants& var) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  check_q(q, H, var);
  if (lay_.n_blocks(L) != nb) return false;
  sel_.set_query(q, H, var);
  sel_.build_runs(nb, mode == HeadMode::SHARED ? 1 : lay_.cfg.n_kv_heads, nullptr);
  sel_.score_runs(L, H, mode, out);
  return true;
}

bool KVStore::group_bounds(int layer, const float* q, int H, HeadMode mode, int64_t ng, double* out,
                           const QueryVariants& var) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  check_index();
  check_q(q, H, var);
  if (lay_.n_groups(lay_.n_blocks(L)) != ng) return false;
  sel_.set_query(q, H, var);
  sel_.group_bounds(L, H, mode, out);
  return true;
}

void KVStore::snapkv_scores(int layer, const SnapKVRequest& r, float* out) {
  std::lock_guard<std::mutex> lk(mu_);
  snap_.run(layer_at(layer), r, out);
}

void KVStore::select(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                     const QueryVariants& var) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  check_q(q, H, var);
  sel_.set_query(q, H, var);
  if (req.rerank > 1) rerank_.set_query(q, H, var);
  select_locked(L, layer, H, req, out_ids, out_cols);
}

CandCache* KVStore::select_locked(const StoreLayer& L, int layer, int H, const SelectRequest& req, int32_t* out_ids,
                                  int out_cols, bool defer) {
  const int n_sets = req.mode == HeadMode::SHARED ? 1 : lay_.cfg.n_kv_heads;
  const int64_t nb = lay_.n_blocks(L);
  const int R = req.rerank;
  if (R < 1 || R > kMaxRerank)
    throw std::invalid_argument("rerank must be in [1, " + std::to_string(kMaxRerank) + "] (1 = off), got " +
                                std::to_string(R));
  timing_.rerank_s = 0;
  reranked_ = false;
  // A candidate list: the layer's cached copy, unless a candidate is a partial block (then the selector goes on
  // with the runs lookup() built). (The first stage's request has the same candidates and exclusions.)
  const SelectRequest& first = R > 1 ? rerank_.widen(req, n_sets, R) : req;
  CandCache* C = nullptr;
  if (req.allowed && linear_anchors(lay_.cfg.anchor_type)) C = cand_.lookup(L, layer, nb, n_sets, first, sel_);
  else sel_.build_runs(nb, n_sets, &first);
  bool keep_all = true;  // (every set keeps all its candidates: no second stage to run)
  if (R > 1)
    check_k(req, n_sets, out_cols, [&](int s) { return C ? C->count[s] : sel_.runs()[s].prefix.back(); }, &keep_all);
  if (keep_all) {
    if (!C) sel_.select_runs(L, H, req, out_ids, out_cols, timing_);
    else if (!defer) cand_.select(*C, req, sel_, out_ids, out_cols, timing_);
    return C;
  }
  // The second stage (rerank.h; never deferred): the first stage's R k picks a set, then the cut by mass.
  const int cols = MassRerank::wide_cols(out_cols, R, nb);
  wide_ids_.resize(size_t(n_sets) * cols);
  if (C) {
    cand_.select(*C, first, sel_, wide_ids_.data(), cols, timing_);
    cand_.copy_tiles(L, *C);  // (the stage reads the picks' K from the candidates' compact copy, as attention does)
  } else {
    sel_.select_runs(L, H, first, wide_ids_.data(), cols, timing_);
  }
  rerank_.run(L, H, req, n_sets, wide_ids_.data(), cols, out_ids, out_cols, timing_, &cand_, C);
  reranked_ = true;
  for (int s = 0; C && s < n_sets; ++s) cand_.set_slots(*C, s, out_ids + int64_t(s) * out_cols, out_cols);
  return C;
}

void KVStore::cache_candidates(int layer, const SelectRequest& req) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (!req.allowed || !linear_anchors(lay_.cfg.anchor_type)) return;
  const int n_sets = req.mode == HeadMode::SHARED ? 1 : lay_.cfg.n_kv_heads;
  if (CandCache* C = cand_.lookup(L, layer, lay_.n_blocks(L), n_sets, req, sel_)) cand_.copy_tiles(L, *C);
}

// ---- attention ----

void KVStore::attend(int layer, const float* q, int H, const BlockSets& blocks, float* out, float* lse,
                     float* block_lse, const QueryVariants& var) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (blocks.n_sets != 1 && blocks.n_sets != lay_.cfg.n_kv_heads)
    throw std::invalid_argument("blocks: expected 1 (shared) or n_kv_heads=" + std::to_string(lay_.cfg.n_kv_heads) +
                                " rows, got " + std::to_string(blocks.n_sets));
  check_q(q, H, var);
  attn_.set_query(q, H, var);
  timing_ = StageTiming{};
  attn_.run(L, H, blocks, true, out, lse, timing_, nullptr, nullptr, nullptr, block_lse);
}

void KVStore::select_attend(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids,
                            int out_cols, float* out, float* lse, const QueryVariants& var) {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  check_q(q, H, var);
  sel_.set_query(q, H, var);
  attn_.set_query(q, H, var);
  const auto t0 = Clock::now();
  const int n_sets = req.mode == HeadMode::SHARED ? 1 : lay_.cfg.n_kv_heads;
  const BlockSets bsets{out_ids, n_sets, out_cols};
  const bool sticky = lay_.cfg.sticky_blocks > 0;
  float* blse = nullptr;  // each attended block's LSE, for the next step's sticky blocks
  if (sticky) {
    sticky_forced(L, layer, req, n_sets);
    block_lse_.resize(size_t(lay_.cfg.n_kv_heads) * out_cols * (H / lay_.cfg.n_kv_heads));
    blse = block_lse_.data();
  } else {
    forced_cols_ = 0;  // (none from a step before set_sticky_blocks(0))
  }
  // Cached candidates are selected set by set inside the attention's dispatch, unless Ada-KV's budgets need
  // every set's scores before any set's top k, or a second stage every set's first picks (then select_locked
  // selects them all first).
  const bool in_pass = !req.ada && req.rerank == 1;  // (a second stage needs every set's first picks)
  if (req.rerank > 1) rerank_.set_query(q, H, var);
  CandCache* C = select_locked(L, layer, H, req, out_ids, out_cols, /*defer=*/in_pass);
  if (C) cand_.copy_tiles(L, *C);  // the attention reads the candidates' tiles from the cache's copy
  SparseAttention::Prologue pre;
  pre.threads = 0;  // set by prepare when the sets need their pass
  if (C && in_pass && !cand_.prepare(*C, req, out_ids, out_cols, &pre.threads)) {  // every set keeps all
    timing_.score_s = 0;
    timing_.topk_s = seconds_since(t0);
  }
  if (!C || !pre.threads) {
    // (in the pass every candidate was kept: the forced ones, candidates too, are among them)
    if (forced_cols_ && (!C || !in_pass))
      for (int s = 0; s < n_sets; ++s) sticky_apply(L, H, req, s, out_ids + s * int64_t(out_cols), out_cols, C);
    attn_.run(L, H, bsets, false, out, lse, timing_, nullptr, &cand_, C, blse);
    if (C && !in_pass)  // (the cache's lookup and tile copy count with the attention, as in the pass)
      timing_.attend_s = std::max(0.0, seconds_since(t0) - timing_.score_s - timing_.topk_s - timing_.rerank_s);
    if (sticky) sticky_record(L, layer, H, bsets, lse);
    return;
  }
  // Cached candidates (SnapKV): each set's selection runs in the attention's dispatch (Prologue).
  struct Ctx {
    KVStore* store;
    const StoreLayer* L;
    int H;
    const CandCache* C;
    const SelectRequest* req;
    int32_t* ids;
    int cols;
  } ctx{this, &L, H, C, &req, out_ids, out_cols};
  pre.n = n_sets;
  pre.count = cand_.head_counts(*C, req);
  pre.ctx = &ctx;
  pre.run = [](void* p, int s) {
    auto* c = static_cast<Ctx*>(p);
    c->store->cand_.select_set(*c->C, *c->req, c->store->sel_, s, c->ids, c->cols);
    if (c->store->forced_cols_)
      c->store->sticky_apply(*c->L, c->H, *c->req, s, c->ids + s * int64_t(c->cols), c->cols, c->C);
  };
  attn_.run(L, H, bsets, false, out, lse, timing_, &pre, &cand_, C, blse);
  // The stages overlap in one pass: score and top-k are their tasks' time over the threads, attend the rest.
  const int spread = std::max(1, std::min(pre.threads, n_sets));
  double score = 0, topk = 0;
  for (int s = 0; s < n_sets; ++s) {
    score += cand_.score_task_s()[s];
    topk += cand_.topk_task_s()[s];
  }
  const double total = seconds_since(t0);
  timing_.score_s = std::min(total, score / spread);
  timing_.topk_s = std::min(total - timing_.score_s, topk / spread);
  timing_.attend_s = total - timing_.score_s - timing_.topk_s;
  if (sticky) sticky_record(L, layer, H, bsets, lse);
}

}  // namespace ktq
