// Checked size arithmetic's messages (checked.h).
#include "common/checked.h"

#include <cstdio>

namespace ktq {

std::string bytes_str(uint64_t bytes) {
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.2f GiB", double(bytes) / double(uint64_t(1) << 30));
  return std::to_string(bytes) + " bytes (" + gib + ")";
}

void throw_overflow(const char* what, const std::string& a, const char* op, const std::string& b) {
  throw std::overflow_error(std::string(what) + ": " + a + " " + op + " " + b + " overflows (too large)");
}

}  // namespace ktq
