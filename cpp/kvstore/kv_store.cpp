// The KV store's storage (kv_store.h): construction, append (encode + incremental anchors), read-back and
// truncate. Layout: layout.h.
#include "kvstore/kv_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/checked.h"
#include "common/finite.h"
#include "common/thread_pool.h"
#include "index/group_bounds.h"

namespace ktq {

namespace {

// fp16 overflows to inf from 65520 on, bf16 from 0x1.fffp127 (both round-to-nearest-even).
constexpr float kF16Overflow = 65520.f;
constexpr float kBF16Overflow = 0x1.fffp127f;

std::string where(int64_t t, int h) { return " at token " + std::to_string(t) + ", kv head " + std::to_string(h); }

}  // namespace

// ---- construction ----

KVStore::KVStore(const StoreConfig& c) : lay_(c), sel_(lay_), cand_(lay_), attn_(lay_), rerank_(lay_), snap_(lay_) {
  // lay_ validated c and computed every size (checked): what is reserved here is what store_bytes says.
  const StoreRegions& r = lay_.layer_regions();
  layers_.resize(c.n_layers);
  sticky_.resize(c.n_layers);
  maps_.reserve(size_t(c.n_layers) * 7);
  auto grab = [&](size_t bytes) -> void* { return maps_.emplace_back(bytes).data(); };
  try {
    for (StoreLayer& L : layers_) {  // a throw unmaps what was reserved (maps_ is destroyed)
      L.kv = static_cast<uint8_t*>(grab(r.kv));
      L.anchors = grab(r.anchors);
      L.n_anchor = static_cast<int32_t*>(grab(r.n_anchor));
      if (r.sums) L.sums = static_cast<double*>(grab(r.sums));
      if (r.imp) L.imp = static_cast<float*>(grab(r.imp));
      if (r.pos) L.pos = static_cast<int32_t*>(grab(r.pos));
      if (r.bounds) L.bounds = static_cast<uint16_t*>(grab(r.bounds));
    }
  } catch (const std::bad_alloc& e) {  // name the whole store: what the caller asked for
    throw alloc_error("KVStore: reserving " + bytes_str(lay_.bytes()) + " for n_layers=" +
                      std::to_string(c.n_layers) + ", n_kv_heads=" + std::to_string(c.n_kv_heads) +
                      ", head_dim=" + std::to_string(c.head_dim) + ", max_seq_len=" + std::to_string(c.max_seq_len) +
                      " (kv_type " + kv_type_name(c.kv_type) + ") failed: " + e.what());
  }
}

KVStore::~KVStore() = default;

// ---- queries ----

const StoreLayer& KVStore::layer_at(int layer) const {
  if (layer < 0 || layer >= lay_.cfg.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " is out of range: the store has " +
                            std::to_string(lay_.cfg.n_layers) + " layers");
  return layers_[layer];
}

int64_t KVStore::length(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return layer_at(layer).len;
}

int64_t KVStore::n_blocks(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return lay_.n_blocks(layer_at(layer));
}

size_t KVStore::nbytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t per_block = lay_.regions(1).total();  // one (head, block): K, V, anchors, bookkeeping
  size_t total = 0;
  for (const StoreLayer& L : layers_) {  // plus the index's bounds of the groups in use
    const int64_t nb = lay_.n_blocks(L);
    total += size_t(nb) * per_block * lay_.cfg.n_kv_heads + lay_.group_bytes(lay_.n_groups(nb));
  }
  return total;
}

size_t KVStore::reserved_bytes() const {
  size_t total = 0;
  for (const MappedBuffer& m : maps_) total += m.size();
  return total;
}

size_t KVStore::cand_nbytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cand_.nbytes();
}

uint64_t KVStore::cand_copies() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cand_.copies();
}

StageTiming KVStore::last_timing() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timing_;
}

IndexStats KVStore::last_index_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sel_.index_stats();
}

void KVStore::set_walk_index(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  sel_.set_walk_index(on);
}

