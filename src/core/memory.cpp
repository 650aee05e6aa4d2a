#include "core/memory.hpp"

#include <unistd.h>

namespace sattn {

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : int64_t(8) << 30;
}

int64_t memory_limit_bytes(int64_t requested) { return requested > 0 ? requested : physical_memory_bytes() / 2; }

}  // namespace sattn
