// The checked arguments of a selection request and of a long_context decode step, shared by the store's
// bindings (select, select_attend, decode_step) and the decode binding (a whole token), and the StorePlan that
// names a layer's store part. The arrays stay alive in these structs; the C++ structs borrow their data.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "decode/layer_step.h"
#include "kvstore/kv_store.h"

namespace ktq::python {

namespace py = pybind11;

HeadMode head_mode(const std::string& s);  // "SHARED" / "SEPARATE", else ValueError

// Checks q [H, D] and returns H.
int query_arg(const KVStore& st, const py::handle& q_obj, py::array_t<float>& q);
// With dual chunk attention's rotations: variants None (q [H, D]) or (succ, intra), the bounds of var, and q
// [3, H, D] (select/request.h QueryVariants; the store checks the bounds). Returns H.
int query_arg(const KVStore& st, const py::handle& q_obj, py::array_t<float>& q, const py::handle& variants,
              QueryVariants& var);

// The arrays of a selection request; they stay alive (and borrowed by `req`) for the call. (Hidden visibility
// like their pybind11 fields': these structs never leave the module.)
struct [[gnu::visibility("hidden")]] SelectArgs {
  py::array_t<int32_t> k;
  py::array_t<int64_t> exclude;
  py::array_t<int32_t> allowed;
  py::array_t<int32_t> out_ids;
  int32_t* out = nullptr;  // out_ids' data (checked writeable)
  SelectRequest req;
};

// ada: None, or (num, den) for Ada-KV budgets with alpha = num / den (SelectRequest::ada). rerank: the second
// stage's width (SelectRequest::rerank, 1..kMaxRerank).
void select_args(const KVStore& st, SelectArgs& a, const std::string& mode, const py::handle& k,
                 const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                 const py::handle& ada, int rerank);

// _C.StorePlan: what one layer's decode step attends in the store (nothing, a fixed block list, or a fresh
// selection into out_ids), checked once against the store it was made for and then run by many steps
// (ktquest/kv/plan.py keeps a token's plans while the context end stays). It keeps the arrays it borrows.
struct [[gnu::visibility("hidden")]] StorePlan {
  py::object store;                // the _C.KVStore it was checked against, kept alive by the plan ...
  const KVStore* st = nullptr;     // ... and its address; null: NONE, which fits any store
  StorePart part = StorePart::NONE;
  py::array_t<int32_t> blocks;  // ATTEND: [1 or KVH, cols], -1 padded
  SelectArgs sel;               // SELECT

  static StorePlan none() { return StorePlan{}; }
  static StorePlan attend(const py::object& store, const py::handle& blocks);
  static StorePlan select(const py::object& store, const std::string& mode, const py::handle& k,
                          const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids,
                          const py::handle& ada, int rerank);
};

// The window arguments of a long_context decode step (KVStore.decode_step, each layer of decode_token) checked,
// with `plan`'s store part, as a LayerStep. H: the query heads of the step (a multiple of the store's KV heads).
// The window arrays stay alive in `wk`/`wv` for the call.
struct [[gnu::visibility("hidden")]] StepArgs {
  py::array_t<float> wk, wv;
  LayerStep step;
};

void step_args(const KVStore& st, StepArgs& a, int H, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
               int64_t width, int64_t skip0, int64_t skip1, int n_threads, const StorePlan& plan);

}  // namespace ktq::python
