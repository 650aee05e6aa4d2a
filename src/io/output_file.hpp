// Output files that are written whole or not at all; every writer of the library and the command goes through here.
//
// An OutputFile opens its destination when it is constructed, so that a command finds an unwritable output before
// it computes anything. A regular file (existing or new) is written to a temporary ".NAME.sattn-XXXXXX" in the
// destination's directory, created with O_EXCL; commit() fsyncs and closes it, then renames it over the destination.
// Until then the destination is untouched, and any failure removes the temporary: a full disk or an error leaves
// the old file as it was, and a killed process leaves the old file (plus, at worst, a temporary). The new file
// keeps the permission bits of the file it replaces; a symbolic link is followed and its target replaced.
// Destinations that are not regular files (character devices such as /dev/null or /dev/full, FIFOs, /dev/stdout
// and the other /proc/self/fd links, these through the process's own descriptor) are written directly, every
// write and the close checked.
// Every failure throws sattn::Error(kIO) naming the destination.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace sattn::io {

class OutputFile {
 public:
  // `label` (e.g. "--out" or "write_png") starts every error message when given.
  explicit OutputFile(std::string path, std::string label = {});
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();  // not committed: the temporary is removed, the destination untouched

  void write(const void* data, size_t size);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void write(const std::vector<uint8_t>& bytes) { write(bytes.data(), bytes.size()); }
  // Flushes the data to disk and closes the file; a regular destination is not replaced yet.
  void close();
  // close(), then renames the temporary over the destination.
  void commit();

  const std::string& path() const { return path_; }
  // The file that commit() replaces (symbolic links resolved); empty when written directly.
  const std::string& destination() const { return destination_; }

 private:
  [[noreturn]] void fail(const std::string& what, int err);  // removes the temporary, throws
  void discard() noexcept;

  std::string path_, label_;
  std::string destination_, temporary_;  // both empty for a destination written directly
  int fd_ = -1;
  pid_t owner_;  // a forked child that unwinds never removes its parent's temporary
  bool committed_ = false, failed_ = false;
};

// Several outputs of one command, committed together: commit() writes out and closes every file before the first
// rename, so that a failing write or close leaves every destination untouched; a failing rename names the
// destinations already replaced.
class OutputFiles {
 public:
  // Opens `path` now; refuses a regular destination that is already in the set.
  OutputFile& add(const std::string& path, const std::string& label = {});
  void commit();

 private:
  std::deque<OutputFile> files_;  // a deque: the references add() returns stay valid
};

// Writes the file at `path` whole: `fill(out)` writes into an OutputFile, which is then committed.
template <typename Fill>
void write_file(const std::string& path, Fill&& fill) {
  OutputFile out(path);
  fill(out);
  out.commit();
}

}  // namespace sattn::io
