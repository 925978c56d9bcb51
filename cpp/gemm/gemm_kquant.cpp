// The K-quant prefill GEMM (gemm_kquant.h): unpacking rows into the panel, the scalar tile and the threaded
// driver. AVX2 tile: gemm_kquant_avx2.cpp.
#include "gemm/gemm_kquant.h"

#include <algorithm>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "quant/kv_codec.h"
#include "quant/q8_act.h"

namespace ktq {

namespace {

constexpr int64_t kPanelRows = 16;  // rows unpacked at a time by each task

inline float h2f(uint16_t h) { return f16_to_f32(h); }

// A task's panel: kPanelRows rows of `in` values.
struct PanelBuf {
  std::vector<uint8_t> codes;
  std::vector<int16_t> sv, mi;
  std::vector<float> d, dm;
  void size(int64_t in) {
    codes.resize(size_t(kPanelRows * in));
    sv.resize(size_t(kPanelRows * in / 2));  // 16 per 32 values
    mi.resize(size_t(kPanelRows * in / 16));
    d.resize(size_t(kPanelRows * in / kQK));
    dm.resize(size_t(kPanelRows * in / kQK));
  }
};

// Super-block b of a row into the panel fields of that super-block (codes [256], sv [8][16], mi [16]).
// Q4_K / Q5_K: their codes (k_code), each sub-block's 6-bit scale and min.
template <class Block>
void unpack(const Block& b, uint8_t* codes, int16_t* sv, int16_t* mi, float& d, float& dm) {
  uint8_t sc[16];
  unpack_k_scales(b.scales, sc);
  for (int s = 0; s < 8; ++s) {
    for (int l = 0; l < 32; ++l) codes[32 * s + l] = uint8_t(k_code(b, s, l));
    std::fill(sv + 16 * s, sv + 16 * s + 16, int16_t(sc[s]));
    mi[2 * s] = mi[2 * s + 1] = sc[8 + s];
  }
  d = h2f(b.d), dm = h2f(b.dmin);
}

// Q6_K (ggml_blocks.h): element l + 32k of half h, codes 0..63 (the -32 moves into the min: 32 x the scale).
void unpack(const BlockQ6_K& b, uint8_t* codes, int16_t* sv, int16_t* mi, float& d, float& dm) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    const int8_t* sc = b.scales + 8 * half;
    for (int k = 0; k < 4; ++k) {
      const int s = 4 * half + k;  // sub-block of 32 values
      for (int l = 0; l < 32; ++l) {
        const int lo = k % 2 ? ql[l + 32] : ql[l];
        codes[32 * s + l] = uint8_t((k < 2 ? lo & 15 : lo >> 4) | ((qh[l] >> (2 * k)) & 3) << 4);
      }
      std::fill(sv + 16 * s, sv + 16 * s + 8, int16_t(sc[2 * k]));
      std::fill(sv + 16 * s + 8, sv + 16 * s + 16, int16_t(sc[2 * k + 1]));
      mi[2 * s] = int16_t(32 * sc[2 * k]);
      mi[2 * s + 1] = int16_t(32 * sc[2 * k + 1]);
    }
  }
  d = dm = h2f(b.d);
}

template <class Block>
void unpack_row(const uint8_t* row, int64_t in, PanelBuf& p, int64_t r) {
  const Block* b = reinterpret_cast<const Block*>(row);
  for (int64_t s = 0; s < in / kQK; ++s)
    unpack(b[s], p.codes.data() + r * in + s * kQK, p.sv.data() + r * (in / 2) + s * 128,
           p.mi.data() + r * (in / 16) + s * 16, p.d[size_t(r * (in / kQK) + s)], p.dm[size_t(r * (in / kQK) + s)]);
}

void unpack_any(GgmlType t, const uint8_t* row, int64_t in, PanelBuf& p, int64_t r) {
  if (t == GgmlType::Q4_K) unpack_row<BlockQ4_K>(row, in, p, r);
  else if (t == GgmlType::Q5_K) unpack_row<BlockQ5_K>(row, in, p, r);
  else unpack_row<BlockQ6_K>(row, in, p, r);
}

bool is_kquant(GgmlType t) { return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K; }

}  // namespace

bool gemm_kquant_supported(const QuantMatrix& m) {
  if (m.parts.empty() || m.in % kQK != 0) return false;
  for (const QuantPart& p : m.parts)
    if (!is_kquant(p.type)) return false;
  return true;
}

void gemm_kquant_tile_scalar(const KPanel& p, int64_t r, const KAct& a, int64_t t0, int nt, float* y, int64_t ldy) {
  const int64_t in = p.in, nsb = in / kQK;
  const uint8_t* codes = p.codes + r * in;
  const int16_t* sv = p.sv + r * (in / 2);
  const int16_t* mi = p.mi + r * (in / 16);
  for (int c = 0; c < nt; ++c) {
    const int8_t* xq = a.q + (t0 + c) * in;
    const int16_t* s16 = a.sum16 + (t0 + c) * (in / 16);
    float acc = 0.f;
    for (int64_t s = 0; s < nsb; ++s) {
      int32_t isum = 0, imin = 0;
      for (int64_t g = 16 * s; g < 16 * s + 16; ++g) {  // 16-value groups: one scale, one min each
        int32_t dot = 0;
        for (int64_t i = 16 * g; i < 16 * g + 16; ++i) dot += codes[i] * xq[i];
        isum += sv[16 * (g / 2) + 8 * (g % 2)] * dot;
        imin += mi[g] * s16[g];
      }
      const float dx = a.d[(t0 + c) * nsb + s];
      acc += p.d[r * nsb + s] * dx * float(isum) - p.dm[r * nsb + s] * dx * float(imin);
    }
    y[c * ldy] = acc;
  }
}

void gemm_kquant(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads) {
  const int64_t in = m.in, out = m.out, nsb = in / kQK;
  // x quantized once per call, read by every task.
  std::vector<int8_t> xq(size_t(T * in));
  std::vector<float> xd(size_t(T * nsb));
  std::vector<int16_t> xs(size_t(T * in / 16));
  for (int64_t t = 0; t < T; ++t)
    quantize_act(x + t * in, in, kQK, xq.data() + t * in, xd.data() + t * nsb, xs.data() + t * (in / 16));
  const KAct act{xq.data(), xd.data(), xs.data()};
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
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(int64_t(n_threads) * 4, n_panels));
  ThreadPool::global().parallel_for(n_tasks, n_threads, [&](int64_t task) {
    thread_local PanelBuf buf;
    buf.size(in);
    for (int64_t pi = n_panels * task / n_tasks; pi < n_panels * (task + 1) / n_tasks; ++pi) {
      const int64_t r0 = pi * kPanelRows, nr = std::min(kPanelRows, out - r0);
      for (int64_t r = 0; r < nr; ++r) {
        GgmlType t = GgmlType::Q4_K;
        const uint8_t* row = row_of(r0 + r, t);
        unpack_any(t, row, in, buf, r);
      }
      const KPanel panel{buf.codes.data(), buf.sv.data(), buf.mi.data(), buf.d.data(), buf.dm.data(), in};
      for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int nt = int(std::min<int64_t>(4, T - t0));
        for (int64_t r = 0; r < nr; ++r) tile(panel, r, act, t0, nt, y + t0 * out + r0 + r, out);
      }
    }
  });
  if (m.bias)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) y[t * out + o] += m.bias[o];
}

}  // namespace ktq
