#include "core/threads.hpp"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "sattn/error.hpp"

namespace sattn {

int hardware_threads() {
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("SATTN_NUM_THREADS"); env && *env) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    check(end && *end == '\0' && n > 0 && n <= 4096, ErrorKind::kInvalidArgument,
          "SATTN_NUM_THREADS: expected a positive integer, got '", env, "'");
    return int(n);
  }
  return hardware_threads();
}

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : int64_t(8) << 30;
}

}  // namespace sattn
