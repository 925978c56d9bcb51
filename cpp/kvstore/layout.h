// The KV store's configuration and byte layout: where a store of a given config keeps what, and how many bytes
// that is. The store reserves its regions from this layout (kv_store.cpp) and _C.store_bytes tells Python the
// same figure.
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
//   bounds:   [KVH, max_groups, 2, D]   fp16 (index_group > 0) the hierarchical index: per group of
//                                        index_group consecutive blocks, the element-wise min then max over
//                                        the group's anchor rows, rounded outward (index/group_bounds.h)
//   candidates (cand_cache.h): for a request that passes preselected candidate lists (SnapKV), their
//             anchor rows and their K/V tiles copied into one compact region per layer, read by
//             select_attend instead of the scattered originals
// Why head-major with a block's K and V side by side: attention runs per KV head over a sorted list of
// selected blocks, reading a block's K rows (logits) and then its V rows (values), so one selected block
// is one contiguous run of 2 tiles (a 64-token FP16 block of D = 64 is 16 KiB, of D = 128 32 KiB): one
// stream the hardware prefetcher follows from K into V, where separate K and V arrays would make two
// short ones (slower from DRAM). Adjacent selected blocks are adjacent in memory, and with a full budget a
// head is one sequential sweep. Scoring reads only `anchors`, also head-major and contiguous per block, so
// it streams A*D values per block and never touches K or V. Anchors are computed from the *stored*
// (rounded/quantised) keys, so the QUEST bound holds for exactly the keys attention reads. With FP16 keys
// the QUEST / BLOCK_MAX anchors (element-wise min / max of fp16 values) are fp16 values themselves, so they
// are kept as halves at no loss and scoring streams half the bytes (at 16-token blocks fp32 min/max anchors
// are 1/8 of the K/V bytes); BLOCK_MEAN's mean is rounded to the nearest half. Other anchors and KV types
// stay fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>

#include "quant/kv_codec.h"

namespace ktq {

enum class AnchorType : int { QUEST = 0, BLOCK_MAX = 1, BLOCK_MEAN = 2, FIXED = 3, DYNAMIC = 4 };
inline constexpr const char* kAnchorTypeNames[] = {"QUEST", "BLOCK_MAX", "BLOCK_MEAN", "FIXED", "DYNAMIC"};
static_assert(std::size(kAnchorTypeNames) == size_t(AnchorType::DYNAMIC) + 1);

const char* anchor_type_name(AnchorType t);
// QUEST / BLOCK_MAX / BLOCK_MEAN: a block's score is one dot product with its anchor row (score_linear).
inline bool linear_anchors(AnchorType t) {
  return t == AnchorType::QUEST || t == AnchorType::BLOCK_MAX || t == AnchorType::BLOCK_MEAN;
}

constexpr int kMaxLayers = 4096;  // a store's layers (their bookkeeping is allocated, not reserved)

struct StoreConfig {
  int n_layers = 1;
  int n_kv_heads = 1;
  int head_dim = 64;
  int64_t max_seq_len = 0;
  int block_size = 64;
  KVType kv_type = KVType::FP16;
  AnchorType anchor_type = AnchorType::QUEST;
  int anchor_num = 2;  // FIXED/DYNAMIC: anchors per block; QUEST always 2, BLOCK_MAX/MEAN always 1
  // Every operation runs on the shared ThreadPool (thread_pool.h) with up to this many threads, from
  // kParallelBytes read on.
  int threads_num = 1;
  // Linear anchors only: the compact copy of a layer's candidates (SelectRequest::allowed, SnapKV's
  // preselected blocks) holds each (block, head) anchor row as int8 with one fp32 scale, a quarter of fp32's
  // bytes and half of fp16's to stream per decode step. QUEST's min row is rounded down and its max row up,
  // so the scores stay upper bounds of q.k over the block; BLOCK_MAX / BLOCK_MEAN round to nearest. The
  // uncached path (no candidate list) still scores the stored anchors.
  bool int8_candidates = false;
  // Blocks per super-block of the hierarchical index (index/group_bounds.h): a selection without a candidate
  // list bounds every group first and scores only the blocks of groups that may hold a top-k block, with the
  // flat scan's picks. 0 = no index (every candidate block scored).
  int index_group = 0;
  // QUEST only: a block's score is (1 - quest_centre) * its upper bound of q.k + quest_centre * q . (min + max) / 2,
  // the query against the block's centre (both folded into one scoring vector: the same cost). The bound
  // ranks first a block whose keys spread widely, even when none matches; the centre ranks first a block whose
  // keys all match, as a retrieval head's copied span does. 0 = Quest's bound alone.
  float quest_centre = 0.f;
  // Sticky blocks (kvstore/sticky.cpp): after a decode step's select_attend, the sticky_blocks blocks of each
  // set that took the largest share of its heads' attention, and the block after each, stay selected at the
  // layer's next step (within its k: they displace its lowest-scored other picks). A number being copied
  // digit by digit keeps the block it is read from when the bounds alone would drop it. 0 = off.
  int sticky_blocks = 0;
};

// The store's operations (scoring, the cached candidates' pass, attention) use threads from this many bytes
// read on: below it (~8 us on one core) handing work to a worker costs more than it saves (workers spin
// between the calls of a decode step).
constexpr int64_t kParallelBytes = 128 << 10;

constexpr int kMaxStickyBlocks = 64;  // StoreConfig::sticky_blocks at most
constexpr int kMaxRerank = 16;        // SelectRequest::rerank at most

// One layer's regions (pointers into the store's reserved memory) and how far it is filled.
struct StoreLayer {
  uint8_t* kv = nullptr;        // [KVH, max_blocks, 2, tile_bytes]  K tile, V tile
  void* anchors = nullptr;      // [KVH, max_blocks, A, D] fp32, or fp16 when a16
  int32_t* n_anchor = nullptr;  // [KVH, max_blocks]
  double* sums = nullptr;       // [KVH, max_blocks, D]   BLOCK_MEAN
  float* imp = nullptr;         // [KVH, max_blocks, A]   DYNAMIC
  int32_t* pos = nullptr;       // [KVH, max_blocks, A]   DYNAMIC
  uint16_t* bounds = nullptr;   // [KVH, max_groups, 2, D] fp16 group min, max (index_group > 0)
  int64_t len = 0;
  uint64_t gen = 0;             // bumped when truncate drops tokens: full blocks may then be rewritten
};

// Bytes of each region for some number of (head, block) pairs (0 for a region the anchor type does not use);
// bounds, kept per group of blocks, only in a layer's regions (layer_regions()).
struct StoreRegions {
  size_t kv = 0, anchors = 0, n_anchor = 0, sums = 0, imp = 0, pos = 0, bounds = 0;
  size_t total() const;  // checked: std::overflow_error when the sum does not fit
};

// The layout of a config, and where a (head, block)'s pieces lie in a layer.
struct StoreLayout {
  // Validates c: std::invalid_argument naming the field, the value and what is allowed (max_blocks fits the
  // int32 block ids), then computes every size with checked arithmetic (common/checked.h): std::overflow_error
  // when one does not fit. So a layout that exists has sizes that fit, and its accessors need no checks.
  explicit StoreLayout(const StoreConfig& c);

