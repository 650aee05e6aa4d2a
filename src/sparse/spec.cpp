// Pattern specs: the Python constructor syntax, e.g.
//   "Neighborhood2D(64, 64, 7, dilation=2) | GlobalTokens([0], SlidingWindow(8, 8))"
// Grammar (Python precedence: & binds tighter than |):
//   expr  := term ('|' term)*          term := atom ('&' atom)*
//   atom  := '(' expr ')' | Name '(' [arg (',' arg)*] ')'
//   arg   := [ident '='] value         value := int | float | 'string' | "string" | True | False | [int, ...] | expr
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>

#include "sattn/error.hpp"
#include "sparse/pattern_node.hpp"

namespace sattn::sparse {

namespace {

struct Value {
  enum Kind { kInt, kFloat, kStr, kBool, kList, kTuple, kPattern } kind = kInt;
  std::vector<double> tuple;
  int64_t i = 0;
  // kInt: whether the integer fits int64 (then it is `i`) and whether it fits uint64 (then it is `u`).
  bool in_int64 = true, in_uint64 = true;
  uint64_t u = 0;
  double f = 0;
  std::string s;  // kStr: the string; kInt, kFloat: the number as written
  std::vector<int64_t> list;
  Pattern p;
  size_t pos = 0;
};

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The length of a non-finite float literal at t[pos] (Python's repr: nan, inf, -inf; also +inf, infinity, any
// case), or 0.
size_t special_float_length(const std::string& t, size_t pos, double& value) {
  size_t x = pos;
  double sign = 1.0;
  if (x < t.size() && (t[x] == '-' || t[x] == '+')) sign = t[x++] == '-' ? -1.0 : 1.0;
  size_t e = x;
  while (e < t.size() && is_name_char(t[e])) ++e;
  std::string word = t.substr(x, e - x);
  for (char& c : word) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (word == "nan") value = std::numeric_limits<double>::quiet_NaN();
  else if (word == "inf" || word == "infinity") value = sign * std::numeric_limits<double>::infinity();
  else return 0;
  return e - pos;
}

class Parser {
 public:
  explicit Parser(const std::string& text) : t_(text) {}

  Pattern parse() {
    if (t_.size() > kMaxSpecLength)
      fail(ErrorKind::kInvalidArgument, "pattern spec: expected at most ", kMaxSpecLength, " characters, got ",
           t_.size());
    skip();
    if (at_end()) error("empty pattern spec", 0);
    Pattern p = expr();
    skip();
    if (!at_end()) error(sattn::message::concat("unexpected '", t_[i_], "'"), i_);
    return p;
  }

 private:
  const std::string& t_;
  size_t i_ = 0;
  int depth_ = 0;  // open parentheses and nested pattern arguments

  // One line: the message, the position and the text there.
  [[noreturn]] void error(const std::string& msg, size_t pos) const {
    const size_t shown = 24;
    std::string near;
    if (pos < t_.size()) {
      near = t_.substr(pos, shown);
      for (char& c : near)
        if (std::iscntrl(static_cast<unsigned char>(c))) c = ' ';
      near = sattn::message::concat(" (near \"", near, pos + shown < t_.size() ? "...\")" : "\")");
    }
    fail(ErrorKind::kInvalidArgument, "pattern spec: ", msg, " at position ", pos, near);
  }
  // Counts one more level of nesting while alive (at most kMaxPatternDepth, so the parser's recursion is bounded).
  struct Nesting {
    Parser& parser;
    Nesting(Parser& p, size_t pos) : parser(p) {
      if (++parser.depth_ > kMaxPatternDepth)
        parser.error(sattn::message::concat("expected patterns nested at most ", kMaxPatternDepth, " deep"), pos);
    }
    ~Nesting() { --parser.depth_; }
  };
  // a | b or a & b, an error at the operator's position (a tree nested too deep).
  Pattern combine(const Pattern& a, const Pattern& b, char op, size_t pos) const {
    try {
      return op == '|' ? a | b : a & b;
    } catch (const Error& e) {
      error(e.what(), pos);
    }
  }
  bool at_end() const { return i_ >= t_.size(); }
  void skip() {
    while (!at_end() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
  }
  bool peek(char c) {
    skip();
    return !at_end() && t_[i_] == c;
  }
  void expect(char c) {
    skip();
    if (at_end()) error(sattn::message::concat("expected '", c, "', got the end of the spec"), i_);
    if (t_[i_] != c) error(sattn::message::concat("expected '", c, "', got '", t_[i_], "'"), i_);
    ++i_;
  }
  std::string ident() {
    skip();
    const size_t s = i_;
    while (!at_end() && (std::isalnum(static_cast<unsigned char>(t_[i_])) || t_[i_] == '_')) ++i_;
    if (s == i_)
      error(at_end() ? "expected a name, got the end of the spec"
                     : sattn::message::concat("expected a name, got '", t_[i_], "'"),
            s);
    return t_.substr(s, i_ - s);
  }

  Pattern expr() {
    Pattern p = term();
    while (peek('|')) {
      const size_t op_pos = i_++;
      p = combine(p, term(), '|', op_pos);
    }
    return p;
  }
  Pattern term() {
    Pattern p = atom();
    while (peek('&')) {
      const size_t op_pos = i_++;
      p = combine(p, atom(), '&', op_pos);
    }
    return p;
  }
  Pattern atom() {
    skip();
    if (peek('(')) {
      const Nesting nesting(*this, i_);
      ++i_;
      Pattern p = expr();
      expect(')');
      return p;
    }
    const size_t name_pos = i_;
    if (at_end() || !(std::isalpha(static_cast<unsigned char>(t_[i_])) || t_[i_] == '_'))
      error(at_end() ? "expected a pattern, got the end of the spec"
                     : sattn::message::concat("expected a pattern, got '", t_[i_], "'"),
            i_);
    const std::string name = ident();
    expect('(');
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keywords;
    if (!peek(')')) {
      while (true) {
        skip();
        // keyword?
        size_t save = i_;
        if (!at_end() && (std::isalpha(static_cast<unsigned char>(t_[i_])) || t_[i_] == '_')) {
          const std::string id = ident();
          if (peek('=')) {
            ++i_;
            keywords.emplace_back(id, value());
          } else {
            i_ = save;
            if (!keywords.empty()) error("positional argument after a keyword argument", save);
            positional.push_back(value());
          }
        } else {
          if (!keywords.empty()) error("positional argument after a keyword argument", save);
          positional.push_back(value());
        }
        if (peek(',')) {
          ++i_;
          if (peek(')')) break;  // trailing comma
          continue;
        }
        break;
      }
    }
    expect(')');
    return construct(name, name_pos, positional, keywords);
  }

  Value value() {
    skip();
    Value v;
    v.pos = i_;
    if (at_end()) error("expected a value, got the end of the spec", i_);
    const char c = t_[i_];
    if (c == '\'' || c == '"') {
      ++i_;
      const size_t s = i_;
      while (!at_end() && t_[i_] != c) ++i_;
      if (at_end()) error("unterminated string", v.pos);
      v.kind = Value::kStr;
      v.s = t_.substr(s, i_ - s);
      ++i_;
      return v;
    }
    if (c == '[') {
      ++i_;
      v.kind = Value::kList;
      if (peek(']')) {
        ++i_;
        return v;
      }
      while (true) {
        Value x = value();
        if (x.kind != Value::kInt || !x.in_int64)
          error(sattn::message::concat("expected a 64-bit integer in the list, got ", describe(x)), x.pos);
        v.list.push_back(x.i);
        if (peek(',')) {
          ++i_;
          if (peek(']')) break;
          continue;
        }
        break;
      }
      expect(']');
      return v;
    }
    if (const size_t n = special_float_length(t_, i_, v.f)) {
      v.kind = Value::kFloat;
      v.s = t_.substr(i_, n);
      i_ += n;
      return v;
    }
    if (std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '+' || c == '.') {
      const size_t s = i_;
      ++i_;
      bool is_float = c == '.';
      while (!at_end() &&
             (std::isdigit(static_cast<unsigned char>(t_[i_])) || t_[i_] == '.' || t_[i_] == 'e' || t_[i_] == 'E' ||
              ((t_[i_] == '-' || t_[i_] == '+') && (t_[i_ - 1] == 'e' || t_[i_ - 1] == 'E')))) {
        if (t_[i_] == '.' || t_[i_] == 'e' || t_[i_] == 'E') is_float = true;
        ++i_;
      }
      v.s = t_.substr(s, i_ - s);
      if (is_float) {
        v.kind = Value::kFloat;
        try {
          size_t used = 0;
          v.f = std::stod(v.s, &used);
          if (used != v.s.size()) throw std::invalid_argument(v.s);
        } catch (const std::out_of_range&) {
          error(sattn::message::concat("number '", v.s, "' is out of the range of a double"), s);
        } catch (const std::exception&) {
          error(sattn::message::concat("malformed number '", v.s, "'"), s);
        }
      } else {
        parse_integer(v, s);
      }
      return v;
    }
    // A tuple of numbers, e.g. logits=(0.5, -1)?
    if (c == '(') {
      size_t look = i_ + 1;
      while (look < t_.size() && std::isspace(static_cast<unsigned char>(t_[look]))) ++look;
      double unused;
      if (look < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[look])) || t_[look] == '-' ||
                               t_[look] == '+' || t_[look] == '.' || special_float_length(t_, look, unused))) {
        ++i_;
        v.kind = Value::kTuple;
        while (true) {
          Value x = value();
          if (x.kind != Value::kInt && x.kind != Value::kFloat) error("expected a number in the tuple", x.pos);
          v.tuple.push_back(as_double(x));
          if (peek(',')) {
            ++i_;
            if (peek(')')) break;
            continue;
          }
          break;
        }
        expect(')');
        return v;
      }
    }
    // True / False or a nested pattern.
    const size_t s = i_;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '(' || c == '_') {
      if (c != '(') {
        const std::string id = ident();
        if (id == "True" || id == "False") {
          v.kind = Value::kBool;
          v.i = id == "True";
          return v;
        }
        i_ = s;
      }
      v.kind = Value::kPattern;
      const Nesting nesting(*this, i_);
      v.p = expr();
      return v;
    }
    error(sattn::message::concat("unexpected '", c, "'"), i_);
  }

