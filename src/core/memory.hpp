// The memory limit of one call, in one place.
#pragma once

#include <cstdint>

namespace sattn {

int64_t physical_memory_bytes();

// The limit on what one call may allocate for a materialised L x L buffer (attention weights, the reference
// kernel's scores): `requested` when > 0 (AttentionOptions::memory_limit_bytes), else half of physical memory.
int64_t memory_limit_bytes(int64_t requested = 0);

// Asks for transparent huge pages (MADV_HUGEPAGE, a hint) for the whole 2 MiB pages inside [data, data + bytes): for
// an output about to be written whole, in memory the caller has just allocated (torch's tensors are fresh
// mappings), so that its first writes fault once per 2 MiB instead of once per 4 KiB page. Nothing below 4 MiB;
// ignored where huge pages are off or the memory is not anonymous.
void advise_huge_pages(void* data, int64_t bytes);

}  // namespace sattn
