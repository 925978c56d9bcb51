// The only file that knows Python. Every entry point checks dtype, shape and contiguity of its
// arguments, raises ValueError/IndexError with a message naming what is wrong, then releases the GIL
// and calls the raw-pointer C++ code. Users never call ktquest._C directly: see ktquest/ops.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <vector>

#include "common/cpu_features.h"
#include "decode/decode_layer.h"
#include "attn/dense_attn.h"
#include "gemm/gemv.h"
#include "kvstore/kv_store.h"
#include "decode/layer_step.h"

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
    if (in % ktq::kQGroup != 0)
      throw py::value_error("w: the input dimension (" + std::to_string(in) + ") must be a multiple of 32");
    py::array_t<int8_t> q({out, in});
    py::array_t<float> d({out, in / ktq::kQGroup});
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
    if (in % ktq::kQGroup != 0)
      throw py::value_error("x: the input dimension (" + std::to_string(in) + ") must be a multiple of 32");
    if (dw.shape(0) != out || dw.shape(1) != in / ktq::kQGroup)
      throw py::value_error("dw: expected [" + std::to_string(out) + ", " + std::to_string(in / ktq::kQGroup) +
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
     "y[T, out] = x[T, in] @ dequant(qw, dw)^T (+ bias); weight-only: x stays fp32.");
}

// ---- KV store and sparse attention (cpp/kv_store.*, cpp/sparse_attn.cpp) ----
// Arrays arrive as numpy views of torch tensors (ktquest/ops.py makes them); every one is checked for
// dtype, shape and C-contiguity here, semantic errors (capacity, ids, non-finite values) are thrown by
// the store before it writes anything. The GIL is released around every call into the store.
template <class T>
py::array_t<T> kv_arg(const py::handle& obj, const char* name, std::initializer_list<int64_t> shape) {
  if (!py::isinstance<py::array>(obj) || !py::isinstance<py::array_t<T>>(obj))
    throw py::type_error(std::string(name) + ": expected a numpy array of dtype " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + ", got " +
                         (py::isinstance<py::array>(obj) ? "dtype " + py::str(obj.attr("dtype")).cast<std::string>()
                                                         : py::str(py::type::of(obj)).cast<std::string>()));
  auto a = py::reinterpret_borrow<py::array_t<T>>(obj);
  bool ok = a.ndim() == py::ssize_t(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape.begin()[i] < 0 || a.shape(i) == shape.begin()[i];
  if (!ok) {  // the message is built only on error: this runs on every decode call
    std::string want, got;
    for (int64_t s : shape) want += (want.empty() ? "" : ", ") + (s < 0 ? std::string("*") : std::to_string(s));
    for (py::ssize_t j = 0; j < a.ndim(); ++j) got += (j ? ", " : "") + std::to_string(a.shape(j));
    throw py::value_error(std::string(name) + ": expected shape [" + want + "], got [" + got + "]");
  }
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + ": must be C-contiguous");
  return a;
}

template <class E>
E kv_enum(const std::string& s, const char* what, std::initializer_list<std::pair<const char*, E>> names) {
  std::string allowed;
  for (const auto& [n, e] : names) {
    if (s == n) return e;
    allowed += (allowed.empty() ? "" : ", ") + std::string(n);
  }
  throw py::value_error(std::string(what) + " '" + s + "' is not one of " + allowed);
}

ktq::HeadMode kv_mode(const std::string& s) {
  return kv_enum<ktq::HeadMode>(s, "head_select_mode", {{"SHARED", ktq::HeadMode::SHARED}, {"SEPARATE", ktq::HeadMode::SEPARATE}});
}

// Checks q [H, D] and returns H.
int kv_q(const ktq::KVStore& st, const py::handle& q_obj, py::array_t<float>& q) {
  q = kv_arg<float>(q_obj, "q", {-1, st.config().head_dim});
  return int(q.shape(0));
}

// The arrays of a selection request; they stay alive (and borrowed by `req`) for the call.
struct KVSelectArgs {
  py::array_t<int32_t> k;
  py::array_t<int64_t> exclude;
  py::array_t<int32_t> allowed;
  py::array_t<int32_t> out_ids;
  ktq::SelectRequest req;
};

void kv_select_args(const ktq::KVStore& st, KVSelectArgs& a, const std::string& mode, const py::handle& k,
                    const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids) {
  a.req.mode = kv_mode(mode);
  const int n_sets = a.req.mode == ktq::HeadMode::SHARED ? 1 : st.config().n_kv_heads;
  a.k = kv_arg<int32_t>(k, "k", {n_sets});
  a.exclude = kv_arg<int64_t>(exclude, "exclude", {-1, 2});
  a.out_ids = kv_arg<int32_t>(out_ids, "out_ids", {n_sets, -1});
  a.req.k_per_set = a.k.data();
  a.req.exclude = a.exclude.data();
  a.req.n_exclude = int(a.exclude.shape(0));
  if (!allowed.is_none()) {
    a.allowed = kv_arg<int32_t>(allowed, "allowed", {n_sets, -1});
    a.req.allowed = a.allowed.data();
    a.req.allowed_cols = int(a.allowed.shape(1));
  }
  if (!a.out_ids.writeable()) throw py::value_error("out_ids: must be writeable");
}

