// The only file that knows Python. Every entry point checks dtype, shape and contiguity of its
// arguments, raises ValueError/IndexError with a message naming what is wrong, then releases the GIL
// and calls the raw-pointer C++ code. Users never call ktquest._C directly: see ktquest/ops.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_features.h"
#include "gemv.h"

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

// ---- int8 weight-only GEMV (decode matmuls) ----
template <class T>
py::array_t<T> gemv_arg(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array_t<T>>(obj) || !py::isinstance<py::array>(obj))
    throw py::type_error(std::string(name) + ": expected a numpy array of dtype " + py::str(py::dtype::of<T>()).cast<std::string>() +
                         ", got " + py::str(py::type::of(obj)).cast<std::string>() +
                         (py::isinstance<py::array>(obj) ? " of dtype " + py::str(obj.attr("dtype")).cast<std::string>() : ""));
  auto a = py::reinterpret_borrow<py::array_t<T>>(obj);
  if (a.ndim() != ndim)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " +
                          std::to_string(a.ndim()));
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(name) + ": must be C-contiguous");
  return a;
}

void bind_gemv(py::module_& m) {
  m.def("quantize_q8_0", [](const py::handle& w_obj) {
    auto w = gemv_arg<float>(w_obj, "w", 2);
    const int64_t out = w.shape(0), in = w.shape(1);
    if (in % ktq::kQ8Group != 0)
      throw py::value_error("w: the input dimension (" + std::to_string(in) + ") must be a multiple of 32");
    py::array_t<int8_t> q({out, in});
    py::array_t<float> d({out, in / ktq::kQ8Group});
    const float* src = w.data();
    int8_t* qp = q.mutable_data();
    float* dp = d.mutable_data();
    {
      py::gil_scoped_release nogil;
      ktq::quantize_q8_0(src, out * in, qp, dp);
    }
    return py::make_tuple(q, d);
  }, py::arg("w"), "Quantize w [out, in] fp32 to Q8_0: (q int8 [out, in], d fp32 [out, in/32]).");

  m.def("gemv_q8_0", [](const py::handle& x_obj, const py::handle& qw_obj, const py::handle& dw_obj,
                        const py::handle& bias_obj, const py::handle& y_obj, int n_threads) {
    auto x = gemv_arg<float>(x_obj, "x", 2);
    auto qw = gemv_arg<int8_t>(qw_obj, "qw", 2);
    auto dw = gemv_arg<float>(dw_obj, "dw", 2);
    auto y = gemv_arg<float>(y_obj, "y", 2);
    const int64_t T = x.shape(0), in = x.shape(1), out = qw.shape(0);
    if (qw.shape(1) != in)
      throw py::value_error("qw: expected [out, " + std::to_string(in) + "] to match x [T, in], got [" +
                            std::to_string(out) + ", " + std::to_string(qw.shape(1)) + "]");
    if (in % ktq::kQ8Group != 0)
      throw py::value_error("x: the input dimension (" + std::to_string(in) + ") must be a multiple of 32");
    if (dw.shape(0) != out || dw.shape(1) != in / ktq::kQ8Group)
      throw py::value_error("dw: expected [" + std::to_string(out) + ", " + std::to_string(in / ktq::kQ8Group) +
                            "], got [" + std::to_string(dw.shape(0)) + ", " + std::to_string(dw.shape(1)) + "]");
    if (y.shape(0) != T || y.shape(1) != out)
      throw py::value_error("y: expected [" + std::to_string(T) + ", " + std::to_string(out) + "], got [" +
                            std::to_string(y.shape(0)) + ", " + std::to_string(y.shape(1)) + "]");
    const float* bp = nullptr;
    if (!bias_obj.is_none()) {
      auto b = gemv_arg<float>(bias_obj, "bias", 1);
      if (b.shape(0) != out)
        throw py::value_error("bias: expected [" + std::to_string(out) + "], got [" + std::to_string(b.shape(0)) + "]");
      bp = b.data();
    }
    if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
    const float* xp = x.data();
    const int8_t* qp = qw.data();
    const float* dp = dw.data();
    float* yp = y.mutable_data();
    py::gil_scoped_release nogil;
    ktq::gemv_q8_0(xp, T, in, qp, dp, out, bp, yp, n_threads);
  }, py::arg("x"), py::arg("qw"), py::arg("dw"), py::arg("bias"), py::arg("y"), py::arg("n_threads"),
     "y[T, out] = x[T, in] @ dequant(qw, dw)^T (+ bias); x is quantized to Q8_0 per row.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ktquest native operators (KV store, sparse attention, quantized GEMV)";
  bind_cpu(m);
  bind_gemv(m);
  // ---- further sections are added below, one bind_* function per area ----
}
