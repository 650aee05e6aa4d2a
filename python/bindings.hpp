// Each area of the Python module binds itself in its own file; module.cpp calls them in order.
#pragma once
#include <pybind11/pybind11.h>

namespace sattn::py {
void bind_core(pybind11::module_& m);       // bind_core.cpp: errors, dtypes, kernels, threads, version
void bind_attention(pybind11::module_& m);  // bind_attention.cpp: scaled_dot_product_attention & co.
void bind_nn(pybind11::module_& m);         // bind_nn.cpp: MultiheadAttention, safetensors
void bind_tools(pybind11::module_& m);      // bind_tools.cpp: diagnose
void bind_fused(pybind11::module_& m);      // bind_fused.cpp: flash_attn_varlen (+ backward)
void bind_sparse(pybind11::module_& m);     // bind_sparse.cpp: sparse patterns, sparse_attention & co.
void bind_sr(pybind11::module_& m);         // bind_sr.cpp: sattn.sr (SattnSR model, bicubic, metrics, images)
void bind_torch(pybind11::module_& m);      // bind_torch.cpp: private bodies of sattn.torch's operators
}  // namespace sattn::py