void KVStore::set_sticky_blocks(int R) {
  if (R < 0 || R > kMaxStickyBlocks)
    throw std::invalid_argument("sticky_blocks must be in [0, " + std::to_string(kMaxStickyBlocks) +
                                "] (0 = off), got " + std::to_string(R));
  std::lock_guard<std::mutex> lk(mu_);
  lay_.cfg.sticky_blocks = R;
  for (StickyLayer& S : sticky_) S = StickyLayer{};
  forced_cols_ = 0;
}

// ---- append ----

void KVStore::update_anchors(StoreLayer& L, int h, int64_t pos, const float* key, float importance) {
  const int D = lay_.cfg.head_dim, bs = lay_.cfg.block_size;
  const int64_t b = pos / bs;
  const int r = static_cast<int>(pos % bs);
  // fp16 anchors are updated in fp32 and stored back: min / max of fp16 keys are fp16 values, so the
  // round trip is exact for QUEST and BLOCK_MAX; BLOCK_MEAN's mean comes from the fp64 sums each time.
  thread_local std::vector<float> work;
  float* a;
  if (lay_.a16) {
    work.resize(size_t(lay_.A) * D);
    a = work.data();
    if (r > 0)
      decode_row(KVType::FP16, reinterpret_cast<const uint8_t*>(lay_.anchor16_at(L, h, b)), nullptr, lay_.A * D, a);
  } else {
    a = lay_.anchor_at(L, h, b);
  }
  int32_t& cnt = L.n_anchor[h * lay_.max_blocks + b];
  if (r == 0) cnt = 0;  // a new block (fresh pages are zero anyway; be explicit)
  switch (lay_.cfg.anchor_type) {
    case AnchorType::QUEST:  // a: [2, D] = element-wise min, max
      if (r == 0) {
        std::memcpy(a, key, D * 4);
        std::memcpy(a + D, key, D * 4);
      } else {
        for (int d = 0; d < D; ++d) {
          a[d] = std::min(a[d], key[d]);
          a[D + d] = std::max(a[D + d], key[d]);
        }
      }
      cnt = 2;
      break;
    case AnchorType::BLOCK_MAX:
      if (r == 0) std::memcpy(a, key, D * 4);
      else
        for (int d = 0; d < D; ++d) a[d] = std::max(a[d], key[d]);
      cnt = 1;
      break;
    case AnchorType::BLOCK_MEAN: {  // mean = fp64 running sum / count, rounded once to fp32
      double* sum = L.sums + (h * lay_.max_blocks + b) * D;
      for (int d = 0; d < D; ++d) sum[d] = (r == 0 ? 0.0 : sum[d]) + double(key[d]);
      for (int d = 0; d < D; ++d) a[d] = float(sum[d] / double(r + 1));
      cnt = 1;
      break;
    }
    case AnchorType::FIXED: {
      // Anchor j is the token at in-block position floor(j * bs / A): evenly spread, the first at 0.
      const int j = cnt;
      if (j < lay_.A && int64_t(j) * bs / lay_.A == r) {
        std::memcpy(a + size_t(j) * D, key, D * 4);
        cnt = j + 1;
      }
      break;
    }
    case AnchorType::DYNAMIC: {
      // Keep the A tokens of highest importance; ties keep the earlier token.
      float* imp = L.imp + (h * lay_.max_blocks + b) * lay_.A;
      int32_t* ps = L.pos + (h * lay_.max_blocks + b) * lay_.A;
      int slot = -1;
      if (cnt < lay_.A) {
        slot = cnt++;
      } else {
        int worst = 0;  // lowest importance, the later token among equals
        for (int j = 1; j < lay_.A; ++j)
          if (imp[j] < imp[worst] || (imp[j] == imp[worst] && ps[j] > ps[worst])) worst = j;
        if (importance > imp[worst]) slot = worst;
      }
      if (slot >= 0) {
        imp[slot] = importance;
        ps[slot] = r;
        std::memcpy(a + size_t(slot) * D, key, D * 4);
      }
      break;
    }
  }
  if (lay_.a16) encode_row(KVType::FP16, a, lay_.A * D, reinterpret_cast<uint8_t*>(lay_.anchor16_at(L, h, b)), nullptr);
}