void kv_check_finite(const float* q, int H, int D) {
  for (int64_t i = 0; i < int64_t(H) * D; ++i)
    if (!std::isfinite(q[i]))
      throw py::value_error("q contains a non-finite value at head " + std::to_string(i / D) + ", dim " +
                            std::to_string(i % D));
}

// The window and store-part arguments of a long_context decode step (KVStore.decode_step and
// DecodeLayer.step_long_context), checked; the arrays stay alive in here for the call.
struct LcStepArgs {
  py::array_t<float> wk, wv;
  py::array_t<int32_t> blocks_arr;
  KVSelectArgs sel;
  ktq::WindowView win;
  ktq::StorePart part = ktq::StorePart::NONE;
  ktq::BlockSets blocks{nullptr, 0, 0};
  int32_t* ids = nullptr;
  int cols = 0;
};

void lc_step_args(const ktq::KVStore& st, LcStepArgs& a, int H, const py::handle& wk_obj, const py::handle& wv_obj,
                  int64_t w0, int64_t width, int64_t skip0, int64_t skip1, int n_threads, int part,
                  const py::handle& blocks_obj, const std::string& mode, const py::handle& k_sel,
                  const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids) {
  const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
  a.wk = kv_arg<float>(wk_obj, "win_k", {KVH, -1, D});
  a.wv = kv_arg<float>(wv_obj, "win_v", {KVH, a.wk.shape(1), D});
  if (!a.wk.writeable() || !a.wv.writeable()) throw py::value_error("win_k/win_v: must be writeable");
  if (H % KVH != 0)
    throw py::value_error("q has " + std::to_string(H) + " heads: must be a multiple of n_kv_heads=" +
                          std::to_string(KVH) + " (GQA)");
  const int64_t rows = a.wk.shape(1);
  if (width < 1 || width > rows || w0 < 0 || w0 >= width)
    throw py::value_error("window: row w0=" + std::to_string(w0) + " and width=" + std::to_string(width) +
                          " must satisfy 0 <= w0 < width <= " + std::to_string(rows) + " (the buffer's rows)");
  if (skip0 < 0 || skip1 < skip0 || skip1 > width || (w0 >= skip0 && w0 < skip1))
    throw py::value_error("skip [" + std::to_string(skip0) + ", " + std::to_string(skip1) +
                          ") must be a range within [0, width) that leaves the new row " + std::to_string(w0));
  if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
  if (part < 0 || part > 2)
    throw py::value_error("part must be 0 (none), 1 (attend) or 2 (select), got " + std::to_string(part));
  a.part = ktq::StorePart(part);
  if (part == 1) {
    a.blocks_arr = kv_arg<int32_t>(blocks_obj, "blocks", {-1, -1});
    if (a.blocks_arr.shape(0) != 1 && a.blocks_arr.shape(0) != KVH)
      throw py::value_error("blocks: expected 1 (shared) or n_kv_heads=" + std::to_string(KVH) + " rows, got " +
                            std::to_string(a.blocks_arr.shape(0)));
    a.blocks = ktq::BlockSets{a.blocks_arr.data(), int(a.blocks_arr.shape(0)), int(a.blocks_arr.shape(1))};
  } else if (part == 2) {
    kv_select_args(st, a.sel, mode, k_sel, exclude, allowed, out_ids);
    a.ids = a.sel.out_ids.mutable_data();
    a.cols = int(a.sel.out_ids.shape(1));
  }
  a.win = ktq::WindowView{a.wk.mutable_data(), a.wv.mutable_data(), rows, w0, width, skip0, skip1};
}

