// The KV store: per layer and per KV head, keys and values in blocks of `block_size` tokens, plus one
// set of block anchors per KV head that the decode step scores to pick the blocks worth attending.
// The byte layout and why: layout.h. The parts of a decode step, each owning its workspaces:
//   selection   select/selector.h     candidates, anchor scores, top k
//   candidates  kvstore/cand_cache.h  a preselected candidate list's compact copies
//   second stage kvstore/rerank.h     the anchors' picks weighed by attention mass (SelectRequest::rerank)
// and a layer's state as bytes for KV files (kv_store_io.cpp).
//   attention   kvstore/sparse_attn.h split-K attention over the selected blocks
// The store owns the memory and the lock; its methods are grouped by concept: storage (kv_store.cpp:
// append, read-back, truncate, incremental anchors) and the decode operations (kv_store_decode.cpp: scores,
// select, attend, select_attend).
//
// Threads: every operation runs on the shared ThreadPool with up to threads_num threads (thread_pool.h).
//
// Memory: capacity (max_seq_len) is reserved as address space per layer at construction (mmap,
// MAP_NORESERVE); the OS commits pages only as blocks are written, so nbytes() — the bytes of the
// blocks in use — is what the store really holds. Appending past max_seq_len throws before writing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/mapped_buffer.h"
#include "kvstore/cand_cache.h"
#include "kvstore/layout.h"
#include "kvstore/rerank.h"
#include "kvstore/sparse_attn.h"
#include "quant/kv_codec.h"
#include "select/request.h"
#include "select/selector.h"
#include "select/snapkv.h"

namespace ktq {

class KVStore {
 public:
  explicit KVStore(const StoreConfig& cfg);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  const StoreConfig& config() const { return lay_.cfg; }
  const StoreLayout& layout() const { return lay_; }
  int anchor_slots() const { return lay_.A; }  // A in the layout
  int anchor_elem_bytes() const { return lay_.anchor_elem_bytes(); }  // 2 = fp16 anchors (see the layout)
  int64_t max_blocks() const { return lay_.max_blocks; }
  int64_t length(int layer) const;
  int64_t n_blocks(int layer) const;
  size_t nbytes() const;          // bytes of the blocks in use (K, V, scales, anchors, bookkeeping)
  size_t reserved_bytes() const;  // address space reserved for max_seq_len
  size_t cand_nbytes() const;     // the candidate caches' copies (anchors, scales, ids, K/V tiles), all layers
  uint64_t cand_copies() const;   // candidates copied into them so far (cand_cache.h CandCaches::copies)

  // ---- storage (kv_store.cpp) ----
  // k, v: [T, KVH, D] in `in`; importance: [T, KVH] fp32 or null (DYNAMIC: a token without importance
  // only fills a free anchor slot). Throws (nothing written) past max_seq_len or on non-finite input.
  void append(int layer, const void* k, const void* v, InType in, int64_t T, const float* importance);
  // Throws what append(layer, k, v, in, T, importance) would throw now, and writes nothing (a caller that
  // must change nothing else before appending checks first: decode/layer_step.cpp).
  void check_append(int layer, const void* k, const void* v, InType in, int64_t T, const float* importance) const;
  // Reads that fill an output sized for n tokens or blocks (the caller looked at length() or n_blocks() before
  // this call took the lock): when the layer no longer holds exactly n (another thread appended or truncated
  // in between) they write nothing and return false, and the caller sizes its output again.
  // Dequantised copy of what is stored. k, v: [n = length, KVH, D] fp32.
  bool read(int layer, int64_t n, float* k, float* v) const;
  // Dequantised copy of tokens [t0, t1) (0 <= t0 <= t1 <= length). k, v: [t1 - t0, KVH, D] fp32.
  void read_range(int layer, int64_t t0, int64_t t1, float* k, float* v) const;
  // Keep the first n tokens of `layer` (-1 = every layer; 0 <= n <= length). The anchors of a now-partial
  // last block are recomputed from its stored keys (DYNAMIC keeps the surviving anchors: token
  // importances are not stored). Stale rows past n are overwritten by the next append.
  void truncate(int layer, int64_t n);
  // anchors: [KVH, nb = n_blocks, A, D], counts: [KVH, nb] (valid anchors per block); as read().
  bool read_anchors(int layer, int64_t nb, float* anchors, int32_t* counts) const;
  // The hierarchical index's rows as fp32: bounds [KVH, ng = n_groups, 2, D] (each group's min row, max row);
  // as read().
  // std::invalid_argument without an index (index_group 0).
  bool read_bounds(int layer, int64_t ng, float* bounds) const;
  int64_t n_groups(int layer) const;  // index groups of the layer's blocks (0 without an index)

