// ---- dense decode attention (cpp/attn/dense_attn.h): mode dense on the CPU ----
#include "attn/dense_attn.h"
#include "common/checked.h"
#include "common/finite.h"
#include "python/args.h"
#include "python/bind.h"

namespace ktq::python {

void bind_dense_attn(py::module_& m) {
  m.def("dense_decode_attention", [](const py::handle& q_obj, const py::handle& k_obj, const py::handle& v_obj,
                                     int64_t n, float scale, const py::handle& out_obj, const py::handle& lse_obj,
                                     int n_threads, int64_t skip0, int64_t skip1) {
    auto q = array_arg<float>(q_obj, "q", {-1, -1});
    const int64_t H = check_positive(q.shape(0), "q: heads (dimension 0)");
    const int64_t D = check_positive(q.shape(1), "q: head_dim (dimension 1)");
    auto k = array_arg<float>(k_obj, "k", {-1, -1, D});
    const int64_t KVH = k.shape(0), S = k.shape(1);
    auto v = array_arg<float>(v_obj, "v", {KVH, S, D});
    if (KVH < 1 || H % KVH != 0)
      throw py::value_error("q has " + std::to_string(H) + " heads: must be a positive multiple of the " +
                            std::to_string(KVH) + " KV heads of k (GQA)");
    auto out = array_arg<float>(out_obj, "out", {H, D});
    auto lse = array_arg<float>(lse_obj, "lse", {H});
    if (n < 1 || n > S)
      throw py::value_error("n=" + std::to_string(n) + " rows: must be between 1 and the " + std::to_string(S) +
                            " rows of k");
    check_threads(n_threads);
    if (skip0 < 0 || skip1 < skip0 || skip1 > n || (skip0 == 0 && skip1 == n && n > 0 && skip1 > 0))
      throw py::value_error("skip [" + std::to_string(skip0) + ", " + std::to_string(skip1) +
                            ") must be a range within [0, n=" + std::to_string(n) + ") that leaves a row");
    const float* qp = q.data();
    const int Hi = checked_int(H, "q heads"), Di = checked_int(D, "head_dim");
    check_finite_q(qp, H, Di);
    check_finite(scale, "scale");
    const float* kp = k.data();
    const float* vp = v.data();
    float* op = out.mutable_data();
    float* lp = lse.mutable_data();
    py::gil_scoped_release nogil;
    dense_decode_attention(qp, Hi, int(KVH), Di, kp, vp, S * D, n, scale, op, lp, n_threads, skip0, skip1);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("n"), py::arg("scale"), py::arg("out"), py::arg("lse"),
     py::arg("n_threads"), py::arg("skip0") = 0, py::arg("skip1") = 0,
     "Decode attention of q [H, D] over rows [0, n) of k, v [KVH, S, D] fp32 but [skip0, skip1): out [H, D] and "
     "lse [H] (GQA: head i reads KV head i // (H / KVH)).");
}

}  // namespace ktq::python