void KVStore::check_rows(const void* k, const void* v, InType in, int64_t T, const float* importance) const {
  const int H = lay_.cfg.n_kv_heads, D = lay_.cfg.head_dim;
  const size_t row_in = size_t(D) * (in == InType::F32 ? 4 : 2);
  const float limit = lay_.cfg.kv_type == KVType::FP16   ? kF16Overflow
                      : lay_.cfg.kv_type == KVType::BF16 ? kBF16Overflow
                                                         : std::numeric_limits<float>::infinity();
  // A decode step appends one token: waking a worker costs more than encoding a few rows.
  const int threads = T * H < 64 ? 1 : lay_.cfg.threads_num;
  const int64_t n_chunks = std::min<int64_t>(T, 64);
  std::vector<std::string> chunk_err(n_chunks);
  ThreadPool::global().parallel_for(n_chunks, threads, [&](int64_t c) {
    std::vector<float> row(D);
    const int64_t t0 = T * c / n_chunks, t1 = T * (c + 1) / n_chunks;
    for (int64_t t = t0; t < t1; ++t)
      for (int h = 0; h < H; ++h)
        for (int which = 0; which < 2; ++which) {
          const uint8_t* src = static_cast<const uint8_t*>(which ? v : k) + (t * H + h) * row_in;
          input_to_f32(in, src, D, row.data());
          const int64_t d = first_not_below(row.data(), D, limit);
          if (d >= 0) {
            const char* name = which ? "v" : "k";
            chunk_err[c] = std::isfinite(row[d])
                               ? std::string(name) + " value " + std::to_string(row[d]) + where(t, h) +
                                     " overflows kv_type " + kv_type_name(lay_.cfg.kv_type)
                               : std::string(name) + " contains a non-finite value" + where(t, h);
            return;
          }
        }
  });
  for (const auto& e : chunk_err)
    if (!e.empty()) throw std::invalid_argument(e);
  if (const int64_t i = importance ? first_non_finite(importance, T * H) : -1; i >= 0)
    throw std::invalid_argument("importance contains a non-finite value" + where(i / H, int(i % H)));
}

void KVStore::check_room(const StoreLayer& L, int layer, int64_t T) const {
  if (T < 0) throw std::invalid_argument("append: T must be >= 0");
  if (L.len + T > lay_.cfg.max_seq_len)
    throw std::length_error("KV store is full: layer " + std::to_string(layer) + " holds " + std::to_string(L.len) +
                            " tokens, appending " + std::to_string(T) + " would exceed max_seq_len=" +
                            std::to_string(lay_.cfg.max_seq_len));
}

void KVStore::check_append(int layer, const void* k, const void* v, InType in, int64_t T,
                           const float* importance) const {
  {
    std::lock_guard<std::mutex> lk(mu_);
    check_room(layer_at(layer), layer, T);
  }
  check_rows(k, v, in, T, importance);
}

