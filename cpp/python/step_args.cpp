// The checked arguments of a selection request and of a long_context decode step (step_args.h).
#include "python/step_args.h"

#include "python/args.h"

namespace ktq::python {

HeadMode head_mode(const std::string& s) { return parse_enum<HeadMode>(s, "head_select_mode", kHeadModeNames); }

int query_arg(const KVStore& st, const py::handle& q_obj, py::array_t<float>& q) {
  q = array_arg<float>(q_obj, "q", {-1, st.config().head_dim});
  return int(q.shape(0));
}

void select_args(const KVStore& st, SelectArgs& a, const std::string& mode, const py::handle& k,
                 const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids) {
  a.req.mode = head_mode(mode);
  const int n_sets = a.req.mode == HeadMode::SHARED ? 1 : st.config().n_kv_heads;
  a.k = array_arg<int32_t>(k, "k", {n_sets});
  a.exclude = array_arg<int64_t>(exclude, "exclude", {-1, 2});
  a.out_ids = array_arg<int32_t>(out_ids, "out_ids", {n_sets, -1});
  a.req.k_per_set = a.k.data();
  a.req.exclude = a.exclude.data();
  a.req.n_exclude = int(a.exclude.shape(0));
  if (!allowed.is_none()) {
    a.allowed = array_arg<int32_t>(allowed, "allowed", {n_sets, -1});
    a.req.allowed = a.allowed.data();
    a.req.allowed_cols = int(a.allowed.shape(1));
  }
  if (!a.out_ids.writeable()) throw py::value_error("out_ids: must be writeable");
}

void step_args(const KVStore& st, StepArgs& a, int H, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
               int64_t width, int64_t skip0, int64_t skip1, int n_threads, int part, const py::handle& blocks_obj,
               const std::string& mode, const py::handle& k_sel, const py::handle& exclude, const py::handle& allowed,
               const py::handle& out_ids) {
  const int KVH = st.config().n_kv_heads, D = st.config().head_dim;
  a.wk = array_arg<float>(wk_obj, "win_k", {KVH, -1, D});
  a.wv = array_arg<float>(wv_obj, "win_v", {KVH, a.wk.shape(1), D});
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
  check_threads(n_threads);
  if (part < 0 || part > 2)
    throw py::value_error("part must be 0 (none), 1 (attend) or 2 (select), got " + std::to_string(part));
  LayerStep& s = a.step;
  s.part = StorePart(part);
  if (s.part == StorePart::ATTEND) {
    a.blocks = array_arg<int32_t>(blocks_obj, "blocks", {-1, -1});
    if (a.blocks.shape(0) != 1 && a.blocks.shape(0) != KVH)
      throw py::value_error("blocks: expected 1 (shared) or n_kv_heads=" + std::to_string(KVH) + " rows, got " +
                            std::to_string(a.blocks.shape(0)));
    s.blocks = BlockSets{a.blocks.data(), int(a.blocks.shape(0)), int(a.blocks.shape(1))};
  } else if (s.part == StorePart::SELECT) {
    select_args(st, a.sel, mode, k_sel, exclude, allowed, out_ids);
    s.req = a.sel.req;
    s.out_ids = a.sel.out_ids.mutable_data();
    s.out_cols = int(a.sel.out_ids.shape(1));
  }
  s.win = WindowView{a.wk.mutable_data(), a.wv.mutable_data(), rows, w0, width, skip0, skip1};
}

}  // namespace ktq::python
