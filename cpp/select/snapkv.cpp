// SnapKV's block scores over the store's keys (snapkv.h).
#include "select/snapkv.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/cpu_features.h"
#include "common/finite.h"
#include "common/scratch.h"
#include "common/thread_pool.h"
#include "quant/kv_codec.h"
#include "select/snapkv_kernels.h"

namespace ktq {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTaskTokens = 256;  // keys per run (pass 2: whole blocks, at least one): a run's logits,
                                      // [G W, 256 + halo] fp32, and its key panel stay in L2
constexpr int64_t kMaxTasks = 64;     // pass 1: tasks per KV head at most (each several runs), which bounds
                                      // the partials at KVH x 64 x 2 G W floats whatever the context
constexpr int kMaxPool = 255;         // the pooling kernel at most (a wider one is no longer "neighbours")
constexpr int64_t kMaxRows = 1 << 14;  // G W at most: a thread's scratch is (D + G W + G + 1) x ss floats, ss
                                       // 256 keys (or a block) and the pooling's halo

// Keys [t0, t1) of KV head h decoded into kt [D, ss] (column j = key t0 + j); columns [t1 - t0, ss) zero.
void keys_t(const StoreLayout& lay, const StoreLayer& L, int h, int64_t t0, int64_t t1, float* kt, int ss,
            float* row) {
  const int D = lay.cfg.head_dim, bs = lay.cfg.block_size;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = lay.k_tile(L, h, t / bs);
    decode_row(lay.cfg.kv_type, lay.row_of(tile, t % bs), lay.scales_of(tile, t % bs), D, row);
    for (int d = 0; d < D; ++d) kt[int64_t(d) * ss + (t - t0)] = row[d];
  }
  for (int d = 0; d < D; ++d) std::fill(kt + int64_t(d) * ss + (t1 - t0), kt + int64_t(d + 1) * ss, 0.f);
}

// Row (g, w) of s [G W, ss] does not see key t0 + j past its query's position q_pos0 + w: its logit becomes -inf.
void mask_future(float* s, int G, int W, int ss, int64_t t0, int n, int64_t q_pos0) {
  if (t0 + n - 1 <= q_pos0) return;  // every key of the run is at or before the window's first query
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) {
      float* row = s + int64_t(g * W + w) * ss;
      for (int64_t j = std::max<int64_t>(0, q_pos0 + w + 1 - t0); j < n; ++j) row[j] = kNegInf;
    }
}

}  // namespace

void SnapKVScorer::check(const StoreLayer& L, const SnapKVRequest& r) const {
  const int KVH = lay_.cfg.n_kv_heads, bs = lay_.cfg.block_size;
  auto bad = [](const std::string& what) { throw std::invalid_argument("snapkv_scores: " + what); };
  if (r.H < 1 || r.H % KVH != 0)
    bad("q has " + std::to_string(r.H) + " heads: must be a positive multiple of n_kv_heads=" + std::to_string(KVH));
  if (r.W < 1 || int64_t(r.W) * (r.H / KVH) > kMaxRows)
    bad("a window of " + std::to_string(r.W) + " queries is not allowed: 1 <= W and W x " + std::to_string(r.H / KVH) +
        " query heads a KV head <= " + std::to_string(kMaxRows));
  if (r.n_keys < 0 || r.n_keys > L.len)
    bad("n_keys=" + std::to_string(r.n_keys) + " is not inside the layer's " + std::to_string(L.len) + " tokens");
  if (r.q_pos0 < 0 || r.q_pos0 > r.n_keys - r.W)
    bad("the window of " + std::to_string(r.W) + " queries from q_pos0=" + std::to_string(r.q_pos0) +
        " is not inside the keys [0, " + std::to_string(r.n_keys) + ")");
  if (r.n_blocks < 0 || r.n_blocks > (r.n_keys + bs - 1) / bs)
    bad("n_blocks=" + std::to_string(r.n_blocks) + " is not allowed: 0..ceil(n_keys / block_size) = " +
        std::to_string((r.n_keys + bs - 1) / bs));
  if (r.pool < 1 || r.pool % 2 == 0 || r.pool > kMaxPool)
    bad("pool=" + std::to_string(r.pool) + " is not allowed: an odd integer in [1, " + std::to_string(kMaxPool) + "]");
  if (!(r.var.n == 1 || (r.var.n == 3 && 0 <= r.var.succ && r.var.succ <= r.var.intra)))
    bad("query rotations: " + std::to_string(r.var.n) + " with bounds (" + std::to_string(r.var.succ) + ", " +
        std::to_string(r.var.intra) + ") are not allowed: 1, or 3 with 0 <= succ <= intra");
  check_finite_q(r.q, int64_t(r.var.n) * r.W * r.H, lay_.cfg.head_dim);
}

