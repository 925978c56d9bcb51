// Enums that Python names by strings keep their names in one table each, in enum order (value i is named
// names[i]): the enum's *_name function, the bindings' string parsing and the _C tuples (KV_TYPES, ...) all
// read that table.
#pragma once

#include <cstddef>

namespace ktq {

template <class E, size_t N>
constexpr const char* enum_name(const char* const (&names)[N], E e) {
  const size_t i = static_cast<size_t>(e);
  return i < N ? names[i] : "?";
}

}  // namespace ktq
