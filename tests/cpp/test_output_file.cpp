// io::OutputFile and io::OutputFiles: regular files replaced atomically (new, existing with its mode, through a
// symbolic link), devices written directly with errors reported, failures leave the old file and no temporary.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io/output_file.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/safetensors.hpp"
#include "sattn/sr.hpp"

namespace fs = std::filesystem;
using sattn::Error;
using sattn::ErrorKind;
using sattn::io::OutputFile;
using sattn::io::OutputFiles;

namespace {

class OutputFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("sattn_output_file_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string slurp(const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  static void put(const std::string& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
  static mode_t mode_of(const std::string& p) {
    struct stat st {};
    EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
    return st.st_mode & 07777;
  }
  // Every entry of the test directory (temporaries included), sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  static std::string message_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(sattn::to_string(e.kind())) + ": " + e.what();
    }
    return "(no error)";
  }

  fs::path dir_;
};

mode_t current_umask() {
  const mode_t m = ::umask(0);
  ::umask(m);
  return m;
}

TEST_F(OutputFileTest, NewFileAppearsOnlyAtCommitWithTheUmaskMode) {
  const std::string p = path("a.bin");
  {
    OutputFile f(p);
    f.write("hello ");
    f.write("world");
    EXPECT_FALSE(fs::exists(p)) << "written before commit";
    const auto names = entries();
    ASSERT_EQ(names.size(), 1u);
    EXPECT_TRUE(names[0].starts_with(".a.bin.sattn-") && names[0].size() == std::string(".a.bin.sattn-XXXXXX").size())
        << names[0];
    f.commit();
  }
  EXPECT_EQ(slurp(p), "hello world");
  EXPECT_EQ(entries(), std::vector<std::string>{"a.bin"});
  EXPECT_EQ(mode_of(p), 0666 & ~current_umask());
}

TEST_F(OutputFileTest, ExistingFileKeepsItsPermissionBits) {
  for (mode_t mode : {mode_t(0640), mode_t(0755), mode_t(0600)}) {
    const std::string p = path("b.txt");
    put(p, "old contents");
    ASSERT_EQ(::chmod(p.c_str(), mode), 0);
    OutputFile f(p);
    f.write("new");
    f.commit();
    EXPECT_EQ(slurp(p), "new");
    EXPECT_EQ(mode_of(p), mode);
  }
  EXPECT_EQ(entries(), std::vector<std::string>{"b.txt"});
}

TEST_F(OutputFileTest, SymbolicLinkTargetIsReplacedAndTheLinkKept) {
  fs::create_directories(dir_ / "data");
  put(path("data/target.txt"), "old");
  fs::create_symlink("data/target.txt", dir_ / "link1");  // relative to the link's directory
  fs::create_symlink(dir_ / "link1", dir_ / "link2");     // a chain, absolute
  OutputFile f(path("link2"));
  EXPECT_EQ(f.destination(), fs::canonical(dir_ / "data/target.txt").string());
  f.write("new");
  f.commit();
  EXPECT_TRUE(fs::is_symlink(dir_ / "link1"));
  EXPECT_TRUE(fs::is_symlink(dir_ / "link2"));
  EXPECT_EQ(slurp(path("data/target.txt")), "new");
  // A dangling link: its target is created.
  fs::create_symlink("data/new.txt", dir_ / "dangling");
  OutputFile g(path("dangling"));
  g.write("made");
  g.commit();
  EXPECT_EQ(slurp(path("data/new.txt")), "made");
  std::vector<std::string> data;
  for (const auto& e : fs::directory_iterator(dir_ / "data")) data.push_back(e.path().filename().string());
  std::sort(data.begin(), data.end());
  EXPECT_EQ(data, (std::vector<std::string>{"new.txt", "target.txt"}));
}

TEST_F(OutputFileTest, DevicesAreWrittenDirectlyAndTheirErrorsReported) {
  {
    OutputFile f("/dev/null");
    EXPECT_TRUE(f.destination().empty());
    f.write("discarded");
    f.commit();
  }
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  const std::string m = message_of([] {
    OutputFile f("/dev/full", "--out");
    f.write(std::string(1 << 16, 'x'));
    f.commit();
  });
  EXPECT_EQ(m, "I/O error: --out: cannot write '/dev/full': No space left on device");
}

