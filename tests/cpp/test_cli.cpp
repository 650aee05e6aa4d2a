// The `sattn` command (built next to the tests, or in $SATTN_BINARY_DIR): --help texts, a good `attn`
// run compared bitwise with the library, `demo`, `version`, and bad inputs -> exit 2 with a message on stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <hwy/highway.h>
#include <nlohmann/json.hpp>

#include "oracle.hpp"
#include "sattn/attention.hpp"
#include "sattn/io.hpp"
#include "sattn/sr.hpp"

namespace fs = std::filesystem;
using sattn::DType;
using sattn::Tensor;

namespace {

struct CliRun {
  int code = -1;
  std::string out, err;
};

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    // SATTN_BINARY_DIR, else the directory of this test binary (both live in the build directory).
    const char* dir = std::getenv("SATTN_BINARY_DIR");
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    binary_ = (dir && *dir ? fs::path(dir) : self.parent_path()) / "sattn";
    if (!fs::exists(binary_)) GTEST_SKIP() << binary_ << " was not built (SATTN_BUILD_CLI=OFF?)";
    tmp_ = fs::path(::testing::TempDir()) / ("sattn_cli_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(tmp_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!tmp_.empty()) fs::remove_all(tmp_, ec);
  }

  std::string path(const std::string& name) const { return (tmp_ / name).string(); }