  // ---- a layer's state as bytes (kv_store_io.cpp; KV files: ktquest/kv/files.py) ----
  // Every region's entries of the layer's blocks in use (each head's first n_blocks of K/V tiles, anchors,
  // bookkeeping, then its first n_groups index bounds), in a fixed order: what a store of the same
  // StoreConfig (max_seq_len aside) needs to hold the layer exactly. layer_bytes(layer, len): their size for
  // `len` tokens.
  size_t state_bytes(int64_t len) const;
  // Where the state of `len` tokens keeps each region: one piece per (region, KV head), in the state's order
  // (name: kv, anchors, n_anchor, sums, imp, pos, bounds; regions the store does not have are absent).
  struct StatePiece {
    const char* name;
    int head;
    size_t offset, bytes;
  };
  std::vector<StatePiece> state_pieces(int64_t len) const;
  void export_layer(int layer, uint8_t* out, size_t n) const;  // n == state_bytes(length(layer)), else throws
  // The layer becomes `len` tokens read from `in` (a KV file's bytes: untrusted). Throws std::invalid_argument,
  // with nothing changed, unless n == state_bytes(len), len <= max_seq_len and the state is one that appends
  // and truncates can make (check_state); the candidate copies of the layer are invalidated.
  void import_layer(int layer, int64_t len, const uint8_t* in, size_t n);
  // import_layer's checks alone (nothing changes): a KV file is checked whole before it replaces a cache.
  void check_import(int layer, int64_t len, const uint8_t* in, size_t n) const;

  // ---- the decode operations (kv_store_decode.cpp) ----
  // q: [H, D] fp32 (H a multiple of KVH), or with dual chunk attention [3, H, D] and `var` (select/request.h):
  // each block is scored and attended with the rotation var gives it. Unscaled block scores, summed over the query heads of each
  // KV head (SEPARATE: out [KVH, nb]) or over all heads (SHARED: out [nb]), nb = n_blocks; as read().
  bool block_scores(int layer, const float* q, int H, HeadMode mode, int64_t nb, float* out,
                    const QueryVariants& var = {});
  // The index's bound of every group for q (select/selector.h group_bounds): out [n_sets, ng] fp64 (SEPARATE:
  // n_sets = KVH, SHARED: 1), ng = n_groups; as read(). std::invalid_argument without an index.
  bool group_bounds(int layer, const float* q, int H, HeadMode mode, int64_t ng, double* out,
                    const QueryVariants& var = {});
  // Top-k blocks per set: out_ids [n_sets, out_cols], ascending, -1 padded. Ties -> lower block id. With
  // req.rerank > 1 (at most kMaxRerank, else std::invalid_argument) the second stage's k (rerank.h).
  void select(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
              const QueryVariants& var = {});
  // softmax(q K^T / sqrt(D)) V over the given blocks. out: [H, D], lse: [H] (natural log, -inf and a
  // zero row for a head with no block).
  // block_lse (optional): [KVH, blocks.cols, G] each block's own LSE per query head (SparseAttention::run).
  void attend(int layer, const float* q, int H, const BlockSets& blocks, float* out, float* lse,
              float* block_lse = nullptr, const QueryVariants& var = {});
  // The copies of req's candidate list (cand_cache.h: its anchor rows and K/V tiles) made now, so that a decode
  // step with the same candidates and exclusions finds them: SnapKV's candidates chosen as a prompt is read are
  // copied then, not by the first decode step. Nothing without a list, with anchors that are not linear, or
  // with a candidate that is a partial block (a step's selector reads those in place). Invalid ids throw as in
  // select(); req's k is not read.
  void cache_candidates(int layer, const SelectRequest& req);
  // select + attend in one call (the decode hot path).
  void select_attend(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                     float* out, float* lse, const QueryVariants& var = {});
  // SnapKV's block scores of `layer` by a prompt's last queries (select/snapkv.h): out [KVH, r.n_blocks].
  // std::invalid_argument naming the field for a request that does not fit the layer.
  void snapkv_scores(int layer, const SnapKVRequest& r, float* out);
  StageTiming last_timing() const;
  // What the last selection that the selector ran (not one served by the candidate copy) scored.
  IndexStats last_index_stats() const;
  // Selections walk the hierarchical index (the default) or scan every block (BlockSelector::set_walk_index).
  void set_walk_index(bool on);
  // StoreConfig::sticky_blocks from now on (0..kMaxStickyBlocks, else std::invalid_argument); the blocks kept
  // so far are dropped (the next step selects without any).
  void set_sticky_blocks(int R);