// /dev/fd/N and /dev/stdout write to the descriptor itself: a file opened for appending (>>) keeps its contents.
TEST_F(OutputFileTest, OwnDescriptorsAreWrittenInPlace) {
  const std::string p = path("log.txt");
  put(p, "before ");
  const int fd = ::open(p.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  {
    OutputFile f("/dev/fd/" + std::to_string(fd));
    EXPECT_TRUE(f.destination().empty());
    f.write("after");
    f.commit();
  }
  EXPECT_EQ(::write(fd, "!", 1), 1) << "the descriptor itself stays open";
  ::close(fd);
  EXPECT_EQ(slurp(p), "before after!");
  EXPECT_EQ(entries(), std::vector<std::string>{"log.txt"});
}

TEST_F(OutputFileTest, UnwritableDestinationsFailWhenOpened) {
  const std::string missing = path("no_dir/x.npy");
  EXPECT_EQ(message_of([&] { OutputFile f(missing, "--lse"); }), "I/O error: --lse: cannot write '" + missing +
                                                                     "': directory '" + path("no_dir") +
                                                                     "': No such file or directory");
  EXPECT_EQ(message_of([&] { OutputFile f(dir_.string() + "/"); }),
            "I/O error: cannot write '" + dir_.string() + "/': expected a file name");
  EXPECT_EQ(message_of([] { OutputFile f(""); }), "I/O error: cannot write '': expected a file name");
  fs::create_directories(dir_ / "sub");
  EXPECT_EQ(message_of([&] { OutputFile f(path("sub")); }),
            "I/O error: cannot write '" + path("sub") + "': Is a directory");
  EXPECT_EQ(entries(), std::vector<std::string>{"sub"});
}

TEST_F(OutputFileTest, AFileNameOfTheLongestLengthWorks) {
  const std::string name(NAME_MAX, 'n');
  OutputFile f(path(name));
  f.write("x");
  f.commit();
  EXPECT_EQ(slurp(path(name)), "x");
  EXPECT_EQ(entries(), std::vector<std::string>{name});
}

// A write that fails (here: over RLIMIT_FSIZE, as on a full disk) or an OutputFile dropped before commit() leaves
// the old file as it was and no temporary behind.
TEST_F(OutputFileTest, FailureLeavesTheOldFileAndNoTemporary) {
  const std::string p = path("c.npy");
  put(p, "old");
  {
    OutputFile f(p);
    f.write("partial");
  }  // not committed
  EXPECT_EQ(slurp(p), "old");
  EXPECT_EQ(entries(), std::vector<std::string>{"c.npy"});

  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string m;
  {
    OutputFile f(p, "--out");
    m = message_of([&] { f.write(std::string(10000, 'y')); });
    EXPECT_THROW(f.commit(), Error) << "a failed file must not be committed";
  }
  const std::string m2 = message_of([&] {
    sattn::Tensor t(sattn::DType::kF32, {4096});
    sattn::write_npy(p, t);
  });
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(m, "I/O error: --out: cannot write '" + p + "': File too large");
  EXPECT_EQ(m2, "I/O error: cannot write '" + p + "': File too large");
  EXPECT_EQ(slurp(p), "old");
  EXPECT_EQ(entries(), std::vector<std::string>{"c.npy"});
}

TEST_F(OutputFileTest, SeveralFilesAreRenamedOnlyAfterAllAreWritten) {
  put(path("a"), "old a");
  put(path("b"), "old b");
  {
    OutputFiles files;
    files.add(path("a")).write("new a");
    files.add(path("b")).write("new b");
    files.add("/dev/null").write("x");
    files.add("/dev/null").write("y");  // devices may repeat
    EXPECT_EQ(slurp(path("a")), "old a");
    files.commit();
  }
  EXPECT_EQ(slurp(path("a")), "new a");
  EXPECT_EQ(slurp(path("b")), "new b");

  // The same regular file twice is refused (the second would silently win).
  fs::create_symlink("a", dir_ / "a_link");
  EXPECT_EQ(message_of([&] {
              OutputFiles files;
              files.add(path("a"), "--out");
              files.add(path("a_link"), "--lse");
            }),
            "invalid argument: --lse: '" + path("a_link") + "' is the same file as '" + path("a") +
                "', written by the same command");

  // A rename that fails (here: a directory appeared at the destination) names the files already replaced; the
  // files after it keep their old contents and no temporary is left.
  std::string m;
  {
    OutputFiles files;
    files.add(path("a")).write("newer a");
    files.add(path("d")).write("new d");
    files.add(path("b")).write("newer b");
    fs::create_directories(dir_ / "d" / "x");
    m = message_of([&] { files.commit(); });
  }
  EXPECT_EQ(m, "I/O error: cannot replace '" + path("d") + "': Is a directory (already replaced: '" + path("a") + "')");
  EXPECT_EQ(slurp(path("a")), "newer a");
  EXPECT_EQ(slurp(path("b")), "new b");
  EXPECT_EQ(entries(), (std::vector<std::string>{"a", "a_link", "b", "d"}));
}

// Every writer of the library goes through OutputFile: /dev/full is an error, not a silent success.
TEST_F(OutputFileTest, LibraryWritersReportAFullDevice) {
  sattn::Tensor t(sattn::DType::kF32, {64, 64});
  sattn::sr::Image sr_image(32, 32, 3);
  const std::vector<std::pair<std::string, std::function<void()>>> writers = {
      {"write_npy", [&] { sattn::write_npy("/dev/full", t); }},
      {"write_safetensors",
       [&] {
         sattn::write_safetensors("/dev/full", {{"t", t.view()}});
       }},
      {"sr::write_png", [&] { sattn::sr::write_png("/dev/full", sr_image); }},
  };
  for (const auto& [name, write] : writers)
    EXPECT_EQ(message_of(write), "I/O error: cannot write '/dev/full': No space left on device") << name;
}

}  // namespace
