// ---- a mixture-of-experts FFN on GGUF-encoded experts, and its routing (cpp/moe/) ----
#include <string>

#include "python/args.h"
#include "python/bind.h"
#include "python/py_moe.h"
#include "python/quant_matrix.h"

namespace ktq::python {

namespace {

const QuantMatrix& matrix(PyMoeFfn& F, const py::handle& obj, const std::string& name) {
  if (!py::isinstance<PyQuantMatrix>(obj))
    throw py::type_error(name + ": expected a QuantMatrix, got " + py::str(py::type::of(obj)).cast<std::string>());
  F.keep.push_back(py::reinterpret_borrow<py::object>(obj));
  return obj.cast<const PyQuantMatrix&>().m;
}

}  // namespace

void bind_moe(py::module_& m) {
  py::class_<PyMoeFfn>(m, "MoeFfn",
                       "A decode token's mixture-of-experts FFN on GGUF-encoded experts (cpp/moe/moe_ffn.h).")
      .def(py::init([](const py::handle& router, const py::sequence& gate_up, const py::sequence& down, int n_used,
                       bool norm_topk, const py::handle& shared_gate_up, const py::handle& shared_down,
                       const py::handle& shared_gate) {
             auto F = std::make_unique<PyMoeFfn>();
             MoeWeights w;
             w.router = matrix(*F, router, "router");
             for (size_t e = 0; e < py::len(gate_up); ++e)
               w.gate_up.push_back(matrix(*F, gate_up[e], "experts_gate_up[" + std::to_string(e) + "]"));
             for (size_t e = 0; e < py::len(down); ++e)
               w.down.push_back(matrix(*F, down[e], "experts_down[" + std::to_string(e) + "]"));
             w.n_used = n_used;
             w.norm_topk = norm_topk;
             if (!shared_gate_up.is_none() || !shared_down.is_none() || !shared_gate.is_none()) {
               if (shared_gate_up.is_none() || shared_down.is_none() || shared_gate.is_none())
                 throw py::value_error("shared expert: give shared_gate_up, shared_down and shared_gate, or none");
               w.shared_gate_up = matrix(*F, shared_gate_up, "shared_gate_up");
               w.shared_down = matrix(*F, shared_down, "shared_down");
               auto g = array_arg<float>(shared_gate, "shared_gate", {w.router.in});
               F->keep.push_back(g);
               w.shared_gate = g.data();
             }
             F->ffn = std::make_unique<MoeFfn>(w);  // check_moe: ValueError naming the part
             return F;
           }),
           py::arg("router"), py::arg("experts_gate_up"), py::arg("experts_down"), py::arg("n_used"),
           py::arg("norm_topk"), py::kw_only(), py::arg("shared_gate_up") = py::none(),
           py::arg("shared_down") = py::none(), py::arg("shared_gate") = py::none())
      .def_property_readonly("n_experts", [](const PyMoeFfn& F) { return F.ffn->weights().router.out; })
      .def_property_readonly("dim", [](const PyMoeFfn& F) { return F.ffn->weights().router.in; })
      .def("run", [](PyMoeFfn& F, const py::handle& xn_obj, const py::handle& y_obj, int n_threads) {
             const MoeWeights& w = F.ffn->weights();
             auto xn = array_arg<float>(xn_obj, "xn", {w.router.in});
             auto y = array_arg<float>(y_obj, "y", {w.router.in});
             if (!y.writeable()) throw py::value_error("y: must be writeable");
             check_threads(n_threads);
             py::array_t<int32_t> ids(w.n_used);
             py::array_t<float> weights(w.n_used);
             const float* xp = xn.data();
             float* yp = y.mutable_data();
             int32_t* ip = ids.mutable_data();
             float* wp = weights.mutable_data();
             {
               py::gil_scoped_release nogil;
               F.ffn->run(xp, yp, n_threads, ip, wp);
             }
             return py::make_tuple(ids, weights);
           }, py::arg("xn"), py::arg("y"), py::arg("n_threads"),
           "xn [dim] (the normed residual) -> y [dim] in place; returns the route taken: (ids int32 [k], weights "
           "fp32 [k]).");

  m.def("moe_route", [](const py::handle& logits_obj, int k, bool norm) {
          auto logits = array_arg<float>(logits_obj, "logits", {-1});
          const int E = int(logits.shape(0));
          if (E < 1 || k < 1 || k > E)
            throw py::value_error("k=" + std::to_string(k) + ": expected 1..E with E=" + std::to_string(E) + " >= 1");
          py::array_t<int32_t> ids(k);
          py::array_t<float> weights(k);
          moe_route(logits.data(), E, k, norm, ids.mutable_data(), weights.mutable_data());
          return py::make_tuple(ids, weights);
        }, py::arg("logits"), py::arg("k"), py::arg("norm"),
        "logits [E] fp32 -> (ids int32 [k] best first, ties to the lower id; weights fp32 [k]): softmax, top-k, "
        "renormalized over the k where norm.");
}

}  // namespace ktq::python
