#include "core/memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>

namespace sattn {

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : int64_t(8) << 30;
}

int64_t memory_limit_bytes(int64_t requested) { return requested > 0 ? requested : physical_memory_bytes() / 2; }

void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!data || bytes < int64_t(2 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // failure is harmless
#else
  (void)data, (void)bytes;
#endif
}

}  // namespace sattn