void KVStore::append(int layer, const void* k, const void* v, InType in, int64_t T, const float* importance) {
  std::lock_guard<std::mutex> lk(mu_);
  StoreLayer& L = const_cast<StoreLayer&>(layer_at(layer));
  const int H = lay_.cfg.n_kv_heads, D = lay_.cfg.head_dim, bs = lay_.cfg.block_size;
  check_room(L, layer, T);
  if (T == 0) return;
  check_rows(k, v, in, T, importance);  // everything is validated before anything is written
  const size_t row_in = size_t(D) * (in == InType::F32 ? 4 : 2);
  const int threads = T * H < 64 ? 1 : lay_.cfg.threads_num;  // as check_rows

  // ---- encode + anchors: tasks own (head, block range) pairs, so they never share a byte ----
  const int64_t p0 = L.len, p1 = L.len + T;
  const int64_t b0 = p0 / bs, b1 = (p1 - 1) / bs + 1;
  const int64_t blocks_per_task = std::max<int64_t>(1, 1024 / bs);
  const int64_t tasks_per_head = (b1 - b0 + blocks_per_task - 1) / blocks_per_task;
  ThreadPool::global().parallel_for(H * tasks_per_head, threads, [&](int64_t task) {
    const int h = static_cast<int>(task / tasks_per_head);
    const int64_t tb0 = b0 + (task % tasks_per_head) * blocks_per_task;
    const int64_t q0 = std::max(p0, tb0 * bs), q1 = std::min(p1, (tb0 + blocks_per_task) * bs);
    std::vector<float> x(D), y(D);  // x: [D] input row, y: [D] the stored row decoded
    for (int64_t p = q0; p < q1; ++p) {
      const int64_t t = p - p0, b = p / bs, r = p % bs;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* src = static_cast<const uint8_t*>(which ? v : k) + (t * H + h) * row_in;
        uint8_t* tile = which ? lay_.v_tile(L, h, b) : lay_.k_tile(L, h, b);
        input_to_f32(in, src, D, x.data());
        uint8_t* row = lay_.row_of(tile, r);
        float* sc = lay_.scales_of(tile, r);
        encode_row(lay_.cfg.kv_type, x.data(), D, row, sc);
        if (which == 0) {
          decode_row(lay_.cfg.kv_type, row, sc, D, y.data());
          const float imp = importance ? importance[t * H + h] : -std::numeric_limits<float>::infinity();
          update_anchors(L, h, p, y.data(), imp);
        }
      }
    }
  });
  // ---- the index's group bounds of the blocks [b0, b1) that changed, one task per KV head ----
  if (lay_.cfg.index_group > 0) {
    const int64_t old_nb = lay_.n_blocks(L);
    const bool widened = anchors_only_widen(lay_.cfg.anchor_type);
    ThreadPool::global().parallel_for(H, threads, [&](int64_t h) {
      update_group_bounds(lay_, L, int(h), b0, old_nb, b1, widened);
    });
  }
  L.len = p1;
  if (lay_.cfg.sticky_blocks > 0) sticky_rotate(layer, p0, T);
}

// ---- read-back ----

bool KVStore::read(int layer, int64_t n, float* k, float* v) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (L.len != n) return false;
  read_locked(L, 0, n, k, v);
  return true;
}

void KVStore::read_range(int layer, int64_t t0, int64_t t1, float* k, float* v) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (t0 < 0 || t0 > t1 || t1 > L.len)
    throw std::out_of_range("read_range: [" + std::to_string(t0) + ", " + std::to_string(t1) + ") is not inside the " +
                            std::to_string(L.len) + " tokens of layer " + std::to_string(layer));
  read_locked(L, t0, t1, k, v);
}

void KVStore::read_locked(const StoreLayer& L, int64_t t0, int64_t t1, float* k, float* v) const {
  const int H = lay_.cfg.n_kv_heads, D = lay_.cfg.head_dim, bs = lay_.cfg.block_size;
  for (int64_t p = t0; p < t1; ++p)
    for (int h = 0; h < H; ++h) {
      const int64_t b = p / bs, r = p % bs;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* tile = which ? lay_.v_tile(L, h, b) : lay_.k_tile(L, h, b);
        decode_row(lay_.cfg.kv_type, lay_.row_of(tile, r), lay_.scales_of(tile, r), D,
                   (which ? v : k) + ((p - t0) * H + h) * D);
      }
    }
}

// ---- truncate ----