  // env: an optional `env ...` prefix for the command
  CliRun run(const std::string& args, const std::string& env = "") const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd =
        env + (env.empty() ? "" : " ") + "'" + binary_.string() + "' " + args + " >'" + out + "' 2>'" + err + "'";
    const int status = std::system(cmd.c_str());
    CliRun r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  static std::string slurp(const std::string& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  // Writes q/k/v (and masks) of a generated problem and returns the problem.
  sattn::testing::Problem write_problem(const sattn::testing::Config& c) const {
    auto p = sattn::testing::make_problem(c, DType::kF32, 9);
    sattn::write_npy(path("q.npy"), p.q);
    sattn::write_npy(path("k.npy"), p.k);
    sattn::write_npy(path("v.npy"), p.v);
    if (p.options.attn_mask.data) sattn::write_npy(path("mask.npy"), p.options.attn_mask);
    if (p.options.key_padding_mask.data) sattn::write_npy(path("kpm.npy"), p.options.key_padding_mask);
    if (p.options.key_lengths.data) sattn::write_npy(path("len.npy"), p.options.key_lengths);
    return p;
  }

  std::string qkv() const { return "--q " + path("q.npy") + " --k " + path("k.npy") + " --v " + path("v.npy"); }

  fs::path binary_, tmp_;
};

bool same(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace

TEST_F(Cli, HelpOfEverySubcommand) {
  CliRun r = run("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* sub : {"attn", "demo", "version"}) EXPECT_NE(r.out.find(sub), std::string::npos) << r.out;
  r = run("attn --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("True = may attend"), std::string::npos) << "mask polarity must be stated: " << r.out;
  EXPECT_NE(r.out.find("True = padding"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bottom-right"), std::string::npos) << r.out;
  r = run("demo --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--len"), std::string::npos);
  r = run("version --help");
  EXPECT_EQ(r.code, 0);
  r = run("version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("reference"), std::string::npos) << r.out;
  r = run("");
  EXPECT_EQ(r.code, 2) << "no subcommand";
  r = run("frobnicate");
  EXPECT_EQ(r.code, 2);
}

TEST_F(Cli, BenchSgemmPeerUsesTheCpusKernels) {
  // OpenBLAS falls back to its Prescott (SSE3) kernels where a VM hides the CPU model; `sattn bench` then re-runs
  // itself with OPENBLAS_CORETYPE from the CPU's features, so its SGEMM peer is the machine's real one. An
  // explicit OPENBLAS_CORETYPE is respected. (Without OpenBLAS there is no core name and nothing to check.)
  const std::string args = "bench --dims 8 --lens 16 --masks full --passes fwd --threads 1 --reps 1 --sgemm-n 64";
  auto core_of = [](const std::string& out) {  // "... GFLOP/s (OpenBLAS <core>)  simd=..."
    const size_t p = out.find("(OpenBLAS ");
    if (p == std::string::npos) return std::string();
    return out.substr(p + 10, out.find(')', p) - (p + 10));
  };
  const CliRun r = run(args, "env -u OPENBLAS_CORETYPE");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string core = core_of(r.out);
  if (core.empty()) GTEST_SKIP() << "no OpenBLAS: " << r.out;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_NE(core, "Prescott") << r.out;
  }
  const CliRun forced = run(args, "env OPENBLAS_CORETYPE=Prescott");
  ASSERT_EQ(forced.code, 0) << forced.err;
  EXPECT_EQ(core_of(forced.out), "Prescott") << forced.out;
}

// The header and every JSON row name the dtype and float32_precision that ran; a bad precision is refused by name.
TEST_F(Cli, BenchNamesTheFloat32Precision) {
  const std::string args = "bench --dims 16 --lens 32 --masks full --passes fwd --threads 1 --reps 1 --sgemm-n 0";
  CliRun r = run(args + " --float32-precision high");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("dtype=f32  float32_precision=high"), std::string::npos) << r.out;
  r = run(args + " --float32-precision high --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json rows = nlohmann::json::parse(r.out);
  const auto attention = std::find_if(rows.begin(), rows.end(), [](const auto& x) { return x["kind"] == "attention"; });
  ASSERT_NE(attention, rows.end()) << r.out;
  EXPECT_EQ((*attention)["float32_precision"], "high") << r.out;
  r = run(args + " --float32-precision medium");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--float32-precision: expected 'highest', 'high' or 'bf16', got 'medium'"), std::string::npos)
      << r.err;
}

TEST_F(Cli, BenchReportsTheFmaLimitAndEachRowsShareOfIt) {
  const CliRun r = run("bench --dims 8 --lens 16 --masks full --passes fwd --threads 1 --reps 1 --sgemm-n 0 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json rows = nlohmann::json::parse(r.out);
  const auto limit = std::find_if(rows.begin(), rows.end(), [](const auto& x) { return x["kind"] == "fma_limit"; });
  ASSERT_NE(limit, rows.end()) << r.out;
  const double gflops = (*limit)["gflops"];
  const auto attention = std::find_if(rows.begin(), rows.end(), [](const auto& x) { return x["kind"] == "attention"; });
  ASSERT_NE(attention, rows.end()) << r.out;
  if ((*limit)["simd"] == "portable") {
    EXPECT_EQ(gflops, 0.0) << r.out;
    return;
  }
  ASSERT_GT(gflops, 0.0) << r.out;
  const double row_gflops = (*attention)["gflops"], pct = (*attention)["pct_fma_limit"];
  EXPECT_NEAR(pct, 100.0 * row_gflops / gflops, 1e-9 * pct) << r.out;
  const CliRun table = run("bench --dims 8 --lens 16 --masks full --passes fwd --threads 1 --reps 1 --sgemm-n 0");
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("FMA limit: "), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("sgemm skipped (--sgemm-n 0)"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("%fma"), std::string::npos) << table.out;
}

TEST_F(Cli, OnlyTheBenchmarksOpenTheBlas) {
  // The BLAS (the benchmarks' SGEMM peer) is opened at run time by bench / sparse-bench alone: OpenBLAS's thread pool
  // spins for its first ~0.1 s beside the kernels' threads of any process that loads it. glibc's loader names every
  // library it opens under LD_DEBUG=files.
  auto opens_blas = [](const std::string& err) { return err.find("blas") != std::string::npos; };
  const CliRun plain = run("version", "env LD_DEBUG=files");
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_NE(plain.err.find("libc.so"), std::string::npos) << "LD_DEBUG gave no file list: " << plain.err;
  EXPECT_FALSE(opens_blas(plain.err)) << plain.err;
  const CliRun bench =
      run("bench --dims 8 --lens 16 --masks full --passes fwd --threads 1 --reps 1 --sgemm-n 64", "env LD_DEBUG=files");
  ASSERT_EQ(bench.code, 0) << bench.err;
  if (bench.out.find("sgemm N=64: 0.0 GFLOP/s") != std::string::npos) GTEST_SKIP() << "no BLAS: " << bench.out;
  EXPECT_TRUE(opens_blas(bench.err)) << bench.out;
}

TEST_F(Cli, HighwaysBenchmarkTimerIsNotCalibratedAtStartUp) {
  // libhwy 1.0.x's load-time initialiser calibrates its nanobenchmark timer (~5 ms of every process on a VM); the
  // sattn executable defines the function it calls (tools/cli/hwy_timer.cpp), and glibc binds libhwy's call to it.
#if HWY_MAJOR == 1 && HWY_MINOR == 0 && defined(__x86_64__) && defined(__linux__)
  const CliRun r = run("version", "env LD_DEBUG=bindings");
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.err);
  std::string line, binding;
  while (std::getline(lines, line))
    if (line.find("`_ZN3hwy8platform15TimerResolutionEv'") != std::string::npos) binding = line;
  ASSERT_FALSE(binding.empty()) << "libhwy bound no TimerResolution under LD_DEBUG=bindings";
  EXPECT_NE(binding.find("libhwy"), std::string::npos) << binding;
  EXPECT_NE(binding.find(" to " + binary_.string() + " ["), std::string::npos) << binding;
#else
  GTEST_SKIP() << "Highway " << HWY_MAJOR << "." << HWY_MINOR << " on this platform: no load-time calibration replaced";
#endif
}

TEST_F(Cli, AttnMatchesTheLibraryBitwise) {
  sattn::testing::Config c;
  c.batch = 2, c.heads_q = 4, c.heads_kv = 2, c.len_q = 9, c.len_k = 13, c.head_dim = 8, c.head_dim_v = 5;
  c.mask = sattn::testing::MaskCase::kBool2D;
  c.key_padding = sattn::KeyPaddingKind::kLengths;
  c.fully_masked = true;
  const auto p = write_problem(c);
  const CliRun r = run("attn " + qkv() + " --mask " + path("mask.npy") + " --lengths " + path("len.npy") +
                       " --causal bottom-right --scale 0.3 --dropout 0.2 --seed 7 --threads 2 --out " + path("o.npy") +
                       " --lse " + path("l.npy") + " --weights " + path("w.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  sattn::AttentionOptions o = p.options;
  o.causal = sattn::Causal::kBottomRight;
  o.scale = 0.3;
  o.dropout_p = 0.2;
  o.seed = 7;
  const auto lib = sattn::attention(p.q, p.k, p.v, o, true, true);
  EXPECT_TRUE(same(sattn::read_npy(path("o.npy")), lib.out));
  EXPECT_TRUE(same(sattn::read_npy(path("l.npy")), lib.lse));
  EXPECT_TRUE(same(sattn::read_npy(path("w.npy")), lib.weights));
}

TEST_F(Cli, AttnAdditiveMaskAndKeyPaddingAgainstTheOracle) {
  sattn::testing::Config c;
  c.batch = 1, c.heads_q = 2, c.heads_kv = 1, c.len_q = 6, c.len_k = 4, c.head_dim = 16, c.head_dim_v = 16;
  c.mask = sattn::testing::MaskCase::kAdd4D;
  c.key_padding = sattn::KeyPaddingKind::kBool;
  c.causal = sattn::Causal::kTopLeft;
  const auto p = write_problem(c);
  const CliRun r = run("attn " + qkv() + " --mask " + path("mask.npy") + " --key-padding " + path("kpm.npy") +
                       " --causal top-left --out " + path("o.npy") + " --lse " + path("l.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto ref = sattn::testing::naive_forward(p);
  EXPECT_TRUE(sattn::testing::all_close(sattn::read_npy(path("o.npy")), ref.out, 2e-5, "out"));
  EXPECT_TRUE(sattn::testing::all_close(sattn::read_npy(path("l.npy")), ref.lse, 2e-5, "lse"));
}

TEST_F(Cli, AttnBadInputsExit2WithAMessage) {
  sattn::testing::Config c;
  c.batch = 1, c.heads_q = 2, c.heads_kv = 2, c.len_q = 3, c.len_k = 4, c.head_dim = 8, c.head_dim_v = 8;
  write_problem(c);
  const std::string o = " --out " + path("o.npy");
  struct Case {
    std::string args, needle;
  };
  // A malformed file, a wrong shape, wrong dtypes.
  {
    std::ofstream(path("junk.npy")) << "not an npy file at all";
    sattn::write_npy(path("k_bad.npy"), Tensor(DType::kF32, {1, 2, 4, 7}));
    sattn::write_npy(path("mask_int.npy"), Tensor(DType::kI32, {3, 4}));
    sattn::write_npy(path("mask_shape.npy"), Tensor(DType::kBool, {3, 5}));
    sattn::write_npy(path("kpm_float.npy"), Tensor(DType::kF32, {1, 4}));
    sattn::write_npy(path("len_bad.npy"), Tensor(DType::kI64, {2}));
    sattn::write_npy(path("q_int.npy"), Tensor(DType::kI32, {1, 2, 3, 8}));
  }
  const std::vector<Case> cases = {
      {"attn --q " + path("missing.npy") + " --k " + path("k.npy") + " --v " + path("v.npy") + o, "cannot open"},
      {"attn --q " + path("junk.npy") + " --k " + path("k.npy") + " --v " + path("v.npy") + o, "bad magic"},
      {"attn --q " + path("q.npy") + " --k " + path("k_bad.npy") + " --v " + path("v.npy") + o, "key"},
      {"attn --q " + path("q_int.npy") + " --k " + path("k.npy") + " --v " + path("v.npy") + o, "--q"},
      {"attn " + qkv() + " --mask " + path("mask_int.npy") + o, "--mask"},
      {"attn " + qkv() + " --mask " + path("mask_shape.npy") + o, "does not broadcast"},
      {"attn " + qkv() + " --key-padding " + path("kpm_float.npy") + o, "True = padding"},
      {"attn " + qkv() + " --lengths " + path("len_bad.npy") + o, "key_lengths"},
      {"attn " + qkv() + " --key-padding " + path("kpm_float.npy") + " --lengths " + path("len_bad.npy") + o,
       "excludes"},
      {"attn " + qkv() + " --causal upper" + o, "--causal"},
      {"attn " + qkv() + " --dropout 1.5" + o, "dropout_p"},
      {"attn " + qkv() + " --kernel warp9" + o, "unknown kernel 'warp9'"},
      {"attn " + qkv(), "--out"},
      {"attn " + qkv() + " --bogus 1" + o, "--bogus"},
      {"attn " + qkv() + " --out " + path("no_such_dir/o.npy"), "--out: cannot write '" + path("no_such_dir/o.npy") +
                                                                    "': directory '" + path("no_such_dir") +
                                                                    "': No such file or directory"},
  };
  for (const auto& cs : cases) {
    const CliRun r = run(cs.args);
    EXPECT_EQ(r.code, 2) << cs.args << "\nstderr: " << r.err;
    EXPECT_NE(r.err.find(cs.needle), std::string::npos) << cs.args << "\nstderr: " << r.err;
  }
}

// Exit 2 and one line on stderr, "sattn: error: ...", containing every needle (the option and the value given).
void expect_one_line_error(const CliRun& r, const std::string& args, const std::vector<std::string>& needles) {
  EXPECT_EQ(r.code, 2) << args << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.rfind("sattn: error: ", 0), 0u) << args << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << args << " (one line)\nstderr: " << r.err;
  for (const std::string& needle : needles)
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": no '" << needle << "' in\n" << r.err;
}

// --threads: 0 (default) or 1 .. 1024 in every subcommand that has it; --seed: 0 .. 2^64-1 (never -1 read as
// 2^64-1); parse errors: one line naming the option and the value.
TEST_F(Cli, ThreadAndSeedRangesAndParseErrorsGiveOneLine) {
  sattn::testing::Config c;
  c.len_q = c.len_k = 4;
  write_problem(c);
  const std::string attn = "attn " + qkv() + " --out " + path("o.npy");
  const std::string sparse_bench = "sparse-bench --pattern 'SlidingWindow(1, 1)' --L 16 --H 1 --D 8 --reps 1";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {attn + " --threads -3", {"--threads", "-3", "1024"}},
      {attn + " --threads 100000", {"--threads", "100000"}},
      {attn + " --threads 1025", {"--threads", "1025"}},
      {attn + " --seed -1", {"--seed", "-1"}},
      {attn + " --seed 18446744073709551616", {"--seed", "18446744073709551616"}},
      {attn + " --bogus 1", {"--bogus"}},
      {"attn " + qkv(), {"--out"}},
      {"demo --attention --seed -1", {"--seed", "-1"}},
      {"demo --attention --threads 5000", {"--threads", "5000"}},
      {"sr upscale " + path("in.png") + " " + path("out.png") + " --scale 2 --threads -3", {"--threads", "-3"}},
      {"sr upscale " + path("in.png") + " " + path("out.png") + " --scale 2 --threads 100000", {"--threads", "100000"}},
      {"sr eval --scale 2 --data " + tmp_.string() + " --threads -1", {"--threads", "-1"}},
      {"sr upscale " + path("in.png") + " " + path("out.png") + " --scale 2 --png-compression 10",
       {"--png-compression", "10"}},
      {"sr downscale " + path("in.png") + " " + path("out.png") + " --scale 2 --png-compression -1",
       {"--png-compression", "-1"}},
      {"profile --L 16 --threads -2", {"--threads", "-2"}},
      {"bench --lens 16 --threads 1,-3", {"--threads", "-3"}},
      {"bench --lens 16 --threads 1,x", {"--threads", "1,x"}},
      {sparse_bench + " --threads 2000", {"--threads", "2000"}},
      {"frobnicate", {"frobnicate"}},
  };
  for (const auto& [args, needles] : cases) expect_one_line_error(run(args), args, needles);
}

// A size past the machine's memory gives one line naming the size, exit 2 (pattern sizes are bounded and run in
// the memory of the lengths, so the sizes that get this far are the tensors' own).
TEST_F(Cli, OutOfMemoryGivesOneLine) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "AddressSanitizer reports a huge allocation instead of failing it";
#endif
  const std::string args = "demo --attention --len 1000000000 --heads 64 --dim 64 --repeat 1";
  expect_one_line_error(run(args), args, {"cannot allocate", "float32[1, 64, 1000000000, 64]"});
}

TEST_F(Cli, DemoChecksAgainstTheReference) {
  CliRun r = run("demo --attention --len 48 --heads 2 --dim 16 --repeat 1 --causal bottom-right");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("kernel:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max error:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" ms"), std::string::npos) << r.out;
  // An impossible tolerance makes the check fail: exit 1.
  r = run("demo --attention --len 48 --heads 2 --dim 16 --repeat 1 --tol 1e-15");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("FAIL"), std::string::npos) << r.out;
  r = run("demo --attention --heads 3 --kv-heads 2 --len 8");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("multiple"), std::string::npos) << r.err;
}

// The default demo: x2 SR of the generated scene. The PNG must hold the four panels side by side, and its panels
// must agree with each other: LR = MATLAB downscale of the HR panel, panel 1 = LR nearest-upscaled, panel 2 =
// bicubic of LR, and the printed bicubic PSNR = psnr_y(panel 2, HR panel).
TEST_F(Cli, DemoUpscalesTheGeneratedScene) {
  const std::string png = path("demo.png");
  CliRun r = run("demo --size 128 --repeat 1 --threads 2 --out " + png);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  if (r.out.find("no x2 SR weights") != std::string::npos) {
    EXPECT_NE(r.out.find("PASS"), std::string::npos) << "the fallback must run the attention demo: " << r.out;
    GTEST_SKIP() << "built without SR weights: the attention demo ran instead";
  }
  for (const char* needle : {"PSNR (Y):", "bicubic", "model dense", "model sparse", "routed", "faster", "wrote:"})
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle << " missing in:\n" << r.out;
  const sattn::sr::Image im = sattn::sr::read_image(png);
  const int64_t s = 128, gap = 8, band = 7 + 2 * gap;  // label band: one line of scale-1 text
  ASSERT_EQ(im.width, 4 * s + 5 * gap);
  ASSERT_EQ(im.height, band + s + gap);
  auto panel = [&](int i) {
    sattn::sr::Image p(s, s, 3);
    for (int64_t y = 0; y < s; ++y)
      for (int64_t x = 0; x < s; ++x)
        for (int64_t c = 0; c < 3; ++c) p.at(y, x, c) = im.at(band + y, gap + i * (s + gap) + x, c);
    return p;
  };
  const sattn::sr::Image hr = panel(3), lr = sattn::sr::downscale(hr, 2);
  const sattn::sr::Image nearest = panel(0), bicubic = panel(1), model = panel(2);
  int64_t nearest_bad = 0;
  for (int64_t y = 0; y < s; ++y)
    for (int64_t x = 0; x < s; ++x)
      for (int64_t c = 0; c < 3; ++c) nearest_bad += nearest.at(y, x, c) != lr.at(y / 2, x / 2, c);
  EXPECT_EQ(nearest_bad, 0);
  EXPECT_EQ(bicubic.data, sattn::sr::upscale_bicubic(lr, 2).data);
  // The scene has flat and textured parts: neither panel is constant, and the model differs from bicubic.
  EXPECT_GT(*std::max_element(hr.data.begin(), hr.data.end()) - *std::min_element(hr.data.begin(), hr.data.end()), 150);
  EXPECT_NE(model.data, bicubic.data);
  const double bic_psnr = sattn::sr::psnr_y(bicubic, hr, 2);
  char expect[64];
  std::snprintf(expect, sizeof expect, "bicubic %.2f dB", bic_psnr);
  EXPECT_NE(r.out.find(expect), std::string::npos) << expect << " not in:\n" << r.out;
  std::snprintf(expect, sizeof expect, "model sparse %.2f dB", sattn::sr::psnr_y(model, hr, 2));
  EXPECT_NE(r.out.find(expect), std::string::npos) << expect << " not in:\n" << r.out;
  // Bad demo options: exit 2 with a message naming the option.
  r = run("demo --len 48");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--attention"), std::string::npos) << r.err;
  r = run("demo --size 64 --repeat 1 --out " + path("no_such_dir/x.png"));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("PSNR"), std::string::npos) << "must fail before the work: " << r.out;
  r = run("demo --size 127");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--size"), std::string::npos) << r.err;
}
