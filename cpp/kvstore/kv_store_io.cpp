// A layer's state as bytes, for KV files (ktquest/kv/files.py): the regions of layout.h cut to the blocks in
// use, head by head. Region order: kv, anchors, n_anchor, sums, imp, pos (per (head, block)), then bounds
// (per (head, group)); regions the store does not have are absent.
//
// An imported state is untrusted (a KV file's checksums can be recomputed by anyone): check_state holds it to
// what appends and truncates make before a byte of it is copied, as the GGUF reader holds its tensors:
//   n_anchor  the rows the scorers (select/score_kernels.h), the index (index/group_bounds.cpp), append and
//             truncate read of a block's anchors: exactly A for QUEST / BLOCK_*, exactly the evenly spread
//             anchors of the block's rows for FIXED, 0..min(A, rows) for DYNAMIC (a truncate keeps fewer).
//             A count past A read past the block's anchors (a crash: SIGSEGV, SIGBUS), a negative one wrote
//             before them (DYNAMIC's next append).
//   pos       DYNAMIC: each valid anchor's row in its block, in [0, rows) (compared only, never an index).
//   values    finite where an operation computes with them, as append keeps them: the stored K/V rows in use
//             (Q8_0 / Q4_0: scales whose products stay finite), the valid anchor rows, BLOCK_MEAN's sums,
//             DYNAMIC's importances (-inf allowed: a token without one); the index's bounds not NaN (+-inf
//             are an empty group's or a row past fp16's range). Non-finite values never index memory, but NaN
//             scores and shares reach comparison sorts, and the store promises finite rows to its readers.
// Rows past the length in the last block and anchor slots past n_anchor are never read: not checked.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "kvstore/kv_store.h"

namespace ktq {

namespace {

template <class T>
T load(const uint8_t* p) {  // the state's bytes have no alignment
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE values by their bits: the first of the n T at p with every bit of `mask` set (the exponent's: NaN or
// +-inf), or -1. Each chunk is first tested without a branch (an OR of equality tests: one pass that
// vectorises), and searched only when it holds one.
template <class T>
int64_t first_all_ones(const uint8_t* p, int64_t n, T mask) {
  constexpr int64_t kChunk = 512;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t i1 = std::min(n, i0 + kChunk);
    T hit = 0;
    for (int64_t i = i0; i < i1; ++i) hit |= T((load<T>(p + i * sizeof(T)) & mask) == mask);
    if (hit)
      for (int64_t i = i0; i < i1; ++i)
        if ((load<T>(p + i * sizeof(T)) & mask) == mask) return i;
  }
  return -1;
}

int64_t first_non_finite_f32(const uint8_t* p, int64_t n) { return first_all_ones<uint32_t>(p, n, 0x7f800000u); }
int64_t first_non_finite_f64(const uint8_t* p, int64_t n) {
  return first_all_ones<uint64_t>(p, n, 0x7ff0000000000000ull);
}
int64_t first_non_finite_f16(const uint8_t* p, int64_t n) { return first_all_ones<uint16_t>(p, n, 0x7c00u); }
int64_t first_non_finite_bf16(const uint8_t* p, int64_t n) { return first_all_ones<uint16_t>(p, n, 0x7f80u); }
int64_t first_nan_f16(const uint8_t* p, int64_t n) {  // (the index's bounds: a few rows per group)
  for (int64_t i = 0; i < n; ++i)
    if ((load<uint16_t>(p + i * 2) & 0x7fffu) > 0x7c00u) return i;
  return -1;
}

// One (head, block) entry's bytes in each per-block region of the layout (regions(1)).
struct Entry {
  const char* name;
  size_t bytes;
  uint8_t* base;
};

// fn(name, head, piece, bytes) for each (region, head) piece of nb blocks, in the state's order.
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
    for (int h = 0; h < H; ++h) fn(e.name, h, e.base + size_t(h) * lay.max_blocks * e.bytes, size_t(nb) * e.bytes);
  }
  if (L.bounds != nullptr) {
    const int64_t ng = lay.n_groups(nb);
    for (int h = 0; h < H; ++h)
      fn("bounds", h, reinterpret_cast<uint8_t*>(lay.bound_at(L, h, 0)), size_t(ng) * 2 * lay.cfg.head_dim * 2);
  }
}

}  // namespace

