// The K-quant prefill GEMM (gemm_kquant.h): unpacking rows into panels, the scalar tile and the threaded driver.
// AVX2 tile: gemm_kquant_avx2.cpp.
#include "gemm/gemm_kquant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "quant/kv_codec.h"
#include "quant/q8_act.h"

namespace ktq {

namespace {

constexpr int kPanelsPerTask = 4;  // panels unpacked together: a token's x is read once per four panels

// One super-block of a row in the type-free form: codes 0..63, each 16-value group's integer scale and min.
struct SuperBlock {
  uint8_t codes[kQK];
  int16_t scale[16], min[16];
  float d, dm;
};

// Q4_K / Q5_K: their codes (k_code); a sub-block's 6-bit scale and min on both of its groups.
template <class Block>
void unpack(const Block& b, SuperBlock& u) {
  uint8_t sc[16];
  unpack_k_scales(b.scales, sc);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) u.codes[32 * s + l] = uint8_t(k_code(b, s, l));
    u.scale[2 * s] = u.scale[2 * s + 1] = sc[s];
    u.min[2 * s] = u.min[2 * s + 1] = sc[8 + s];
  }
  u.d = f16_to_f32(b.d), u.dm = f16_to_f32(b.dmin);
}

// Q6_K (ggml_blocks.h): element l + 32k of half h, codes 0..63 (the -32 moves into the min: 32 x the scale).
void unpack(const BlockQ6_K& b, SuperBlock& u) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    for (int k = 0; k < 4; ++k) {
      const int s = 4 * half + k;  // sub-block of 32 values
      for (int l = 0; l < 32; ++l) {
        const int lo = k % 2 ? ql[l + 32] : ql[l];
        u.codes[32 * s + l] = uint8_t((k < 2 ? lo & 15 : lo >> 4) | ((qh[l] >> (2 * k)) & 3) << 4);
      }
    }
  }
  for (int g = 0; g < 16; ++g) u.scale[g] = b.scales[g], u.min[g] = int16_t(32 * b.scales[g]);
  u.d = u.dm = f16_to_f32(b.d);
}

// Super-block s of a row of type t.
void unpack_any(GgmlType t, const uint8_t* row, int64_t s, SuperBlock& u) {
  if (t == GgmlType::Q4_K) unpack(reinterpret_cast<const BlockQ4_K*>(row)[s], u);
  else if (t == GgmlType::Q5_K) unpack(reinterpret_cast<const BlockQ5_K*>(row)[s], u);
  else unpack(reinterpret_cast<const BlockQ6_K*>(row)[s], u);
}

int steps_of(GgmlType t) { return t == GgmlType::Q4_K ? 8 : t == GgmlType::Q5_K ? 4 : 2; }

// A task's panels, each laid out as KPanel says (the fields of panel p start at p * kPanelRows rows).
struct PanelBuf {
  std::vector<uint8_t> codes;
  std::vector<int16_t> sv, mi;
  std::vector<float> d, dm;
  int64_t in = 0;
  void size(int64_t in_) {
    if (in_ == in) return;
    in = in_;
    const size_t rows = size_t(kPanelsPerTask * kPanelRows);
    codes.resize(rows * size_t(in));
    sv.resize(rows * size_t(in / 8));
    mi.resize(rows * size_t(in / 16));
    d.resize(rows * size_t(in / kQK));
    dm.resize(rows * size_t(in / kQK));
  }
  KPanel panel(int p, int steps) const {
    const size_t r = size_t(p * kPanelRows);
    return {codes.data() + r * size_t(in), sv.data() + r * size_t(in / 8), mi.data() + r * size_t(in / 16),
            d.data() + r * size_t(in / kQK), dm.data() + r * size_t(in / kQK), in, steps};
  }
  // Row r of panel p from a row of type t; row == nullptr writes a padding row (zero codes, scales and mins).
  void put_row(int p, int r, GgmlType t, const uint8_t* row) {
    const size_t base = size_t(p * kPanelRows);
    uint8_t* c = codes.data() + base * size_t(in);
    int16_t* s_v = sv.data() + base * size_t(in / 8);
    int16_t* m_i = mi.data() + base * size_t(in / 16);
    float* d_ = d.data() + base * size_t(in / kQK);
    float* dm_ = dm.data() + base * size_t(in / kQK);
    SuperBlock u{};
    for (int64_t s = 0; s < in / kQK; ++s) {
      if (row != nullptr) unpack_any(t, row, s, u);  // a padding row keeps u all zeros
      for (int q = 0; q < kQK / 4; ++q)
        std::memcpy(c + ((s * kQK / 4 + q) * kPanelRows + r) * 4, u.codes + 4 * q, 4);
      for (int g = 0; g < 16; ++g) {
        s_v[((s * 16 + g) * kPanelRows + r) * 2] = s_v[((s * 16 + g) * kPanelRows + r) * 2 + 1] = u.scale[g];
        m_i[((s * 8 + g / 2) * kPanelRows + r) * 2 + g % 2] = u.min[g];
      }
      d_[s * kPanelRows + r] = u.d;
      dm_[s * kPanelRows + r] = u.dm;
    }
  }
};

