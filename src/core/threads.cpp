#include "core/threads.hpp"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/env.hpp"
#include "sattn/error.hpp"

namespace sattn {

int hardware_threads() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  return int(env::get_integer("SATTN_NUM_THREADS", 1, 4096, hardware_threads()));
}

}  // namespace sattn