size_t KVStore::state_bytes(int64_t len) const {
  if (len < 0 || len > lay_.cfg.max_seq_len)
    throw std::invalid_argument("a layer of " + std::to_string(len) + " tokens: the store holds 0.." +
                                std::to_string(lay_.cfg.max_seq_len) + " (max_seq_len)");
  const int64_t nb = (len + lay_.cfg.block_size - 1) / lay_.cfg.block_size;
  size_t total = 0;
  for_each_piece(lay_, layers_[0], nb, [&](const char*, int, uint8_t*, size_t n) { total += n; });  // layers alike
  return total;
}

std::vector<KVStore::StatePiece> KVStore::state_pieces(int64_t len) const {
  state_bytes(len);  // throws for a len past max_seq_len
  const int64_t nb = (len + lay_.cfg.block_size - 1) / lay_.cfg.block_size;
  std::vector<StatePiece> out;
  size_t off = 0;
  for_each_piece(lay_, layers_[0], nb, [&](const char* name, int h, uint8_t*, size_t n) {
    out.push_back({name, h, off, n});
    off += n;
  });
  return out;
}

void KVStore::check_state(int layer, int64_t len, const uint8_t* in) const {
  const StoreConfig& c = lay_.cfg;
  const int H = c.n_kv_heads, D = c.head_dim, bs = c.block_size, A = lay_.A;
  const int64_t nb = (len + bs - 1) / bs;
  const std::vector<StatePiece> pieces = state_pieces(len);
  auto piece = [&](const char* name, int h) -> const uint8_t* {  // null: a region the store does not have
    for (const StatePiece& p : pieces)
      if (p.head == h && std::strcmp(p.name, name) == 0) return in + p.offset;
    return nullptr;
  };
  const std::string where = "import_layer: layer " + std::to_string(layer) + ", kv head ";
  const size_t anchor_row = size_t(A) * D * lay_.anchor_elem_bytes();
  // Q8_0 / Q4_0 decode x = d * q, |q| <= 128 (Q8_0) or 8 (Q4_0): a scale whose product is not finite is refused.
  const float qmax = c.kv_type == KVType::Q8_0 ? 128.f : 8.f;
  for (int h = 0; h < H; ++h) {
    const uint8_t *kv = piece("kv", h), *anchors = piece("anchors", h), *counts = piece("n_anchor", h);
    const uint8_t *sums = piece("sums", h), *imp = piece("imp", h), *pos = piece("pos", h);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t rows = std::min<int64_t>(bs, len - b * bs);  // tokens in the block
      auto bad = [&](const std::string& what) {
        throw std::invalid_argument(where + std::to_string(h) + ", block " + std::to_string(b) + " (" +
                                    std::to_string(rows) + " tokens): " + what);
      };
      // ---- the anchor count ----
      const int32_t cnt = load<int32_t>(counts + b * 4);
      int64_t lo = A, hi = A;  // QUEST / BLOCK_*: every slot
      if (c.anchor_type == AnchorType::FIXED) lo = hi = (rows * A + bs - 1) / bs;  // anchors j * bs / A < rows
      if (c.anchor_type == AnchorType::DYNAMIC) lo = 0, hi = std::min<int64_t>(A, rows);
      if (cnt < lo || cnt > hi)
        bad("n_anchor=" + std::to_string(cnt) + " is not allowed: " + anchor_type_name(c.anchor_type) +
            " anchors of a block of " + std::to_string(rows) + " tokens are " +
            (lo == hi ? std::to_string(lo) : std::to_string(lo) + ".." + std::to_string(hi)));
      // ---- DYNAMIC: the valid anchors' rows and importances ----
      for (int j = 0; pos && j < cnt; ++j) {
        const int32_t r = load<int32_t>(pos + (b * A + j) * 4);
        if (r < 0 || r >= rows)
          bad("pos[" + std::to_string(j) + "]=" + std::to_string(r) + " is not a row of the block (0.." +
              std::to_string(rows - 1) + ")");
      }
      for (int j = 0; imp && j < cnt; ++j) {
        const float x = load<float>(imp + (b * A + j) * 4);
        if (!(x < std::numeric_limits<float>::infinity()))
          bad("imp[" + std::to_string(j) + "]=" + std::to_string(x) +
              " is not allowed (finite, or -inf: no importance)");
      }
      // ---- values: finite, as append stores them ----
      const int64_t valid = int64_t(linear_anchors(c.anchor_type) ? A : cnt) * D;  // anchor values read
      const uint8_t* a = anchors + b * anchor_row;
      const int64_t ai = lay_.a16 ? first_non_finite_f16(a, valid) : first_non_finite_f32(a, valid);
      if (ai >= 0)
        bad("anchor " + std::to_string(ai / D) + " holds a non-finite value at dim " + std::to_string(ai % D));
      if (sums)
        if (const int64_t i = first_non_finite_f64(sums + b * D * 8, D); i >= 0)
          bad("the key sums hold a non-finite value at dim " + std::to_string(i));
      for (int which = 0; which < 2; ++which) {
        const uint8_t* tile = kv + (b * 2 + which) * lay_.tile_bytes;
        const char* name = which ? "v" : "k";
        int64_t i = -1;
        switch (c.kv_type) {
          case KVType::FP32: i = first_non_finite_f32(tile, rows * D); break;
          case KVType::FP16: i = first_non_finite_f16(tile, rows * D); break;
          case KVType::BF16: i = first_non_finite_bf16(tile, rows * D); break;
          case KVType::Q8_0:
          case KVType::Q4_0:  // the scales (1/32 of the values)
            for (int64_t g = 0; g < rows * lay_.row_scales; ++g) {
              const float d = load<float>(tile + lay_.scale_off + g * 4);
              if (!(std::fabs(d) * qmax < std::numeric_limits<float>::infinity()))
                bad(std::string(name) + " scale " + std::to_string(d) + " of token " +
                    std::to_string(b * bs + g / lay_.row_scales) + ", dims " +
                    std::to_string(g % lay_.row_scales * kQGroup) + ".. decodes to non-finite values");
            }
            break;
        }
        if (i >= 0)
          bad(std::string(name) + " holds a non-finite value at token " + std::to_string(b * bs + i / D) + ", dim " +
              std::to_string(i % D));
      }
    }
  }
  // ---- the index's bounds: +-inf are an empty group's or a row past fp16's range, NaN is no bound ----
  const int64_t ng = lay_.n_groups(nb);
  for (int h = 0; h < H && ng > 0; ++h)
    if (const int64_t i = first_nan_f16(piece("bounds", h), ng * 2 * D); i >= 0)
      throw std::invalid_argument(where + std::to_string(h) + ", index group " + std::to_string(i / (2 * D)) +
                                  ": its " + (i / D % 2 ? "max" : "min") + " bound is NaN at dim " +
                                  std::to_string(i % D));
}

