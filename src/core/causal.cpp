// The names of Causal and Float32Precision (sattn/problem.hpp), apart from the attention entry points: the pattern
// parsers, the CLI and the Python module use them too.
#include <string>

#include "sattn/error.hpp"
#include "sattn/problem.hpp"

namespace sattn {

const char* to_string(Causal causal) {
  switch (causal) {
    case Causal::kNone: return "none";
    case Causal::kTopLeft: return "top_left";
    case Causal::kBottomRight: return "bottom_right";
  }
  return "?";
}

Causal parse_causal(const std::string& text, const char* argument_name) {
  if (text == "none" || text.empty()) return Causal::kNone;
  if (text == "top_left" || text == "top-left") return Causal::kTopLeft;
  if (text == "bottom_right" || text == "bottom-right") return Causal::kBottomRight;
  fail(ErrorKind::kInvalidArgument, argument_name, ": expected 'none', 'top_left' or 'bottom_right', got '", text, "'");
}

const char* to_string(Float32Precision precision) {
  switch (precision) {
    case Float32Precision::kBF16: return "bf16";
    case Float32Precision::kHigh: return "high";
    default: return "highest";
  }
}

Float32Precision parse_float32_precision(const std::string& text, const char* argument_name) {
  if (text == "highest") return Float32Precision::kHighest;
  if (text == "high") return Float32Precision::kHigh;
  if (text == "bf16") return Float32Precision::kBF16;
  fail(ErrorKind::kInvalidArgument, argument_name, ": expected 'highest', 'high' or 'bf16', got '", text, "'");
}

}  // namespace sattn
