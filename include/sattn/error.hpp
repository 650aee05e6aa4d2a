// sattn::Error — the one exception type of the public API.
//
// Every public entry validates its arguments once, at the boundary, and throws
// sattn::Error with a kind and a message that names the argument, what was
// expected and what was given. Python maps the kinds to ValueError / TypeError /
// MemoryError / NotImplementedError / OSError; the CLI prints the message and exits 2.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace sattn {

enum class ErrorKind {
  kInvalidArgument,  // a shape, value or option is wrong          -> ValueError
  kTypeError,        // a dtype is wrong                             -> TypeError
  kOutOfMemory,      // a buffer would exceed the memory limit       -> MemoryError
  kUnsupported,      // valid, but no kernel supports it (e.g. strict mode) -> NotImplementedError
  kIO,               // a file could not be read or is malformed     -> OSError / ValueError
  kInternal,         // a bug in sattn
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// Message building for check and fail, usable on its own: message::concat("x = ", x) streams each part.
namespace message {
// Writes one part of a message; a part that is a function with no arguments (e.g. [&] { return p.repr(); }) is
// called here, so that a costly part is computed only when the message is built.
template <typename T>
void write_part(std::ostringstream& os, const T& part) {
  if constexpr (std::is_invocable_v<const T&>) os << part();
  else os << part;
}
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (write_part(os, args), ...);
  return os.str();
}
}  // namespace message

// Throws sattn::Error(kind, concat(args...)) when `cond` is false. The message is built only then; its arguments
// are evaluated by the caller, so pass a costly part as a function (see message::write_part).
template <typename... Args>
inline void check(bool cond, ErrorKind kind, const Args&... args) {
  if (!cond) throw Error(kind, message::concat(args...));
}
template <typename... Args>
[[noreturn]] inline void fail(ErrorKind kind, const Args&... args) {
  throw Error(kind, message::concat(args...));
}

}  // namespace sattn
