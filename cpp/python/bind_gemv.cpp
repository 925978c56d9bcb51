// ---- Q8_0 weights and the weight-only GEMV of the decode matmuls (quant/q8_0.h, gemm/gemv.h) ----
#include "gemm/gemv.h"
#include "python/args.h"
#include "python/bind.h"
#include "quant/q8_0.h"

namespace ktq::python {

void bind_gemv(py::module_& m) {
  m.def("quantize_q8_0", [](const py::handle& w_obj) {
    auto w = ndim_arg<float>(w_obj, "w", 2);
    const int64_t out = w.shape(0), in = w.shape(1);
    if (in % kQGroup != 0)
      throw py::value_error("w: the input dimension (" + std::to_string(in) + ") must be a multiple of " +
                            std::to_string(kQGroup));
    py::array_t<int8_t> q({out, in});
    py::array_t<float> d({out, in / kQGroup});
    const float* src = w.data();
    int8_t* qp = q.mutable_data();
    float* dp = d.mutable_data();
    {
      py::gil_scoped_release nogil;
      quantize_q8_0(src, out * in, qp, dp);
    }
    return py::make_tuple(q, d);
  }, py::arg("w"), "Quantize w [out, in] fp32 to Q8_0: (q int8 [out, in], d fp32 [out, in/32]).");

  m.def("gemv_q8_0", [](const py::handle& x_obj, const py::handle& qw_obj, const py::handle& dw_obj,
                        const py::handle& bias_obj, const py::handle& y_obj, int n_threads) {
    auto x = ndim_arg<float>(x_obj, "x", 2);
    auto qw = ndim_arg<int8_t>(qw_obj, "qw", 2);
    auto dw = ndim_arg<float>(dw_obj, "dw", 2);
    auto y = ndim_arg<float>(y_obj, "y", 2);
    const int64_t T = x.shape(0), in = x.shape(1), out = qw.shape(0);
    if (qw.shape(1) != in)
      throw py::value_error("qw: expected [out, " + std::to_string(in) + "] to match x [T, in], got [" +
                            std::to_string(out) + ", " + std::to_string(qw.shape(1)) + "]");
    if (in % kQGroup != 0)
      throw py::value_error("x: the input dimension (" + std::to_string(in) + ") must be a multiple of " +
                            std::to_string(kQGroup));
    if (dw.shape(0) != out || dw.shape(1) != in / kQGroup)
      throw py::value_error("dw: expected [" + std::to_string(out) + ", " + std::to_string(in / kQGroup) +
                            "], got [" + std::to_string(dw.shape(0)) + ", " + std::to_string(dw.shape(1)) + "]");
    if (y.shape(0) != T || y.shape(1) != out)
      throw py::value_error("y: expected [" + std::to_string(T) + ", " + std::to_string(out) + "], got [" +
                            std::to_string(y.shape(0)) + ", " + std::to_string(y.shape(1)) + "]");
    const float* bp = nullptr;
    if (!bias_obj.is_none()) {
      auto b = ndim_arg<float>(bias_obj, "bias", 1);
      if (b.shape(0) != out)
        throw py::value_error("bias: expected [" + std::to_string(out) + "], got [" + std::to_string(b.shape(0)) + "]");
      bp = b.data();
    }
    check_threads(n_threads);
    const float* xp = x.data();
    const int8_t* qp = qw.data();
    const float* dp = dw.data();
    float* yp = y.mutable_data();
    py::gil_scoped_release nogil;
    gemv_q8_0(xp, T, in, qp, dp, out, bp, yp, n_threads);
  }, py::arg("x"), py::arg("qw"), py::arg("dw"), py::arg("bias"), py::arg("y"), py::arg("n_threads"),
     "y[T, out] = x[T, in] @ dequant(qw, dw)^T (+ bias); weight-only: x stays fp32.");

  m.attr("Q8_GROUP") = kQGroup;  // values per fp32 scale in Q8_0 weights and in the store's Q8_0/Q4_0 rows
}

}  // namespace ktq::python
