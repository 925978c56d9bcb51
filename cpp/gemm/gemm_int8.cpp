// The int8 prefill GEMM (gemm_int8.h): unpacking rows into panels, the scalar tile and the threaded driver.
// AVX2 tile: gemm_int8_avx2.cpp.
#include "gemm/gemm_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "quant/kv_codec.h"
#include "quant/q8_act.h"

namespace ktq {

namespace {

constexpr int kPanelsPerTask = 4;  // panels unpacked together: a token's x is read once per four panels

// One scaled block's scales, type-free: each 16-value group's integer scale and min (the first qk / 16 used), and
// the block's d and dmin (the codes: block_codes).
struct BlockScales {
  int16_t scale[16], min[16];
  float d, dm;
};

// Q4_K / Q5_K: a sub-block's 6-bit scale and min on both of its groups.
template <class Block>
void k_scales(const Block& b, BlockScales& u) {
  uint8_t sc[16];
  unpack_k_scales(b.scales, sc);
  for (int s = 0; s < 8; ++s) {
    u.scale[2 * s] = u.scale[2 * s + 1] = sc[s];
    u.min[2 * s] = u.min[2 * s + 1] = sc[8 + s];
  }
  u.d = f16_to_f32(b.d), u.dm = f16_to_f32(b.dmin);
}

// Scaled block s of a row of type t (a super-block of 256 values, or a block of 32). Q6_K: the -32 moves into
// the min (32 x the scale); the 32-value types: scale 1, the offset a min (Q4_0 / Q5_0: 8 / 16 with dm = d;
// Q4_1 / Q5_1: 1 with dm = -m).
void block_scales(GgmlType t, const uint8_t* row, int64_t s, BlockScales& u) {
  switch (t) {
    case GgmlType::Q4_K: return k_scales(reinterpret_cast<const BlockQ4_K*>(row)[s], u);
    case GgmlType::Q5_K: return k_scales(reinterpret_cast<const BlockQ5_K*>(row)[s], u);
    case GgmlType::Q6_K: {
      const auto& b = reinterpret_cast<const BlockQ6_K*>(row)[s];
      for (int g = 0; g < 16; ++g) u.scale[g] = b.scales[g], u.min[g] = int16_t(32 * b.scales[g]);
      u.d = u.dm = f16_to_f32(b.d);
      return;
    }
    case GgmlType::Q4_0: u.min[0] = 8, u.d = u.dm = f16_to_f32(reinterpret_cast<const BlockQ4_0*>(row)[s].d); break;
    case GgmlType::Q5_0: u.min[0] = 16, u.d = u.dm = f16_to_f32(reinterpret_cast<const BlockQ5_0*>(row)[s].d); break;
    case GgmlType::Q4_1: {
      const auto& b = reinterpret_cast<const BlockQ4_1*>(row)[s];
      u.min[0] = 1, u.d = f16_to_f32(b.d), u.dm = -f16_to_f32(b.m);
      break;
    }
    default: {  // Q5_1
      const auto& b = reinterpret_cast<const BlockQ5_1*>(row)[s];
      u.min[0] = 1, u.d = f16_to_f32(b.d), u.dm = -f16_to_f32(b.m);
      break;
    }
  }
  u.scale[0] = u.scale[1] = 1, u.min[1] = u.min[0];  // the 32-value types
}

// The 32-value types (ggml_blocks.h): nibble j (and bit j of qh) is element j.
void codes32(const uint8_t* qs, uint32_t qh, uint8_t* codes) {
  for (int j = 0; j < 16; ++j) {
    codes[j] = uint8_t((qs[j] & 15) | ((qh >> j) & 1) << 4);
    codes[j + 16] = uint8_t((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
  }
}

uint32_t qh_of(const uint8_t* qh) {
  uint32_t v;
  std::memcpy(&v, qh, 4);
  return v;
}

// The qk codes (0..63) of scaled block s of a row of type t, in element order: Q4_K / Q5_K through k_code, Q6_K
// element l + 32k of half h as ggml_blocks.h spells it.
void block_codes(GgmlType t, const uint8_t* row, int64_t s, uint8_t* codes) {
  switch (t) {
    case GgmlType::Q4_K: {
      const auto& b = reinterpret_cast<const BlockQ4_K*>(row)[s];
      for (int sb = 0; sb < 8; ++sb)
        for (int l = 0; l < 32; ++l) codes[32 * sb + l] = uint8_t(k_code(b, sb, l));
      return;
    }
    case GgmlType::Q5_K: {
      const auto& b = reinterpret_cast<const BlockQ5_K*>(row)[s];
      for (int sb = 0; sb < 8; ++sb)
        for (int l = 0; l < 32; ++l) codes[32 * sb + l] = uint8_t(k_code(b, sb, l));
      return;
    }
    case GgmlType::Q6_K: {
      const auto& b = reinterpret_cast<const BlockQ6_K*>(row)[s];
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b.ql + 64 * half;
        const uint8_t* qh = b.qh + 32 * half;
        for (int k = 0; k < 4; ++k)
          for (int l = 0; l < 32; ++l) {
            const int lo = k % 2 ? ql[l + 32] : ql[l];
            codes[32 * (4 * half + k) + l] = uint8_t((k < 2 ? lo & 15 : lo >> 4) | ((qh[l] >> (2 * k)) & 3) << 4);
          }
      }
      return;
    }
    case GgmlType::Q4_0: return codes32(reinterpret_cast<const BlockQ4_0*>(row)[s].qs, 0, codes);
    case GgmlType::Q4_1: return codes32(reinterpret_cast<const BlockQ4_1*>(row)[s].qs, 0, codes);
    case GgmlType::Q5_0: {
      const auto& b = reinterpret_cast<const BlockQ5_0*>(row)[s];
      return codes32(b.qs, qh_of(b.qh), codes);
    }
    default: {  // Q5_1
      const auto& b = reinterpret_cast<const BlockQ5_1*>(row)[s];
      return codes32(b.qs, qh_of(b.qh), codes);
    }
  }
}

// Steps of four values whose maddubs pair sums add up in int16: codes < 16 / 32 / 64 against |x| <= 127.
int steps_of(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1: return 8;
    case GgmlType::Q6_K: return 2;
    default: return 4;  // Q5_K, Q5_0, Q5_1
  }
}

bool is_kquant(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K; }
bool is_q32(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q5_0 || t == GgmlType::Q5_1;
}

// A task's panels, each laid out as KPanel says (the fields of panel p start at p * kPanelRows rows; d and dm
// sized for blocks of 32, the shortest).
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
    d.resize(rows * size_t(in / kQ32));
    dm.resize(rows * size_t(in / kQ32));
  }
  KPanelOut out(int p) {  // panel p's arrays, to unpack into
    const size_t r = size_t(p * kPanelRows);
    return {codes.data() + r * size_t(in), sv.data() + r * size_t(in / 8), mi.data() + r * size_t(in / 16),
            d.data() + r * size_t(in / kQ32), dm.data() + r * size_t(in / kQ32)};
  }
  KPanel panel(int p, int steps, int qk) {  // the same arrays, to read
    const KPanelOut o = out(p);
    return {o.codes, o.sv, o.mi, o.d, o.dm, in, steps, qk};
  }
};

