#include "bindings.hpp"

namespace sattn::py {
void bind_nn(pybind11::module_& m) { (void)m; }
}  // namespace sattn::py
