// The bindings' shared argument checks. Arrays arrive as numpy views of torch tensors (ktquest/native/store.py makes
// them); every one is checked for dtype, shape and C-contiguity before the GIL is released, with a message
// naming the argument, what was expected and what came. Sizes that must be positive are checked here
// (check_positive), size products with common/checked.h (OverflowError) and scalars with common/finite.h.
// Semantic errors (capacity, ids, non-finite values) are thrown by the C++ code itself before it writes anything.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace ktq::python {

namespace py = pybind11;

// A C-contiguous array of T with the given shape (-1: any size).
template <class T>
py::array_t<T> array_arg(const py::handle& obj, const char* name, std::initializer_list<int64_t> shape) {
  if (!py::isinstance<py::array>(obj) || !py::isinstance<py::array_t<T>>(obj))
    throw py::type_error(std::string(name) + ": expected a numpy array of dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         (py::isinstance<py::array>(obj) ? "dtype " + py::str(obj.attr("dtype")).cast<std::string>()
                                                         : py::str(py::type::of(obj)).cast<std::string>()));
  auto a = py::reinterpret_borrow<py::array_t<T>>(obj);
  bool ok = a.ndim() == py::ssize_t(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape.begin()[i] < 0 || a.shape(i) == shape.begin()[i];
  if (!ok) {  // the message is built only on error: this runs on every decode call
    std::string want, got;
    for (int64_t s : shape) want += (want.empty() ? "" : ", ") + (s < 0 ? std::string("*") : std::to_string(s));
    for (py::ssize_t j = 0; j < a.ndim(); ++j) got += (j ? ", " : "") + std::to_string(a.shape(j));
    throw py::value_error(std::string(name) + ": expected shape [" + want + "], got [" + got + "]");
  }
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": must be C-contiguous");
  return a;
}

// A C-contiguous array of T with ndim dimensions (the GEMV's arguments, whose shapes are checked against each
// other by the caller).
template <class T>
py::array_t<T> ndim_arg(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array_t<T>>(obj) || !py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + ": expected a numpy array of dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         py::str(py::type::of(obj)).cast<std::string>() +
                         (py::isinstance<py::array>(obj)
                              ? " of dtype " + py::str(obj.attr("dtype")).cast<std::string>()
                              : ""));
  auto a = py::reinterpret_borrow<py::array_t<T>>(obj);
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " +
                          std::to_string(a.ndim()));
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": must be C-contiguous");
  return a;
}

// The enum value named s in `names` (the enum's one table, in enum order: common/enum_names.h).
template <class E, size_t N>
E parse_enum(const std::string& s, const char* what, const char* const (&names)[N]) {
  std::string allowed;
  for (size_t i = 0; i < N; ++i) {
    if (s == names[i]) return E(i);
    allowed += (allowed.empty() ? "" : ", ") + std::string(names[i]);
  }
  throw py::value_error(std::string(what) + " '" + s + "' is not one of " + allowed);
}

// The names of an enum's table as a Python tuple (what _C tells Python, e.g. KV_TYPES).
template <size_t N>
py::tuple names_tuple(const char* const (&names)[N]) {
  py::tuple t(N);
  for (size_t i = 0; i < N; ++i) t[i] = py::str(names[i]);
  return t;
}

// An integer item of a Python sequence (an int, or anything with __index__ such as numpy's; not a bool):
// TypeError naming it otherwise, ValueError past 64 bits.
inline int64_t int_item(const py::handle& seq, size_t i, const std::string& what) {
  const py::object o = seq[py::int_(i)];
  if (!PyIndex_Check(o.ptr()) || py::isinstance<py::bool_>(o))
    throw py::type_error(what + ": expected an integer, got " + py::str(py::type::of(o)).cast<std::string>());
  const py::int_ n = py::reinterpret_steal<py::int_>(PyNumber_Index(o.ptr()));
  if (!n) throw py::error_already_set();
  try {
    return n.cast<int64_t>();
  } catch (const py::cast_error&) {
    throw py::value_error(what + ": " + py::str(o).cast<std::string>() + " does not fit in 64 bits");
  }
}

// A size from the caller (an argument, an array's dimension) that must be >= 1: ValueError naming it, before it
// reaches a division or a loop bound (a head_dim of 0 was a SIGFPE). Size products: common/checked.h.
inline int64_t check_positive(int64_t v, const char* what) {
  if (v < 1) throw py::value_error(std::string(what) + " must be >= 1, got " + std::to_string(v));
  return v;
}

inline void check_threads(int n_threads) {
  if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
}

}  // namespace ktq::python