void bind_kv_store(py::module_& m) {
  using ktq::KVStore;
  py::class_<KVStore>(m, "KVStore", "Blocked KV cache with anchors and sparse decode attention (see ktquest.ops).")
      .def(py::init([](int n_layers, int n_kv_heads, int head_dim, int64_t max_seq_len, int block_size,
                       const std::string& kv_type, const std::string& anchor_type, int anchor_num, int threads_num,
                       bool int8_candidates) {
             ktq::StoreConfig c;
             c.n_layers = n_layers;
             c.n_kv_heads = n_kv_heads;
             c.head_dim = head_dim;
             c.max_seq_len = max_seq_len;
             c.block_size = block_size;
             c.kv_type = kv_enum<ktq::KVType>(kv_type, "kv_type",
                                              {{"FP32", ktq::KVType::FP32}, {"FP16", ktq::KVType::FP16},
                                               {"BF16", ktq::KVType::BF16}, {"Q8_0", ktq::KVType::Q8_0},
                                               {"Q4_0", ktq::KVType::Q4_0}});
             c.anchor_type = kv_enum<ktq::AnchorType>(
                 anchor_type, "anchor_type",
                 {{"QUEST", ktq::AnchorType::QUEST}, {"BLOCK_MAX", ktq::AnchorType::BLOCK_MAX},
                  {"BLOCK_MEAN", ktq::AnchorType::BLOCK_MEAN}, {"FIXED", ktq::AnchorType::FIXED},
                  {"DYNAMIC", ktq::AnchorType::DYNAMIC}});
             c.anchor_num = anchor_num;
             c.threads_num = threads_num;
             c.int8_candidates = int8_candidates;
             return new KVStore(c);
           }),
           py::arg("n_layers"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("max_seq_len"),
           py::arg("block_size"), py::arg("kv_type"), py::arg("anchor_type"), py::arg("anchor_num"),
           py::arg("threads_num"), py::arg("int8_candidates") = false)
      .def_property_readonly("anchor_slots", &KVStore::anchor_slots)
      .def_property_readonly("anchor_elem_bytes", &KVStore::anchor_elem_bytes, "2 = fp16 anchors, 4 = fp32")
      .def("length", &KVStore::length, py::arg("layer"))
      .def("n_blocks", &KVStore::n_blocks, py::arg("layer"))
      .def("nbytes", &KVStore::nbytes)
      .def("reserved_bytes", &KVStore::reserved_bytes)
      .def("cand_nbytes", &KVStore::cand_nbytes)
      .def("append", [](KVStore& st, int layer, const py::handle& k_obj, const py::handle& v_obj,
                        const std::string& dtype, const py::handle& imp_obj) {
        const int H = st.config().n_kv_heads, D = st.config().head_dim;
        ktq::InType in;
        py::array k, v;
        auto same = [&](auto tag) {
          using T = decltype(tag);
          auto ka = kv_arg<T>(k_obj, "k", {-1, H, D});
          auto va = kv_arg<T>(v_obj, "v", {ka.shape(0), H, D});
          k = ka, v = va;
        };
        if (dtype == "float32") in = ktq::InType::F32, same(float{});
        else if (dtype == "float16") in = ktq::InType::F16, same(int16_t{});  // raw fp16 bits
        else if (dtype == "bfloat16") in = ktq::InType::BF16, same(int16_t{});  // raw bf16 bits
        else throw py::value_error("k/v dtype '" + dtype + "' is not one of float32, float16, bfloat16");
        const int64_t T = k.shape(0);
        const float* imp = nullptr;
        py::array_t<float> ia;
        if (!imp_obj.is_none()) {
          ia = kv_arg<float>(imp_obj, "importance", {T, H});
          imp = ia.data();
        }
        const void* kp = k.data();
        const void* vp = v.data();
        py::gil_scoped_release nogil;
        st.append(layer, kp, vp, in, T, imp);
      }, py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("dtype"), py::arg("importance"),
         "k, v: [T, KVH, D] (float32, or float16/bfloat16 as int16 bits named by dtype); importance [T, KVH] or None.")
      .def("read", [](const KVStore& st, int layer) {
        const int64_t T = st.length(layer);
        const int H = st.config().n_kv_heads, D = st.config().head_dim;
        py::array_t<float> k({T, int64_t(H), int64_t(D)}), v({T, int64_t(H), int64_t(D)});
        float *kp = k.mutable_data(), *vp = v.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.read(layer, kp, vp);
        }
        return py::make_tuple(k, v);
      }, py::arg("layer"), "Dequantised (k, v), each [length, KVH, D] fp32.")
      .def("read_range", [](const KVStore& st, int layer, int64_t t0, int64_t t1) {
        const int H = st.config().n_kv_heads, D = st.config().head_dim;
        const int64_t T = std::max<int64_t>(0, t1 - t0);
        py::array_t<float> k({T, int64_t(H), int64_t(D)}), v({T, int64_t(H), int64_t(D)});
        float *kp = k.mutable_data(), *vp = v.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.read_range(layer, t0, t1, kp, vp);
        }
        return py::make_tuple(k, v);
      }, py::arg("layer"), py::arg("t0"), py::arg("t1"), "Dequantised (k, v) of tokens [t0, t1), [t1 - t0, KVH, D].")
      .def("truncate", [](KVStore& st, int layer, int64_t n) {
        py::gil_scoped_release nogil;
        st.truncate(layer, n);
      }, py::arg("layer"), py::arg("n"), "Keep the first n tokens of a layer (-1 = all); partial-block anchors recomputed.")
      .def("read_anchors", [](const KVStore& st, int layer) {
        const int64_t nb = st.n_blocks(layer);
        const int64_t H = st.config().n_kv_heads, D = st.config().head_dim, A = st.anchor_slots();
        py::array_t<float> a({H, nb, A, D});
        py::array_t<int32_t> c({H, nb});
        float* ap = a.mutable_data();
        int32_t* cp = c.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.read_anchors(layer, ap, cp);
        }
        return py::make_tuple(a, c);
      }, py::arg("layer"), "(anchors [KVH, n_blocks, A, D] fp32, counts [KVH, n_blocks] int32).")
      .def("block_scores", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode) {
        py::array_t<float> q;
        const int H = kv_q(st, q_obj, q);
        const ktq::HeadMode hm = kv_mode(mode);
        const int64_t nb = st.n_blocks(layer);
        py::array_t<float> out({int64_t(hm == ktq::HeadMode::SHARED ? 1 : st.config().n_kv_heads), nb});
        const float* qp = q.data();
        float* op = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          st.block_scores(layer, qp, H, hm, op);
        }
        return out;
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), "Unscaled block scores [n_sets, n_blocks].")
      .def("select", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode, const py::handle& k,
                        const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids) {
        py::array_t<float> q;
        const int H = kv_q(st, q_obj, q);
        KVSelectArgs a;
        kv_select_args(st, a, mode, k, exclude, allowed, out_ids);
        const float* qp = q.data();
        int32_t* ip = a.out_ids.mutable_data();
        const int cols = int(a.out_ids.shape(1));
        py::gil_scoped_release nogil;
        st.select(layer, qp, H, a.req, ip, cols);
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("k"), py::arg("exclude"), py::arg("allowed"),
         py::arg("out_ids"))
      .def("attend", [](KVStore& st, int layer, const py::handle& q_obj, const py::handle& blocks_obj,
                        const py::handle& out_obj, const py::handle& lse_obj) {
        py::array_t<float> q;
        const int H = kv_q(st, q_obj, q);
        auto blocks = kv_arg<int32_t>(blocks_obj, "blocks", {-1, -1});
        auto out = kv_arg<float>(out_obj, "out", {H, st.config().head_dim});
        auto lse = kv_arg<float>(lse_obj, "lse", {H});
        if (!out.writeable() || !lse.writeable()) throw py::value_error("out/lse: must be writeable");
        const ktq::BlockSets b{blocks.data(), int(blocks.shape(0)), int(blocks.shape(1))};
        const float* qp = q.data();
        float* op = out.mutable_data();
        float* lp = lse.mutable_data();
        py::gil_scoped_release nogil;
        st.attend(layer, qp, H, b, op, lp);
      }, py::arg("layer"), py::arg("q"), py::arg("blocks"), py::arg("out"), py::arg("lse"))
      .def("select_attend", [](KVStore& st, int layer, const py::handle& q_obj, const std::string& mode,
                               const py::handle& k, const py::handle& exclude, const py::handle& allowed,
                               const py::handle& out_ids, const py::handle& out_obj, const py::handle& lse_obj) {
        py::array_t<float> q;
        const int H = kv_q(st, q_obj, q);
        KVSelectArgs a;
        kv_select_args(st, a, mode, k, exclude, allowed, out_ids);
        auto out = kv_arg<float>(out_obj, "out", {H, st.config().head_dim});
        auto lse = kv_arg<float>(lse_obj, "lse", {H});
        if (!out.writeable() || !lse.writeable()) throw py::value_error("out/lse: must be writeable");
        const float* qp = q.data();
        int32_t* ip = a.out_ids.mutable_data();
        const int cols = int(a.out_ids.shape(1));
        float* op = out.mutable_data();
        float* lp = lse.mutable_data();
        py::gil_scoped_release nogil;
        st.select_attend(layer, qp, H, a.req, ip, cols, op, lp);
      }, py::arg("layer"), py::arg("q"), py::arg("mode"), py::arg("k"), py::arg("exclude"), py::arg("allowed"),
         py::arg("out_ids"), py::arg("out"), py::arg("lse"))
      .def("decode_step", [](KVStore& st, int layer, const py::handle& q_obj, const py::handle& k_obj,
                             const py::handle& v_obj, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
                             int64_t width, int64_t skip0, int64_t skip1, float scale, int n_threads, int part,
                             const py::handle& blocks_obj, const std::string& mode, const py::handle& k_sel,
                             const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                             const py::handle& out_obj) {
        const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
        py::array_t<float> q;
        const int H = kv_q(st, q_obj, q);
        auto k = kv_arg<float>(k_obj, "k", {KVH, D});
        auto v = kv_arg<float>(v_obj, "v", {KVH, D});
        auto out = kv_arg<float>(out_obj, "out", {H, D});
        if (!out.writeable()) throw py::value_error("out: must be writeable");
        kv_check_finite(q.data(), H, D);
        LcStepArgs a;
        lc_step_args(st, a, H, wk_obj, wv_obj, w0, width, skip0, skip1, n_threads, part, blocks_obj, mode, k_sel,
                     exclude, allowed, out_ids);
        const float *qp = q.data(), *kp = k.data(), *vp = v.data();
        float* op = out.mutable_data();
        py::gil_scoped_release nogil;
        ktq::long_context_decode_step(st, layer, qp, H, kp, vp, a.win, scale, n_threads, a.part, a.blocks, a.sel.req,
                                      a.ids, a.cols, op);
      }, py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("win_k"), py::arg("win_v"),
         py::arg("w0"), py::arg("width"), py::arg("skip0"), py::arg("skip1"), py::arg("scale"), py::arg("n_threads"),
         py::arg("part"), py::arg("blocks"), py::arg("mode"), py::arg("k_sel"), py::arg("exclude"), py::arg("allowed"),
         py::arg("out_ids"), py::arg("out"),
         "One long_context decode step of a layer (cpp/lc_decode.h): k/v [KVH, D] written to row w0 of the window "
         "win_k/win_v [KVH, rows, D], window rows [0, width) but [skip0, skip1) attended densely, the store part "
         "(part 0: none, 1: blocks, 2: select with mode/k_sel/exclude/allowed into out_ids) attended sparsely, "
         "merged by LSE into out [H, D]; then k/v appended to the store.")
      .def("last_timing", [](const KVStore& st) {
        const ktq::StageTiming t = st.last_timing();
        return py::make_tuple(t.score_s, t.topk_s, t.attend_s);
      }, "(score_s, topk_s, attend_s) of the last select/attend call.");
}