// Values per scaled block of m's GEMM: 256 or 32; 0 where the GEMM does not take m.
int block_of(const QuantMatrix& m) {
  if (m.parts.empty()) return 0;
  bool k = true, q = true;
  for (const QuantPart& p : m.parts) k = k && is_kquant(p.type), q = q && is_q32(p.type);
  if (k && m.in % kQK == 0) return kQK;
  if (q && m.in % kQ32 == 0) return kQ32;
  return 0;
}

}  // namespace

bool gemm_int8_supported(const QuantMatrix& m) { return block_of(m) != 0; }

int gemm_int8_block(const QuantMatrix& m) { return block_of(m); }

void gemm_int8_tile_scalar(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  const int64_t in = p.in, nsb = in / p.qk, ng = p.qk / 16;
  for (int c = 0; c < nt; ++c) {
    const int64_t tok = a.row(t0 + c);  // its x row
    const int8_t* xq = a.q + tok * in;
    const int16_t* s16 = a.sum16 + tok * (in / 16);
    for (int r = 0; r < nr; ++r) {
      float acc = 0.f;
      for (int64_t s = 0; s < nsb; ++s) {
        const float dx = a.d[tok * nsb + s];
        if (p.qk == kQ32) {  // scales 1, one min: the offset term from KPanel::dm and KAct::sx
          int32_t isum = 0;
          for (int64_t q = 8 * s; q < 8 * s + 8; ++q)
            for (int b = 0; b < 4; ++b) isum += p.codes[(q * kPanelRows + r) * 4 + b] * xq[4 * q + b];
          acc = std::fma(float(isum), p.d[s * kPanelRows + r] * dx, acc);
          acc = std::fma(-p.dm[s * kPanelRows + r], a.sx[tok * nsb + s], acc);
          continue;
        }
        int32_t isum = 0, imin = 0;
        for (int64_t g = ng * s; g < ng * s + ng; ++g) {  // 16-value groups: one scale, one min each
          int32_t dot = 0;
          for (int64_t q = 4 * g; q < 4 * g + 4; ++q)
            for (int b = 0; b < 4; ++b) dot += p.codes[(q * kPanelRows + r) * 4 + b] * xq[4 * q + b];
          isum += p.sv[(g * kPanelRows + r) * 2] * dot;
          imin += p.mi[((g / 2) * kPanelRows + r) * 2 + g % 2] * s16[g];
        }
        acc = std::fma(float(isum), p.d[s * kPanelRows + r] * dx, acc);
        acc = std::fma(-float(imin), p.dm[s * kPanelRows + r] * dx, acc);
      }
      y[c * ldy + r] = acc;
    }
  }
}

