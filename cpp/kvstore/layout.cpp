// The store's config checks and byte layout (layout.h).
#include "kvstore/layout.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "common/checked.h"
#include "common/enum_names.h"

namespace ktq {

const char* anchor_type_name(AnchorType t) { return enum_name(kAnchorTypeNames, t); }

StoreLayout::StoreLayout(const StoreConfig& c) : cfg(c) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  // Each layer's bookkeeping is allocated (not reserved) at construction: no model has thousands of layers.
  if (c.n_layers < 1 || c.n_layers > kMaxLayers)
    bad("n_layers must be in [1, " + std::to_string(kMaxLayers) + "], got " + std::to_string(c.n_layers));
  if (c.n_kv_heads < 1) bad("n_kv_heads must be >= 1, got " + std::to_string(c.n_kv_heads));
  if (c.head_dim < 1) bad("head_dim must be >= 1, got " + std::to_string(c.head_dim));
  if (c.max_seq_len < 1) bad("max_seq_len must be >= 1, got " + std::to_string(c.max_seq_len));
  if (c.block_size < 1) bad("block_size must be >= 1, got " + std::to_string(c.block_size));
  if (c.threads_num < 1) bad("threads_num must be >= 1, got " + std::to_string(c.threads_num));
  if (kv_type_quantized(c.kv_type) && c.head_dim % kQGroup != 0)
    bad(std::string("kv_type ") + kv_type_name(c.kv_type) + " quantises groups of 32 along head_dim: head_dim must be "
        "a multiple of 32, got " + std::to_string(c.head_dim));
  switch (c.anchor_type) {
    case AnchorType::QUEST: A = 2; break;
    case AnchorType::BLOCK_MAX:
    case AnchorType::BLOCK_MEAN: A = 1; break;
    case AnchorType::FIXED:
    case AnchorType::DYNAMIC:
      if (c.anchor_num < 1 || c.anchor_num > c.block_size)
        bad(std::string("anchor_num must be in [1, block_size=") + std::to_string(c.block_size) + "] for anchor_type " +
            anchor_type_name(c.anchor_type) + ", got " + std::to_string(c.anchor_num));
      A = c.anchor_num;
      break;
  }
  if (c.index_group < 0)
    bad("index_group must be >= 0 (blocks per index group; 0 = no index), got " + std::to_string(c.index_group));
  if (c.sticky_blocks < 0 || c.sticky_blocks > kMaxStickyBlocks)
    bad("sticky_blocks must be in [0, " + std::to_string(kMaxStickyBlocks) + "] (0 = off), got " +
        std::to_string(c.sticky_blocks));
  if (!(c.quest_centre >= 0.f && c.quest_centre <= 1.f))
    bad("quest_centre must be in [0, 1], got " + std::to_string(c.quest_centre));
  if (c.quest_centre != 0.f && c.anchor_type != AnchorType::QUEST)
    bad(std::string("quest_centre needs anchor_type QUEST, got ") + anchor_type_name(c.anchor_type));
  if (c.int8_candidates && !linear_anchors(c.anchor_type))
    bad(std::string("int8_candidates needs linear anchors (QUEST, BLOCK_MAX or BLOCK_MEAN), got anchor_type ") +
        anchor_type_name(c.anchor_type));
  a16 = c.kv_type == KVType::FP16 && linear_anchors(c.anchor_type);
  // ---- sizes: limits first, then every product checked (checked.h), before the store reserves anything ----
  max_blocks = c.max_seq_len / c.block_size + (c.max_seq_len % c.block_size != 0);
  if (max_blocks > std::numeric_limits<int32_t>::max())
    bad("max_seq_len=" + std::to_string(c.max_seq_len) + " in blocks of block_size=" + std::to_string(c.block_size) +
        " is " + std::to_string(max_blocks) + " blocks a layer: at most " +
        std::to_string(std::numeric_limits<int32_t>::max()) + " (block ids are int32); raise block_size or lower "
        "max_seq_len");
  // A (head, block)'s anchor row is indexed with int: A * D must fit.
  checked_int(checked_mul<int64_t>(A, c.head_dim, "anchor row (anchors x head_dim)"), "anchors x head_dim");
  row_bytes = kv_row_bytes(c.kv_type, c.head_dim);
  row_scales = kv_row_scales(c.kv_type, c.head_dim);
  scale_off = checked_mul<size_t>(c.block_size, row_bytes, "one K/V tile (block_size x row bytes)");
  tile_bytes = checked_add<size_t>(
      scale_off, checked_mul<size_t>(size_t(c.block_size) * 4, size_t(row_scales), "a tile's scales"), "one K/V tile");
  tile_bytes = checked_add<size_t>(tile_bytes, 63, "one K/V tile") & ~size_t(63);  // every tile on a cache line
  layer_ = regions(checked_mul<size_t>(c.n_kv_heads, size_t(max_blocks), "(head, block) pairs of a layer"));
  max_groups = n_groups(max_blocks);
  layer_.bounds = group_bytes(max_groups);
  bytes_ = checked_mul<size_t>(layer_.total(), c.n_layers, "the store's bytes (one layer's x n_layers)");
}

StoreRegions StoreLayout::regions(size_t hb) const {
  const size_t D = size_t(cfg.head_dim);
  auto mul = [](size_t a, size_t b) { return checked_mul<size_t>(a, b, "a KV store region's bytes"); };
  StoreRegions r;
  r.kv = mul(mul(hb, 2), tile_bytes);
  r.anchors = mul(mul(hb, size_t(A) * D), anchor_elem_bytes());
  r.n_anchor = mul(hb, 4);
  if (cfg.anchor_type == AnchorType::BLOCK_MEAN) r.sums = mul(mul(hb, D), 8);
  if (cfg.anchor_type == AnchorType::DYNAMIC) r.imp = r.pos = mul(mul(hb, A), 4);
  return r;
}

size_t StoreLayout::group_bytes(int64_t n) const {
  return checked_mul<size_t>(checked_mul<size_t>(size_t(n), cfg.n_kv_heads, "index groups of a layer"),
                             size_t(2) * cfg.head_dim * 2, "the index's bounds");
}

size_t StoreRegions::total() const {
  size_t t = 0;
  for (size_t b : {kv, anchors, n_anchor, sums, imp, pos, bounds}) t = checked_add(t, b, "a KV store layer's bytes");
  return t;
}

size_t store_bytes(const StoreConfig& c) { return StoreLayout(c).bytes(); }

}  // namespace ktq
