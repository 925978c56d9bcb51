// ---- the gated delta rule of a DeltaNet layer (cpp/delta/) ----
#include <string>

#include "delta/delta_rule.h"
#include "python/args.h"
#include "python/bind.h"

namespace ktq::python {

void bind_delta(py::module_& m) {
  m.def("gated_delta_rule",
        [](const py::handle& q_obj, const py::handle& k_obj, const py::handle& v_obj, const py::handle& g_obj,
           const py::handle& beta_obj, const py::handle& S_obj, const py::handle& o_obj, int n_threads,
           bool grouped) {
          auto v = ndim_arg<float>(v_obj, "v", 3);
          auto q = ndim_arg<float>(q_obj, "q", 3);
          const int64_t T = check_positive(v.shape(0), "T (v's tokens)");
          const int64_t Hv = check_positive(v.shape(1), "Hv (v's heads)");
          const int64_t Dv = check_positive(v.shape(2), "Dv (v's head dim)");
          const int64_t Hk = check_positive(q.shape(1), "Hk (q's heads)");
          const int64_t Dk = check_positive(q.shape(2), "Dk (q's head dim)");
          q = array_arg<float>(q_obj, "q", {T, Hk, Dk});
          auto k = array_arg<float>(k_obj, "k", {T, Hk, Dk});
          auto g = array_arg<float>(g_obj, "g", {T, Hv});
          auto beta = array_arg<float>(beta_obj, "beta", {T, Hv});
          auto S = array_arg<float>(S_obj, "S", {Hv, Dk, Dv});
          auto o = array_arg<float>(o_obj, "o", {T, Hv, Dv});
          if (!S.writeable() || !o.writeable()) throw py::value_error("S and o: must be writeable");
          if (Hv % Hk) throw py::value_error("Hv=" + std::to_string(Hv) + ": a multiple of Hk=" + std::to_string(Hk));
          if (Dv > kMaxDeltaValueDim)
            throw py::value_error("Dv=" + std::to_string(Dv) + ": at most " + std::to_string(kMaxDeltaValueDim));
          check_threads(n_threads);
          const float *qp = q.data(), *kp = k.data(), *vp = v.data(), *gp = g.data(), *bp = beta.data();
          float *Sp = S.mutable_data(), *op = o.mutable_data();
          py::gil_scoped_release nogil;
          gated_delta_rule(qp, kp, vp, gp, bp, Sp, op, int(T), int(Hk), int(Hv), int(Dk), int(Dv), n_threads,
                           grouped);
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("S"), py::arg("o"),
        py::arg("n_threads"), py::arg("grouped") = false,
        "The gated delta rule of T tokens, in place: q, k [T, Hk, Dk] fp32 (l2-normed; q scaled), v [T, Hv, Dv], "
        "g, beta [T, Hv], S [Hv, Dk, Dv] (the state, updated), o [T, Hv, Dv] (written). Value head h reads q/k "
        "head h % Hk, or h / (Hv / Hk) with grouped.");
}

}  // namespace ktq::python
