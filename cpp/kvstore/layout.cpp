// The store's config checks and byte layout (layout.h).
#include "kvstore/layout.h"

#include <stdexcept>
#include <string>

#include "common/enum_names.h"

namespace ktq {

const char* anchor_type_name(AnchorType t) { return enum_name(kAnchorTypeNames, t); }

StoreLayout::StoreLayout(const StoreConfig& c) : cfg(c) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (c.n_layers < 1) bad("n_layers must be >= 1, got " + std::to_string(c.n_layers));
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
  if (c.int8_candidates && !linear_anchors(c.anchor_type))
    bad(std::string("int8_candidates needs linear anchors (QUEST, BLOCK_MAX or BLOCK_MEAN), got anchor_type ") +
        anchor_type_name(c.anchor_type));
  a16 = c.kv_type == KVType::FP16 && linear_anchors(c.anchor_type);
  max_blocks = (c.max_seq_len + c.block_size - 1) / c.block_size;
  row_bytes = kv_row_bytes(c.kv_type, c.head_dim);
  row_scales = kv_row_scales(c.kv_type, c.head_dim);
  scale_off = size_t(c.block_size) * row_bytes;
  tile_bytes = scale_off + size_t(c.block_size) * row_scales * 4;
  tile_bytes = (tile_bytes + 63) & ~size_t(63);  // every tile starts on a cache line
}

StoreRegions StoreLayout::regions(size_t hb) const {
  const size_t D = size_t(cfg.head_dim);
  StoreRegions r;
  r.kv = hb * 2 * tile_bytes;
  r.anchors = hb * A * D * anchor_elem_bytes();
  r.n_anchor = hb * 4;
  if (cfg.anchor_type == AnchorType::BLOCK_MEAN) r.sums = hb * D * 8;
  if (cfg.anchor_type == AnchorType::DYNAMIC) r.imp = r.pos = hb * A * 4;
  return r;
}

size_t store_bytes(const StoreConfig& c) { return StoreLayout(c).bytes(); }

}  // namespace ktq
