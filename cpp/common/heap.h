// The C heap's settings for a long-running decode loop.
//
// glibc serves a block of at least its mmap threshold (128 KiB at start) by mmap, and on freeing such a block
// raises the threshold to the block's size (up to 32 MiB). After a prefill's large temporaries are freed,
// every buffer under that size comes from the heap, and a decode loop that keeps small objects alive between
// short-lived buffers leaves the heap ever larger with the bytes in use flat: resident memory grew ~40 MB per
// 1,000 decode steps in long_context mode (tools/soak.py; mallinfo2 showed the arena growing, in-use flat).
// A fixed threshold switches the raise off; the heap then stays flat.
#pragma once

#include <cstddef>

namespace ktq {

inline constexpr std::size_t kMmapThreshold = std::size_t(1) << 20;  // 1 MiB: flat, and the smallest heap

// Fixes glibc's mmap threshold at kMmapThreshold once per process, unless the user set MALLOC_MMAP_THRESHOLD_
// (or the C library is not glibc). Returns the threshold it set, 0 when it left the heap as it was.
std::size_t fix_mmap_threshold();

}  // namespace ktq
