// AVX2 twins of the K-quant row dot products (gemm/gemv_blocks.h; scalar: gemv_blocks_scalar.cpp), after ggml's
// Q4_K/Q5_K/Q6_K x Q8_K kernels. Per super-block: unsigned weight codes times int8 activations with maddubs (pairs
// summed to int16: at most 2 * 63 * 127 = 16002, no saturation), times the integer sub-block scales with madd
// (int32), summed over the super-block and converted to fp32 once. Compiled with -mavx2 -mfma -mf16c, called
// only when use_avx2().
#include <cstring>
#include <type_traits>

#include "gemm/avx2_blocks.h"
#include "gemm/gemv_blocks.h"

namespace ktq::avx2 {

namespace {

// Every int16 lane = int16 lane s of v's 128-bit half (v holds the same 8 scales in both halves).
inline __m256i bcast_i16(__m256i v, int s) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(short(0x0202 * s + 0x0100)));
}

// sum_s mn[s] * sum(q8 over sub-block s) as 4 int32 lanes.
inline __m128i mins_dot(__m256i sc_mn, const int16_t* sum32) {
  return _mm_madd_epi16(_mm256_extracti128_si256(sc_mn, 1), loadu128(sum32));
}

// (d, dmin), adjacent fp16 at p, times the activation scale dx: [d * dx, dmin * dx, 0, 0].
inline __m128 scales_d_dmin(const uint16_t* p, float dx) {
  uint32_t both;
  std::memcpy(&both, p, 4);
  return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(int(both))), _mm_set1_ps(dx));
}

inline float hsum128(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

}  // namespace

// ---- Q4_K / Q5_K ----

// Q5_K adds a fifth bit from qh: bit s of qh[l] is that of element l of sub-block s, shifted down two places per
// 64 values. A 16-bit shift moves each byte's own bits (bit 0 of either byte after `& 1` comes from that byte).
template <bool kStream, class Block>
float q45_k(const uint8_t* row, const ActRow& a, int64_t in) {
  constexpr bool kQ5 = std::is_same_v<Block, BlockQ5_K>;
  const Block* b = reinterpret_cast<const Block*>(row);
  const __m256i m4 = _mm256_set1_epi8(0xF), m1 = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  __m128 acc_m = _mm_setzero_ps();
  for (int64_t i = 0; i < in / kQK; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const __m128 dd = scales_d_dmin(&b[i].d, a.d[i]);
    const __m256i sc_mn = scales_mins(b[i].scales);
    const __m128 mins = _mm_cvtepi32_ps(mins_dot(sc_mn, a.sum32 + i * (kQK / 32)));
    acc_m = _mm_fnmadd_ps(_mm_shuffle_ps(dd, dd, 0x55), mins, acc_m);  // - dmin * dx * sum_s mn[s] * sum(q8)

    const __m128i sc128 = _mm256_castsi256_si128(sc_mn);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    __m256i hbits = _mm256_setzero_si256();
    if constexpr (kQ5) hbits = loadu256(b[i].qh);
    const uint8_t* q = b[i].qs;
    const int8_t* q8 = a.q + i * kQK;
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j, q += 32, q8 += 64) {  // 64 values: sub-blocks 2j (low nibbles), 2j+1 (high)
      const __m256i bits = loadu256(q);
      __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      if constexpr (kQ5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, m1), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), m1), 4));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      const __m256i pl = _mm256_madd_epi16(bcast_i16(scales, 2 * j), _mm256_maddubs_epi16(lo, loadu256(q8)));
      const __m256i ph = _mm256_madd_epi16(bcast_i16(scales, 2 * j + 1), _mm256_maddubs_epi16(hi, loadu256(q8 + 32)));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
    }
    acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum(acc) + hsum128(acc_m);
}

