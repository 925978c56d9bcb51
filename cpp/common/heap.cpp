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

bool prefill_heap(bool on) {
#if defined(__GLIBC__)
  if (fix_mmap_threshold() == 0) return false;
  constexpr int kDefaultTrim = 128 * 1024;  // glibc's M_TRIM_THRESHOLD at start
  mallopt(M_TRIM_THRESHOLD, on ? int(kPrefillTrimThreshold) : kDefaultTrim);
  mallopt(M_MMAP_THRESHOLD, int(on ? kPrefillMmapThreshold : kMmapThreshold));
  if (!on) malloc_trim(0);
  return true;
#else
  (void)on;
  return false;
#endif
}

}  // namespace ktq
