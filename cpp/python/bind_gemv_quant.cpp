// ---- weights in their GGUF encoding: the block layouts, dequantization and the block GEMV
//      (quant/ggml_blocks.h, gemm/gemv_blocks.h) ----
#include <memory>
#include <string>
#include <vector>

#include "common/checked.h"
#include "gemm/gemm_int8.h"
#include "gemm/gemv_blocks.h"
#include "python/args.h"
#include "python/bind.h"
#include "python/quant_matrix.h"
#include "quant/ggml_blocks.h"

namespace ktq::python {

namespace {

GgmlType type_arg(const std::string& name) { return parse_enum<GgmlType>(name, "type", kGgmlTypeNames); }

// Rows of a uint8 [rows, row_bytes] array must start where the type's fields can be read in place.
void check_aligned(const void* p, GgmlType t, const char* name) {
  const int align = ggml_type_info(t).align;
  if (reinterpret_cast<uintptr_t>(p) % uintptr_t(align) != 0)
    throw py::value_error(std::string(name) + ": " + ggml_type_name(t) + " rows must be " + std::to_string(align) +
                          "-byte aligned");
}

// parts: a list of (type, uint8 [rows, row_bytes]) stacked in order; the input dimension is the first part's
// and every part must agree with it.
std::unique_ptr<PyQuantMatrix> quant_matrix(const py::list& parts, const py::handle& bias_obj, bool x16) {
  if (py::len(parts) == 0) throw py::value_error("parts: a matrix needs at least one part");
  auto M = std::make_unique<PyQuantMatrix>();
  M->m.x16 = x16;
  for (size_t i = 0; i < py::len(parts); ++i) {
    const std::string what = "parts[" + std::to_string(i) + "]";
    if (!py::isinstance<py::tuple>(parts[i]) || py::len(parts[i]) != 2)
      throw py::type_error(what + ": expected a tuple (type, uint8 array [rows, row_bytes])");
    py::tuple p = parts[i];
    const GgmlType t = type_arg(py::cast<std::string>(p[0]));
    if (!gemv_quant_supported(t)) throw py::value_error(what + ": no GEMV kernels for " + ggml_type_name(t));
    auto w = ndim_arg<uint8_t>(p[1], what.c_str(), 2);
    const GgmlTypeInfo info = ggml_type_info(t);
    if (w.shape(1) == 0 || w.shape(1) % info.block_bytes != 0)
      throw py::value_error(what + ": a " + ggml_type_name(t) + " row is whole blocks of " +
                            std::to_string(info.block_bytes) + " bytes, got rows of " + std::to_string(w.shape(1)));
    const int64_t in = w.shape(1) / info.block_bytes * info.block_values;
    if (i > 0 && in != M->m.in)
      throw py::value_error(what + ": rows of " + std::to_string(in) + " values, the matrix's are " +
                            std::to_string(M->m.in));
    check_aligned(w.data(), t, what.c_str());
    M->m.in = in;
    M->m.parts.push_back({t, w.data(), w.shape(0)});
    M->m.out = checked_add<int64_t>(M->m.out, w.shape(0), "matrix rows");
    M->keep.push_back(w);
  }
  if (!bias_obj.is_none()) {
    auto b = array_arg<float>(bias_obj, "bias", {M->m.out});
    M->m.bias = b.data();
    M->keep.push_back(b);
  }
  return M;
}

// y[T, out] = f(m, x[T, in]): the arguments checked, then f without the GIL (gemv_matrix, gemm_int8).
void run_matrix(void (*f)(const QuantMatrix&, const float*, int64_t, float*, int), const PyQuantMatrix& M,
                const py::handle& x_obj, const py::handle& y_obj, int n_threads) {
  auto x = ndim_arg<float>(x_obj, "x", 2);
  const int64_t T = x.shape(0);
  if (x.shape(1) != M.m.in)
    throw py::value_error("x: expected [T, " + std::to_string(M.m.in) + "], got [" + std::to_string(T) + ", " +
                          std::to_string(x.shape(1)) + "]");
  auto y = array_arg<float>(y_obj, "y", {T, M.m.out});
  check_threads(n_threads);
  const float* xp = x.data();
  float* yp = y.mutable_data();
  py::gil_scoped_release nogil;
  f(M.m, xp, T, yp, n_threads);
}

}  // namespace

void bind_gemv_quant(py::module_& m) {
  py::class_<PyQuantMatrix>(m, "QuantMatrix",
                            "A weight [out, in] in its GGUF encoding, read in place: parts of whole rows stacked in "
                            "order, each (type, uint8 [rows, row_bytes]), and a bias [out] or None; x16: the 32-value block types "
                            "round x to int16 (per 32 values), not int8; the other types are unchanged.")
      .def(py::init(&quant_matrix), py::arg("parts"), py::arg("bias") = py::none(), py::arg("x16") = false)
      .def_property_readonly("x16", [](const PyQuantMatrix& M) { return M.m.x16; })
      .def_property_readonly("int8_gemm", [](const PyQuantMatrix& M) { return gemm_int8_supported(M.m); },
                             "whether gemm_int8 takes the matrix (every part of one of its families)")
      .def_property_readonly("out_features", [](const PyQuantMatrix& M) { return M.m.out; })
      .def_property_readonly("in_features", [](const PyQuantMatrix& M) { return M.m.in; })
      .def_property_readonly("types", [](const PyQuantMatrix& M) {
        py::list l;
        for (const QuantPart& p : M.m.parts) l.append(ggml_type_name(p.type));
        return l;
      });

  m.def("gemv_matrix", [](const PyQuantMatrix& M, const py::handle& x_obj, const py::handle& y_obj, int n_threads) {
    run_matrix(gemv_matrix, M, x_obj, y_obj, n_threads);
  }, py::arg("m"), py::arg("x"), py::arg("y"), py::arg("n_threads"),
     "y[T, out] = x[T, in] @ dequant(m)^T (+ bias), every part in one threaded pass.");

  m.def("gemm_int8", [](const PyQuantMatrix& M, const py::handle& x_obj, const py::handle& y_obj, int n_threads) {
    if (!gemm_int8_supported(M.m))
      throw py::value_error("m: the int8 GEMM takes Q4_K, Q5_K and Q6_K parts (rows a multiple of 256) or Q4_0, "
                            "Q4_1, Q5_0 and Q5_1 parts, not the two mixed, got " + [&] {
        std::string s;
        for (const QuantPart& p : M.m.parts) s += (s.empty() ? "" : ", ") + std::string(ggml_type_name(p.type));
        return s;
      }());
    run_matrix(gemm_int8, M, x_obj, y_obj, n_threads);
  }, py::arg("m"), py::arg("x"), py::arg("y"), py::arg("n_threads"),
     "y[T, out] = q8(x)[T, in] @ dequant(m)^T (+ bias) for K-quant parts (Q4_K, Q5_K, Q6_K) or 4/5-bit 32-value "
     "parts (Q4_0, Q4_1, Q5_0, Q5_1): the prefill GEMM, x rounded to int8 per 256 or 32 values as the decode GEMV "
     "rounds it.");

  m.def("gemm_int8_grouped", [](const py::sequence& mats_obj, const py::handle& offsets_obj, const py::handle& x_obj,
                                const py::handle& y_obj, int n_threads, const py::handle& rows_obj) {
    const size_t n = py::len(mats_obj);
    if (n < 1) throw py::value_error("mats: at least one matrix");
    std::vector<const QuantMatrix*> mats;
    for (size_t e = 0; e < n; ++e) {
      const py::handle h = mats_obj[py::int_(e)];
      if (!py::isinstance<PyQuantMatrix>(h))
        throw py::type_error("mats[" + std::to_string(e) + "]: expected a QuantMatrix");
      mats.push_back(&h.cast<const PyQuantMatrix&>().m);
    }
    const QuantMatrix& m0 = *mats[0];
    const int qk = gemm_int8_block(m0);
    if (qk == 0) throw py::value_error("mats[0]: the int8 GEMM does not take its parts");
    for (size_t e = 1; e < n; ++e)
      if (mats[e]->in != m0.in || mats[e]->out != m0.out || gemm_int8_block(*mats[e]) != qk)
        throw py::value_error("mats[" + std::to_string(e) + "]: every matrix must have mats[0]'s shape [" +
                              std::to_string(m0.out) + ", " + std::to_string(m0.in) + "] and block family");
    auto offsets = array_arg<int64_t>(offsets_obj, "offsets", {int64_t(n) + 1});
    const int64_t* off = offsets.data();
    if (off[0] != 0) throw py::value_error("offsets: must start at 0");
    for (size_t e = 0; e < n; ++e)
      if (off[e + 1] < off[e]) throw py::value_error("offsets: must not decrease");
    py::array_t<int64_t> rows;
    if (!rows_obj.is_none()) rows = array_arg<int64_t>(rows_obj, "rows", {off[n]});
    auto x = array_arg<float>(x_obj, "x", {rows_obj.is_none() ? off[n] : -1, m0.in});
    const int64_t n_x = x.shape(0);
    if (!rows_obj.is_none())
      for (int64_t i = 0; i < off[n]; ++i)
        if (rows.data()[i] < 0 || rows.data()[i] >= n_x)
          throw py::index_error("rows[" + std::to_string(i) + "] = " + std::to_string(rows.data()[i]) +
                                " is outside the " + std::to_string(n_x) + " rows of x");
    auto y = array_arg<float>(y_obj, "y", {off[n], m0.out});
    if (!y.writeable()) throw py::value_error("y: must be writeable");
    check_threads(n_threads);
    if (off[n] == 0) return;
    const float* xp = x.data();
    float* yp = y.mutable_data();
    const int64_t* rp = rows_obj.is_none() ? nullptr : rows.data();
    py::gil_scoped_release nogil;
    gemm_int8_grouped(mats.data(), off, int(n), xp, yp, n_threads, rp, n_x);
  }, py::arg("mats"), py::arg("offsets"), py::arg("x"), py::arg("y"), py::arg("n_threads"), py::arg("rows") = py::none(),
     "Rows [offsets[e], offsets[e + 1]) of x [N, in] through mats[e] into the same rows of y [N, out], in one call "
     "(gemm_int8 of each, bit for bit): every matrix of one shape and block family. With rows (int64 [N]), x is "
     "[n_x, in] and row i reads x row rows[i] (the experts' tokens without a gathered copy of x).");

  m.def("dequantize_matrix", [](const PyQuantMatrix& M, int64_t r0, int64_t r1, const py::handle& out_obj,
                                int n_threads, const py::handle& order_obj) {
    if (r0 < 0 || r1 < r0 || r1 > M.m.out)
      throw py::index_error("rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ") are outside the " +
                            std::to_string(M.m.out) + " rows of the matrix");
    auto out = ndim_arg<float>(out_obj, "out", 2);
    if (out.shape(0) < r1 - r0 || out.shape(1) != M.m.in)
      throw py::value_error("out: expected at least [" + std::to_string(r1 - r0) + ", " + std::to_string(M.m.in) +
                            "], got [" + std::to_string(out.shape(0)) + ", " + std::to_string(out.shape(1)) + "]");
    check_threads(n_threads);
    const int32_t* order = nullptr;
    py::array_t<int32_t> order_arr;
    if (!order_obj.is_none()) {
      order_arr = array_arg<int32_t>(order_obj, "order", {M.m.out});
      for (int64_t i = r0; i < r1; ++i)
        if (order_arr.data()[i] < 0 || order_arr.data()[i] >= M.m.out)
          throw py::index_error("order[" + std::to_string(i) + "] = " + std::to_string(order_arr.data()[i]) +
                                " is not a row of the matrix (" + std::to_string(M.m.out) + " rows)");
      order = order_arr.data();
    }
    float* op = out.mutable_data();
    py::gil_scoped_release nogil;
    dequantize_matrix_rows(M.m, r0, r1, op, n_threads, order);
  }, py::arg("m"), py::arg("r0"), py::arg("r1"), py::arg("out"), py::arg("n_threads"), py::arg("order") = py::none(),
     "out[:r1 - r0] = rows [r0, r1) of m dequantized to fp32 (the bias is not added); with order (int32 [out]), "
     "out row i is matrix row order[r0 + i].");