void KVStore::export_layer(int layer, uint8_t* out, size_t n) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (n != state_bytes(L.len))
    throw std::invalid_argument("export_layer: the buffer holds " + std::to_string(n) + " bytes, the layer's "
                                "state " + std::to_string(state_bytes(L.len)));
  for_each_piece(lay_, L, lay_.n_blocks(L), [&](const char*, int, uint8_t* p, size_t m) {
    if (m) std::memcpy(out, p, m);  // (an empty state may come with a null buffer)
    out += m;
  });
}

void KVStore::check_import(int layer, int64_t len, const uint8_t* in, size_t n) const {
  layer_at(layer);  // out_of_range for a layer the store does not have
  const size_t want = state_bytes(len);  // throws for a len past max_seq_len
  if (n != want)
    throw std::invalid_argument("import_layer: " + std::to_string(n) + " bytes given, a layer of " +
                                std::to_string(len) + " tokens has " + std::to_string(want));
  check_state(layer, len, in);
}

void KVStore::import_layer(int layer, int64_t len, const uint8_t* in, size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  check_import(layer, len, in, n);  // before anything changes: a refused state leaves the layer as it was
  StoreLayer& L = layers_[layer];
  sticky_[layer] = StickyLayer{};
  const int64_t nb = (len + lay_.cfg.block_size - 1) / lay_.cfg.block_size;
  for_each_piece(lay_, L, nb, [&](const char*, int, uint8_t* p, size_t m) {
    if (m) std::memcpy(p, in, m);
    in += m;
  });
  L.len = len;
  ++L.gen;  // every candidate copy of the layer is stale
}

}  // namespace ktq
