// The memory limit of one call, in one place.
#pragma once

#include <cstdint>

namespace sattn {

int64_t physical_memory_bytes();

// The limit on what one call may allocate for a materialised L x L buffer (attention weights, the reference
// kernel's scores): `requested` when > 0 (AttentionOptions::memory_limit_bytes), else half of physical memory.
int64_t memory_limit_bytes(int64_t requested = 0);

}  // namespace sattn