void gemm_int8_unpack_scalar(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk,
                             const KPanelOut& out) {
  const int ng = qk / 16;  // 16-value groups of a block
  uint8_t u[kQK];
  for (int r = 0; r < kPanelRows; ++r)
    for (int64_t s = 0; s < in / qk; ++s) {
      BlockScales b{};  // a padding row keeps zeros
      if (rows[r] != nullptr) {
        block_codes(types[r], rows[r], s, u);
        block_scales(types[r], rows[r], s, b);
      } else {
        std::memset(u, 0, size_t(qk));
      }
      for (int q = 0; q < qk / 4; ++q) std::memcpy(out.codes + ((s * qk / 4 + q) * kPanelRows + r) * 4, u + 4 * q, 4);
      for (int g = 0; g < ng; ++g) {
        const int64_t gg = s * ng + g;
        out.sv[(gg * kPanelRows + r) * 2] = out.sv[(gg * kPanelRows + r) * 2 + 1] = b.scale[g];
        out.mi[((gg / 2) * kPanelRows + r) * 2 + gg % 2] = b.min[g];
      }
      out.d[s * kPanelRows + r] = b.d;
      out.dm[s * kPanelRows + r] = qk == kQ32 ? b.dm * float(b.min[0]) : b.dm;  // (KPanel::dm)
    }
}

