// ---- CPU features and the forced scalar kernels (common/cpu_features.h) ----
#include "common/cpu_features.h"
#include "common/heap.h"
#include "common/thread_pool.h"
#include "python/bind.h"

namespace ktq::python {

namespace py = pybind11;

void bind_cpu(py::module_& m) {
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["f16c"] = f.f16c;
    d["avx_vnni"] = f.avx_vnni;
    return d;
  }, "CPU features detected at run time: {'avx2', 'fma', 'f16c', 'avx_vnni'} -> bool.");
  m.def("use_avx2", &use_avx2, "True when the AVX2/FMA/F16C kernels are in use (not forced scalar).");
  m.def("set_force_scalar", &set_force_scalar, py::arg("force"),
        "Force the scalar kernels (process-wide); the env var KTQUEST_FORCE_SCALAR=1 does the same at start.");
  m.def("force_scalar", &force_scalar, "Whether the scalar kernels are forced (set_force_scalar, KTQUEST_FORCE_SCALAR).");
  m.def("use_avx_vnni", &use_avx_vnni, "True when the AVX-VNNI kernel variants are in use.");
  m.def("set_allow_vnni", &set_allow_vnni, py::arg("allow"),
        "Let the kernels with an AVX-VNNI variant use it (process-wide; KTQUEST_NO_VNNI=1 says no at start).");
  m.def("allow_vnni", &allow_vnni, "What set_allow_vnni last said (or KTQUEST_NO_VNNI at start).");
  m.def("set_pool_spin_us", [](int64_t us) { ThreadPool::global().set_spin_us(us); }, py::arg("us"),
        "How long the worker pool's idle threads spin before they sleep, in microseconds (common/thread_pool.h).");
  m.def("pool_spin_us", [] { return ThreadPool::global().spin_us(); }, "What set_pool_spin_us last set.");
  m.attr("MMAP_THRESHOLD") = fix_mmap_threshold();  // at import: see common/heap.h
  m.def("prefill_heap", &prefill_heap, py::arg("on"),
        "The C heap's prefill settings (on) or decode settings (off, then malloc_trim): common/heap.h. "
        "False where the user's MALLOC_MMAP_THRESHOLD_ (or a non-glibc C library) leaves the heap alone.");
}

}  // namespace ktq::python
