// Writing a whole file from bytes in memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sattn {

// Writes `bytes` to `path` (created or truncated), every write and the close checked. Throws sattn::Error(kIO)
// naming the path.
void write_file(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace sattn