  struct Param {
    const char* name;
    bool required;
  };

  // Binds arguments to parameter names; reports unknown, duplicate and missing arguments with positions.
  std::map<std::string, Value> bind(const std::string& name, size_t name_pos, const std::vector<Param>& params,
                                    const std::vector<Value>& positional,
                                    const std::vector<std::pair<std::string, Value>>& keywords) const {
    std::map<std::string, Value> out;
    if (positional.size() > params.size())
      error(sattn::message::concat(name, "() takes at most ", params.size(), " arguments, got ", positional.size()),
            positional[params.size()].pos);
    for (size_t x = 0; x < positional.size(); ++x) out[params[x].name] = positional[x];
    for (const auto& [k, v] : keywords) {
      bool known = false;
      for (const auto& p : params) known = known || k == p.name;
      if (!known) error(sattn::message::concat(name, "() has no argument '", k, "'"), v.pos);
      if (out.count(k)) error(sattn::message::concat(name, "() got argument '", k, "' twice"), v.pos);
      out[k] = v;
    }
    for (const auto& p : params)
      if (p.required && !out.count(p.name))
        error(sattn::message::concat(name, "() is missing the argument '", p.name, "'"), name_pos);
    return out;
  }

  // An integer literal (digits with an optional sign) into v (kInt).
  void parse_integer(Value& v, size_t pos) const {
    v.kind = Value::kInt;
    const bool negative = v.s[0] == '-';
    const size_t digits = v.s[0] == '-' || v.s[0] == '+' ? 1 : 0;
    const char* end = v.s.data() + v.s.size();
    uint64_t magnitude = 0;
    const auto [ptr, ec] = std::from_chars(v.s.data() + digits, end, magnitude);
    if (ptr != end || (ec != std::errc() && ec != std::errc::result_out_of_range))
      error(sattn::message::concat("malformed number '", v.s, "'"), pos);
    const uint64_t int64_limit = uint64_t(std::numeric_limits<int64_t>::max()) + (negative ? 1 : 0);
    v.in_uint64 = ec == std::errc() && (!negative || magnitude == 0);
    v.in_int64 = ec == std::errc() && magnitude <= int64_limit;
    v.u = v.in_uint64 ? magnitude : 0;
    if (v.in_int64) v.i = negative ? int64_t(0 - magnitude) : int64_t(magnitude);
  }
  // A number as a double (an integer beyond the double range: +-inf, which the constructors refuse).
  static double as_double(const Value& v) { return v.kind == Value::kFloat ? v.f : std::strtod(v.s.c_str(), nullptr); }
  static std::string describe(const Value& v) {
    switch (v.kind) {
      case Value::kInt:
      case Value::kFloat: return v.s;
      case Value::kStr: return "'" + v.s + "'";
      case Value::kBool: return v.i ? "True" : "False";
      case Value::kList: return "a list";
      case Value::kTuple: return "a tuple";
      case Value::kPattern: return "a pattern";
    }
    return "?";
  }
  int64_t get_int(const std::map<std::string, Value>& a, const char* k, int64_t dflt) const {
    auto it = a.find(k);
    if (it == a.end()) return dflt;
    const Value& v = it->second;
    if (v.kind == Value::kBool) return v.i;
    if (v.kind != Value::kInt)
      error(sattn::message::concat("argument '", k, "': expected an integer, got ", describe(v)), v.pos);
    if (!v.in_int64)
      error(sattn::message::concat("argument '", k, "': expected an integer in ", std::numeric_limits<int64_t>::min(),
                                   "..", std::numeric_limits<int64_t>::max(), ", got ", v.s),
            v.pos);
    return v.i;
  }
  uint64_t get_uint64(const std::map<std::string, Value>& a, const char* k, uint64_t dflt) const {
    auto it = a.find(k);
    if (it == a.end()) return dflt;
    const Value& v = it->second;
    if (v.kind != Value::kInt)
      error(sattn::message::concat("argument '", k, "': expected an integer, got ", describe(v)), v.pos);
    if (!v.in_uint64)
      error(sattn::message::concat("argument '", k, "': expected an integer in 0..",
                                   std::numeric_limits<uint64_t>::max(), ", got ", v.s),
            v.pos);
    return v.u;
  }
  bool get_bool(const std::map<std::string, Value>& a, const char* k, bool dflt) const {
    auto it = a.find(k);
    if (it == a.end()) return dflt;
    const Value& v = it->second;
    if (v.kind != Value::kBool && !(v.kind == Value::kInt && v.in_int64 && (v.i == 0 || v.i == 1)))
      error(sattn::message::concat("argument '", k, "': expected True or False, got ", describe(v)), v.pos);
    return v.i != 0;
  }
  double get_double(const std::map<std::string, Value>& a, const char* k, double dflt) const {
    auto it = a.find(k);
    if (it == a.end()) return dflt;
    const Value& v = it->second;
    if (v.kind == Value::kInt) return as_double(v);
    if (v.kind != Value::kFloat)
      error(sattn::message::concat("argument '", k, "': expected a number, got ", describe(v)), v.pos);
    return v.f;
  }
  std::string get_str(const std::map<std::string, Value>& a, const char* k, const std::string& dflt) const {
    auto it = a.find(k);
    if (it == a.end()) return dflt;
    if (it->second.kind != Value::kStr)
      error(sattn::message::concat("argument '", k, "': expected a string"), it->second.pos);
    return it->second.s;
  }
  Alignment get_alignment(const std::map<std::string, Value>& a) const {
    auto it = a.find("alignment");
    if (it == a.end()) return Alignment::kBottomRight;
    const Value& v = it->second;
    if (v.kind != Value::kStr ||
        (v.s != "top_left" && v.s != "bottom_right" && v.s != "top-left" && v.s != "bottom-right"))
      error("argument 'alignment': expected 'bottom_right' or 'top_left'", v.pos);
    return v.s == "top_left" || v.s == "top-left" ? Alignment::kTopLeft : Alignment::kBottomRight;
  }
  const Pattern& get_pattern(const std::map<std::string, Value>& a, const char* k) const {
    const Value& v = a.at(k);
    if (v.kind != Value::kPattern) error(sattn::message::concat("argument '", k, "': expected a pattern"), v.pos);
    return v.p;
  }