// The same dot products for n <= kDotTokens activation rows at once (batched decode): each super-block's codes
// unpacked and its scales decoded once for all of them, then each row's integer sums and fp32 accumulation exactly
// as q45_k does them (out[t] is q45_k(row, a[t], in), bit for bit).
template <bool kStream, class Block, int N>
void q45_k_n(const uint8_t* row, const ActRow* a, int64_t in, float* out) {
  constexpr bool kQ5 = std::is_same_v<Block, BlockQ5_K>;
  const Block* b = reinterpret_cast<const Block*>(row);
  const __m256i m4 = _mm256_set1_epi8(0xF), m1 = _mm256_set1_epi8(1);
  __m256 acc[N];
  __m128 acc_m[N];
  for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps(), acc_m[t] = _mm_setzero_ps();
  for (int64_t i = 0; i < in / kQK; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    uint32_t both;
    std::memcpy(&both, &b[i].d, 4);
    const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(int(both)));
    const __m256i sc_mn = scales_mins(b[i].scales);
    const __m128i sc128 = _mm256_castsi256_si128(sc_mn);
    const __m256i scales = _mm256_set_m128i(sc128, sc128);
    __m256i hbits = _mm256_setzero_si256();
    if constexpr (kQ5) hbits = loadu256(b[i].qh);
    __m256i sumi[N];
    for (int t = 0; t < N; ++t) sumi[t] = _mm256_setzero_si256();
    const uint8_t* q = b[i].qs;
    for (int j = 0; j < 4; ++j, q += 32) {  // 64 values: sub-blocks 2j (low nibbles), 2j+1 (high)
      const __m256i bits = loadu256(q);
      __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      if constexpr (kQ5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, m1), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), m1), 4));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      const __m256i sl = bcast_i16(scales, 2 * j), sh = bcast_i16(scales, 2 * j + 1);
      for (int t = 0; t < N; ++t) {
        const int8_t* q8 = a[t].q + i * kQK + 64 * j;
        const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, loadu256(q8)));
        const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, loadu256(q8 + 32)));
        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
      }
    }
    for (int t = 0; t < N; ++t) {
      const __m128 dd = _mm_mul_ps(d_dmin, _mm_set1_ps(a[t].d[i]));
      const __m128 mins = _mm_cvtepi32_ps(mins_dot(sc_mn, a[t].sum32 + i * (kQK / 32)));
      acc_m[t] = _mm_fnmadd_ps(_mm_shuffle_ps(dd, dd, 0x55), mins, acc_m[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
    }
  }
  for (int t = 0; t < N; ++t) out[t] = hsum(acc[t]) + hsum128(acc_m[t]);
}

template <bool kStream, class Block>
void q45_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  switch (n) {
    case 1: q45_k_n<kStream, Block, 1>(row, a, in, out); return;
    case 2: q45_k_n<kStream, Block, 2>(row, a, in, out); return;
    case 3: q45_k_n<kStream, Block, 3>(row, a, in, out); return;
    default: q45_k_n<kStream, Block, 4>(row, a, in, out); return;
  }
}

// ---- Q6_K ----

template <bool kStream>
float q6_k(const uint8_t* row, const ActRow& a, int64_t in) {
  const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row);
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQK; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const float d = a.d[i] * h2f(b[i].d);
    const __m128i scales = loadu128(b[i].scales);  // 16 int8, one per 16 values
    // The codes are q + 32 with q in [0, 64): sum (q - 32) * x = sum q * x - 32 * sum x, the second term from the
    // activation sums of 16, weighted by the same scales (one madd for the super-block).
    const __m256i corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), loadu256(a.sum16 + i * (kQK / 16)));
    __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* q8 = a.q + i * kQK;
    for (int j = 0; j < 2; ++j, ql += 64, qh += 32, q8 += 128) {  // 128 values, scales 8j .. 8j+8
      const __m256i l1 = loadu256(ql), l2 = loadu256(ql + 32), h = loadu256(qh);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l2, m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
      const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
      // Chunk k's 32 values take scales 8j + 2k (first 16) and 8j + 2k + 1: bytes {s x 8, s+1 x 8}, widened.
      auto scale = [&](int k) {
        const int s = 8 * j + 2 * k;
        return _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(scales, _mm_set_epi64x(0x0101010101010101LL * (s + 1), 0x0101010101010101LL * s)));
      };
      const __m256i p0 = _mm256_madd_epi16(scale(0), _mm256_maddubs_epi16(q0, loadu256(q8)));
      const __m256i p1 = _mm256_madd_epi16(scale(1), _mm256_maddubs_epi16(q1, loadu256(q8 + 32)));
      const __m256i p2 = _mm256_madd_epi16(scale(2), _mm256_maddubs_epi16(q2, loadu256(q8 + 64)));
      const __m256i p3 = _mm256_madd_epi16(scale(3), _mm256_maddubs_epi16(q3, loadu256(q8 + 96)));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
  }
  return hsum(acc);
}

