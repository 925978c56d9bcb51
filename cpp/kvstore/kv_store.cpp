// KV store memory, append (encode + incremental anchors) and read-back. Layout: kv_store.h.
#include "kvstore/kv_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include "common/thread_pool.h"

namespace ktq {

namespace {

// fp16 overflows to inf from 65520 on, bf16 from 0x1.fffp127 (both round-to-nearest-even).
constexpr float kF16Overflow = 65520.f;
constexpr float kBF16Overflow = 0x1.fffp127f;

std::string where(int64_t t, int h) { return " at token " + std::to_string(t) + ", kv head " + std::to_string(h); }

}  // namespace

// Address space only: pages are committed (zero-filled) on first write. Selected blocks are scattered over
// the whole context: with 2 MiB pages a tile costs no TLB miss of its own (a hint; without transparent huge
// pages it is a no-op).
MappedBuffer::MappedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t want = bytes >= kHuge ? bytes + kHuge : bytes;  // room to start on a 2 MiB boundary
  base_ = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    throw std::bad_alloc();
  }
  mapped_ = want;
  p_ = static_cast<uint8_t*>(base_);
  if (bytes >= kHuge) {
    p_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base_) + kHuge - 1) & ~(kHuge - 1));
    madvise(base_, mapped_, MADV_HUGEPAGE);
  }
}

MappedBuffer::~MappedBuffer() {
  if (base_) munmap(base_, mapped_);
}

const char* anchor_type_name(AnchorType t) {
  switch (t) {
    case AnchorType::QUEST: return "QUEST";
    case AnchorType::BLOCK_MAX: return "BLOCK_MAX";
    case AnchorType::BLOCK_MEAN: return "BLOCK_MEAN";
    case AnchorType::FIXED: return "FIXED";
    case AnchorType::DYNAMIC: return "DYNAMIC";
  }
  return "?";
}

// ---- construction ----

KVStore::KVStore(const StoreConfig& c) : cfg_(c) {
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
    case AnchorType::QUEST: A_ = 2; break;
    case AnchorType::BLOCK_MAX:
    case AnchorType::BLOCK_MEAN: A_ = 1; break;
    case AnchorType::FIXED:
    case AnchorType::DYNAMIC:
      if (c.anchor_num < 1 || c.anchor_num > c.block_size)
        bad(std::string("anchor_num must be in [1, block_size=") + std::to_string(c.block_size) + "] for anchor_type " +
            anchor_type_name(c.anchor_type) + ", got " + std::to_string(c.anchor_num));
      A_ = c.anchor_num;
      break;
  }
  if (c.int8_candidates && !linear_anchors(c.anchor_type))
    bad(std::string("int8_candidates needs linear anchors (QUEST, BLOCK_MAX or BLOCK_MEAN), got anchor_type ") +
        anchor_type_name(c.anchor_type));
  const int D = c.head_dim, H = c.n_kv_heads;
  a16_ = c.kv_type == KVType::FP16 && linear_anchors(c.anchor_type);
  max_blocks_ = (c.max_seq_len + c.block_size - 1) / c.block_size;
  row_bytes_ = kv_row_bytes(c.kv_type, D);
  scale_off_ = size_t(c.block_size) * row_bytes_;
  tile_bytes_ = scale_off_ + size_t(c.block_size) * kv_row_scales(c.kv_type, D) * 4;
  tile_bytes_ = (tile_bytes_ + 63) & ~size_t(63);  // every tile starts on a cache line

  const size_t hb = size_t(H) * max_blocks_;  // (head, block) pairs
  layers_.resize(c.n_layers);
  auto grab = [&](size_t bytes) -> void* { return maps_.emplace_back(bytes).data(); };
  for (Layer& L : layers_) {  // a throw unmaps what was reserved (maps_ is destroyed)
    L.kv = static_cast<uint8_t*>(grab(hb * 2 * tile_bytes_));
    L.anchors = grab(hb * A_ * D * anchor_elem_bytes());
    L.n_anchor = static_cast<int32_t*>(grab(hb * 4));
    if (c.anchor_type == AnchorType::BLOCK_MEAN) L.sums = static_cast<double*>(grab(hb * D * 8));
    if (c.anchor_type == AnchorType::DYNAMIC) {
      L.imp = static_cast<float*>(grab(hb * A_ * 4));
      L.pos = static_cast<int32_t*>(grab(hb * A_ * 4));
    }
  }
}

