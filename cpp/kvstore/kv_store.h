// The KV store: per layer and per KV head, keys and values in blocks of `block_size` tokens, plus one
// set of block anchors per KV head that the decode step scores to pick the blocks worth attending.
//
// ---- layout (one layer) ----
//   kv:       [KVH, max_blocks, 2, tile] the K tile then the V tile of each (head, block);
//             tile = [block_size rows of kv_row_bytes | block_size x D/32 fp32 scales (Q8_0/Q4_0 only)],
//             padded to 64 bytes
//   anchors:  [KVH, max_blocks, A, D]   fp32, or fp16 when the anchors are linear and kv_type is FP16
//                                        (A = 2 for QUEST: min then max; 1 for BLOCK_MAX/BLOCK_MEAN;
//                                         anchor_num for FIXED/DYNAMIC)
//   n_anchor: [KVH, max_blocks]         int32 valid anchors (FIXED/DYNAMIC; partial blocks have fewer)
//   sums:     [KVH, max_blocks, D]      fp64 running key sums (BLOCK_MEAN; exact for FP16/BF16 keys)
//   imp, pos: [KVH, max_blocks, A]      anchor importance / token position (DYNAMIC)
//   candidates (CandCache, below): for a request that passes preselected candidate lists (SnapKV), their
//             anchor rows and their K/V tiles copied into one compact region per layer, read by
//             select_attend instead of the scattered originals
// Why head-major with a block's K and V side by side: attention runs per KV head over a sorted list of
// selected blocks, reading a block's K rows (logits) and then its V rows (values), so one selected block
// is one contiguous run of 2 tiles (a 64-token FP16 block of D = 64 is 16 KiB, of D = 128 32 KiB): one
// stream the hardware prefetcher follows from K into V, where separate K and V arrays would make two
// short ones (measured: +20% attention throughput from DRAM for D = 64). Adjacent selected blocks are
// adjacent in memory, and with a full budget a head is one sequential sweep. Scoring reads only
// `anchors`, also head-major and contiguous per block, so it streams A*D values per block and never
// touches K or V. Anchors are computed from the *stored* (rounded/quantised) keys, so the QUEST bound
// holds for exactly the keys attention reads. With FP16 keys the QUEST / BLOCK_MAX anchors (element-wise
// min / max of fp16 values) are fp16 values themselves, so they are kept as halves at no loss and
// scoring streams half the bytes (at 16-token blocks fp32 min/max anchors are 1/8 of the K/V bytes);
// BLOCK_MEAN's mean is rounded to the nearest half. Other anchors and KV types stay fp32.
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
#include <utility>
#include <vector>

#include "quant/kv_codec.h"

