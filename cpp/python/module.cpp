// ktquest._C: the only code that knows Python lives in this folder. Every entry point checks dtype, shape and
// contiguity of its arguments, raises ValueError/IndexError with a message naming what is wrong, then
// releases the GIL and calls the raw-pointer C++ code. Users never call ktquest._C directly: ktquest/native/ is
// the one door to it (tests/test_structure.py holds the package to that).
#include <pybind11/pybind11.h>

#include "python/bind.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "ktquest native operators (KV store, sparse attention, quantized GEMV)";
  ktq::python::bind_cpu(m);
  ktq::python::bind_gemv_quant(m);
  ktq::python::bind_kv_store(m);
  ktq::python::bind_store_plan(m);
  ktq::python::bind_dense_attn(m);
  ktq::python::bind_moe(m);
  ktq::python::bind_delta(m);
  ktq::python::bind_decode(m);
  ktq::python::bind_sample(m);
}
