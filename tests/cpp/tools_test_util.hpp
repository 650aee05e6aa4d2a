// Helpers shared by the viz/doctor tests: random tensors, PNG decoding, a small XML well-formedness check,
// and running the `sattn` binary.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "sattn/error.hpp"
#include "sattn/sr.hpp"
#include "sattn/tensor.hpp"

namespace sattn::testing_tools {

inline Tensor randn(Shape shape, uint32_t seed, double scale = 1.0) {
  Tensor t(DType::kF32, std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  float* p = t.data<float>();
  for (int64_t n = 0; n < t.numel(); ++n) p[n] = float(scale) * dist(gen);
  return t;
}

struct Decoded {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  bool ok = false;
  bool non_constant() const {
    for (size_t p = 3; p + 2 < rgb.size(); p += 3)
      if (rgb[p] != rgb[0] || rgb[p + 1] != rgb[1] || rgb[p + 2] != rgb[2]) return true;
    return false;
  }
  int distinct_colours() const {
    std::vector<uint32_t> c;
    for (size_t p = 0; p + 2 < rgb.size(); p += 3)
      c.push_back(uint32_t(rgb[p]) << 16 | uint32_t(rgb[p + 1]) << 8 | rgb[p + 2]);
    std::sort(c.begin(), c.end());
    return int(std::unique(c.begin(), c.end()) - c.begin());
  }
};

inline Decoded decode_png_bytes(const std::vector<uint8_t>& bytes) {
  Decoded d;
  try {
    sr::Image im = sr::decode_image(bytes.data(), bytes.size(), "png bytes");
    d.width = int(im.width), d.height = int(im.height);
    d.rgb = std::move(im.data);
    d.ok = true;
  } catch (const Error&) {
  }
  return d;
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline Decoded decode_png_file(const std::string& path) {
  const auto bytes = read_bytes(path);
  // PNG signature first: a file that merely decodes as "something" is not enough.
  static const uint8_t kSig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() < 8 || !std::equal(kSig, kSig + 8, bytes.begin())) return {};
  return decode_png_bytes(bytes);
}

// Checks that every tag is closed in order and attribute quotes balance. Returns "" when well formed.
inline std::string xml_problem(const std::string& s) {
  std::vector<std::string> stack;
  size_t i = 0;
  while ((i = s.find('<', i)) != std::string::npos) {
    const size_t end = s.find('>', i);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(i);
    std::string tag = s.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty()) return "empty tag";
    if (tag[0] == '?' || tag[0] == '!') continue;
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return "unbalanced quotes in <" + tag + ">";
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) return "unexpected </" + name + ">";
      stack.pop_back();
      continue;
    }
    if (tag.back() == '/') continue;
    stack.push_back(tag.substr(0, tag.find_first_of(" \t\n")));
  }
  if (!stack.empty()) return "unclosed <" + stack.back() + ">";
  return "";
}

inline size_t count_of(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

// A fresh directory under the test temp dir.
inline std::string temp_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::filesystem::path p = std::filesystem::path(::testing::TempDir()) /
                            ("sattn_" + name + "_" + info->name() + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

struct RunResult {
  int code = -1;
  std::string out, err;
};

// Runs `$SATTN_BINARY_DIR/sattn args`, capturing stdout and stderr (stdout/stderr are files, not terminals).
// The build directory: $SATTN_BINARY_DIR (set by ctest), else the one this test binary was configured in.
inline std::string binary_dir() {
  if (const char* bin = std::getenv("SATTN_BINARY_DIR"); bin && *bin) return bin;
#ifdef SATTN_TEST_BINARY_DIR
  return SATTN_TEST_BINARY_DIR;
#else
  return ".";
#endif
}

inline RunResult run_sattn(const std::string& args, const std::string& dir) {
  const std::string exe = binary_dir() + "/sattn";
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const std::string cmd = "cd '" + dir + "' && '" + exe + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

inline bool have_binary() { return std::filesystem::exists(binary_dir() + "/sattn"); }

}  // namespace sattn::testing_tools
