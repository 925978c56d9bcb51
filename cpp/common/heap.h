// The C heap's settings for a long-running decode loop.
//
// glibc serves a block of at least its mmap threshold (128 KiB at start) by mmap, and on freeing such a block
// raises the threshold to the block's size (up to 32 MiB). After a prefill's large temporaries are freed,
// every buffer under that size comes from the heap, and a decode loop that keeps small objects alive between
// short-lived buffers leaves the heap ever larger with the bytes in use flat: resident memory grew ~40 MB per
// 1,000 decode steps in long_context mode (tools/soak.py; mallinfo2 showed the arena growing, in-use flat).
// A fixed threshold switches the raise off; the heap then stays flat.
//
// Prefill is the other way round: every chunk allocates the same few MB-sized temporaries (activations,
// quantized x, matmul outputs), and at a 1 MiB threshold each is a fresh mapping whose pages the kernel faults
// in and zeroes, chunk after chunk: 10-20% of the prefill time of the shaped 1.5B model (perf: clear_page_erms,
// exc_page_fault). So a prefill runs with a high threshold and no trimming (its temporaries come back from the
// heap), and at its end the decode settings return and the heap's free pages go back to the system
// (malloc_trim): decode starts from the same small heap as before.
#pragma once

#include <cstddef>

namespace ktq {

inline constexpr std::size_t kMmapThreshold = std::size_t(1) << 20;  // 1 MiB: flat, and the smallest heap

// Fixes glibc's mmap threshold at kMmapThreshold once per process, unless the user set MALLOC_MMAP_THRESHOLD_
// (or the C library is not glibc). Returns the threshold it set, 0 when it left the heap as it was.
std::size_t fix_mmap_threshold();

inline constexpr std::size_t kPrefillMmapThreshold = std::size_t(64) << 20;
inline constexpr std::size_t kPrefillTrimThreshold = std::size_t(1) << 30;

// on: the prefill settings above; off: kMmapThreshold again, glibc's default trim threshold, and malloc_trim.
// Does nothing (returns false) where fix_mmap_threshold left the heap alone.
bool prefill_heap(bool on);

}  // namespace ktq