  Pattern construct(const std::string& name, size_t pos, const std::vector<Value>& positional,
                    const std::vector<std::pair<std::string, Value>>& keywords) {
    try {
      if (name == "SlidingWindow") {
        auto a = bind(name, pos, {{"left", true}, {"right", true}, {"alignment", false}}, positional, keywords);
        return SlidingWindow(get_int(a, "left", 0), get_int(a, "right", 0), get_alignment(a));
      }
      if (name == "Dilated") {
        auto a = bind(name, pos, {{"window", true}, {"dilation", true}, {"alignment", false}}, positional, keywords);
        return Dilated(get_int(a, "window", 0), get_int(a, "dilation", 1), get_alignment(a));
      }
      if (name == "BlockLocal") {
        auto a = bind(name, pos, {{"block", true}, {"alignment", false}}, positional, keywords);
        return BlockLocal(get_int(a, "block", 1), get_alignment(a));
      }
      if (name == "GlobalTokens") {
        auto a = bind(name, pos, {{"indices", true}, {"base", true}, {"alignment", false}}, positional, keywords);
        const Value& iv = a.at("indices");
        std::vector<int64_t> idx;
        if (iv.kind == Value::kList) idx = iv.list;
        else if (iv.kind == Value::kInt) idx = {get_int(a, "indices", 0)};
        else error("argument 'indices': expected a list of integers", iv.pos);
        return GlobalTokens(idx, get_pattern(a, "base"), get_alignment(a));
      }
      if (name == "BigBird") {
        auto a = bind(name, pos,
                      {{"block", true},
                       {"window_blocks", true},
                       {"global_blocks", true},
                       {"random_blocks", true},
                       {"seed", false},
                       {"alignment", false}},
                      positional, keywords);
        return BigBird(get_int(a, "block", 1), get_int(a, "window_blocks", 0), get_int(a, "global_blocks", 0),
                       get_int(a, "random_blocks", 0), get_uint64(a, "seed", 0), get_alignment(a));
      }
      if (name == "Neighborhood2D") {
        auto a = bind(name, pos,
                      {{"height", true}, {"width", true}, {"kernel", true}, {"dilation", false}, {"causal", false}},
                      positional, keywords);
        return Neighborhood2D(get_int(a, "height", 0), get_int(a, "width", 0), get_int(a, "kernel", 0),
                              get_int(a, "dilation", 1), get_bool(a, "causal", false));
      }
      if (name == "WindowAttention2D") {
        auto a = bind(name, pos, {{"height", true}, {"width", true}, {"window", true}, {"shift", false}}, positional,
                      keywords);
        return WindowAttention2D(get_int(a, "height", 0), get_int(a, "width", 0), get_int(a, "window", 0),
                                 get_int(a, "shift", 0));
      }
      if (name == "TopK") {
        auto a = bind(name, pos, {{"k", true}}, positional, keywords);
        return TopK(get_int(a, "k", 1));
      }
      if (name == "BlockTopK") {
        auto a = bind(name, pos, {{"block", true}, {"k_blocks", true}, {"local", false}, {"causal", false}}, positional,
                      keywords);
        return BlockTopK(get_int(a, "block", 1), get_int(a, "k_blocks", 1), get_bool(a, "local", true),
                         get_bool(a, "causal", false));
      }
      if (name == "ReLUAttention") {
        auto a = bind(name, pos, {{"power", false}, {"normalize", false}}, positional, keywords);
        return ReLUAttention(get_double(a, "power", 2.0), get_str(a, "normalize", "none"));
      }
      if (name == "MixedAttention") {
        auto a = bind(name, pos, {{"logits", false}}, positional, keywords);
        double l1 = 0.0, l2 = 0.0;
        if (auto it = a.find("logits"); it != a.end()) {
          if (it->second.kind != Value::kTuple || it->second.tuple.size() != 2)
            error("argument 'logits': expected a pair of numbers (a1, a2)", it->second.pos);
          l1 = it->second.tuple[0];
          l2 = it->second.tuple[1];
        }
        return MixedAttention(l1, l2);
      }
      if (name == "Full") {
        bind(name, pos, {}, positional, keywords);
        return Full();
      }
    } catch (const Error& e) {
      if (std::string(e.what()).rfind("pattern spec:", 0) == 0) throw;
      error(e.what(), pos);
    }
    error(
        sattn::message::concat("unknown pattern '", name,
                               "' (expected SlidingWindow, Dilated, BlockLocal, GlobalTokens, BigBird, Neighborhood2D, "
                               "WindowAttention2D, Full, TopK, BlockTopK, ReLUAttention or MixedAttention)"),
        pos);
  }
};

}  // namespace

Pattern Pattern::parse(const std::string& spec) { return Parser(spec).parse(); }

}  // namespace sattn::sparse
