// The `sattn` command's outputs: an unwritable output fails before the work and writes nothing; /dev/full and a
// full disk are errors (exit 2) that leave the old files; the same file as input and output is safe; and
// `sr upscale` killed with SIGKILL at any point (found with strace) leaves each output old or new, never partial.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "sattn/io.hpp"
#include "sattn/sr.hpp"

namespace fs = std::filesystem;

namespace {

struct CommandResult {
  int code = -1;
  std::string out, err;
};

class CliOutputs : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* bin = std::getenv("SATTN_BINARY_DIR");
#ifdef SATTN_TEST_BINARY_DIR
    binary_ = fs::path(bin && *bin ? bin : SATTN_TEST_BINARY_DIR) / "sattn";
#else
    binary_ = fs::path(bin && *bin ? bin : ".") / "sattn";
#endif
    if (!fs::exists(binary_)) GTEST_SKIP() << binary_ << " was not built (SATTN_BUILD_CLI=OFF?)";
    const char* src = std::getenv("SATTN_SOURCE_DIR");
#ifdef SATTN_TEST_SOURCE_DIR
    if (!src || !*src) src = SATTN_TEST_SOURCE_DIR;
#endif
    weights_ = fs::path(src ? src : ".") / "sr" / "weights" / "sattn_sr_x2.safetensors";
    tmp_ = fs::path(::testing::TempDir()) / ("sattn_cli_outputs_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_ / "run");
  }
  void TearDown() override {
    std::error_code ec;
    if (!tmp_.empty()) fs::remove_all(tmp_, ec);
  }

  std::string path(const std::string& name) const { return (tmp_ / name).string(); }
  bool have_weights() const { return fs::exists(weights_); }
  std::string weights() const { return " --weights " + weights_.string(); }

  // `prefix` runs before the command in the same shell (e.g. limits); stdout/stderr are captured under run/.
  CommandResult run(const std::string& args, const std::string& prefix = "") const {
    const std::string out = path("run/stdout.txt"), err = path("run/stderr.txt");
    const std::string cmd = "(" + prefix + (prefix.empty() ? "" : "; ") + "exec '" + binary_.string() + "' " + args +
                            ") >'" + out + "' 2>'" + err + "'";
    const int status = std::system(cmd.c_str());
    CommandResult r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  static std::string slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  static void put(const std::string& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  }
  // Temporaries of OutputFile (".NAME.sattn-XXXXXX") in the test directory.
  std::vector<std::string> temporaries() const {
    std::vector<std::string> t;
    for (const auto& e : fs::directory_iterator(tmp_))
      if (e.path().filename().string().find(".sattn-") != std::string::npos) t.push_back(e.path().filename());
    return t;
  }

  // A noisy RGB picture (noise keeps its PNG large: a 96x96 one is about 27 KB).
  void write_picture(const std::string& p, int64_t side, uint32_t seed) const {
    sattn::sr::Image im(side, side, 3);
    std::mt19937 g(seed);
    for (auto& v : im.data) v = uint8_t(g() & 0xff);
    sattn::sr::write_png(p, im);
  }
  void write_qkv() const {
    sattn::Tensor t(sattn::DType::kF32, {1, 2, 8, 4});
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = float(i % 7) * 0.25f;
    for (const char* n : {"q.npy", "k.npy", "v.npy"}) sattn::write_npy(path(n), t);
  }
  std::string qkv() const { return "--q " + path("q.npy") + " --k " + path("k.npy") + " --v " + path("v.npy"); }

  fs::path binary_, weights_, tmp_;
};

size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

// Every command that writes files opens them before its work: an output in a missing directory fails at once,
// with one line naming it, and no other output of the command is written.
TEST_F(CliOutputs, UnwritableOutputFailsFirstAndWritesNothing) {
  write_qkv();
  write_picture(path("in.png"), 24, 1);
  put(path("plain_file"), "x");
  const std::string missing = path("missing");
  struct Case {
    std::string args, bad;               // bad: the unwritable output the message must name
    std::vector<std::string> untouched;  // outputs that must not appear
    bool needs_weights = false;
  };
  std::vector<Case> cases = {
      {"attn " + qkv() + " --out " + path("o.npy") + " --lse " + missing + "/l.npy", missing + "/l.npy", {"o.npy"}},
      {"attn " + qkv() + " --out " + path("o.npy") + " --lse " + path("l.npy") + " --weights " + missing + "/w.npy",
       missing + "/w.npy",
       {"o.npy", "l.npy"}},
      {"sparse " + qkv() + " --pattern 'SlidingWindow(2, 0)' --out " + path("o.npy") + " --lse " + missing + "/l.npy",
       missing + "/l.npy",
       {"o.npy"}},
      {"sr downscale " + path("in.png") + " " + missing + "/o.png --scale 2", missing + "/o.png", {}},
      {"sr upscale " + path("in.png") + " " + path("o.png") + " --scale 2 --routing-out " + missing + "/r.npy" +
           weights(),
       missing + "/r.npy",
       {"o.png"},
       true},
      {"profile --L 16 --heads 1 --repeats 1 --kernels reference --csv " + path("p.csv") + " --plot " + missing +
           "/p.svg",
       missing + "/p.svg",
       {"p.csv"}},
      {"doctor --example --plot " + missing + "/d.png", missing + "/d.png", {}},
      {"report " + missing + "/r.html --no-profile", missing + "/r.html", {}},
      {"viz --example --out " + path("plain_file") + "/maps", path("plain_file") + "/maps", {}},
  };
  for (const Case& c : cases) {
    if (c.needs_weights && !have_weights()) {
      ADD_FAILURE() << "sr/weights/sattn_sr_x2.safetensors missing: not checked: " << c.args;
      continue;
    }
    const CommandResult r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find("sattn: error: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("'" + c.bad), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(lines(r.err), 1u) << r.err;
    for (const auto& name : c.untouched) EXPECT_FALSE(fs::exists(path(name))) << name << " written by " << c.args;
    EXPECT_TRUE(temporaries().empty()) << c.args;
  }
}

// A full device is an error (exit 2, the old outputs kept), /dev/null is a place to write to.
TEST_F(CliOutputs, FullDeviceIsAnError) {
  write_qkv();
  write_picture(path("in.png"), 24, 2);
  struct Case {
    std::string args;
    std::vector<std::string> untouched;
    bool needs_weights = false;
  };
  const std::vector<Case> cases = {
      {"attn " + qkv() + " --out /dev/full", {}},
      {"attn " + qkv() + " --out " + path("o.npy") + " --lse /dev/full", {"o.npy"}},
      {"sr downscale " + path("in.png") + " /dev/full --scale 2", {}},
      {"sr upscale " + path("in.png") + " /dev/full --scale 2" + weights(), {}, true},
      {"report /dev/full --no-profile", {}},
  };
  for (const Case& c : cases) {
    if (c.needs_weights && !have_weights()) {
      ADD_FAILURE() << "sr/weights/sattn_sr_x2.safetensors missing: not checked: " << c.args;
      continue;
    }
    const CommandResult r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find("cannot write '/dev/full': No space left on device"), std::string::npos) << c.args << "\n"
                                                                                                  << r.err;
    for (const auto& name : c.untouched) EXPECT_FALSE(fs::exists(path(name))) << name << " written by " << c.args;
    EXPECT_TRUE(temporaries().empty()) << c.args;
  }
  EXPECT_EQ(run("attn " + qkv() + " --out /dev/null --lse /dev/null").code, 0);
  // Standard output too: what a command prints must arrive.
  const int status = std::system(("'" + binary_.string() + "' version >/dev/full 2>" + path("run/err.txt")).c_str());
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 2);
  EXPECT_NE(slurp(path("run/err.txt")).find("cannot write standard output"), std::string::npos);
}

