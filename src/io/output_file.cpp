// Output files written whole or not at all (output_file.hpp).
#include "io/output_file.hpp"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "sattn/error.hpp"

namespace sattn::io {
namespace {

std::string error_text(int err) {
  char buf[256];
  return strerror_r(err, buf, sizeof buf);  // the GNU variant: thread-safe, returns the text
}

// Six letters/digits, different for every call in this process and unlikely to repeat across processes
// (O_EXCL retries the rare collision).
std::string random_suffix() {
  static std::atomic<uint64_t> counter{0};
  uint64_t x = uint64_t(::getpid()) << 40 ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
               (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull);
  // splitmix64 finaliser
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  static const char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string s(6, ' ');
  for (char& c : s) c = kChars[x % 62], x /= 62;
  return s;
}

bool under_proc(const std::string& dir) { return dir == "/proc" || dir.starts_with("/proc/"); }

}  // namespace

OutputFile::OutputFile(std::string path, std::string label)
    : path_(std::move(path)), label_(std::move(label)), owner_(::getpid()) {
  namespace fs = std::filesystem;
  // Follow symbolic links to the file to replace. Links into /proc (/dev/stdout -> /proc/self/fd/1) name open
  // files of this process: those are written directly.
  std::string target = path_;
  bool direct = false;
  bool existing = false;
  mode_t keep_mode = 0;
  for (int hops = 0;; ++hops) {
    if (hops > 40) fail("cannot write '" + path_ + "'", ELOOP);
    const fs::path p(target);
    const std::string name = p.filename().string();
    if (name.empty() || name == "." || name == "..") fail("cannot write '" + path_ + "': expected a file name", 0);
    const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
    std::unique_ptr<char, decltype(&std::free)> real(::realpath(dir.c_str(), nullptr), &std::free);
    if (!real) fail("cannot write '" + path_ + "': directory '" + dir + "'", errno);
    const std::string real_dir = real.get();
    if (under_proc(real_dir)) {
      // /dev/stdout, /dev/fd/N: this process's own descriptor, so that an append (>>) or an offset is honoured.
      if (real_dir == "/proc/" + std::to_string(::getpid()) + "/fd" &&
          name.find_first_not_of("0123456789") == std::string::npos) {
        fd_ = ::fcntl(std::atoi(name.c_str()), F_DUPFD_CLOEXEC, 0);
        if (fd_ < 0) fail("cannot write '" + path_ + "'", errno);
        return;
      }
      direct = true;
      break;
    }
    const std::string full = (real_dir == "/" ? "" : real_dir) + "/" + name;
    struct stat st {};
    if (::lstat(full.c_str(), &st) != 0) {
      if (errno != ENOENT) fail("cannot write '" + path_ + "'", errno);
      destination_ = full;  // a new file
      break;
    }
    if (S_ISLNK(st.st_mode)) {
      std::string link(size_t(st.st_size > 0 ? st.st_size : PATH_MAX) + 1, '\0');
      const ssize_t n = ::readlink(full.c_str(), link.data(), link.size());
      if (n < 0) fail("cannot write '" + path_ + "': link '" + full + "'", errno);
      link.resize(size_t(n));
      target = link.starts_with("/") ? link : real_dir + "/" + link;
      continue;
    }
    if (S_ISDIR(st.st_mode)) fail("cannot write '" + path_ + "'", EISDIR);
    if (!S_ISREG(st.st_mode)) {
      direct = true;
      break;
    }
    // An existing file we may not write stays as it is, as if it were opened for writing.
    if (::faccessat(AT_FDCWD, full.c_str(), W_OK, AT_EACCESS) != 0) fail("cannot write '" + path_ + "'", errno);
    destination_ = full;
    existing = true;
    keep_mode = st.st_mode & 07777;
    break;
  }
  if (direct) {
    do fd_ = ::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) fail("cannot write '" + path_ + "'", errno);
    return;
  }
  const fs::path dest(destination_);
  const std::string dir = dest.parent_path().string();
  std::string stem(1, '.');
  stem += dest.filename().string();
  const size_t suffix = std::strlen(".sattn-XXXXXX");
  if (stem.size() + suffix > NAME_MAX) stem.resize(NAME_MAX - suffix);  // a long name still fits the file system
  for (int attempt = 0; fd_ < 0; ++attempt) {
    temporary_ = (dir == "/" ? "" : dir) + "/" + stem + ".sattn-" + random_suffix();
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);  // 0666 & ~umask for a new file
    if (fd_ >= 0) break;
    const int err = errno;
    temporary_.clear();
    if ((err != EEXIST && err != EINTR) || attempt >= 100)
      fail("cannot write '" + path_ + "': cannot create a file in '" + dir + "'", err);
  }
  if (existing && ::fchmod(fd_, keep_mode) != 0) fail("cannot write '" + path_ + "'", errno);
}

OutputFile::~OutputFile() { discard(); }

void OutputFile::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temporary_.empty() && ::getpid() == owner_) ::unlink(temporary_.c_str());
  temporary_.clear();
}

void OutputFile::fail(const std::string& what, int err) {
  discard();
  failed_ = true;
  std::string message = label_.empty() ? what : label_ + ": " + what;
  if (err) message += ": " + error_text(err);
  throw Error(ErrorKind::kIO, message);
}

void OutputFile::write(const void* data, size_t size) {
  check(fd_ >= 0 && !failed_, ErrorKind::kInternal, "OutputFile '", path_, "': written after close or failure");
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(size, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("cannot write '" + path_ + "'", errno);
    if (n == 0) fail("cannot write '" + path_ + "'", ENOSPC);
    p += n;
    size -= size_t(n);
  }
}

void OutputFile::close() {
  check(!failed_, ErrorKind::kInternal, "OutputFile '", path_, "': closed after a failure");
  if (fd_ < 0) return;
  if (!temporary_.empty() && ::fsync(fd_) != 0) fail("cannot write '" + path_ + "'", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot write '" + path_ + "'", errno);  // NFS and full disks report here
}

void OutputFile::commit() {
  if (committed_) return;
  close();
  if (!temporary_.empty()) {
    if (::rename(temporary_.c_str(), destination_.c_str()) != 0) fail("cannot replace '" + path_ + "'", errno);
    temporary_.clear();
  }
  committed_ = true;
}

OutputFile& OutputFiles::add(const std::string& path, const std::string& label) {
  OutputFile& f = files_.emplace_back(path, label);
  for (size_t i = 0; i + 1 < files_.size(); ++i)
    if (!f.destination().empty() && files_[i].destination() == f.destination()) {
      const std::string other = files_[i].path();
      files_.pop_back();
      fail(ErrorKind::kInvalidArgument, label.empty() ? "" : label + ": ", "'", path, "' is the same file as '", other,
           "', written by the same command");
    }
  return f;
}

void OutputFiles::commit() {
  for (OutputFile& f : files_) f.close();
  std::string replaced;
  for (OutputFile& f : files_) {
    try {
      f.commit();
    } catch (const Error& e) {
      if (replaced.empty()) throw;
      throw Error(e.kind(), std::string(e.what()) + " (already replaced: " + replaced + ")");
    }
    if (!f.destination().empty()) replaced += (replaced.empty() ? "'" : ", '") + f.path() + "'";
  }
}

}  // namespace sattn::io
