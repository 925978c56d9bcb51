// The bindings of each area, called once from module.cpp's PYBIND11_MODULE (in this order: a binding's
// argument types are registered before it is used).
#pragma once

#include <pybind11/pybind11.h>

namespace ktq::python {

void bind_cpu(pybind11::module_& m);         // bind_cpu.cpp: CPU features, forced scalar kernels
void bind_gemv_quant(pybind11::module_& m);  // bind_gemv_quant.cpp: GGUF-encoded weights and their GEMV
void bind_kv_store(pybind11::module_& m);    // bind_kv_store.cpp: the store, its layout, its decode step
void bind_store_plan(pybind11::module_& m);  // step_args.cpp: a layer's store part, planned once
void bind_dense_attn(pybind11::module_& m);  // bind_dense_attn.cpp: dense decode attention
void bind_moe(pybind11::module_& m);         // bind_moe.cpp: a mixture-of-experts FFN and its routing
void bind_delta(pybind11::module_& m);       // bind_delta.cpp: a DeltaNet layer's gated delta rule
void bind_decode(pybind11::module_& m);      // bind_decode.cpp: a block's stages, a layer's and a token's step
void bind_sample(pybind11::module_& m);      // bind_sample.cpp: logits -> the next token

}  // namespace ktq::python
