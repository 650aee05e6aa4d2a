// sattn::viz: the attention diagnostics on a healthy call.
#include <sattn/diagnose.hpp>

#include <iostream>

#include "common.hpp"

int main() {
  const sattn::Tensor q = example_q();
  const sattn::Diagnosis d = sattn::diagnose(q, q, q, {});
  std::cout << "viz: " << d.findings.size() << " findings\n";
  return d.heads.size() == 2 ? 0 : 1;
}
