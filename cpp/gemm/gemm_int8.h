// The int8 prefill GEMM on rows read in place: the K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M / Q5_K_M files hold)
// and the 4/5-bit 32-value types (below), integer dot products as the decode GEMV's (gemv_blocks.h), with each
// weight row unpacked once per call instead of once per token:
//   y[T, out] = q8(x)[T, in] @ dequant(W)^T (+ bias),  x quantized to int8 per 256 or 32 values (quant/q8_act.h)
//
// Rows are unpacked sixteen at a time into a panel, one form for every type, interleaved so that one int32
// lane of a 256-bit register is one row: four consecutive values of row r sit at bytes 4r..4r+3 of a 64-byte
// step (rows 0-7 in its first 32 bytes, 8-15 in the next). A token's four int8 x values, broadcast to every
// lane, then feed eight rows at once:
//   maddubs(codes of 8 rows x 4 values, x broadcast)  -> 16 int16 pair sums (two per row)
// and the pair sums of W steps add up in int16 before one madd with the rows' scales widens them to int32
// (W = 8 for Q4_K, Q4_0, Q4_1; 4 for Q5_K, Q5_0, Q5_1; 2 for Q6_K: the most steps whose sum cannot leave int16,
// codes < 16 / 32 / 64 against |x| <= 127; where the CPU has AVX-VNNI, one vpdpbusd a step sums in int32 instead,
// gemm_int8_vnni.cpp). Per scaled block (a super-block of 256 values, or 32) each row's sum is
//   d * dx * sum_g scale_g * dot_g(codes, xq)  -  dm * dx * sum_g min_g * sum16_g(xq)
// over its 16-value groups g, exactly the type's dequant(w) . (dx * xq) (Q4_K / Q5_K: each sub-block's 6-bit
// scale and min on both its groups, d and dmin; Q6_K: codes 0..63, the int8 group scale, min 32 x the scale,
// d twice). One panel runs against up to three tokens per pass (kTileTokens).
//
// The 4- and 5-bit 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1) take the same panel and tile with blocks of 32
// values in place of super-blocks of 256 (KPanel::qk), x quantized per 32 as their decode GEMV quantizes it: each
// group's scale is 1, d the block's scale, and the offset a min:
//   Q4_0 / Q5_0: codes 0..15 / 0..31, min 8 / 16, dm = d;   Q4_1 / Q5_1: min 1, dm = -m.
// A block of 32 values has one min and one x scale, so its offset term is one product of two floats made
// before the tiles: (dm * min) per row in the panel, dx * sum32(xq) per token (KAct::sx), not integer sums of
// mins in the tile (a third of a 32-value block's operations there).
// (Q8_0's codes do not fit maddubs' unsigned operand; it keeps the dequantized panels of layers/linear.py.) Only
// int8 activations take the GEMM: `activations: auto` rounds to int16 under 1B parameters (the bundled SmolLM2's
// Q4_1 and Gemma 3's Q5_0), and those prefill on dequantized panels unless set to int8.
#pragma once

#include <cstdint>

#include "gemm/gemv_blocks.h"

namespace ktq {

// True when every part of m is a K-quant (in % 256 == 0), or every part one of Q4_0, Q4_1, Q5_0, Q5_1: the
// GEMM's types (a panel's rows share one block length).
bool gemm_int8_supported(const QuantMatrix& m);
// The values per scaled block the GEMM reads m in: 256 (K-quants), 32 (the 32-value types), 0 (not taken).
int gemm_int8_block(const QuantMatrix& m);

// x: [T, in] fp32, y: [T, out] fp32; gemm_int8_supported(m).
// Rows split across threads; every output is one row's blocks summed in a fixed order (the thread count
// and the kernel path do not change the result).
void gemm_int8(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads);

// Many matrices on their own rows of x in one call (a mixture of experts' prefill: each expert's tokens, grouped):
// rows [offsets[e], offsets[e + 1]) of x [offsets[n], in] through mats[e] into the same rows of y [offsets[n],
// out]. Every matrix has the same in, out and block length (gemm_int8_supported, checked by the caller). x is
// quantized once; the tasks are (matrix, panel group) pairs across the threads. Each output is what gemm_int8 of
// that matrix on those rows gives, bit for bit.
// With rows (not nullptr), x is [n_x, in] and row i of the grouped order reads x row rows[i] (0 <= rows[i] <
// n_x, checked by the caller): the experts' tokens without a gathered copy of x, each token quantized once
// however many experts it is routed to.
void gemm_int8_grouped(const QuantMatrix* const* mats, const int64_t* offsets, int n, const float* x, float* y,
                       int n_threads, const int64_t* rows = nullptr, int64_t n_x = 0);

// ---- what the kernels read ----

constexpr int kPanelRows = 16;  // rows of a panel: the int32 lanes of two 256-bit registers
constexpr int kTileTokens = 3;  // tokens a tile takes at most

struct KPanel {  // 16 rows unpacked (see above)
  const uint8_t* codes;  // [in / 4][16 rows][4]: value 4q + b of row r at (16q + r) * 4 + b
  const int16_t* sv;     // [in / 16][16 rows][2]: row r's scale of 16-value group g, twice (madd's pair)
  const int16_t* mi;     // [in / 32][16 rows][2]: row r's integer mins of groups 2p and 2p + 1
  const float* d;        // [in / qk][16 rows]
  const float* dm;       // [in / qk][16 rows]; qk 32: dm x the block's min (exact: the min is 1, 8 or 16)
  int64_t in;
  int steps;             // W above: 8, 4 or 2 (the least over the panel's rows' types)
  int qk;                // values per scaled block: 256 (K-quants) or 32
};

struct KAct {  // x quantized per qk values (quant/q8_act.h): token t's data at t * the per-token stride
  const int8_t* q;       // [T, in]
  const float* d;        // [T, in / qk]
  const int16_t* sum16;  // [T, in / 16]
  const float* sx;       // qk 32: [T, in / 32], each block's d * (its integer sum of q), for the offset term
  const int64_t* rows;   // nullptr, or the x row each row of y reads: token t of a tile is x row rows[t]
  int64_t row(int64_t t) const { return rows != nullptr ? rows[t] : t; }
};

// y[c * ldy + r] = row r of the panel . token (t0 + c) (x row a.row(t0 + c)), for r in [0, nr), c in [0, nt); nr <= kPanelRows,
// nt <= kTileTokens (no bias). Rows past nr are padding (all-zero codes and scales).
using KTile = void(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy);
void gemm_int8_tile_scalar(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy);
void gemm_int8_tile_avx2(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy);
void gemm_int8_tile_vnni(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy);

struct KPanelOut {  // where a panel is unpacked: KPanel's arrays, writable
  uint8_t* codes;
  int16_t* sv;
  int16_t* mi;
  float* d;
  float* dm;
};

// A panel's sixteen rows, every scaled block of in values, unpacked into KPanel's layout: rows[r] the bytes of a
// row of type types[r] (one family: blocks of qk values), nullptr a padding row (zero codes, scales and mins).
// One call a panel: what a prefill pays once per matrix and chunk, and a mixture of experts once per expert and
// chunk for its few tokens.
using KUnpack = void(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk, const KPanelOut& out);
void gemm_int8_unpack_scalar(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk,
                             const KPanelOut& out);
void gemm_int8_unpack_avx2(const GgmlType* types, const uint8_t* const* rows, int64_t in, int qk, const KPanelOut& out);

}  // namespace ktq
