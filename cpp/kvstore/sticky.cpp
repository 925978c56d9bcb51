// Sticky blocks (StoreConfig::sticky_blocks = R): the R blocks of each set that took the largest share of
// its query heads' attention at a layer's decode step, and the block after each, stay selected at that
// layer's next step. A number copied digit by digit is read from consecutive keys of one block (or the next
// one); the anchors' bounds alone often rank that block below the top k at the step after it was read.
//
// A step's blocks are for the layer's next token (taken at select_attend, current once that step's token is
// appended: a step refused before its append, or a token rolled back, leaves the layer as it was).
//
// Forced blocks are candidates of the new step (not excluded, in the candidate list if any), at most k of
// them; the step keeps exactly its k picks: the forced ones, then the best of the others by their scores (after
// a second stage, rerank.h: by their masses).
// Since its top k already holds the best k - |forced| of the others, that is a rewrite of its picks (the
// lowest-scored unforced ones give way), the same after the flat scan, the index or the candidate cache.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "kvstore/kv_store.h"

namespace ktq {

void KVStore::sticky_rotate(int layer, int64_t old_len, int64_t T) {
  StickyLayer& S = sticky_[layer];
  if (T == 1 && S.next.len == old_len) {  // the token of the step that took `next`: they are for the one after
    S.prev = std::move(S.cur);
    S.cur = std::move(S.next);
    S.cur.len = old_len + 1;
  } else {  // a prompt, or a token appended without its selection: nothing follows
    S.cur.len = S.prev.len = -1;
  }
  S.next.len = -1;
}

void KVStore::sticky_rewind(int layer, int64_t n) {
  StickyLayer& S = sticky_[layer];
  if (S.cur.len != n) {  // a token rolled back (its step's blocks are current again), or a rewind: none
    if (S.prev.len == n) S.cur = std::move(S.prev);
    else S.cur.len = -1;
  }
  S.prev.len = S.next.len = -1;
}

void KVStore::sticky_forced(const StoreLayer& L, int layer, const SelectRequest& req, int n_sets) {
  const Sticky& st = sticky_[layer].cur;
  forced_cols_ = 0;
  if (st.len != L.len || st.n_sets != n_sets) return;  // not the step they were taken for
  const int64_t nb = lay_.n_blocks(L);
  forced_.assign(size_t(n_sets) * st.cols, -1);
  for (int s = 0; s < n_sets; ++s) {
    int n = 0;
    for (int i = 0; i < st.cols; ++i) {
      const int32_t b = st.ids[size_t(s) * st.cols + i];
      bool ok = b >= 0 && b < nb;
      for (int e = 0; ok && e < req.n_exclude; ++e) ok = !(b >= req.exclude[2 * e] && b < req.exclude[2 * e + 1]);
      if (ok) forced_[size_t(s) * st.cols + n++] = b;
    }
  }
  forced_cols_ = st.cols;
}

void KVStore::sticky_apply(const StoreLayer& L, int H, const SelectRequest& req, int s, int32_t* row, int cols,
                           const CandCache* C) {
  int n = 0;  // the set's picks, ascending
  while (n < cols && row[n] >= 0) ++n;
  const int32_t* f = forced_.data() + size_t(s) * forced_cols_;
  const int32_t* allowed = req.allowed ? req.allowed + size_t(s) * req.allowed_cols : nullptr;
  const int32_t* cand = C ? C->ids.data() + s * C->stride : nullptr;
  // The forced blocks that are candidates, in order of share, at most n.
  int32_t want[2 * kMaxStickyBlocks];
  int nw = 0;
  for (int i = 0; i < forced_cols_ && f[i] >= 0 && nw < n; ++i) {
    const int32_t b = f[i];
    if (cand ? !std::binary_search(cand, cand + C->count[s], b)
             : allowed && std::find(allowed, allowed + req.allowed_cols, b) == allowed + req.allowed_cols)
      continue;
    if (std::find(want, want + nw, b) == want + nw) want[nw++] = b;
  }
  int missing = 0;
  for (int i = 0; i < nw; ++i) missing += !std::binary_search(row, row + n, want[i]);
  if (!missing) return;
  // The unforced picks by score, lowest first (equal scores: the higher id first, as top k keeps the lower).
  thread_local std::vector<std::pair<float, int32_t>> rest;  // (sets run on several threads at once)
  rest.clear();
  const int32_t* slot = C ? cand_.slots() + s * int64_t(cols) : nullptr;
  for (int i = 0; i < n; ++i)
    if (std::find(want, want + nw, row[i]) == want + nw) {
      // The score that chose the pick: the second stage's mass, the candidates' copy's (int8 with
      // int8_candidates), else the anchors'.
      const float v = reranked_ ? float(rerank_.mass_of(s, row[i]))
                      : C       ? cand_.score(*C, s, slot[i])
                                : sel_.score_block(L, H, req.mode, s, row[i]);
      rest.emplace_back(std::isnan(v) ? -std::numeric_limits<float>::infinity() : v, row[i]);  // NaN: as top k
    }
  std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  });
  int m = 0;
  for (size_t i = missing; i < rest.size(); ++i) row[m++] = rest[i].second;
  for (int i = 0; i < nw; ++i) row[m++] = want[i];
  std::sort(row, row + m);
  if (C) cand_.set_slots(*C, s, row, cols);
}

void KVStore::sticky_record(const StoreLayer& L, int layer, int H, const BlockSets& bsets, const float* lse) {
  const int KVH = lay_.cfg.n_kv_heads, G = H / KVH, R = lay_.cfg.sticky_blocks;
  const int64_t nb = lay_.n_blocks(L);
  Sticky& st = sticky_[layer].next;  // for the step after this one, once this step's token is appended
  st.n_sets = bsets.n_sets;
  st.cols = 2 * R;
  st.ids.assign(size_t(st.n_sets) * st.cols, -1);
  st.len = L.len;
  thread_local std::vector<std::pair<double, int32_t>> share;
  for (int s = 0; s < bsets.n_sets; ++s) {
    const int32_t* row = bsets.ids + s * int64_t(bsets.cols);
    int n = 0;
    while (n < bsets.cols && row[n] >= 0) ++n;
    share.assign(n, {0.0, 0});
    for (int j = 0; j < n; ++j) share[j].second = row[j];
    const int h0 = bsets.n_sets == 1 ? 0 : s, h1 = bsets.n_sets == 1 ? KVH : s + 1;  // SHARED: every head
    for (int h = h0; h < h1; ++h)
      for (int g = 0; g < G; ++g) {
        const float l = lse[h * G + g];
        if (!std::isfinite(l)) continue;
        for (int j = 0; j < n; ++j) share[j].first += std::exp(double(block_lse_[(size_t(h) * bsets.cols + j) * G + g] - l));
      }
    // The R largest shares (equal shares: the lower id), each then the block after it.
    const int r = std::min(R, n);
    std::partial_sort(share.begin(), share.begin() + r, share.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    int32_t* out = st.ids.data() + size_t(s) * st.cols;
    int m = 0;
    for (int i = 0; i < r; ++i)
      for (const int32_t b : {share[i].second, share[i].second + 1})
        if (b < nb && std::find(out, out + m, b) == out + m) out[m++] = b;
  }
}

}  // namespace ktq