// `sr upscale|downscale IN IN` replaces the input with the result; on a full disk (here a file size limit, which
// fails the write the same way) it exits 2 and leaves the input byte for byte, its mode kept either way.
TEST_F(CliOutputs, SameInputAndOutputIsSafe) {
  const std::string photo = path("photo.png");
  write_picture(photo, 96, 3);
  ASSERT_EQ(::chmod(photo.c_str(), 0640), 0);
  const std::string original = slurp(photo);
  const std::string full_disk = "trap '' XFSZ; ulimit -f 8";  // 4-8 KB (shells differ); the PNGs are larger
  std::vector<std::string> commands = {"sr downscale " + photo + " " + photo + " --scale 2"};
  if (have_weights()) commands.push_back("sr upscale " + photo + " " + photo + " --scale 2 --threads 2" + weights());
  else ADD_FAILURE() << "sr/weights/sattn_sr_x2.safetensors missing: sr upscale IN IN not checked";
  for (const std::string& cmd : commands) {
    const CommandResult r = run(cmd, full_disk);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.err;
    EXPECT_NE(r.err.find("cannot write '" + photo + "': File too large"), std::string::npos) << r.err;
    EXPECT_TRUE(slurp(photo) == original) << "the input was damaged by " << cmd;
    EXPECT_TRUE(temporaries().empty()) << cmd;
  }
  for (const std::string& cmd : commands) {
    put(photo, original);
    const CommandResult r = run(cmd);
    ASSERT_EQ(r.code, 0) << cmd << "\n" << r.err;
    const sattn::sr::Image im = sattn::sr::read_image(photo);
    EXPECT_EQ(im.width, cmd.find("downscale") != std::string::npos ? 48 : 192) << cmd;
    struct stat st {};
    ASSERT_EQ(::stat(photo.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0640u);
    EXPECT_TRUE(temporaries().empty()) << cmd;
  }
}

// SIGKILL at >= 10 points of `sr upscale IN OUT` with three more outputs: at every write, fsync and rename of the
// run (strace -e inject=SYSCALL:signal=KILL:when=K) and at a few moments of the computation. After each kill
// every output holds its old bytes or the complete run's bytes; the temporaries a kill leaves do not disturb the
// next run.
TEST_F(CliOutputs, SrUpscaleKilledAnywhereLeavesEachOutputOldOrNew) {
  if (std::system("strace -V >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "strace is not installed: SIGKILL points NOT checked";
  if (!have_weights()) GTEST_SKIP() << weights_ << " missing: SIGKILL points NOT checked";
  write_picture(path("in.png"), 16, 4);
  const std::vector<std::string> outputs = {"o.png", "f.npy", "r.npy", "g.npy"};
  const std::string args = "sr upscale " + path("in.png") + " " + path("o.png") + " --scale 2 --threads 1 --tile 0" +
                           weights() + " --float-out " + path("f.npy") + " --routing-out " + path("r.npy") +
                           " --gates-out " + path("g.npy");
  // The complete run's bytes.
  CommandResult r = run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, std::string> fresh, old;
  for (const auto& o : outputs) fresh[o] = slurp(path(o)), old[o] = "old " + o;
  auto restore_old = [&] {
    for (const auto& o : outputs) put(path(o), old[o]);
    ::chmod(path("o.png").c_str(), 0640);
  };
  int old_left = 0, new_left = 0;  // how the kills left o.png: both must happen
  auto check_outputs = [&](const std::string& point) {
    for (const auto& o : outputs) {
      const std::string now = slurp(path(o));
      EXPECT_TRUE(now == old[o] || now == fresh[o])
          << point << ": " << o << " is neither the old file nor the complete output (" << now.size() << " bytes)";
      if (o == "o.png") (now == old[o] ? old_left : new_left) += 1;
    }
    struct stat st {};
    ASSERT_EQ(::stat(path("o.png").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0640u) << point;
  };
  // strace counts per tracee: the main thread does every write. ASan's leak check cannot run under ptrace.
  const std::string strace =
      "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 strace -f -qq -o " + path("run/trace.txt");
  // Count the syscalls to kill at: a traced run without injection.
  const std::string count_cmd = strace + " -e trace=write,fsync,rename,renameat,renameat2 '" + binary_.string() + "' " +
                                args + " >/dev/null 2>&1";
  restore_old();
  ASSERT_EQ(std::system(count_cmd.c_str()), 0);
  std::map<std::string, std::map<std::string, int>> per_pid;  // pid -> syscall -> count
  {
    std::istringstream trace(slurp(path("run/trace.txt")));
    for (std::string line; std::getline(trace, line);) {
      std::istringstream ls(line);
      std::string pid, call;
      ls >> pid >> call;
      call = call.substr(0, call.find('('));
      ++per_pid[pid][call];
    }
  }
  std::map<std::string, int> counts;
  for (const auto& [pid, c] : per_pid)
    if (c.count("write") && c.at("write") > counts["write"]) counts = c;
  const std::string rename_call = counts.count("rename")      ? "rename"
                                  : counts.count("renameat2") ? "renameat2"
                                                              : "renameat";
  ASSERT_GE(counts["write"], 4) << "four files are written";
  std::vector<std::pair<std::string, int>> points;  // syscall, K (its K-th call: killed on entry)
  for (const std::string& call : {std::string("write"), std::string("fsync"), rename_call})
    for (int k = 1; k <= counts[call]; ++k) points.emplace_back(call, k);
  ASSERT_GE(points.size(), 10u);
  std::printf("SIGKILL at %zu syscalls: %d write, %d fsync, %d %s; and at 3 moments\n", points.size(), counts["write"],
              counts["fsync"], counts[rename_call], rename_call.c_str());
  for (const auto& [call, k] : points) {
    restore_old();
    const std::string point = call + " " + std::to_string(k);
    const std::string cmd = strace + " -e trace=" + call + " -e inject=" + call +
                            ":signal=KILL:when=" + std::to_string(k) + " '" + binary_.string() + "' " + args +
                            " >/dev/null 2>&1";
    std::system(cmd.c_str());
    EXPECT_NE(slurp(path("run/trace.txt")).find("+++ killed by SIGKILL +++"), std::string::npos)
        << point << ": not killed";
    check_outputs(point);
  }
  // And at moments of the computation, without strace.
  const std::string shell_cmd = "exec '" + binary_.string() + "' " + args + " >/dev/null 2>&1";
  for (int ms : {0, 20, 60}) {
    restore_old();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // nothing but exec in the child of a threaded process
      ::execl("/bin/sh", "sh", "-c", shell_cmd.c_str(), (char*)nullptr);
      ::_exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    check_outputs("SIGKILL after " + std::to_string(ms) + " ms");
  }
  EXPECT_GT(old_left, 0) << "no kill left the old o.png";
  EXPECT_GT(new_left, 0) << "no kill left the new o.png";
  EXPECT_FALSE(temporaries().empty()) << "the kills inside the writes should have left temporaries";
  restore_old();
  r = run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const auto& o : outputs) EXPECT_TRUE(slurp(path(o)) == fresh[o]) << o << " after the kills";
}

}  // namespace
