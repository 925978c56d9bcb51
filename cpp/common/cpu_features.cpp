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
  f.avx_vnni = __builtin_cpu_supports("avxvnni");
#endif
  return f;
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_force_scalar{env_set("KTQUEST_FORCE_SCALAR")};
std::atomic<bool> g_allow_vnni{!env_set("KTQUEST_NO_VNNI")};

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

bool use_avx_vnni() { return use_avx2() && cpu_features().avx_vnni && g_allow_vnni.load(std::memory_order_relaxed); }
void set_allow_vnni(bool allow) { g_allow_vnni.store(allow, std::memory_order_relaxed); }
bool allow_vnni() { return g_allow_vnni.load(std::memory_order_relaxed); }

}  // namespace ktq
