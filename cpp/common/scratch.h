// Memory helpers of the kernels' callers: a per-thread scratch buffer and an L2 prefetch of a byte range.
// Internal linkage (as when each caller had its own copy): each file keeps its own thread-local buffer,
// reached without going through a shared TLS symbol of the module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ktq {
namespace {

// Per-thread kernel scratch (logits, a decoded row); grows once per worker thread.
inline float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

inline void prefetch_l2(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

}  // namespace
}  // namespace ktq