  m.attr("GGML_TYPES") = names_tuple(kGgmlTypeNames);  // the weight encodings read in place (gguf's names)
  m.attr("GEMV_STREAM_IN") = kGemvStreamIn;             // rows this long take the prefetching AVX2 kernels

  m.def("ggml_row_bytes", [](const std::string& type, int64_t in) {
    const GgmlType t = type_arg(type);
    const int bv = ggml_type_info(t).block_values;
    if (in < 0 || in % bv != 0)
      throw py::value_error("in: " + std::string(ggml_type_name(t)) + " rows hold a multiple of " +
                            std::to_string(bv) + " values, got " + std::to_string(in));
    return ggml_row_bytes(t, in);
  }, py::arg("type"), py::arg("in"), "Bytes of one row of `in` values in the ggml encoding `type`.");

  m.def("dequantize_rows", [](const std::string& type, const py::handle& raw_obj) {
    const GgmlType t = type_arg(type);
    auto raw = ndim_arg<uint8_t>(raw_obj, "raw", 2);
    const GgmlTypeInfo info = ggml_type_info(t);
    const int64_t rows = raw.shape(0), row_bytes = raw.shape(1);
    if (row_bytes % info.block_bytes != 0)
      throw py::value_error("raw: a " + std::string(ggml_type_name(t)) + " row is whole blocks of " +
                            std::to_string(info.block_bytes) + " bytes, got rows of " + std::to_string(row_bytes));
    check_aligned(raw.data(), t, "raw");
    const int64_t in = row_bytes / info.block_bytes * info.block_values;
    py::array_t<float> y({rows, in});
    const uint8_t* src = raw.data();
    float* dst = y.mutable_data();
    {
      py::gil_scoped_release nogil;
      for (int64_t r = 0; r < rows; ++r) dequantize_row(t, src + r * row_bytes, in, dst + r * in);
    }
    return y;
  }, py::arg("type"), py::arg("raw"),
     "raw uint8 [rows, row_bytes] in the ggml encoding `type` -> fp32 [rows, in] (as gguf's dequantizer).");