void KVStore::truncate(int layer, int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (layer != -1) layer_at(layer);  // out_of_range for a layer the store does not have (-1: every layer)
  const int l0 = layer < 0 ? 0 : layer, l1 = layer < 0 ? lay_.cfg.n_layers : layer + 1;
  // One layer: 0 <= n <= its length. Every layer (-1): layers holding fewer than n tokens (a forward pass
  // interrupted half-way leaves the later layers shorter) keep what they hold.
  for (int l = l0; l < l1; ++l)  // validate every layer before changing any
    if (n < 0 || (layer >= 0 && n > layer_at(l).len))
      throw std::out_of_range("truncate(" + std::to_string(n) + "): layer " + std::to_string(l) + " holds " +
                              std::to_string(layer_at(l).len) + " tokens");
  for (int l = l0; l < l1; ++l) sticky_rewind(l, n);
  const int H = lay_.cfg.n_kv_heads, D = lay_.cfg.head_dim, bs = lay_.cfg.block_size;
  const int64_t b = n / bs, r_end = n % bs;  // block b keeps rows [0, r_end)
  const float none = -std::numeric_limits<float>::infinity();
  for (int l = l0; l < l1; ++l) {
    StoreLayer& L = layers_[l];
    if (r_end > 0 && n < L.len) {
      std::vector<float> y(D);  // [D] one stored key, decoded
      for (int h = 0; h < H; ++h) {
        if (lay_.cfg.anchor_type == AnchorType::DYNAMIC) {  // keep the anchors of surviving rows, in order
          float* a = lay_.anchor_at(L, h, b);
          float* imp = L.imp + (h * lay_.max_blocks + b) * lay_.A;
          int32_t* ps = L.pos + (h * lay_.max_blocks + b) * lay_.A;
          int32_t& cnt = L.n_anchor[h * lay_.max_blocks + b];
          int kept = 0;
          for (int j = 0; j < cnt; ++j)
            if (ps[j] < r_end) {
              if (kept != j) {
                imp[kept] = imp[j], ps[kept] = ps[j];
                std::memmove(a + size_t(kept) * D, a + size_t(j) * D, D * 4);
              }
              ++kept;
            }
          cnt = kept;
          continue;
        }
        const uint8_t* tile = lay_.k_tile(L, h, b);
        for (int64_t r = 0; r < r_end; ++r) {  // replay the block's keys: row 0 resets the anchors
          decode_row(lay_.cfg.kv_type, lay_.row_of(tile, r), lay_.scales_of(tile, r), D, y.data());
          update_anchors(L, h, b * bs + r, y.data(), none);
        }
      }
    }
    if (n < L.len) {  // the last group (now partial, or with a partial last block) from its blocks
      const int64_t nb = (n + bs - 1) / bs;
      for (int h = 0; h < H && nb > 0; ++h) update_group_bounds(lay_, L, h, nb - 1, nb, nb, false);
      ++L.gen;
    }
    L.len = std::min(L.len, n);
  }
}

void KVStore::check_index() const {
  if (lay_.cfg.index_group == 0)
    throw std::invalid_argument("the store has no hierarchical index (index_group=0)");
}

int64_t KVStore::n_groups(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return lay_.n_groups(lay_.n_blocks(layer_at(layer)));
}

bool KVStore::read_bounds(int layer, int64_t ng, float* bounds) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  check_index();
  if (lay_.n_groups(lay_.n_blocks(L)) != ng) return false;
  for (int h = 0; h < lay_.cfg.n_kv_heads; ++h)  // fp16 -> fp32: exact
    scalar::input_to_f32(InType::F16, lay_.bound_at(L, h, 0), ng * 2 * lay_.cfg.head_dim,
                         bounds + h * ng * 2 * lay_.cfg.head_dim);
  return true;
}

bool KVStore::read_anchors(int layer, int64_t nb, float* anchors, int32_t* counts) const {
  std::lock_guard<std::mutex> lk(mu_);
  const StoreLayer& L = layer_at(layer);
  if (lay_.n_blocks(L) != nb) return false;
  const size_t per = size_t(lay_.A) * lay_.cfg.head_dim;
  for (int h = 0; h < lay_.cfg.n_kv_heads; ++h) {
    if (lay_.a16)
      scalar::input_to_f32(InType::F16, lay_.anchor16_at(L, h, 0), nb * per, anchors + h * nb * per);
    else
      std::memcpy(anchors + h * nb * per, lay_.anchor_at(L, h, 0), nb * per * 4);
    std::memcpy(counts + h * nb, L.n_anchor + h * lay_.max_blocks, nb * 4);
  }
  return true;
}

}  // namespace ktq