namespace {

// x [T, in] quantized per qk values (tokens across the threads) into the calling thread's buffers, kept from call
// to call (a prefill calls with the same shapes chunk after chunk).
KAct quantize_x(const float* x, int64_t T, int64_t in, int qk, int n_threads) {
  const int64_t nsb = in / qk;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int16_t> xs;
  thread_local std::vector<float> xsx;
  xq.resize(std::max(xq.size(), size_t(T * in)));
  xd.resize(std::max(xd.size(), size_t(T * nsb)));
  xs.resize(std::max(xs.size(), size_t(T * in / 16)));
  xsx.resize(std::max(xsx.size(), size_t(qk == kQ32 ? T * nsb : 0)));
  // Pointers, not the names: a worker's thread_locals are its own.
  int8_t* q = xq.data();
  float* qd = xd.data();
  int16_t* qs = xs.data();
  float* qsx = xsx.data();
  ThreadPool::global().parallel_for(T, n_threads, [&](int64_t t) {
    quantize_act(x + t * in, in, qk, q + t * in, qd + t * nsb, qs + t * (in / 16));
    if (qk == kQ32)  // KAct::sx: a block's d times its integer sum (two 16-value sums, exact in fp32)
      for (int64_t s = 0; s < nsb; ++s)
        qsx[t * nsb + s] = qd[t * nsb + s] * float(qs[t * (in / 16) + 2 * s] + qs[t * (in / 16) + 2 * s + 1]);
  });
  return {q, qd, qs, qsx, nullptr};
}

struct Kernels {  // the AVX2 pair or the scalar twins
  KUnpack* unpack;
  KTile* tile;
};

Kernels kernels() {
  if (use_avx_vnni()) return {gemm_int8_unpack_avx2, gemm_int8_tile_vnni};
  if (use_avx2()) return {gemm_int8_unpack_avx2, gemm_int8_tile_avx2};
  return {gemm_int8_unpack_scalar, gemm_int8_tile_scalar};
}

int64_t panel_groups(const QuantMatrix& m) {
  const int64_t n_panels = (m.out + kPanelRows - 1) / kPanelRows;
  return (n_panels + kPanelsPerTask - 1) / kPanelsPerTask;
}

// Panel group gi of m (kPanelsPerTask panels of kPanelRows rows, unpacked into the thread's buffer) against the
// tokens [t_begin, t_end) of act: y[t * m.out + row] (no bias).
void run_group(const QuantMatrix& m, int qk, int64_t gi, const KAct& act, int64_t t_begin, int64_t t_end, float* y,
               const Kernels& kernels) {
  thread_local PanelBuf buf;
  const int64_t in = m.in, out = m.out;
  auto row_of = [&](int64_t o, GgmlType& t) -> const uint8_t* {  // a row of the matrix: its part's type and bytes
    for (const QuantPart& p : m.parts) {
      if (o < p.rows) return t = p.type, p.w + o * ggml_row_bytes(p.type, in);
      o -= p.rows;
    }
    return nullptr;
  };
  const int64_t n_panels = (out + kPanelRows - 1) / kPanelRows;
  buf.size(in);
  const int64_t p0 = gi * kPanelsPerTask, np = std::min<int64_t>(kPanelsPerTask, n_panels - p0);
  KPanel panels[kPanelsPerTask];
  int rows[kPanelsPerTask];
  for (int p = 0; p < np; ++p) {
    const int64_t r0 = (p0 + p) * kPanelRows;
    rows[p] = int(std::min<int64_t>(kPanelRows, out - r0));
    GgmlType types[kPanelRows];
    const uint8_t* row[kPanelRows];
    int steps = 8;
    for (int r = 0; r < kPanelRows; ++r) {
      types[r] = GgmlType::Q4_K;
      row[r] = r < rows[p] ? row_of(r0 + r, types[r]) : nullptr;
      if (row[r] != nullptr) steps = std::min(steps, steps_of(types[r]));
    }
    kernels.unpack(types, row, in, qk, buf.out(p));
    panels[p] = buf.panel(p, steps, qk);
  }
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTileTokens) {
    const int nt = int(std::min<int64_t>(kTileTokens, t_end - t0));
    for (int p = 0; p < np; ++p)
      kernels.tile(panels[p], act, t0, nt, rows[p], y + t0 * out + (p0 + p) * kPanelRows, out);
  }
}

void add_bias(const QuantMatrix& m, int64_t t_begin, int64_t t_end, float* y) {
  if (m.bias)
    for (int64_t t = t_begin; t < t_end; ++t)
      for (int64_t o = 0; o < m.out; ++o) y[t * m.out + o] += m.bias[o];
}

}  // namespace

void gemm_int8(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads) {
  const int qk = block_of(m);
  const KAct act = quantize_x(x, T, m.in, qk, n_threads);  // once per call, read by every task
  const Kernels k = kernels();
  const int64_t n_groups = panel_groups(m);
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(int64_t(n_threads) * 4, n_groups));
  ThreadPool::global().parallel_for(n_tasks, n_threads, [&](int64_t task) {
    for (int64_t gi = n_groups * task / n_tasks; gi < n_groups * (task + 1) / n_tasks; ++gi)
      run_group(m, qk, gi, act, 0, T, y, k);
  });
  add_bias(m, 0, T, y);
}

void gemm_int8_grouped(const QuantMatrix* const* mats, const int64_t* offsets, int n, const float* x, float* y,
                       int n_threads, const int64_t* rows, int64_t n_x) {
  const QuantMatrix& first = *mats[0];
  const int qk = block_of(first);
  KAct act = quantize_x(x, rows != nullptr ? n_x : offsets[n], first.in, qk, n_threads);  // every row once
  act.rows = rows;
  const Kernels k = kernels();
  std::vector<std::pair<int, int64_t>> tasks;  // (matrix, its panel group), for the matrices with rows of x
  for (int e = 0; e < n; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t gi = 0; gi < panel_groups(*mats[e]); ++gi) tasks.emplace_back(e, gi);
  ThreadPool::global().parallel_for(int64_t(tasks.size()), n_threads, [&](int64_t i) {
    const auto [e, gi] = tasks[size_t(i)];
    run_group(*mats[e], qk, gi, act, offsets[e], offsets[e + 1], y, k);
  });
  for (int e = 0; e < n; ++e) add_bias(*mats[e], offsets[e], offsets[e + 1], y);
}

}  // namespace ktq
