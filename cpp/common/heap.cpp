#include "common/heap.h"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ktq {

std::size_t fix_mmap_threshold() {
#if defined(__GLIBC__)
  static const std::size_t set = [] {
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) return std::size_t(0);  // the user's choice stands
    return mallopt(M_MMAP_THRESHOLD, int(kMmapThreshold)) == 1 ? kMmapThreshold : std::size_t(0);
  }();
  return set;
#else
  return 0;
#endif
}

}  // namespace ktq
