// The checked arguments of a selection request and of a long_context decode step, shared by the store's
// bindings (select, select_attend, decode_step) and the decode bindings (step_long_context, a whole token).
// The arrays stay alive in these structs for the call; the C++ structs borrow their data.
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

// The arrays of a selection request; they stay alive (and borrowed by `req`) for the call. (Hidden visibility
// like their pybind11 fields': these structs never leave the module.)
struct [[gnu::visibility("hidden")]] SelectArgs {
  py::array_t<int32_t> k;
  py::array_t<int64_t> exclude;
  py::array_t<int32_t> allowed;
  py::array_t<int32_t> out_ids;
  SelectRequest req;
};

void select_args(const KVStore& st, SelectArgs& a, const std::string& mode, const py::handle& k,
                 const py::handle& exclude, const py::handle& allowed, const py::handle& out_ids);

// The window and store-part arguments of a long_context decode step (KVStore.decode_step,
// DecodeLayer.step_long_context, each layer of decode_token_long_context), checked, as a LayerStep.
struct [[gnu::visibility("hidden")]] StepArgs {
  py::array_t<float> wk, wv;
  py::array_t<int32_t> blocks;
  SelectArgs sel;
  LayerStep step;
};

// H: the query heads of the step (a multiple of the store's KV heads).
void step_args(const KVStore& st, StepArgs& a, int H, const py::handle& wk_obj, const py::handle& wv_obj, int64_t w0,
               int64_t width, int64_t skip0, int64_t skip1, int n_threads, int part, const py::handle& blocks_obj,
               const std::string& mode, const py::handle& k_sel, const py::handle& exclude, const py::handle& allowed,
               const py::handle& out_ids);

}  // namespace ktq::python
