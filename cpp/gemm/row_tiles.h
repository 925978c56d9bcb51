// How the GEMVs split a [T, out] product across threads (gemv.cpp, gemv_blocks.cpp).
//
// Two contiguous row ranges per thread: each thread then reads long forward streams that the prefetchers
// follow (small chunks claimed in turn made each thread's reads jump every few KiB, and two threads then read
// the bundled model's lm_head slower than one). Within a range, every activation row runs over 64 weight rows
// while they are in L1/L2 (T > 1: a few tokens). The ranges depend on n_threads, the result does not: output
// o is row o's dot products summed in a fixed order.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/thread_pool.h"

namespace ktq {

// rows(t, r0, r1): activation row t times weight rows [r0, r1).
template <class Rows>
void for_row_tiles(int64_t T, int64_t out, int n_threads, const Rows& rows) {
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(int64_t(n_threads) * 2, out / 64));
  const int64_t rows_per_task = (out + n_tasks - 1) / n_tasks;
  auto task = [&](int64_t c) {
    const int64_t o0 = std::min(out, c * rows_per_task), o1 = std::min(out, o0 + rows_per_task);
    for (int64_t r0 = o0; r0 < o1; r0 += 64) {
      const int64_t r1 = std::min(o1, r0 + 64);
      for (int64_t t = 0; t < T; ++t) rows(t, r0, r1);
    }
  };
  ThreadPool::global().parallel_for(n_tasks, n_threads, task);
}

}  // namespace ktq
