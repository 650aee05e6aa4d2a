#include <cstdlib>
#include <string>

#include "kernels/kernel.hpp"

namespace sattn {

const std::vector<KernelEntry>& registered_kernels() {
  // Fastest first; the reference (supports everything) is always last.
  static const std::vector<KernelEntry> kernels = {
      fused_kernel(),
      reference_kernel(),
  };
  return kernels;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& k : registered_kernels()) names.emplace_back(k.name);
  return names;
}

std::vector<std::pair<std::string, std::string>> explain_kernels(const AttentionProblem& problem) {
  std::vector<std::pair<std::string, std::string>> result;
  for (const auto& k : registered_kernels()) {
    std::string why;
    const bool ok = k.supports(problem, &why);
    result.emplace_back(k.name, ok ? std::string() : (why.empty() ? "not supported" : why));
  }
  return result;
}

}  // namespace sattn
