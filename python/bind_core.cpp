#include "bindings.hpp"

namespace sattn::py {
void bind_core(pybind11::module_& m) { (void)m; }
}  // namespace sattn::py
