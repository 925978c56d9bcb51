// A layer's state as bytes, for KV files (ktquest/kv/files.py): the regions of layout.h cut to the blocks in
// use, head by head. Region order: kv, anchors, n_anchor, sums, imp, pos (per (head, block)), then bounds
// (per (head, group)); regions the store does not have are absent.
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvstore/kv_store.h"

namespace ktq {

namespace {

// One (head, block) entry's bytes in each per-block region of the layout (regions(1)).
struct Entry {
  const char* name;
  size_t bytes;
  uint8_t* base;
};

template <typename Fn>
void for_each_piece(const StoreLayout& lay, const StoreLayer& L, int64_t nb, Fn&& fn) {
  const StoreRegions one = lay.regions(1);
  const Entry entries[] = {
      {"kv", one.kv, L.kv},
      {"anchors", one.anchors, static_cast<uint8_t*>(L.anchors)},
      {"n_anchor", one.n_anchor, reinterpret_cast<uint8_t*>(L.n_anchor)},
      {"sums", one.sums, reinterpret_cast<uint8_t*>(L.sums)},
      {"imp", one.imp, reinterpret_cast<uint8_t*>(L.imp)},
      {"pos", one.pos, reinterpret_cast<uint8_t*>(L.pos)},
  };
  const int H = lay.cfg.n_kv_heads;
  for (const Entry& e : entries) {
    if (e.base == nullptr || e.bytes == 0) continue;
    for (int h = 0; h < H; ++h) fn(e.base + size_t(h) * lay.max_blocks * e.bytes, size_t(nb) * e.bytes);
  }
  if (L.bounds != nullptr) {
    const int64_t ng = lay.n_groups(nb);
    for (int h = 0; h < H; ++h)
      fn(reinterpret_cast<uint8_t*>(lay.bound_at(L, h, 0)), size_t(ng) * 2 * lay.cfg.head_dim * 2);
  }
}

}  // namespace

size_t KVStore::state_bytes(int64_t len) const {
  if (len < 0 || len > lay_.cfg.max_seq_len)
    throw std::invalid_argument("a layer of " + std::to_string(len) + " tokens: the store holds 0.." +
                                std::to_string(lay_.cfg.max_seq_len) + " (max_seq_len)");
  const int64_t nb = (len + lay_.cfg.block_size - 1) / lay_.cfg.block_size;
  size_t total = 0;
  for_each_piece(lay_, layers_[0], nb, [&](uint8_t*, size_t n) { total += n; });  // every layer alike
  return total;
}

void KVStore::export_layer(int layer, uint8_t* out, size_t n) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (n != state_bytes(L.len))
    throw std::invalid_argument("export_layer: the buffer holds " + std::to_string(n) + " bytes, the layer's "
                                "state " + std::to_string(state_bytes(L.len)));
  for_each_piece(lay_, L, lay_.n_blocks(L), [&](uint8_t* p, size_t m) {
    std::memcpy(out, p, m);
    out += m;
  });
}

void KVStore::import_layer(int layer, int64_t len, const uint8_t* in, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  layer_at(layer);  // out_of_range for a layer the store does not have
  StoreLayer& L = layers_[layer];
  sticky_[layer] = StickyLayer{};
  const size_t want = state_bytes(len);  // throws for a len past max_seq_len
  if (n != want)
    throw std::invalid_argument("import_layer: " + std::to_string(n) + " bytes given, a layer of " +
                                std::to_string(len) + " tokens has " + std::to_string(want));
  const int64_t nb = (len + lay_.cfg.block_size - 1) / lay_.cfg.block_size;
  for_each_piece(lay_, L, nb, [&](uint8_t* p, size_t m) {
    std::memcpy(p, in, m);
    in += m;
  });
  L.len = len;
  ++L.gen;  // every candidate copy of the layer is stale
}

}  // namespace ktq