KVStore::~KVStore() = default;

// ---- queries ----

const KVStore::Layer& KVStore::layer_at(int layer) const {
  if (layer < 0 || layer >= cfg_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " is out of range: the store has " +
                            std::to_string(cfg_.n_layers) + " layers");
  return layers_[layer];
}

int64_t KVStore::length(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return layer_at(layer).len;
}

int64_t KVStore::n_blocks(int layer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return (layer_at(layer).len + cfg_.block_size - 1) / cfg_.block_size;
}

size_t KVStore::nbytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  const int D = cfg_.head_dim;
  size_t per_block = 2 * tile_bytes_ + size_t(A_) * D * anchor_elem_bytes() + 4;  // K, V, anchors, anchor count
  if (cfg_.anchor_type == AnchorType::BLOCK_MEAN) per_block += size_t(D) * 8;
  if (cfg_.anchor_type == AnchorType::DYNAMIC) per_block += size_t(A_) * 8;
  size_t total = 0;
  for (const Layer& L : layers_) total += size_t((L.len + cfg_.block_size - 1) / cfg_.block_size) * per_block;
  return total * cfg_.n_kv_heads;
}

size_t KVStore::reserved_bytes() const {
  size_t total = 0;
  for (const MappedBuffer& m : maps_) total += m.size();
  return total;
}

size_t KVStore::cand_nbytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t total = 0;
  for (const CandCache& C : cand_)
    total += C.anchors.size() + C.scales.size() * 4 + C.ids.size() * 4 + C.kv.size();
  return total;
}

StageTiming KVStore::last_timing() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timing_;
}

// ---- append ----

