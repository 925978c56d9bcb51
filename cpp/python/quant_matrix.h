// The Python-visible QuantMatrix (gemm/gemv_blocks.h): the parts' arrays kept alive by the object that points
// into them. Built and checked once (bind_gemv_quant.cpp); DecodeLayer and gemv_matrix take it as it is.
#pragma once

#include <vector>

#include <pybind11/pybind11.h>

#include "gemm/gemv_blocks.h"

namespace ktq::python {

namespace py = pybind11;

struct PyQuantMatrix {
  QuantMatrix m;
  std::vector<py::object> keep;  // the parts' arrays (the mapped file's views) and the bias
};

}  // namespace ktq::python