namespace ktq {

enum class AnchorType : int { QUEST = 0, BLOCK_MAX = 1, BLOCK_MEAN = 2, FIXED = 3, DYNAMIC = 4 };
enum class HeadMode : int { SHARED = 0, SEPARATE = 1 };

const char* anchor_type_name(AnchorType t);
// QUEST / BLOCK_MAX / BLOCK_MEAN: a block's score is one dot product with its anchor row (score_linear).
inline bool linear_anchors(AnchorType t) {
  return t == AnchorType::QUEST || t == AnchorType::BLOCK_MAX || t == AnchorType::BLOCK_MEAN;
}

// Anonymous memory from mmap, 2 MiB aligned with a huge-page hint, released in the destructor; move-only.
class MappedBuffer {
 public:
  MappedBuffer() = default;
  explicit MappedBuffer(size_t bytes);
  ~MappedBuffer();
  MappedBuffer(MappedBuffer&& o) noexcept { swap(o); }
  MappedBuffer& operator=(MappedBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void swap(MappedBuffer& o) noexcept {
    std::swap(base_, o.base_), std::swap(mapped_, o.mapped_), std::swap(p_, o.p_), std::swap(n_, o.n_);
  }
  void* base_ = nullptr;
  size_t mapped_ = 0;
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

struct StoreConfig {
  int n_layers = 1;
  int n_kv_heads = 1;
  int head_dim = 64;
  int64_t max_seq_len = 0;
  int block_size = 64;
  KVType kv_type = KVType::FP16;
  AnchorType anchor_type = AnchorType::QUEST;
  int anchor_num = 2;  // FIXED/DYNAMIC: anchors per block; QUEST always 2, BLOCK_MAX/MEAN always 1
  int threads_num = 1;
  // Linear anchors only: the compact copy of a layer's candidates (SelectRequest::allowed, SnapKV's
  // preselected blocks) holds each (block, head) anchor row as int8 with one fp32 scale, a quarter of fp32's
  // bytes and half of fp16's to stream per decode step. QUEST's min row is rounded down and its max row up,
  // so the scores stay upper bounds of q.k over the block; BLOCK_MAX / BLOCK_MEAN round to nearest. The
  // uncached path (no candidate list) still scores the stored anchors.
  bool int8_candidates = false;
};

// Wall time of the stages of the last select/attend call, seconds.
// With cached candidates (SnapKV's preselection) a set is scored and cut in one task: topk_s is then the
// top-k part of those tasks spread over the threads, score_s the rest of the pass. In select_attend those
// tasks share the attention's dispatch: score_s and topk_s are their task times over the threads, attend_s
// the rest of the call.
struct StageTiming {
  double score_s = 0, topk_s = 0, attend_s = 0;
};

// Which blocks to keep (all pointers borrowed for the call). n_sets = 1 (SHARED) or KVH (SEPARATE).
struct SelectRequest {
  HeadMode mode = HeadMode::SEPARATE;
  const int32_t* k_per_set = nullptr;  // [n_sets] blocks to keep per set
  const int64_t* exclude = nullptr;    // [n_exclude, 2] half-open block ranges [b0, b1), never selected
  int n_exclude = 0;
  const int32_t* allowed = nullptr;  // [n_sets, allowed_cols] candidate block ids, -1 = padding; null = all
  int allowed_cols = 0;
};

// Selected blocks: [n_sets, cols], ascending ids then -1 padding; n_sets = 1 means "every KV head".
struct BlockSets {
  const int32_t* ids = nullptr;
  int n_sets = 1;
  int cols = 0;
};

class KVStore {
 public:
  struct Cand {  // a top-k candidate: higher score wins, then the lower block id
    float score;
    int32_t id;
  };

  explicit KVStore(const StoreConfig& cfg);
  ~KVStore();
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  const StoreConfig& config() const { return cfg_; }
  int anchor_slots() const { return A_; }  // A in the layout above
  int anchor_elem_bytes() const { return a16_ ? 2 : 4; }  // 2 = fp16 anchors (see the layout above)
  int64_t max_blocks() const { return max_blocks_; }
  int64_t length(int layer) const;
  int64_t n_blocks(int layer) const;
  size_t nbytes() const;          // bytes of the blocks in use (K, V, scales, anchors, bookkeeping)
  size_t reserved_bytes() const;  // address space reserved for max_seq_len
  size_t cand_nbytes() const;     // the candidate caches' copies (anchors, scales, ids, K/V tiles), all layers

  // k, v: [T, KVH, D] in `in`; importance: [T, KVH] fp32 or null (DYNAMIC: a token without importance
  // only fills a free anchor slot). Throws (nothing written) past max_seq_len or on non-finite input.
  void append(int layer, const void* k, const void* v, InType in, int64_t T, const float* importance);
  // Dequantised copy of what is stored. k, v: [length, KVH, D] fp32.
  void read(int layer, float* k, float* v) const;
  // Dequantised copy of tokens [t0, t1) (0 <= t0 <= t1 <= length). k, v: [t1 - t0, KVH, D] fp32.
  void read_range(int layer, int64_t t0, int64_t t1, float* k, float* v) const;
  // Keep the first n tokens of `layer` (-1 = every layer; 0 <= n <= length). The anchors of a now-partial
  // last block are recomputed from its stored keys (DYNAMIC keeps the surviving anchors: token
  // importances are not stored). Stale rows past n are overwritten by the next append.
  void truncate(int layer, int64_t n);
  // anchors: [KVH, n_blocks, A, D], counts: [KVH, n_blocks] (valid anchors per block).
  void read_anchors(int layer, float* anchors, int32_t* counts) const;

  // q: [H, D] fp32 (H a multiple of KVH). Unscaled block scores, summed over the query heads of each
  // KV head (SEPARATE: out [KVH, n_blocks]) or over all heads (SHARED: out [n_blocks]).
  void block_scores(int layer, const float* q, int H, HeadMode mode, float* out);
  // Top-k blocks per set: out_ids [n_sets, out_cols], ascending, -1 padded. Ties -> lower block id.
  void select(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols);
  // softmax(q K^T / sqrt(D)) V over the given blocks. out: [H, D], lse: [H] (natural log, -inf and a
  // zero row for a head with no block).
  void attend(int layer, const float* q, int H, const BlockSets& blocks, float* out, float* lse);
  // select + attend in one call (the decode hot path).
  void select_attend(int layer, const float* q, int H, const SelectRequest& req, int32_t* out_ids, int out_cols,
                     float* out, float* lse);
  StageTiming last_timing() const;

 private:
  struct Layer {
    uint8_t* kv = nullptr;        // [KVH, max_blocks, 2, tile_bytes_]  K tile, V tile
    void* anchors = nullptr;      // [KVH, max_blocks, A, D] fp32, or fp16 when a16_
    int32_t* n_anchor = nullptr;  // [KVH, max_blocks]
    double* sums = nullptr;       // [KVH, max_blocks, D]   BLOCK_MEAN
    float* imp = nullptr;         // [KVH, max_blocks, A]   DYNAMIC
    int32_t* pos = nullptr;       // [KVH, max_blocks, A]   DYNAMIC
    int64_t len = 0;
    uint64_t gen = 0;             // bumped when truncate drops tokens: full blocks may then be rewritten
  };

  // A layer's last candidate list (SelectRequest::allowed) with its anchors copied contiguously: the decode
  // loop passes the same preselected blocks every step, scattered over the layer; scoring them from one
  // compact stream instead of one cache miss per block. Valid while the request's allowed rows and
  // exclusions and the layer's gen are unchanged, and only for full blocks (a full block's linear anchors
  // never change until a truncate).
  struct CandCache {
    bool valid = false;  // answers `key` (a hit)
    bool built = false;  // ids, count and anchors are consistent for generation gen (they can be extended)
    uint64_t gen = 0;
    HeadMode mode = HeadMode::SEPARATE;
    std::vector<int64_t> key;              // mode, the allowed rows as given, the exclusion ranges as given
    std::vector<int32_t> ids;              // [n_sets, stride] candidate ids, ascending
    std::vector<int64_t> count;            // [n_sets]
    int64_t stride = 0;                    // candidates room per set
    std::vector<uint8_t> anchors;          // [n_sets, heads per set, stride, A*D] fp16 or fp32 rows, or
                                           // int8 rows (int8_candidates)
    std::vector<float> scales;             // [n_sets, heads per set, stride] int8 rows' scales
    // The candidates' K and V tiles, copied once (cand_tiles): [n_sets, heads per set, stride, 2, tile]. A
    // step attends to a third of a set's candidates; read from here they are near neighbours in one compact
    // region per layer instead of 2 KiB pieces spread over the whole context, so the hardware prefetchers
    // and the DRAM pages work for them (the attention reads the store's tiles only through this copy).
    MappedBuffer kv;
    std::vector<int64_t> kv_count;         // [n_sets] candidates whose tiles are in kv (a prefix of ids)
  };

  // ---- layout helpers ----
  uint8_t* k_tile(const Layer& L, int h, int64_t b) const { return L.kv + (h * max_blocks_ + b) * 2 * tile_bytes_; }
  uint8_t* v_tile(const Layer& L, int h, int64_t b) const { return k_tile(L, h, b) + tile_bytes_; }
  float* anchor_at(const Layer& L, int h, int64_t b) const {  // fp32 anchors
    return static_cast<float*>(L.anchors) + (h * max_blocks_ + b) * int64_t(A_) * cfg_.head_dim;
  }
  uint16_t* anchor16_at(const Layer& L, int h, int64_t b) const {  // fp16 anchors (a16_)
    return static_cast<uint16_t*>(L.anchors) + (h * max_blocks_ + b) * int64_t(A_) * cfg_.head_dim;
  }
  const uint8_t* anchor_bytes(const Layer& L, int h, int64_t b) const {  // either layout: A*D elements
    if (a16_) return reinterpret_cast<const uint8_t*>(anchor16_at(L, h, b));
    return reinterpret_cast<const uint8_t*>(anchor_at(L, h, b));
  }
  const Layer& layer_at(int layer) const;
  void check_q(const float* q, int H) const;

  // ---- append (kv_store.cpp) ----
  void update_anchors(Layer& L, int h, int64_t pos, const float* key, float importance);

  // ---- selection and attention (sparse_attn.cpp), called with mu_ held ----
  // Candidate blocks of one set as runs of consecutive ids: [start[i], start[i] + len[i]), ascending;
  // prefix[i] = candidates before run i (prefix.back() = all of them).
  struct Runs {
    std::vector<int32_t> start, len;
    std::vector<int64_t> prefix;
    template <class F>
    void each(F&& f) const {  // f(block id) for every candidate, ascending
      for (size_t r = 0; r < start.size(); ++r)
        for (int32_t b = start[r]; b < start[r] + len[r]; ++b) f(b);
    }
  };
  void prepare_query(const float* q, int H);  // fills qs_, qe_, qraw_
  void build_runs(int64_t nb, int n_sets, const SelectRequest* req);  // fills runs_
  void score_runs(const Layer& L, int H, HeadMode mode, float* scores);
  // out[0, n) (+)= linear scores (QUEST / BLOCK_*) of n consecutive anchor rows at a, for KV head h; int8
  // rows (a CandCache of int8_candidates) when scale8 is given, their scales.
  void score_linear_rows(const uint8_t* a, int64_t n, int h, float* out, bool accumulate,
                         const float* scale8 = nullptr) const;
  // One stored anchor row (A*D elements at src) as int8 at dst with its scale (int8_candidates' rounding).
  void quantize_anchor_row(const uint8_t* src, int8_t* dst, float* scale) const;
  size_t cand_row_bytes() const;  // one anchor row of a CandCache
  // defer: where the cached candidates' per-set pass is due (scores, then top k), leave it to the caller
  // and return the cache (select_attend runs the pass inside the attention's dispatch); null otherwise,
  // with out_ids written.
  const CandCache* select_locked(const Layer& L, int layer, int H, const SelectRequest& req, int32_t* out_ids,
                                 int out_cols, bool defer = false);
  // The layer's CandCache for this request (built when missing or stale), or null when it does not apply.
  // Builds runs_ whenever it does not return a hit.
  const CandCache* cand_cache(const Layer& L, int layer, int64_t nb, int n_sets, const SelectRequest& req);
  // Cached candidates: check k and write every set that keeps all of its candidates; true when a set
  // still needs cached_set (the workspaces are then sized for it), with *threads the pass's threads.
  bool cached_prepare(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols, int* threads);
  // Set s's scores over its cached candidates and its top k into out_ids row s (thread-safe across sets).
  void cached_set(const CandCache& C, const SelectRequest& req, int s, int32_t* out_ids, int out_cols);
  void select_cached(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols);
  // Copies the tiles of the candidates that joined the layer's CandCache since the last call into C.kv.
  void cand_tiles(const Layer& L, CandCache& C);
  uint8_t* cand_tile(const CandCache& C, int s, int j, int64_t slot) const {  // set s, head j of the set
    return C.kv.data() + ((size_t(s) * (C.mode == HeadMode::SHARED ? cfg_.n_kv_heads : 1) + j) * C.stride + slot) *
                             2 * tile_bytes_;
  }
  // Work done in the attention's own dispatch, ahead of it: tasks [0, n) run run(ctx, s) (set s's
  // selection; must not throw), and head h's attention tasks start once its set (h, or 0 when shared) is
  // done, so the selection and the attention share one hand-off to the workers and the threads that
  // finish a set early go on attending. count [KVH]: the blocks each head will attend (known up front).
  struct Prologue {
    int n = 0;
    int threads = 1;
    const int64_t* count = nullptr;
    void (*run)(void* ctx, int s) = nullptr;
    void* ctx = nullptr;
  };
  // kvc: read the tiles from kvc->kv at the slots in slots_ (a select_attend over cached candidates).
  void attend_locked(const Layer& L, int H, const BlockSets& blocks, bool validate, float* out, float* lse,
                     const Prologue* pre = nullptr, const CandCache* kvc = nullptr);

  StoreConfig cfg_;
  int A_ = 2;
  bool a16_ = false;  // anchors stored as fp16 (linear anchors over FP16 keys)
  int64_t max_blocks_ = 0;
  size_t tile_bytes_ = 0;   // one (head, block) tile of K or V
  size_t row_bytes_ = 0;    // one stored row
  size_t scale_off_ = 0;    // offset of the scales inside a tile
  std::vector<Layer> layers_;
  std::vector<MappedBuffer> maps_;  // the reserved regions

  // Per-call workspaces, grown on demand and reused (no allocation on the decode path once warm).
  mutable std::mutex mu_;  // one operation at a time per store (the GIL is released during calls)
  std::vector<float> qs_;                  // [H, D] q / sqrt(D)
  std::vector<float> qe_;                  // [KVH, A*D] per-head scoring vectors (QUEST/BLOCK_*)
  const float* qraw_ = nullptr;            // [H, D] the caller's q (FIXED/DYNAMIC scoring), this call only
  std::vector<std::pair<int64_t, int64_t>> excl_;  // merged exclusion ranges
  std::vector<int32_t> ids_;               // allowed ids, sorted
  std::vector<Runs> runs_;                 // [n_sets]
  std::vector<float> scores_;              // [n_sets, n_blocks]
  std::vector<CandCache> cand_;            // [n_layers]
  std::vector<int64_t> key_;               // the current request's CandCache key
  std::vector<float> cscores_;             // [n_sets, stride] scores of cached candidates
  std::vector<int32_t> slots_;             // [n_sets, out_cols] the kept cached candidates' positions
  std::vector<Cand> heap_;                 // top-k heaps, [n_sets, kcap]
  std::vector<float> topv_;                // top-k: score copies of the uncached path, [n_sets, candidates]
  std::vector<int32_t> topids_;            // top-k: their block ids, [n_sets, candidates]
  std::vector<int32_t> topkeys_;           // top-k: top_k's scratch keys, [n_sets, candidates]
  std::vector<double> topk_task_s_;        // cached candidates: each set's top-k time (StageTiming split)
  std::vector<double> score_task_s_;       // ... and its scoring time
  std::vector<int64_t> task_start_;        // task ranges per set / head
  std::vector<int64_t> count_;             // [KVH] selected blocks per head
  std::vector<int64_t> count_pre_;         // [KVH] blocks per head a Prologue's selection will give
  std::vector<float> part_;                // split-K partials: [n_tasks, G, D + 2]
  StageTiming timing_;
};

}  // namespace ktq
