#include "core/write_file.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "sattn/error.hpp"

namespace sattn {

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  check(f != nullptr, ErrorKind::kIO, "cannot open '", path, "' for writing: ", std::strerror(errno));
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  check(written == bytes.size(), ErrorKind::kIO, "cannot write '", path, "': ", std::strerror(write_errno), " (",
        written, " of ", bytes.size(), " bytes written)");
  check(closed, ErrorKind::kIO, "cannot write '", path, "': ", std::strerror(errno));
}

}  // namespace sattn
