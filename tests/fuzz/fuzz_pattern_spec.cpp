// Pattern-spec parser (Pattern::parse): any text gives a pattern or sattn::Error, within the limits of the spec
// language: at most 65 536 characters, at most 256 levels of nesting (grouping parentheses and pattern arguments;
// a leaf's own call and a tuple argument add 2 more parentheses at most), every size, window, dilation, block
// and count within ±(2^31 − 1) (a BigBird seed is any uint64). An accepted pattern round-trips through repr()
// (parse(repr(p)) == p), and on small lengths its block mask covers exactly the pairs allowed() allows.
#include <algorithm>
#include <charconv>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "block_mask_check.hpp"
#include "fuzz_check.hpp"
#include "sattn/patterns.hpp"

namespace {

using sattn::fuzz::accepted;
using sattn::fuzz::finding;
using sattn::sparse::Pattern;

constexpr size_t kMaxSpecChars = 65536;
constexpr int kMaxDepth = 256;
// Parentheses open at once beyond the nesting levels: a leaf's call and a tuple argument (logits=(a, b)).
constexpr int kLeafParentheses = 2;
constexpr int64_t kMaxSize = (int64_t(1) << 31) - 1;
// allowed() evaluations per block-mask check at most (pairs × heads × nodes), so that one input stays fast.
constexpr int64_t kMaxPredicateCalls = int64_t(1) << 18;

// The most parentheses open at once, outside quoted strings.
int paren_depth(const std::string& s) {
  int depth = 0, most = 0;
  char quote = 0;
  for (char c : s) {
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == '(') {
      most = std::max(most, ++depth);
    } else if (c == ')') {
      --depth;
    }
  }
  return most;
}

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Every integer of a repr lies within ±kMaxSize, except a BigBird seed and GlobalTokens' index list.
void check_sizes(const std::string& repr) {
  int in_list = 0;
  for (size_t i = 0; i < repr.size();) {
    const char c = repr[i];
    if (c == '\'' || c == '"') {  // a string argument
      const size_t close = repr.find(c, i + 1);
      i = close == std::string::npos ? repr.size() : close + 1;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {  // a name such as Neighborhood2D
      while (i < repr.size() && is_name_char(repr[i])) ++i;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '-') {
      in_list += c == '[' ? 1 : c == ']' ? -1 : 0;
      ++i;
      continue;
    }
    const size_t start = i++;
    while (i < repr.size() && (std::isdigit(static_cast<unsigned char>(repr[i])) || std::strchr(".eE+-", repr[i]))) ++i;
    const std::string number = repr.substr(start, i - start);
    const bool is_float = number.find_first_of(".eE") != std::string::npos;
    const bool is_seed = start >= 5 && repr.compare(start - 5, 5, "seed=") == 0;
    if (is_float || is_seed || in_list > 0) continue;
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec != std::errc() || end != number.data() + number.size() || v > kMaxSize || v < -kMaxSize)
      finding("the accepted pattern ", repr, " holds ", number, ", outside ±(2^31 - 1)");
  }
}

// Lq = Lk = height * width of the first 2-D pattern in the repr, 0 if there is none.
int64_t grid_length(const std::string& repr) {
  for (const char* name : {"Neighborhood2D(", "WindowAttention2D("}) {
    const size_t at = repr.find(name);
    if (at == std::string::npos) continue;
    char* end = nullptr;
    const int64_t height = std::strtoll(repr.c_str() + at + std::strlen(name), &end, 10);
    const int64_t width = std::strtoll(end + 1, nullptr, 10);  // after the ','
    return height * width;
  }
  return 0;
}

// The block mask against allowed() on a few small lengths (none for content-adaptive patterns, whose
// check_lengths refuses every length).
void check_block_masks(const Pattern& p, const std::string& repr) {
  struct Lengths {
    int64_t lq, lk, block;
  };
  std::vector<Lengths> cases = {{37, 37, 7}, {20, 45, 16}, {45, 20, 5}, {1, 50, 3}};
  if (const int64_t n = grid_length(repr); n >= 1 && n <= 144) cases.push_back({n, n, 4});
  const int64_t heads = p.head_dependent() ? 2 : 1;
  const int64_t nodes = std::count(repr.begin(), repr.end(), '(');
  for (const Lengths& c : cases) {
    if (c.lq * c.lk * heads * nodes > kMaxPredicateCalls) continue;
    if (!accepted([&] { p.check_lengths(c.lq, c.lk); })) continue;
    const std::string why = sattn::sparse::block_mask_mismatch(p, c.lq, c.lk, heads, c.block, /*exact=*/false);
    if (!why.empty()) finding("block_mask disagrees with allowed(): ", why);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  Pattern p;
  if (!accepted([&] { p = Pattern::parse(spec); })) return 0;
  if (spec.size() > kMaxSpecChars)
    finding("a spec of ", spec.size(), " characters was accepted (at most ", kMaxSpecChars, ")");
  if (const int depth = paren_depth(spec); depth > kMaxDepth + kLeafParentheses)
    finding("a spec ", depth, " parentheses deep was accepted (at most ", kMaxDepth + kLeafParentheses, ")");
  const std::string repr = p.repr();
  check_sizes(repr);
  Pattern again;
  if (!accepted([&] { again = Pattern::parse(repr); })) finding("parse(repr(p)) refused the repr ", repr);
  if (!(again == p)) finding("parse(repr(p)) != p: ", repr, " became ", again.repr());
  check_block_masks(p, repr);
  return 0;
}
