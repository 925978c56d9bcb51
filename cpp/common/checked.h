// Checked size arithmetic and allocation errors: the one place where the native code multiplies and adds sizes
// that come from a caller (a store's capacity, heads and block size, a block's projections, a candidate copy)
// and says what failed when memory cannot be had. Sizes are computed here before anything is allocated:
//   - a product or sum that does not fit its type throws std::overflow_error (Python: OverflowError) naming what
//     was being computed and the operands, never a wrapped-around small size (a store that reserved 0 bytes);
//   - a size narrowed to int that does not fit throws std::overflow_error naming it;
//   - an allocation that fails throws alloc_error, a std::bad_alloc (Python: MemoryError) whose message names
//     the bytes asked for and what they were for.
// These run once per call (a constructor, a binding's argument check), never per element in a kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace ktq {

// "12884901888 bytes (12.00 GiB)"
std::string bytes_str(uint64_t bytes);

[[noreturn]] void throw_overflow(const char* what, const std::string& a, const char* op, const std::string& b);

// a * b and a + b of sizes of one integer type; throws std::overflow_error("<what>: a * b overflows ...").
template <class T>
T checked_mul(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>);
  T r;
  if (__builtin_mul_overflow(a, b, &r)) throw_overflow(what, std::to_string(a), "*", std::to_string(b));
  return r;
}

template <class T>
T checked_add(T a, T b, const char* what) {
  static_assert(std::is_integral_v<T>);
  T r;
  if (__builtin_add_overflow(a, b, &r)) throw_overflow(what, std::to_string(a), "+", std::to_string(b));
  return r;
}

// v as an int (a count the kernels index with int): std::overflow_error naming `what` unless it fits.
inline int checked_int(int64_t v, const char* what) {
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    throw std::overflow_error(std::string(what) + "=" + std::to_string(v) + " does not fit in a 32-bit int");
  return int(v);
}

// An allocation that failed: a std::bad_alloc (so every handler of one still catches it) with a message.
class alloc_error : public std::bad_alloc {
 public:
  explicit alloc_error(std::string msg) : msg_(std::move(msg)) {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

}  // namespace ktq
