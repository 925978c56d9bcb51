// The cached candidates of the store's layers. A decode loop with a preselection (SnapKV) passes the same
// candidate list (SelectRequest::allowed) every step, its blocks scattered over the layer; a layer's
// CandCache keeps that list with copies of its anchor rows and its K/V tiles in one compact region, so
// scoring streams the anchors instead of taking one cache miss per block, and select_attend reads the tiles
// there. A cache answers a request while the request's allowed rows and exclusions and the layer's gen are
// unchanged, and holds only full blocks (a full block's anchors and tiles never change until a truncate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/checked.h"
#include "common/mapped_buffer.h"
#include "kvstore/layout.h"
#include "select/request.h"
#include "select/selector.h"

namespace ktq {

// The shape of one layer's candidate copies for a head mode: sets, heads per set, and the bytes of one
// candidate of one head (its anchor row, the row's scale, its K and V tiles) and of one set (its id).
struct CandLayout {
  CandLayout(const StoreLayout& lay, HeadMode mode);
  int n_sets = 1;       // 1 (SHARED) or KVH (SEPARATE)
  int heads = 1;        // heads per set: KVH (SHARED) or 1 (SEPARATE)
  size_t row = 0;       // one anchor row: A*D elements as stored (fp16 or fp32), or int8 (int8_candidates)
  bool scaled = false;  // int8 rows: one fp32 scale each
  size_t tiles = 0;     // one candidate's K tile and V tile
  // One layer's copies with room for `room` candidates per set: anchor rows, scales, ids and K/V tiles.
  size_t bytes(int64_t room) const;  // checked (common/checked.h)
};

// Bytes of every layer's candidate copies with room for `room` candidates per set (checks c as the store
// does): what _C.candidate_copy_bytes tells Python. 0 where c's anchors are not linear (never cached).
size_t candidate_copy_bytes(const StoreConfig& c, HeadMode mode, int64_t room);

// The candidates a layer's copy has room for when it is built for `need` of them: a quarter more (at least 64)
// for the blocks that join the candidates as decoding goes on (the copy is rebuilt bigger past that).
inline int64_t candidate_room(int64_t need) {
  return checked_add<int64_t>(need, need / 4 > 64 ? need / 4 : 64, "candidate room");
}

// One layer's candidate list and its copies.
struct CandCache {
  bool valid = false;  // answers `key` (a hit)
  bool built = false;  // ids, count and anchors are consistent for generation gen (they can be extended)
  uint64_t gen = 0;
  HeadMode mode = HeadMode::SEPARATE;
  std::vector<int64_t> key;      // mode, the allowed rows as given, the exclusion ranges as given
  std::vector<int32_t> ids;      // [n_sets, stride] candidate ids, ascending
  std::vector<int64_t> count;    // [n_sets]
  int64_t stride = 0;            // candidates room per set
  std::vector<uint8_t> anchors;  // [n_sets, heads per set, stride, A*D] fp16 or fp32 rows, or int8 rows
                                 // (int8_candidates)
  std::vector<float> scales;     // [n_sets, heads per set, stride] int8 rows' scales
  // The candidates' K and V tiles, copied once (copy_tiles): [n_sets, heads per set, stride, 2, tile]. A
  // step attends to a third of a set's candidates; read from here they are near neighbours in one compact
  // region per layer instead of 2 KiB pieces spread over the whole context, so the hardware prefetchers
  // and the DRAM pages work for them (the attention reads the store's tiles only through this copy).
  MappedBuffer kv;
  std::vector<int64_t> kv_count;  // [n_sets] candidates whose tiles are in kv (a prefix of ids)
};

// Every layer's CandCache, and the workspaces of their selections.
class CandCaches {
 public:
  explicit CandCaches(const StoreLayout& lay);

