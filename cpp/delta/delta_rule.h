// The gated delta rule of a DeltaNet layer over a run of tokens, every value head (delta_kernels.h: one head).
#pragma once

#include <cstdint>

namespace ktq {

constexpr int kMaxDeltaValueDim = 1024;  // a head's value dims (the scalar twin's buffers)

// q, k [T, Hk, Dk] (l2-normed; q scaled by 1/sqrt(Dk)), v [T, Hv, Dv], g, beta [T, Hv], S [Hv, Dk, Dv] (in place),
// o [T, Hv, Dv]. Value head h reads q/k head h % Hk (the tiled order llama.cpp's converter gives qwen35 files), or
// h / (Hv / Hk) where `grouped` (qwen3next files keep the model's order). Heads run in parallel on up to n_threads
// threads; each head's tokens in order. std::invalid_argument for sizes it cannot run (Hv % Hk,
// Dv > kMaxDeltaValueDim, a size < 1), before anything is written.
void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
                      float* o, int T, int Hk, int Hv, int Dk, int Dv, int n_threads, bool grouped = false);

}  // namespace ktq
