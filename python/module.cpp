#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "sattn native core (use the `sattn` package)";
  sattn::py::bind_core(m);
  sattn::py::bind_attention(m);
  sattn::py::bind_nn(m);
  sattn::py::bind_tools(m);
  sattn::py::bind_fused(m);
  sattn::py::bind_sparse(m);
  sattn::py::bind_sr(m);
  sattn::py::bind_torch(m);
}
