// AVX-VNNI tile of the int8 prefill GEMM (gemm_int8.h, gemm_int8_tile.h): vpdpbusd takes a lane's four
// products and adds them to its int32 sum in one instruction, where AVX2 needs maddubs, an int16 add and, every
// W steps, a madd. The int32 sums have no int16 bound: a scale group is one dpbusd sum, multiplied by the rows'
// scales once (vpmulld): 8 steps for Q4_K / Q5_K (a scale per 32 values) and the 32-value types (scale 1), 4 for a
// panel with Q6_K rows (a scale per 16). The integer sums are the AVX2 tile's, so are the bits. Compiled with
// -mavx2 -mfma -mf16c -mavxvnni; chosen when the CPU has AVX-VNNI (common/cpu_features.h).
#include <immintrin.h>

#include "gemm/gemm_int8.h"
#include "gemm/gemm_int8_tile.h"

namespace ktq {

namespace {

struct Dpbusd {
  static constexpr bool kUnrollAll = true;
  static __m256i step(__m256i part, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(part, w, x); }
  static __m256i widen(__m256i part, __m256i sv) {  // sv: the scale in both int16 halves of a lane
    return _mm256_mullo_epi32(part, _mm256_srai_epi32(sv, 16));
  }
  static __m256i widen1(__m256i part) { return part; }
};

}  // namespace

void gemm_int8_tile_vnni(const KPanel& p, const KAct& a, int64_t t0, int nt, int nr, float* y, int64_t ldy) {
  if (p.qk == kQ32) return tile_steps<Dpbusd, 8, kQ32>(p, a, t0, nt, nr, y, ldy);
  if (p.steps == 2) return tile_steps<Dpbusd, 4, kQK>(p, a, t0, nt, nr, y, ldy);  // Q6_K rows: a scale per 16
  return tile_steps<Dpbusd, 8, kQK>(p, a, t0, nt, nr, y, ldy);
}

}  // namespace ktq