void KVStore::update_anchors(Layer& L, int h, int64_t pos, const float* key, float importance) {
  const int D = cfg_.head_dim, bs = cfg_.block_size;
  const int64_t b = pos / bs;
  const int r = static_cast<int>(pos % bs);
  // fp16 anchors are updated in fp32 and stored back: min / max of fp16 keys are fp16 values, so the
  // round trip is exact for QUEST and BLOCK_MAX; BLOCK_MEAN's mean comes from the fp64 sums each time.
  thread_local std::vector<float> work;
  float* a;
  if (a16_) {
    work.resize(size_t(A_) * D);
    a = work.data();
    if (r > 0) decode_row(KVType::FP16, reinterpret_cast<const uint8_t*>(anchor16_at(L, h, b)), nullptr, A_ * D, a);
  } else {
    a = anchor_at(L, h, b);
  }
  int32_t& cnt = L.n_anchor[h * max_blocks_ + b];
  if (r == 0) cnt = 0;  // a new block (fresh pages are zero anyway; be explicit)
  switch (cfg_.anchor_type) {
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
      double* sum = L.sums + (h * max_blocks_ + b) * D;
      for (int d = 0; d < D; ++d) sum[d] = (r == 0 ? 0.0 : sum[d]) + double(key[d]);
      for (int d = 0; d < D; ++d) a[d] = float(sum[d] / double(r + 1));
      cnt = 1;
      break;
    }
    case AnchorType::FIXED: {
      // Anchor j is the token at in-block position floor(j * bs / A): evenly spread, the first at 0.
      const int j = cnt;
      if (j < A_ && int64_t(j) * bs / A_ == r) {
        std::memcpy(a + size_t(j) * D, key, D * 4);
        cnt = j + 1;
      }
      break;
    }
    case AnchorType::DYNAMIC: {
      // Keep the A tokens of highest importance; ties keep the earlier token.
      float* imp = L.imp + (h * max_blocks_ + b) * A_;
      int32_t* ps = L.pos + (h * max_blocks_ + b) * A_;
      int slot = -1;
      if (cnt < A_) {
        slot = cnt++;
      } else {
        int worst = 0;  // lowest importance, the later token among equals
        for (int j = 1; j < A_; ++j)
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
  if (a16_) encode_row(KVType::FP16, a, A_ * D, reinterpret_cast<uint8_t*>(anchor16_at(L, h, b)), nullptr);
}

void KVStore::append(int layer, const void* k, const void* v, InType in, int64_t T, const float* importance) {
  std::lock_guard<std::mutex> lk(mu_);
  Layer& L = const_cast<Layer&>(layer_at(layer));
  const int H = cfg_.n_kv_heads, D = cfg_.head_dim, bs = cfg_.block_size;
  if (T < 0) throw std::invalid_argument("append: T must be >= 0");
  if (L.len + T > cfg_.max_seq_len)
    throw std::length_error("KV store is full: layer " + std::to_string(layer) + " holds " + std::to_string(L.len) +
                            " tokens, appending " + std::to_string(T) + " would exceed max_seq_len=" +
                            std::to_string(cfg_.max_seq_len));
  if (T == 0) return;
  const size_t in_size = in == InType::F32 ? 4 : 2;
  const size_t row_in = size_t(D) * in_size;

  // ---- validate everything before writing anything ----
  const float limit = cfg_.kv_type == KVType::FP16 ? kF16Overflow
                      : cfg_.kv_type == KVType::BF16 ? kBF16Overflow
                                                     : std::numeric_limits<float>::infinity();
  // A decode step appends one token: waking a worker costs more than encoding a few rows.
  const int threads = T * H < 64 ? 1 : cfg_.threads_num;
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
          for (int d = 0; d < D; ++d)
            if (!(std::fabs(row[d]) < limit)) {
              const char* name = which ? "v" : "k";
              chunk_err[c] = std::isfinite(row[d])
                                 ? std::string(name) + " value " + std::to_string(row[d]) + where(t, h) +
                                       " overflows kv_type " + kv_type_name(cfg_.kv_type)
                                 : std::string(name) + " contains a non-finite value" + where(t, h);
              return;
            }
        }
  });
  for (const auto& e : chunk_err)
    if (!e.empty()) throw std::invalid_argument(e);
  if (importance)
    for (int64_t i = 0; i < T * H; ++i)
      if (!std::isfinite(importance[i]))
        throw std::invalid_argument("importance contains a non-finite value" + where(i / H, int(i % H)));

  // ---- encode + anchors: tasks own (head, block range) pairs, so they never share a byte ----
  const int64_t p0 = L.len, p1 = L.len + T;
  const int64_t b0 = p0 / bs, b1 = (p1 - 1) / bs + 1;
  const int64_t blocks_per_task = std::max<int64_t>(1, 1024 / bs);
  const int64_t tasks_per_head = (b1 - b0 + blocks_per_task - 1) / blocks_per_task;
  const int ns = kv_row_scales(cfg_.kv_type, D);
  ThreadPool::global().parallel_for(H * tasks_per_head, threads, [&](int64_t task) {
    const int h = static_cast<int>(task / tasks_per_head);
    const int64_t tb0 = b0 + (task % tasks_per_head) * blocks_per_task;
    const int64_t q0 = std::max(p0, tb0 * bs), q1 = std::min(p1, (tb0 + blocks_per_task) * bs);
    std::vector<float> x(D), y(D);  // x: [D] input row, y: [D] the stored row decoded
    for (int64_t p = q0; p < q1; ++p) {
      const int64_t t = p - p0, b = p / bs, r = p % bs;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* src = static_cast<const uint8_t*>(which ? v : k) + (t * H + h) * row_in;
        uint8_t* tile = which ? v_tile(L, h, b) : k_tile(L, h, b);
        input_to_f32(in, src, D, x.data());
        uint8_t* row = tile + r * row_bytes_;
        float* sc = reinterpret_cast<float*>(tile + scale_off_) + r * ns;
        encode_row(cfg_.kv_type, x.data(), D, row, sc);
        if (which == 0) {
          decode_row(cfg_.kv_type, row, sc, D, y.data());
          const float imp = importance ? importance[t * H + h] : -std::numeric_limits<float>::infinity();
          update_anchors(L, h, p, y.data(), imp);
        }
      }
    }
  });
  L.len = p1;
}