  StoreConfig cfg;
  int A = 2;              // anchors per (head, block)
  bool a16 = false;       // anchors stored as fp16 (linear anchors over FP16 keys)
  int64_t max_blocks = 0;
  int64_t max_groups = 0;  // index groups of a full layer (0 without the index)
  size_t row_bytes = 0;   // one stored row
  int row_scales = 0;     // its fp32 scales (Q8_0/Q4_0)
  size_t scale_off = 0;   // offset of the scales inside a tile
  size_t tile_bytes = 0;  // one (head, block) tile of K or V

  int anchor_elem_bytes() const { return a16 ? 2 : 4; }  // 2 = fp16 anchors
  StoreRegions regions(size_t head_blocks) const;         // the regions of `head_blocks` (head, block) pairs
  const StoreRegions& layer_regions() const { return layer_; }  // one full layer's
  size_t layer_bytes() const { return layer_.total(); }
  size_t bytes() const { return bytes_; }  // a full store
  int64_t n_blocks(const StoreLayer& L) const { return (L.len + cfg.block_size - 1) / cfg.block_size; }
  int64_t n_groups(int64_t nb) const { return cfg.index_group ? (nb + cfg.index_group - 1) / cfg.index_group : 0; }
  size_t group_bytes(int64_t n_groups) const;  // the bounds of n_groups groups of every KV head

  // ---- a (head, block)'s pieces ----
  uint8_t* k_tile(const StoreLayer& L, int h, int64_t b) const { return L.kv + (h * max_blocks + b) * 2 * tile_bytes; }
  uint8_t* v_tile(const StoreLayer& L, int h, int64_t b) const { return k_tile(L, h, b) + tile_bytes; }
  float* anchor_at(const StoreLayer& L, int h, int64_t b) const {  // fp32 anchors
    return static_cast<float*>(L.anchors) + (h * max_blocks + b) * int64_t(A) * cfg.head_dim;
  }
  uint16_t* anchor16_at(const StoreLayer& L, int h, int64_t b) const {  // fp16 anchors (a16)
    return static_cast<uint16_t*>(L.anchors) + (h * max_blocks + b) * int64_t(A) * cfg.head_dim;
  }
  const uint8_t* anchor_bytes(const StoreLayer& L, int h, int64_t b) const {  // either layout: A*D elements
    if (a16) return reinterpret_cast<const uint8_t*>(anchor16_at(L, h, b));
    return reinterpret_cast<const uint8_t*>(anchor_at(L, h, b));
  }
  uint16_t* bound_at(const StoreLayer& L, int h, int64_t g) const {  // group g's [2, D] fp16: min row, max row
    return L.bounds + (h * max_groups + g) * 2 * int64_t(cfg.head_dim);
  }
  // Row r of a tile: its row_bytes of data and its row_scales scales.
  uint8_t* row_of(uint8_t* tile, int64_t r) const { return tile + r * row_bytes; }
  const uint8_t* row_of(const uint8_t* tile, int64_t r) const { return tile + r * row_bytes; }
  float* scales_of(uint8_t* tile, int64_t r) const { return reinterpret_cast<float*>(tile + scale_off) + r * row_scales; }
  const float* scales_of(const uint8_t* tile, int64_t r) const {
    return reinterpret_cast<const float*>(tile + scale_off) + r * row_scales;
  }

 private:
  StoreRegions layer_;  // one full layer's regions
  size_t bytes_ = 0;    // a full store
};

// Bytes a full store of config c reserves (checks c as the store does): what _C.store_bytes tells Python.
size_t store_bytes(const StoreConfig& c);

}  // namespace ktq