// q6_k for n <= kDotTokens activation rows at once, as q45_k_n is q45_k's (out[t] is q6_k(row, a[t], in)).
template <bool kStream, int N>
void q6_k_n(const uint8_t* row, const ActRow* a, int64_t in, float* out) {
  const BlockQ6_K* b = reinterpret_cast<const BlockQ6_K*>(row);
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  __m256 acc[N];
  for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in / kQK; ++i) {
    if constexpr (kStream) prefetch_block<sizeof(*b)>(b + i);
    const float dw = h2f(b[i].d);
    const __m128i scales = loadu128(b[i].scales);
    const __m256i sc16 = _mm256_cvtepi8_epi16(scales);
    __m256i sumi[N];
    for (int t = 0; t < N; ++t) {
      const __m256i corr = _mm256_madd_epi16(sc16, loadu256(a[t].sum16 + i * (kQK / 16)));
      sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
    }
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    for (int j = 0; j < 2; ++j, ql += 64, qh += 32) {  // 128 values, scales 8j .. 8j+8
      const __m256i l1 = loadu256(ql), l2 = loadu256(ql + 32), h = loadu256(qh);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l2, m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
      const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
      auto scale = [&](int k) {
        const int s = 8 * j + 2 * k;
        return _mm256_cvtepi8_epi16(
            _mm_shuffle_epi8(scales, _mm_set_epi64x(0x0101010101010101LL * (s + 1), 0x0101010101010101LL * s)));
      };
      const __m256i s0 = scale(0), s1 = scale(1), s2 = scale(2), s3 = scale(3);
      for (int t = 0; t < N; ++t) {
        const int8_t* q8 = a[t].q + i * kQK + 128 * j;
        const __m256i p0 = _mm256_madd_epi16(s0, _mm256_maddubs_epi16(q0, loadu256(q8)));
        const __m256i p1 = _mm256_madd_epi16(s1, _mm256_maddubs_epi16(q1, loadu256(q8 + 32)));
        const __m256i p2 = _mm256_madd_epi16(s2, _mm256_maddubs_epi16(q2, loadu256(q8 + 64)));
        const __m256i p3 = _mm256_madd_epi16(s3, _mm256_maddubs_epi16(q3, loadu256(q8 + 96)));
        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
      }
    }
    for (int t = 0; t < N; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(a[t].d[i] * dw), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
  }
  for (int t = 0; t < N; ++t) out[t] = hsum(acc[t]);
}

template <bool kStream>
void q6_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  switch (n) {
    case 1: q6_k_n<kStream, 1>(row, a, in, out); return;
    case 2: q6_k_n<kStream, 2>(row, a, in, out); return;
    case 3: q6_k_n<kStream, 3>(row, a, in, out); return;
    default: q6_k_n<kStream, 4>(row, a, in, out); return;
  }
}

// ---- the kernels without and with the weight prefetch of long rows ----

float dot_q4_k(const uint8_t* row, const ActRow& a, int64_t in) { return q45_k<false, BlockQ4_K>(row, a, in); }
float dot_q5_k(const uint8_t* row, const ActRow& a, int64_t in) { return q45_k<false, BlockQ5_K>(row, a, in); }
float dot_q6_k(const uint8_t* row, const ActRow& a, int64_t in) { return q6_k<false>(row, a, in); }
void dot_q4_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  q45_k_rows<false, BlockQ4_K>(row, a, n, in, out);
}
void dot_q5_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  q45_k_rows<false, BlockQ5_K>(row, a, n, in, out);
}
void dot_q6_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  q6_k_rows<false>(row, a, n, in, out);
}

}  // namespace ktq::avx2

namespace ktq::avx2_stream {

float dot_q4_k(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q45_k<true, BlockQ4_K>(row, a, in); }
float dot_q5_k(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q45_k<true, BlockQ5_K>(row, a, in); }
float dot_q6_k(const uint8_t* row, const ActRow& a, int64_t in) { return avx2::q6_k<true>(row, a, in); }
void dot_q4_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  avx2::q45_k_rows<true, BlockQ4_K>(row, a, n, in, out);
}
void dot_q5_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  avx2::q45_k_rows<true, BlockQ5_K>(row, a, n, in, out);
}
void dot_q6_k_rows(const uint8_t* row, const ActRow* a, int n, int64_t in, float* out) {
  avx2::q6_k_rows<true>(row, a, n, in, out);
}

}  // namespace ktq::avx2_stream