void SnapKVScorer::run(const StoreLayer& L, const SnapKVRequest& r, float* out) {
  check(L, r);
  const int D = lay_.cfg.head_dim, KVH = lay_.cfg.n_kv_heads, bs = lay_.cfg.block_size;
  const int G = r.H / KVH, W = r.W, R = G * W, p = r.pool / 2;
  const int64_t N = r.n_keys, nb = r.n_blocks;
  std::fill(out, out + KVH * nb, 0.f);
  if (nb == 0) return;
  // Each KV head's rows (g, w), scaled as the attention scales them.
  const float scale = 1.f / std::sqrt(float(D));
  const QueryVariants& var = r.var;
  q_.resize(size_t(var.n) * KVH * R * D);
  for (int v = 0; v < var.n; ++v)
    for (int h = 0; h < KVH; ++h)
      for (int g = 0; g < G; ++g)
        for (int w = 0; w < W; ++w) {
          const float* src = r.q + ((int64_t(v) * W + w) * r.H + h * G + g) * D;
          float* dst = q_.data() + ((int64_t(v) * KVH + h) * R + g * W + w) * D;
          for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
        }
  auto q_of = [&](int v, int h) { return q_.data() + (int64_t(v) * KVH + h) * R * D; };
  const bool simd = use_avx2();
  auto logits = simd ? avx2::snapkv_logits : scalar::snapkv_logits;
  const int64_t bt = std::max<int64_t>(1, kTaskTokens / bs);  // pass 2: blocks per task
  const int ss = int((std::max(kTaskTokens, bt * bs + 2 * p) + 7) & ~int64_t(7));
  // (with several rotations, R x ss more: one piece's logits before they join the run's)
  auto scratch = [&]() { return thread_scratch(size_t(D) + size_t(D + R + G + 1 + (var.n > 1 ? R : 0)) * ss); };
  const int threads = lay_.cfg.threads_num;

  // ---- pass 1: every row's log-sum-exp over the keys it sees ----
  const int64_t runs = (N + kTaskTokens - 1) / kTaskTokens;       // runs of keys per KV head
  const int64_t n1 = std::min(runs, kMaxTasks);                  // tasks per KV head
  part_.resize(size_t(KVH) * n1 * 2 * R);                        // [KVH, n1, 2, R]: m then l of each task
  ThreadPool::global().parallel_for(KVH * n1, threads, [&](int64_t task) {
    const int h = int(task / n1);
    const int64_t i = task % n1;
    float* row = scratch();          // [D] a decoded key
    float* kt = row + D;             // [D, ss] the run's keys, transposed
    float* s = kt + int64_t(D) * ss;  // [R, ss] their logits
    float* m = part_.data() + size_t(task) * 2 * R;
    std::fill(m, m + R, kNegInf);
    std::fill(m + R, m + 2 * R, 0.f);
    for (int64_t run = runs * i / n1; run < runs * (i + 1) / n1; ++run) {  // (the split depends on N only)
      const int64_t r0 = run * kTaskTokens, r1 = std::min(N, r0 + kTaskTokens);
      for (int64_t t0 = r0, t1; t0 < r1; t0 = t1) {  // pieces of one query rotation
        t1 = std::min(r1, var.end_of(t0));
        keys_t(lay_, L, h, t0, t1, kt, ss, row);
        logits(q_of(var.of(t0), h), R, D, kt, ss, s);
        mask_future(s, G, W, ss, t0, int(t1 - t0), r.q_pos0);
        (simd ? avx2::snapkv_lse : scalar::snapkv_lse)(s, R, int(t1 - t0), ss, m, m + R);
      }
    }
  });
  lse_.assign(size_t(KVH) * R, kNegInf);  // [KVH, R]: the tasks' partials merged in task order
  std::vector<float>& sum = sum_;
  sum.assign(size_t(R), 0.f);
  for (int h = 0; h < KVH; ++h) {
    float* mx = lse_.data() + size_t(h) * R;
    for (int64_t t = 0; t < n1; ++t) {
      const float* m = part_.data() + (size_t(h) * n1 + t) * 2 * R;
      for (int i = 0; i < R; ++i) mx[i] = std::max(mx[i], m[i]);
    }
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t t = 0; t < n1; ++t) {
      const float* m = part_.data() + (size_t(h) * n1 + t) * 2 * R;
      for (int i = 0; i < R; ++i)
        if (m[i] != kNegInf) sum[i] += m[R + i] * std::exp(m[i] - mx[i]);
    }
    for (int i = 0; i < R; ++i) mx[i] += std::log(sum[i]);  // (every row sees key 0: finite)
  }

  // ---- pass 2: the probabilities of the scored blocks' keys (and their pooling halo), pooled, merged, summed
  // per block ----
  const int64_t n2 = (nb + bt - 1) / bt;
  ThreadPool::global().parallel_for(KVH * n2, threads, [&](int64_t task) {
    const int h = int(task / n2);
    const int64_t b0 = (task % n2) * bt, b1 = std::min(nb, b0 + bt);
    const int64_t u0 = b0 * bs, u1 = std::min(N, b1 * bs);  // the blocks' keys
    const int64_t v0 = std::max<int64_t>(0, u0 - p), v1 = std::min(N, u1 + p);  // ... and the pooling's halo
    float* row = scratch();           // [D] a decoded key
    float* kt = row + D;              // [D, ss] the keys [v0, v1), transposed
    float* s = kt + int64_t(D) * ss;  // [R, ss] their logits
    float* x = s + int64_t(R) * ss;   // [G, xs]: column c is key u0 - p + c (-inf outside [v0, v1))
    float* y = x + int64_t(G) * ss;   // [u1 - u0] the pooled, merged scores of the blocks' keys
    const int xs = int(u1 - u0) + 2 * p, n = int(v1 - v0), off = int(v0 - (u0 - p));
    if (var.end_of(v0) >= v1) {
      keys_t(lay_, L, h, v0, v1, kt, ss, row);
      logits(q_of(var.of(v0), h), R, D, kt, ss, s);
    } else {  // keys of several query rotations: each piece's logits, then into its columns of s
      float* piece = y + ss;  // [R, ss] (past y, in the scratch)
      for (int64_t t0 = v0, t1; t0 < v1; t0 = t1) {
        t1 = std::min(v1, var.end_of(t0));
        keys_t(lay_, L, h, t0, t1, kt, ss, row);
        logits(q_of(var.of(t0), h), R, D, kt, ss, piece);
        for (int i = 0; i < R; ++i)
          std::copy(piece + int64_t(i) * ss, piece + int64_t(i) * ss + (t1 - t0), s + int64_t(i) * ss + (t0 - v0));
      }
    }
    mask_future(s, G, W, ss, v0, n, r.q_pos0);
    for (int g = 0; g < G; ++g) {
      std::fill(x + int64_t(g) * xs, x + int64_t(g) * xs + off, kNegInf);
      std::fill(x + int64_t(g) * xs + off + n, x + int64_t(g + 1) * xs, kNegInf);
    }
    (simd ? avx2::snapkv_probs : scalar::snapkv_probs)(s, G, W, n, ss, lse_.data() + size_t(h) * R, x + off, xs);
    (simd ? avx2::snapkv_pool : scalar::snapkv_pool)(x, G, xs, int(u1 - u0), p, r.max_merge, y);
    for (int64_t b = b0; b < b1; ++b) {
      float sum = 0.f;
      for (int64_t t = b * bs; t < std::min(N, (b + 1) * bs); ++t) sum += y[t - u0];
      out[h * nb + b] = sum;
    }
  });
}

}  // namespace ktq