bool is_kquant(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K; }

}  // namespace

bool gemm_kquant_supported(const QuantMatrix& m) {
  if (m.parts.empty() || m.in % kQK != 0) return false;
  for (const QuantPart& p : m.parts)
    if (!is_kquant(p.type)) return false;
  return true;
}

void gemm_kquant_tile_scalar(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  const int64_t in = p.in, nsb = in / kQK;
  for (int c = 0; c < nt; ++c) {
    const int8_t* xq = a.q + (t0 + c) * in;
    const int16_t* s16 = a.sum16 + (t0 + c) * (in / 16);
    for (int r = 0; r < nr; ++r) {
      float acc = 0.f;
      for (int64_t s = 0; s < nsb; ++s) {
        int32_t isum = 0, imin = 0;
        for (int64_t g = 16 * s; g < 16 * s + 16; ++g) {  // 16-value groups: one scale, one min each
          int32_t dot = 0;
          for (int64_t q = 4 * g; q < 4 * g + 4; ++q)
            for (int b = 0; b < 4; ++b) dot += p.codes[(q * kPanelRows + r) * 4 + b] * xq[4 * q + b];
          isum += p.sv[(g * kPanelRows + r) * 2] * dot;
          imin += p.mi[((g / 2) * kPanelRows + r) * 2 + g % 2] * s16[g];
        }
        const float dx = a.d[(t0 + c) * nsb + s];
        acc = std::fma(float(isum), p.d[s * kPanelRows + r] * dx, acc);
        acc = std::fma(-float(imin), p.dm[s * kPanelRows + r] * dx, acc);
      }
      y[c * ldy + r] = acc;
    }
  }
}

void gemm_kquant(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads) {
  const int64_t in = m.in, out = m.out, nsb = in / kQK;
  // x quantized once per call (tokens across the threads), read by every task; the calling thread's buffers are
  // kept (a prefill calls with the same shapes chunk after chunk).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int16_t> xs;
  xq.resize(std::max(xq.size(), size_t(T * in)));
  xd.resize(std::max(xd.size(), size_t(T * nsb)));
  xs.resize(std::max(xs.size(), size_t(T * in / 16)));
  // Pointers, not the names: a worker's thread_locals are its own.
  int8_t* q = xq.data();
  float* qd = xd.data();
  int16_t* qs = xs.data();
  ThreadPool::global().parallel_for(T, n_threads, [&](int64_t t) {
    quantize_act(x + t * in, in, kQK, q + t * in, qd + t * nsb, qs + t * (in / 16));
  });
  const KAct act{q, qd, qs};
  KTile* tile = use_avx2() ? gemm_kquant_tile_avx2 : gemm_kquant_tile_scalar;

  // Row of the matrix -> its part's type and bytes.
  auto row_of = [&](int64_t o, GgmlType& t) -> const uint8_t* {
    for (const QuantPart& p : m.parts) {
      if (o < p.rows) return t = p.type, p.w + o * ggml_row_bytes(p.type, in);
      o -= p.rows;
    }
    return nullptr;
  };
  const int64_t n_panels = (out + kPanelRows - 1) / kPanelRows;
  const int64_t n_groups = (n_panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(int64_t(n_threads) * 4, n_groups));
  ThreadPool::global().parallel_for(n_tasks, n_threads, [&](int64_t task) {
    thread_local PanelBuf buf;
    for (int64_t gi = n_groups * task / n_tasks; gi < n_groups * (task + 1) / n_tasks; ++gi) {
      buf.size(in);
      const int64_t p0 = gi * kPanelsPerTask, np = std::min<int64_t>(kPanelsPerTask, n_panels - p0);
      KPanel panels[kPanelsPerTask];
      int rows[kPanelsPerTask];
      for (int p = 0; p < np; ++p) {
        const int64_t r0 = (p0 + p) * kPanelRows;
        rows[p] = int(std::min<int64_t>(kPanelRows, out - r0));
        int steps = 8;
        for (int r = 0; r < kPanelRows; ++r) {
          GgmlType t = GgmlType::Q4_K;
          const uint8_t* row = r < rows[p] ? row_of(r0 + r, t) : nullptr;
          buf.put_row(p, r, t, row);
          if (row != nullptr) steps = std::min(steps, steps_of(t));
        }
        panels[p] = buf.panel(p, steps);
      }
      for (int64_t t0 = 0; t0 < T; t0 += kTileTokens) {
        const int nt = int(std::min<int64_t>(kTileTokens, T - t0));
        for (int p = 0; p < np; ++p)
          tile(panels[p], act, t0, nt, rows[p], y + t0 * out + (p0 + p) * kPanelRows, out);
      }
    }
  });
  if (m.bias)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) y[t * out + o] += m.bias[o];
}

}  // namespace ktq