  // The layer's CandCache for this request (built or extended when missing or stale), or null when it does
  // not apply (a candidate in a partial block). Builds sel's runs whenever it does not return a hit.
  CandCache* lookup(const StoreLayer& L, int layer, int64_t nb, int n_sets, const SelectRequest& req,
                    BlockSelector& sel);
  // The selection over C: the same scores (same kernels on the same anchor bytes, heads summed in the same
  // order), the same Ada-KV budgets with req.ada and the same top-k rule as the selector, so the same ids as
  // the uncached path (int8_candidates: the scores of the int8 copy, upper bounds for QUEST, instead).
  // out_ids as BlockSelector::select_runs; t.score_s, t.topk_s.
  void select(const CandCache& C, const SelectRequest& req, const BlockSelector& sel, int32_t* out_ids,
              int out_cols, StageTiming& t);
  // Checks k and writes every set that keeps all of its candidates; true when a set still needs select_set
  // (the workspaces are then sized for it), with *threads the pass's threads.
  bool prepare(const CandCache& C, const SelectRequest& req, int32_t* out_ids, int out_cols, int* threads);
  // Set s's scores over its cached candidates and its top k into out_ids row s (thread-safe across sets;
  // not for req.ada, whose k come from every set's scores: select()).
  void select_set(const CandCache& C, const SelectRequest& req, const BlockSelector& sel, int s, int32_t* out_ids,
                  int out_cols);
  // [KVH]: the blocks each KV head attends once every set of C has its top k (a Prologue's counts).
  const int64_t* head_counts(const CandCache& C, const SelectRequest& req);
  // Copies the tiles of the candidates that joined C since the last call into C.kv.
  void copy_tiles(const StoreLayer& L, CandCache& C);
  // Set s's candidate at `slot`, head j of the set: its K tile (the V tile follows).
  uint8_t* tile(const CandCache& C, int s, int j, int64_t slot) const {
    return C.kv.data() + ((size_t(s) * (C.mode == HeadMode::SHARED ? lay_.cfg.n_kv_heads : 1) + j) * C.stride + slot) *
                             2 * lay_.tile_bytes;
  }
  // [n_sets, out_cols]: where the kept candidates of the last selection lie in their set's candidates.
  const int32_t* slots() const { return slots_.data(); }
  // The score select_set gave set s's candidate at `slot` (its pass for this step must have run).
  float score(const CandCache& C, int s, int64_t slot) const { return cscores_[s * C.stride + slot]; }
  // Set s's slots for a row of its candidates rewritten after select_set (ids ascending, -1 padded; each one
  // of C's candidates for the set): their positions in C's list.
  void set_slots(const CandCache& C, int s, const int32_t* row, int cols);
  // Each set's scoring and top-k time in the last pass (after prepare: the StageTiming split).
  const std::vector<double>& score_task_s() const { return score_task_s_; }
  const std::vector<double>& topk_task_s() const { return topk_task_s_; }
  size_t nbytes() const;  // every layer's copies (anchors, scales, ids, K/V tiles)
  // Candidates copied so far (a candidate's anchor rows in lookup, its tiles in copy_tiles: one each), every
  // layer: a request its cache answered copies none.
  uint64_t copies() const { return copies_; }

 private:
  // One stored anchor row (A*D elements at src) as int8 at dst with its scale (int8_candidates' rounding).
  void quantize_anchor_row(const uint8_t* src, int8_t* dst, float* scale) const;
  // Set s's scores over its cached candidates (cscores_ row s), and its top k of them into out_ids row s.
  void score_set(const CandCache& C, const BlockSelector& sel, int s);
  void cut_set(const CandCache& C, int s, int64_t k, int32_t* out_ids, int out_cols);

  const StoreLayout& lay_;
  std::vector<CandCache> cand_;       // [n_layers]
  std::vector<int64_t> key_;          // the current request's key
  std::vector<float> cscores_;        // [n_sets, stride] scores of cached candidates
  std::vector<int32_t> topkeys_;      // [n_sets, stride] top_k's scratch keys
  std::vector<int32_t> slots_;        // [n_sets, out_cols] the kept cached candidates' positions
  std::vector<int64_t> head_counts_;  // [KVH] head_counts()
  std::vector<double> topk_task_s_;   // each set's top-k time (StageTiming split)
  std::vector<double> score_task_s_;  // ... and its scoring time
  AdaSplit ada_;                      // Ada-KV: the candidates' scores and the sets' budgets
  uint64_t copies_ = 0;               // copies()
};

}  // namespace ktq
