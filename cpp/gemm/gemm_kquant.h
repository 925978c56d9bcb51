// Prefill GEMM on K-quant rows read in place (Q4_K, Q5_K, Q6_K: what Q4_K_M / Q5_K_M files hold), integer dot
// products as the decode GEMV's (gemv_blocks.h), with each weight row unpacked once per call instead of once per
// token:
//   y[T, out] = q8(x)[T, in] @ dequant(W)^T (+ bias),  x quantized to int8 per 256 values (quant/q8_act.h)
//
// A panel of rows is unpacked into one form for the three types. For the 32 values of sub-block j of a row:
//   codes  u8 [32]   the type's unsigned codes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63)
//   sv     i16 [16]  the integer scale of each of maddubs' 16 pair sums: 8 lanes of one 16-value group's scale,
//                    8 of the next's (Q4_K / Q5_K: the sub-block's 6-bit scale twice; Q6_K: its two int8 scales)
// and per super-block of 256: mi i16 [16] (each 16-value group's integer min: Q4_K / Q5_K the sub-block's 6-bit
// min, Q6_K 32 x its scale), d and dm fp32 (Q4_K / Q5_K: d, dmin; Q6_K: d, d). Then a row's super-block is
//   d * dx * sum_j madd(maddubs(codes_j, xq_j), sv_j)  -  dm * dx * madd(mi, sum16(xq))
// exactly the type's dequant(w) . (dx * xq), summed in int32 within the super-block (|lane| < 2^25).
// The kernels take one row against up to four tokens per pass: the row's codes are read once per four tokens.
#pragma once

#include <cstdint>

#include "gemm/gemv_blocks.h"

namespace ktq {

// True when every part of m is a K-quant (the GEMM's types).
bool gemm_kquant_supported(const QuantMatrix& m);

// x: [T, in] fp32, y: [T, out] fp32. m's parts all K-quants (gemm_kquant_supported); in % 256 == 0.
// Rows split across threads; every output is one row's super-blocks summed in a fixed order (the thread count
// does not change the result).
void gemm_kquant(const QuantMatrix& m, const float* x, int64_t T, float* y, int n_threads);

// ---- what the kernels read ----

struct KPanel {  // rows unpacked (see above); row r's data at r * the per-row stride of each field
  const uint8_t* codes;  // [rows, in]
  const int16_t* sv;     // [rows, in / 32, 16]
  const int16_t* mi;     // [rows, in / 256, 16]
  const float* d;        // [rows, in / 256]
  const float* dm;       // [rows, in / 256]
  int64_t in;
};

struct KAct {  // x quantized per 256 (quant/q8_act.h): token t's data at t * the per-token stride
  const int8_t* q;       // [T, in]
  const float* d;        // [T, in / 256]
  const int16_t* sum16;  // [T, in / 16]
};

// y[c * ldy] = row r of the panel . token (t0 + c), for c in [0, nt), nt <= 4 (no bias).
using KTile = void(const KPanel& p, int64_t r, const KAct& a, int64_t t0, int nt, float* y, int64_t ldy);
void gemm_kquant_tile_scalar(const KPanel& p, int64_t r, const KAct& a, int64_t t0, int nt, float* y, int64_t ldy);
void gemm_kquant_tile_avx2(const KPanel& p, int64_t r, const KAct& a, int64_t t0, int nt, float* y, int64_t ldy);

}  // namespace ktq