 private:
  const StoreLayer& layer_at(int layer) const;
  // append's checks: room for T more tokens (with mu_ held), and the values (non-finite, overflowing kv_type).
  void check_room(const StoreLayer& L, int layer, int64_t T) const;
  void check_rows(const void* k, const void* v, InType in, int64_t T, const float* importance) const;
  // Tokens [t0, t1) of L dequantised into k, v (with mu_ held, the range checked).
  void read_locked(const StoreLayer& L, int64_t t0, int64_t t1, float* k, float* v) const;
  // import_layer's checks of a state of `len` tokens at `in` (kv_store_io.cpp), before anything is copied:
  // every value a later operation indexes with or loops to (anchor counts, DYNAMIC positions) is in range and
  // every value it computes with is finite, as append keeps them; std::invalid_argument naming the layer, the
  // KV head, the block and the value.
  void check_state(int layer, int64_t len, const uint8_t* in) const;
  // Throws std::invalid_argument unless q [var.n, H, D] has a positive multiple of KVH heads, all finite, and
  // var is 1 rotation or 3 with 0 <= succ <= intra.
  void check_q(const float* q, int H, const QueryVariants& var = {}) const;
  void check_index() const;  // std::invalid_argument unless the store has an index
  void update_anchors(StoreLayer& L, int h, int64_t pos, const float* key, float importance);
  // The selection of select() and select_attend(), with mu_ held and the selector's query set (and the second
  // stage's, with rerank > 1: then the selection is the second stage's, and never deferred). Returns the
  // layer's candidate cache when the request's candidates are cached (null: the selector scanned them), with
  // out_ids written, unless defer: then the cache's per-set pass (scores, then top k) is left to the caller
  // (select_attend runs it inside the attention's dispatch).
  CandCache* select_locked(const StoreLayer& L, int layer, int H, const SelectRequest& req, int32_t* out_ids,
                           int out_cols, bool defer = false);
  // Sticky blocks (StoreConfig::sticky_blocks; kvstore/sticky.cpp), with mu_ held. sticky_forced: this
  // select_attend's forced blocks per set (forced_), from the layer's last decode step when this call is its
  // next token. sticky_apply: set s's picks (row; C: read through the candidate cache) made to hold them, its
  // lowest-scored other picks giving way (safe to run for different sets at once). sticky_record: the next
  // step's, from this call's attention shares (block_lse_, lse).
  void sticky_forced(const StoreLayer& L, int layer, const SelectRequest& req, int n_sets);
  void sticky_apply(const StoreLayer& L, int H, const SelectRequest& req, int s, int32_t* row, int cols,
                    const CandCache* C);
  void sticky_record(const StoreLayer& L, int layer, int H, const BlockSets& bsets, const float* lse);

  StoreLayout lay_;
  std::vector<StoreLayer> layers_;
  std::vector<MappedBuffer> maps_;  // the reserved regions

  mutable std::mutex mu_;  // one operation at a time per store (the GIL is released during calls)
  // The decode operations' parts, each with its workspaces (grown on demand and reused: no allocation on the
  // decode path once warm).
  BlockSelector sel_;
  CandCaches cand_;
  struct Sticky {                 // one layer's blocks for a decode step
    std::vector<int32_t> ids;     // [n_sets, cols]: each top block then the one after it, -1 padded
    int n_sets = 0, cols = 0;
    int64_t len = -1;             // the layer's length at the step they are for (-1: none)
  };
  // Per layer: cur (for the step at cur.len), next (taken at a step, for the one after: becomes cur when that
  // step's token is appended, so a step refused before its append changes nothing) and prev (cur before,
  // back when a truncate rolls that token back). sticky_rotate / sticky_rewind: in append / truncate.
  struct StickyLayer {
    Sticky cur, next, prev;
  };
  std::vector<StickyLayer> sticky_;  // [n_layers]
  void sticky_rotate(int layer, int64_t old_len, int64_t T);
  void sticky_rewind(int layer, int64_t n);
  std::vector<int32_t> forced_;   // [n_sets, forced_cols_] this call's, -1 padded (none: forced_cols_ 0)
  int forced_cols_ = 0;
  std::vector<float> block_lse_;  // [KVH, cols, G] this call's blocks' own LSEs
  SparseAttention attn_;
  MassRerank rerank_;
  std::vector<int32_t> wide_ids_;  // [n_sets, wide cols] the first stage's picks (rerank > 1)
  bool reranked_ = false;          // the last selection ran the second stage
  SnapKVScorer snap_;
  StageTiming timing_;
};

}  // namespace ktq
