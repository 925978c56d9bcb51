#include "common/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ktq {

namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the YMM state (XGETBV).
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
#endif
  return f;
}

bool env_force_scalar() {
  const char* v = std::getenv("KTQUEST_FORCE_SCALAR");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_force_scalar{env_force_scalar()};

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

bool use_avx2() {
  const CpuFeatures& f = cpu_features();
  return f.avx2 && f.fma && f.f16c && !g_force_scalar.load(std::memory_order_relaxed);
}

void set_force_scalar(bool force) { g_force_scalar.store(force, std::memory_order_relaxed); }
bool force_scalar() { return g_force_scalar.load(std::memory_order_relaxed); }

}  // namespace ktq
