// The quantisation group of every Q format here (ggml's): kQGroup consecutive values share one fp32 scale,
// along head_dim in the KV store's Q8_0/Q4_0 rows (kv_codec.h).
#pragma once

namespace ktq {

constexpr int kQGroup = 32;

}  // namespace ktq
