// The only file that knows Python. Every entry point checks dtype, shape and contiguity of its
// arguments, raises ValueError/IndexError with a message naming what is wrong, then releases the GIL
// and calls the raw-pointer C++ code. Users never call ktquest._C directly: see ktquest/ops.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_features.h"

namespace py = pybind11;

namespace {

// ---- cpu features ----
void bind_cpu(py::module_& m) {
  m.def("cpu_features", [] {
    const ktq::CpuFeatures& f = ktq::cpu_features();
    py::dict d;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["f16c"] = f.f16c;
    return d;
  }, "CPU features detected at run time: {'avx2', 'fma', 'f16c'} -> bool.");
  m.def("use_avx2", &ktq::use_avx2, "True when the AVX2/FMA/F16C kernels are in use (not forced scalar).");
  m.def("set_force_scalar", &ktq::set_force_scalar, py::arg("force"),
        "Force the scalar kernels (process-wide); the env var KTQUEST_FORCE_SCALAR=1 does the same at start.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ktquest native operators (KV store, sparse attention, quantized GEMV)";
  bind_cpu(m);
  // ---- further sections are added below, one bind_* function per area ----
}