  m.def("gemv_quant", [](const py::handle& x_obj, const py::handle& w_obj, const std::string& type,
                         const py::handle& bias_obj, const py::handle& y_obj, int n_threads) {
    const GgmlType t = type_arg(type);
    if (!gemv_quant_supported(t))
      throw py::value_error("type '" + type + "': no GEMV kernels for this encoding");
    auto x = ndim_arg<float>(x_obj, "x", 2);
    auto w = ndim_arg<uint8_t>(w_obj, "w", 2);
    auto y = ndim_arg<float>(y_obj, "y", 2);
    const int64_t T = x.shape(0), in = x.shape(1), out = w.shape(0);
    const GgmlTypeInfo info = ggml_type_info(t);
    if (in % info.block_values != 0)
      throw py::value_error("x: the input dimension (" + std::to_string(in) + ") must be a multiple of " +
                            std::to_string(info.block_values) + " for " + ggml_type_name(t) + " weights");
    if (w.shape(1) != ggml_row_bytes(t, in))
      throw py::value_error("w: expected rows of " + std::to_string(ggml_row_bytes(t, in)) + " bytes (" +
                            std::to_string(in / info.block_values) + " " + ggml_type_name(t) + " blocks of " +
                            std::to_string(info.block_bytes) + " bytes for in = " + std::to_string(in) +
                            "), got " + std::to_string(w.shape(1)));
    check_aligned(w.data(), t, "w");
    if (y.shape(0) != T || y.shape(1) != out)
      throw py::value_error("y: expected [" + std::to_string(T) + ", " + std::to_string(out) + "], got [" +
                            std::to_string(y.shape(0)) + ", " + std::to_string(y.shape(1)) + "]");
    const float* bp = nullptr;
    if (!bias_obj.is_none()) {
      auto b = ndim_arg<float>(bias_obj, "bias", 1);
      if (b.shape(0) != out)
        throw py::value_error("bias: expected [" + std::to_string(out) + "], got [" + std::to_string(b.shape(0)) +
                              "]");
      bp = b.data();
    }
    check_threads(n_threads);
    const float* xp = x.data();
    const uint8_t* wp = w.data();
    float* yp = y.mutable_data();
    py::gil_scoped_release nogil;
    gemv_quant(t, xp, T, in, wp, out, bp, yp, n_threads);
  }, py::arg("x"), py::arg("w"), py::arg("type"), py::arg("bias"), py::arg("y"), py::arg("n_threads"),
     "y[T, out] = x[T, in] @ dequant(w)^T (+ bias), w uint8 [out, row_bytes] in the ggml encoding `type`, read "
     "in place; quantized types quantize x to int8 per 32 (256 for K-quants) values first.");
}

}  // namespace ktq::python
