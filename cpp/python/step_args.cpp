// The checked arguments of a selection request and of a long_context decode step (step_args.h).
#include "python/step_args.h"

#include "common/checked.h"
#include "python/args.h"
#include "python/bind.h"
#include "select/ada.h"

namespace ktq::python {

HeadMode head_mode(const std::string& s) { return parse_enum<HeadMode>(s, "head_select_mode", kHeadModeNames); }

int query_arg(const KVStore& st, const py::handle& q_obj, py::array_t<float>& q) {
  q = array_arg<float>(q_obj, "q", {-1, st.config().head_dim});
  return checked_int(q.shape(0), "q heads");
}

int query_arg(const KVStore& st, const py::handle& q_obj, py::array_t<float>& q, const py::handle& variants,
              QueryVariants& var) {
  if (variants.is_none()) return query_arg(st, q_obj, q);
  const auto b = variants.cast<std::pair<int64_t, int64_t>>();
  var = QueryVariants{3, b.first, b.second};
  q = array_arg<float>(q_obj, "q", {3, -1, st.config().head_dim});
  return checked_int(q.shape(1), "q heads");
}

void select_args(const KVStore& st, SelectArgs& a, const std::string& mode, const py::handle& k,
                 const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                 const py::handle& ada, int rerank) {
  a.req.mode = head_mode(mode);
  if (rerank < 1 || rerank > kMaxRerank)
    throw py::value_error("rerank must be in [1, " + std::to_string(kMaxRerank) + "] (1 = off), got " +
                          std::to_string(rerank));
  a.req.rerank = rerank;
  const int n_sets = a.req.mode == HeadMode::SHARED ? 1 : st.config().n_kv_heads;
  a.k = array_arg<int32_t>(k, "k", {n_sets});
  a.exclude = array_arg<int64_t>(exclude, "exclude", {-1, 2});
  a.out_ids = array_arg<int32_t>(out_ids, "out_ids", {n_sets, -1});
  a.req.k_per_set = a.k.data();
  a.req.exclude = a.exclude.data();
  a.req.n_exclude = checked_int(a.exclude.shape(0), "exclude rows");
  if (!allowed.is_none()) {
    a.allowed = array_arg<int32_t>(allowed, "allowed", {n_sets, -1});
    a.req.allowed = a.allowed.data();
    a.req.allowed_cols = checked_int(a.allowed.shape(1), "allowed columns");
  }
  if (!a.out_ids.writeable()) throw py::value_error("out_ids: must be writeable");
  a.out = a.out_ids.mutable_data();
  if (!ada.is_none()) {
    const char* want = "ada: expected None or (num, den), two integers (alpha = num / den)";
    if (!py::isinstance<py::tuple>(ada) || py::len(ada) != 2) throw py::value_error(want);
    try {
      const auto t = ada.cast<py::tuple>();
      a.req.ada_num = t[0].cast<int64_t>(), a.req.ada_den = t[1].cast<int64_t>();
    } catch (const py::cast_error&) {
      throw py::value_error(want);
    }
    if (a.req.ada_den < 1 || a.req.ada_den > kAdaMaxDen || a.req.ada_num < 0 || a.req.ada_num > a.req.ada_den)
      throw py::value_error("ada: alpha = " + std::to_string(a.req.ada_num) + "/" + std::to_string(a.req.ada_den) +
                            " must lie in [0, 1] with a denominator in [1, " + std::to_string(kAdaMaxDen) + "]");
    a.req.ada = true;
  }
}

StorePlan StorePlan::attend(const py::object& store, const py::handle& blocks_obj) {
  const KVStore& st = store.cast<const KVStore&>();
  StorePlan p;
  p.store = store, p.st = &st;
  p.part = StorePart::ATTEND;
  const int KVH = st.config().n_kv_heads;
  p.blocks = array_arg<int32_t>(blocks_obj, "blocks", {-1, -1});
  if (p.blocks.shape(0) != 1 && p.blocks.shape(0) != KVH)
    throw py::value_error("blocks: expected 1 (shared) or n_kv_heads=" + std::to_string(KVH) + " rows, got " +
                          std::to_string(p.blocks.shape(0)));
  return p;
}

StorePlan StorePlan::select(const py::object& store, const std::string& mode, const py::handle& k,
                            const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                            const py::handle& ada, int rerank) {
  const KVStore& st = store.cast<const KVStore&>();
  StorePlan p;
  p.store = store, p.st = &st;
  p.part = StorePart::SELECT;
  select_args(st, p.sel, mode, k, exclude, allowed, out_ids, ada, rerank);
  return p;
}

void step_args(const KVStore& st, StepArgs& a, int H, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
               int64_t width, int64_t skip0, int64_t skip1, int n_threads, const StorePlan& plan) {
  const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
  a.wk = array_arg<float>(wk_obj, "win_k", {KVH, -1, D});
  a.wv = array_arg<float>(wv_obj, "win_v", {KVH, a.wk.shape(1), D});
  if (!a.wk.writeable() || !a.wv.writeable()) throw py::value_error("win_k/win_v: must be writeable");
  if (H < 1 || H % KVH != 0)
    throw py::value_error("q has " + std::to_string(H) + " heads: must be a positive multiple of n_kv_heads=" +
                          std::to_string(KVH) + " (GQA)");
  const int64_t rows = a.wk.shape(1);
  if (width < 1 || width > rows || w0 < 0 || w0 >= width)
    throw py::value_error("window: row w0=" + std::to_string(w0) + " and width=" + std::to_string(width) +
                          " must satisfy 0 <= w0 < width <= " + std::to_string(rows) + " (the buffer's rows)");
  if (skip0 < 0 || skip1 < skip0 || skip1 > width || (w0 >= skip0 && w0 < skip1))
    throw py::value_error("skip [" + std::to_string(skip0) + ", " + std::to_string(skip1) +
                          ") must be a range within [0, width) that leaves the new row " + std::to_string(w0));
  check_threads(n_threads);
  if (plan.st != nullptr && plan.st != &st)
    throw py::value_error("plan: a StorePlan made for another store");
  LayerStep& s = a.step;
  s.part = plan.part;
  if (s.part == StorePart::ATTEND) {
    s.blocks = BlockSets{plan.blocks.data(), int(plan.blocks.shape(0)),
                         checked_int(plan.blocks.shape(1), "blocks columns")};
  } else if (s.part == StorePart::SELECT) {
    s.req = plan.sel.req;
    s.out_ids = plan.sel.out;
    s.out_cols = checked_int(plan.sel.out_ids.shape(1), "out_ids columns");
  }
  s.win = WindowView{a.wk.mutable_data(), a.wv.mutable_data(), rows, w0, width, skip0, skip1};
}

void bind_store_plan(py::module_& m) {
  py::class_<StorePlan>(m, "StorePlan",
                        "What one layer's long_context decode step attends in the store, checked once against the "
                        "store and run by many steps (see ktquest/kv/plan.py).")
      .def_static("none", &StorePlan::none, "No context block yet: the step attends its window alone.")
      .def_static("attend", &StorePlan::attend, py::arg("store"), py::arg("blocks"),
                  "A fixed list: blocks int32 [1 (every KV head) or n_kv_heads, cols], ascending, -1 padded.")
      .def_static("select", &StorePlan::select, py::arg("store"), py::arg("mode"), py::arg("k"), py::arg("exclude"),
                  py::arg("allowed"), py::arg("out_ids"), py::arg("ada") = py::none(), py::arg("rerank") = 1,
                  "A fresh selection as KVStore.select_attend makes it (mode SHARED/SEPARATE, k int32 [n_sets], "
                  "exclude int64 [n, 2] block ranges, allowed int32 [n_sets, N] or None, ada None or (num, den), "
                  "rerank the second stage's width); the picks land in out_ids int32 [n_sets, cols].")
      .def_property_readonly("out_ids", [](const StorePlan& p) -> py::object {
        if (p.part != StorePart::SELECT) return py::none();
        return p.sel.out_ids;
      }, "The selection's ids buffer (SELECT), where every step run with this plan writes its picks; else None.");
}

}  // namespace ktq::python