// ---- read-back ----

void KVStore::read(int layer, float* k, float* v) const {
  read_range(layer, 0, length(layer), k, v);
}

void KVStore::read_range(int layer, int64_t t0, int64_t t1, float* k, float* v) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  if (t0 < 0 || t0 > t1 || t1 > L.len)
    throw std::out_of_range("read_range: [" + std::to_string(t0) + ", " + std::to_string(t1) +
                            ") is not inside the " + std::to_string(L.len) + " tokens of layer " + std::to_string(layer));
  const int H = cfg_.n_kv_heads, D = cfg_.head_dim, bs = cfg_.block_size;
  const int ns = kv_row_scales(cfg_.kv_type, D);
  for (int64_t p = t0; p < t1; ++p)
    for (int h = 0; h < H; ++h) {
      const int64_t b = p / bs, r = p % bs;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* tile = which ? v_tile(L, h, b) : k_tile(L, h, b);
        decode_row(cfg_.kv_type, tile + r * row_bytes_, reinterpret_cast<const float*>(tile + scale_off_) + r * ns, D,
                   (which ? v : k) + ((p - t0) * H + h) * D);
      }
    }
}

// ---- truncate ----

void KVStore::truncate(int layer, int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  const int l0 = layer < 0 ? 0 : layer, l1 = layer < 0 ? cfg_.n_layers : layer + 1;
  // One layer: 0 <= n <= its length. Every layer (-1): layers holding fewer than n tokens (a forward pass
  // interrupted half-way leaves the later layers shorter) keep what they hold.
  for (int l = l0; l < l1; ++l)  // validate every layer before changing any
    if (n < 0 || (layer >= 0 && n > layer_at(l).len))
      throw std::out_of_range("truncate(" + std::to_string(n) + "): layer " + std::to_string(l) + " holds " +
                              std::to_string(layer_at(l).len) + " tokens");
  const int H = cfg_.n_kv_heads, D = cfg_.head_dim, bs = cfg_.block_size;
  const int ns = kv_row_scales(cfg_.kv_type, D);
  const int64_t b = n / bs, r_end = n % bs;  // block b keeps rows [0, r_end)
  const float none = -std::numeric_limits<float>::infinity();
  for (int l = l0; l < l1; ++l) {
    Layer& L = layers_[l];
    if (r_end > 0 && n < L.len) {
      std::vector<float> y(D);  // [D] one stored key, decoded
      for (int h = 0; h < H; ++h) {
        if (cfg_.anchor_type == AnchorType::DYNAMIC) {  // keep the anchors of surviving rows, in order
          float* a = anchor_at(L, h, b);
          float* imp = L.imp + (h * max_blocks_ + b) * A_;
          int32_t* ps = L.pos + (h * max_blocks_ + b) * A_;
          int32_t& cnt = L.n_anchor[h * max_blocks_ + b];
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
        const uint8_t* tile = k_tile(L, h, b);
        for (int64_t r = 0; r < r_end; ++r) {  // replay the block's keys: row 0 resets the anchors
          decode_row(cfg_.kv_type, tile + r * row_bytes_, reinterpret_cast<const float*>(tile + scale_off_) + r * ns,
                     D, y.data());
          update_anchors(L, h, b * bs + r, y.data(), none);
        }
      }
    }
    if (n < L.len) ++L.gen;
    L.len = std::min(L.len, n);
  }
}

void KVStore::read_anchors(int layer, float* anchors, int32_t* counts) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Layer& L = layer_at(layer);
  const int64_t nb = (L.len + cfg_.block_size - 1) / cfg_.block_size;
  const size_t per = size_t(A_) * cfg_.head_dim;
  for (int h = 0; h < cfg_.n_kv_heads; ++h) {
    if (a16_)
      scalar::input_to_f32(InType::F16, anchor16_at(L, h, 0), nb * per, anchors + h * nb * per);
    else
      std::memcpy(anchors + h * nb * per, anchor_at(L, h, 0), nb * per * 4);
    std::memcpy(counts + h * nb, L.n_anchor + h * max_blocks_, nb * 4);
  }
}

}  // namespace ktq