// ---- dense decode attention (cpp/dense_attn.*): mode dense on the CPU ----
void bind_dense_attn(py::module_& m) {
  m.def("dense_decode_attention", [](const py::handle& q_obj, const py::handle& k_obj, const py::handle& v_obj,
                                     int64_t n, float scale, const py::handle& out_obj, const py::handle& lse_obj,
                                     int n_threads, int64_t skip0, int64_t skip1) {
    auto q = kv_arg<float>(q_obj, "q", {-1, -1});
    const int64_t H = q.shape(0), D = q.shape(1);
    auto k = kv_arg<float>(k_obj, "k", {-1, -1, D});
    const int64_t KVH = k.shape(0), S = k.shape(1);
    auto v = kv_arg<float>(v_obj, "v", {KVH, S, D});
    if (KVH < 1 || H % KVH != 0)
      throw py::value_error("q has " + std::to_string(H) + " heads: must be a positive multiple of the " +
                            std::to_string(KVH) + " KV heads of k (GQA)");
    auto out = kv_arg<float>(out_obj, "out", {H, D});
    auto lse = kv_arg<float>(lse_obj, "lse", {H});
    if (n < 1 || n > S)
      throw py::value_error("n=" + std::to_string(n) + " rows: must be between 1 and the " + std::to_string(S) +
                            " rows of k");
    if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
    if (skip0 < 0 || skip1 < skip0 || skip1 > n || (skip0 == 0 && skip1 == n && n > 0 && skip1 > 0))
      throw py::value_error("skip [" + std::to_string(skip0) + ", " + std::to_string(skip1) +
                            ") must be a range within [0, n=" + std::to_string(n) + ") that leaves a row");
    const float* qp = q.data();
    kv_check_finite(qp, int(H), int(D));
    const float* kp = k.data();
    const float* vp = v.data();
    float* op = out.mutable_data();
    float* lp = lse.mutable_data();
    py::gil_scoped_release nogil;
    ktq::dense_decode_attention(qp, int(H), int(KVH), int(D), kp, vp, S * D, n, scale, op, lp, n_threads, skip0,
                                skip1);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("n"), py::arg("scale"), py::arg("out"), py::arg("lse"),
     py::arg("n_threads"), py::arg("skip0") = 0, py::arg("skip1") = 0,
     "Decode attention of q [H, D] over rows [0, n) of k, v [KVH, S, D] fp32 but [skip0, skip1): out [H, D] and "
     "lse [H] (GQA: head i reads KV head i // (H / KVH)).");
}

// ---- fused decode stages of one block (cpp/decode_layer.*) ----
// The Python object keeps the weight arrays alive; shapes are checked once here, at construction.
struct PyDecodeLayer {
  std::vector<py::object> keep;
  std::unique_ptr<ktq::DecodeLayer> layer;
  int64_t dim = 0, n_qkv = 0, n_attn = 0;
};

ktq::Q8Matrix q8_matrix(PyDecodeLayer& L, const py::handle& q_obj, const py::handle& d_obj, const py::handle& b_obj,
                        const char* name, int64_t out, int64_t in) {
  const std::string n(name);
  auto q = kv_arg<int8_t>(q_obj, (n + ".q").c_str(), {out, in});
  auto d = kv_arg<float>(d_obj, (n + ".d").c_str(), {out, in / ktq::kQGroup});
  ktq::Q8Matrix m;
  m.q = q.data();
  m.d = d.data();
  m.out = out;
  m.in = in;
  L.keep.push_back(q);
  L.keep.push_back(d);
  if (!b_obj.is_none()) {
    auto b = kv_arg<float>(b_obj, (n + ".bias").c_str(), {out});
    m.bias = b.data();
    L.keep.push_back(b);
  }
  return m;
}

// The layer's heads match the store's. index: the layer's place in a whole-token call, or -1.
void lc_layer_check(const PyDecodeLayer& L, const ktq::KVStore& st, int index) {
  const ktq::DecodeLayerWeights& w = L.layer->weights();
  if (st.config().n_kv_heads != w.n_kv_heads || st.config().head_dim != w.head_dim)
    throw py::value_error("store: " + std::to_string(st.config().n_kv_heads) + " KV heads of dim " +
                          std::to_string(st.config().head_dim) + ", " +
                          (index < 0 ? std::string("the layer") : "layer " + std::to_string(index)) + " has " +
                          std::to_string(w.n_kv_heads) + " of dim " + std::to_string(w.head_dim));
}

// One block's long_context decode step (GIL released): qkv, the attention step, out; x updated in place.
void lc_block_step(PyDecodeLayer& L, ktq::KVStore& st, int layer, const LcStepArgs& a, float* x, const float* cos,
                   const float* sin, float scale, int n_threads) {
  const ktq::DecodeLayerWeights& w = L.layer->weights();
  const int H = w.n_heads, KVH = w.n_kv_heads, D = w.head_dim;
  thread_local std::vector<float> buf;
  buf.resize(size_t(L.n_qkv + L.n_attn));
  float *qkv = buf.data(), *attn = qkv + L.n_qkv;
  L.layer->qkv(x, cos, sin, qkv, n_threads);
  for (int64_t i = 0; i < int64_t(H) * D; ++i)  // as the store would, before anything is written
    if (!std::isfinite(qkv[i]))
      throw std::invalid_argument("layer " + std::to_string(layer) +
                                  ": q is not finite (the layer's input overflowed?)");
  ktq::long_context_decode_step(st, layer, qkv, H, qkv + int64_t(H) * D, qkv + int64_t(H + KVH) * D, a.win, scale,
                                n_threads, a.part, a.blocks, a.sel.req, a.ids, a.cols, attn);
  L.layer->out(attn, x, n_threads);
}

void bind_decode_layer(py::module_& m) {
  py::class_<PyDecodeLayer>(m, "DecodeLayer",
                            "One block's decode step around attention, with Q8_0 weights (cpp/decode_layer.h).")
      .def(py::init([](const py::handle& attn_norm, const py::handle& ffn_norm, float eps, py::tuple wqkv,
                       py::tuple wo, py::tuple w_gate_up, py::tuple w_down, int n_heads, int n_kv_heads,
                       int head_dim) {
             if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0)
               throw py::value_error("n_heads=" + std::to_string(n_heads) + " must be a positive multiple of n_kv_heads=" +
                                     std::to_string(n_kv_heads));
             if (head_dim < 2 || head_dim % 2 != 0 || head_dim > 1024)
               throw py::value_error("head_dim=" + std::to_string(head_dim) + " must be even and in [2, 1024]");
             for (auto* t : {&wqkv, &wo, &w_gate_up, &w_down})
               if (py::len(*t) != 3) throw py::value_error("each weight is a tuple (q, d, bias or None)");
             auto L = std::make_unique<PyDecodeLayer>();
             auto an = kv_arg<float>(attn_norm, "attn_norm", {-1});
             const int64_t dim = an.shape(0);
             auto fn = kv_arg<float>(ffn_norm, "ffn_norm", {dim});
             if (dim % ktq::kQGroup != 0 || (int64_t(n_heads) * head_dim) % ktq::kQGroup != 0)
               throw py::value_error("dim and n_heads * head_dim must be multiples of 32 (Q8_0 groups)");
             const py::handle gu_q = w_gate_up[0];
             if (!py::isinstance<py::array>(gu_q) || py::array(py::reinterpret_borrow<py::object>(gu_q)).ndim() != 2)
               throw py::value_error("w_gate_up.q: expected a 2-D int8 array [2 * ffn, dim]");
             const int64_t two_ffn = py::array(py::reinterpret_borrow<py::object>(gu_q)).shape(0);
             if (two_ffn % 64 != 0) throw py::value_error("w_gate_up.q: 2 * ffn rows must be a multiple of 64");
             const int64_t n_qkv = int64_t(n_heads + 2 * n_kv_heads) * head_dim, n_attn = int64_t(n_heads) * head_dim;
             ktq::DecodeLayerWeights w;
             w.attn_norm = an.data();
             w.ffn_norm = fn.data();
             L->keep.push_back(an);
             L->keep.push_back(fn);
             w.eps = eps;
             w.wqkv = q8_matrix(*L, wqkv[0], wqkv[1], wqkv[2], "wqkv", n_qkv, dim);
             w.wo = q8_matrix(*L, wo[0], wo[1], wo[2], "wo", dim, n_attn);
             w.w_gate_up = q8_matrix(*L, w_gate_up[0], w_gate_up[1], w_gate_up[2], "w_gate_up", two_ffn, dim);
             w.w_down = q8_matrix(*L, w_down[0], w_down[1], w_down[2], "w_down", dim, two_ffn / 2);
             w.n_heads = n_heads;
             w.n_kv_heads = n_kv_heads;
             w.head_dim = head_dim;
             L->layer = std::make_unique<ktq::DecodeLayer>(w);
             L->dim = dim;
             L->n_qkv = n_qkv;
             L->n_attn = n_attn;
             return L;
           }),
           py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("eps"), py::arg("wqkv"), py::arg("wo"),
           py::arg("w_gate_up"), py::arg("w_down"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"))
      .def("qkv", [](PyDecodeLayer& L, const py::handle& x_obj, const py::handle& cos_obj, const py::handle& sin_obj,
                     const py::handle& out_obj, int n_threads) {
             const int64_t D = L.layer->weights().head_dim;
             auto x = kv_arg<float>(x_obj, "x", {L.dim});
             auto c = kv_arg<float>(cos_obj, "cos", {D});
             auto s = kv_arg<float>(sin_obj, "sin", {D});
             auto o = kv_arg<float>(out_obj, "out", {L.n_qkv});
             if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
             const float *xp = x.data(), *cp = c.data(), *sp = s.data();
             float* op = o.mutable_data();
             py::gil_scoped_release nogil;
             L.layer->qkv(xp, cp, sp, op, n_threads);
           }, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("n_threads"),
           "x [dim] -> out [(H + 2 KVH) * D]: RMSNorm, the qkv projection, RoPE on q and k.")
      .def("out", [](PyDecodeLayer& L, const py::handle& attn_obj, const py::handle& x_obj, int n_threads) {
             auto a = kv_arg<float>(attn_obj, "attn", {L.n_attn});
             auto x = kv_arg<float>(x_obj, "x", {L.dim});
             if (n_threads < 1) throw py::value_error("n_threads must be >= 1, got " + std::to_string(n_threads));
             const float* ap = a.data();
             float* xp = x.mutable_data();
             py::gil_scoped_release nogil;
             L.layer->out(ap, xp, n_threads);
           }, py::arg("attn"), py::arg("x"), py::arg("n_threads"),
           "x [dim] += Wo attn [H * D], then x += the SwiGLU FFN of RMSNorm(x), in place.")
      .def("step_long_context", [](PyDecodeLayer& L, const py::handle& x_obj, const py::handle& cos_obj,
                                   const py::handle& sin_obj, ktq::KVStore& st, int layer, const py::handle& wk_obj,
                                   const py::handle& wv_obj, int64_t w0, int64_t width, int64_t skip0, int64_t skip1,
                                   float scale, int n_threads, int part, const py::handle& blocks_obj,
                                   const std::string& mode, const py::handle& k_sel, const py::handle& exclude,
                                   const py::handle& allowed, const py::handle& out_ids) {
             lc_layer_check(L, st, -1);
             auto x = kv_arg<float>(x_obj, "x", {L.dim});
             const int D = L.layer->weights().head_dim;
             auto c = kv_arg<float>(cos_obj, "cos", {D});
             auto s = kv_arg<float>(sin_obj, "sin", {D});
             if (!x.writeable()) throw py::value_error("x: must be writeable");
             LcStepArgs a;
             lc_step_args(st, a, L.layer->weights().n_heads, wk_obj, wv_obj, w0, width, skip0, skip1, n_threads, part,
                          blocks_obj, mode, k_sel, exclude, allowed, out_ids);
             float* xp = x.mutable_data();
             const float *cp = c.data(), *sp = s.data();
             py::gil_scoped_release nogil;
             lc_block_step(L, st, layer, a, xp, cp, sp, scale, n_threads);
           }, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("store"), py::arg("layer"), py::arg("win_k"),
           py::arg("win_v"), py::arg("w0"), py::arg("width"), py::arg("skip0"), py::arg("skip1"), py::arg("scale"),
           py::arg("n_threads"), py::arg("part"), py::arg("blocks"), py::arg("mode"), py::arg("k_sel"),
           py::arg("exclude"), py::arg("allowed"), py::arg("out_ids"),
           "The whole decode step of the block in long_context mode: qkv(), KVStore.decode_step() on its q/k/v "
           "(same window and store-part arguments), out(); x [dim] updated in place.");

  m.def("rms_norm", [](const py::handle& x_obj, const py::handle& w_obj, float eps, const py::handle& out_obj) {
          auto x = kv_arg<float>(x_obj, "x", {-1});
          auto w = kv_arg<float>(w_obj, "w", {x.shape(0)});
          auto o = kv_arg<float>(out_obj, "out", {x.shape(0)});
          if (!o.writeable()) throw py::value_error("out: must be writeable");
          if (!(eps >= 0.f)) throw py::value_error("eps must be >= 0, got " + std::to_string(eps));
          const float *xp = x.data(), *wp = w.data();
          float* op = o.mutable_data();
          py::gil_scoped_release nogil;
          ktq::rms_norm(xp, wp, x.shape(0), eps, op);
        }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out"),
        "out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] for x, w, out [n] fp32 (the decode stages' RMSNorm).");

  m.def("decode_token_long_context", [](const py::list& layers, const py::handle& x_obj, const py::handle& cos_obj,
                                        const py::handle& sin_obj, ktq::KVStore& st, const py::list& windows,
                                        int64_t w0, int64_t width, int64_t skip0, int64_t skip1, float scale,
                                        int n_threads, const py::list& steps) {
          const int n = st.config().n_layers;
          if (int(py::len(layers)) != n || int(py::len(windows)) != n || int(py::len(steps)) != n)
            throw py::value_error("layers, windows and steps: expected one per store layer (" + std::to_string(n) +
                                  "), got " + std::to_string(py::len(layers)) + ", " +
                                  std::to_string(py::len(windows)) + " and " + std::to_string(py::len(steps)));
          // Every argument of every layer is checked before the first layer runs.
          std::vector<PyDecodeLayer*> ls(n);
          std::vector<LcStepArgs> args(n);
          for (int i = 0; i < n; ++i) {
            if (!py::isinstance<PyDecodeLayer>(layers[i]))
              throw py::type_error("layers[" + std::to_string(i) + "]: expected a DecodeLayer, got " +
                                   py::str(py::type::of(layers[i])).cast<std::string>());
            ls[i] = &layers[i].cast<PyDecodeLayer&>();
            lc_layer_check(*ls[i], st, i);
            if (ls[i]->dim != ls[0]->dim)
              throw py::value_error("layer " + std::to_string(i) + ": dim " + std::to_string(ls[i]->dim) +
                                    ", layer 0 has " + std::to_string(ls[0]->dim));
            const py::handle w = windows[i], s = steps[i];
            if (!py::isinstance<py::tuple>(w) || py::len(w) != 2)
              throw py::value_error("windows[" + std::to_string(i) + "]: expected a tuple (win_k, win_v)");
            if (!py::isinstance<py::tuple>(s) || py::len(s) != 7)
              throw py::value_error("steps[" + std::to_string(i) +
                                    "]: expected a tuple (part, blocks, mode, k, exclude, allowed, out_ids)");
            const py::tuple wt = py::reinterpret_borrow<py::tuple>(w), t = py::reinterpret_borrow<py::tuple>(s);
            lc_step_args(st, args[i], ls[i]->layer->weights().n_heads, wt[0], wt[1], w0, width, skip0, skip1,
                         n_threads, t[0].cast<int>(), t[1], t[2].cast<std::string>(), t[3], t[4], t[5], t[6]);
          }
          const int D = ls[0]->layer->weights().head_dim;
          auto x = kv_arg<float>(x_obj, "x", {ls[0]->dim});
          auto c = kv_arg<float>(cos_obj, "cos", {D});
          auto s = kv_arg<float>(sin_obj, "sin", {D});
          if (!x.writeable()) throw py::value_error("x: must be writeable");
          float* xp = x.mutable_data();
          const float *cp = c.data(), *sp = s.data();
          py::gil_scoped_release nogil;
          for (int i = 0; i < n; ++i) lc_block_step(*ls[i], st, i, args[i], xp, cp, sp, scale, n_threads);
        }, py::arg("layers"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("store"), py::arg("windows"),
        py::arg("w0"), py::arg("width"), py::arg("skip0"), py::arg("skip1"), py::arg("scale"), py::arg("n_threads"),
        py::arg("steps"),
        "A whole token's long_context decode through every block in one call: DecodeLayer.step_long_context for "
        "layer i = 0..n_layers-1 of the store with layers[i], windows[i] = (win_k, win_v) and steps[i] = (part, "
        "blocks, mode, k, exclude, allowed, out_ids); all arguments are checked first. A step's blocks may be "
        "an earlier step's out_ids (read after that step wrote them).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ktquest native operators (KV store, sparse attention, quantized GEMV)";
  bind_cpu(m);
  bind_gemv(m);
  // ---- further sections are added below, one bind_* function per area ----
  bind_kv_store(m);
  bind_dense_attn(m);
  bind_decode_layer(m);
}
