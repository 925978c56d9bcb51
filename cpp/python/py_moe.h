// The Python-visible MoeFfn (moe/moe_ffn.h): its matrices kept alive by the object. Built and checked once
// (bind_moe.cpp); DecodeLayer takes it for a block whose FFN is a mixture of experts.
#pragma once

#include <memory>
#include <vector>

#include <pybind11/pybind11.h>

#include "moe/moe_ffn.h"

namespace ktq::python {

namespace py = pybind11;

struct PyMoeFfn {
  std::vector<py::object> keep;  // the router's, the experts' and the shared expert's QuantMatrix objects
  std::unique_ptr<MoeFfn> ffn;
};

}  // namespace ktq::python
