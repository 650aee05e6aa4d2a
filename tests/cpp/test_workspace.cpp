// The workspace allocator of the kernels' large scratch (src/core/workspace.cpp): alignment, the cache of freed
// blocks and its limits, errors that name the array, and a fork while another thread uses the cache; huge pages asked
// for an output (src/core/memory.cpp).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/memory.hpp"
#include "core/workspace.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"

namespace {

constexpr size_t kMiB = size_t(1) << 20;

// KiB of transparent huge pages backing [begin, end) (the AnonHugePages of the mappings that overlap it).
int64_t huge_kib(uintptr_t begin, uintptr_t end) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  int64_t kib = 0;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
      inside = lo < end && hi > begin;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      kib += std::stoll(line.substr(14));
    }
  }
  return kib;
}

TEST(Memory, AnOutputAdvisedForHugePagesGetsThemWhereTheKernelAllowsIt) {
  std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(enabled, mode);
  if (mode.find("[madvise]") == std::string::npos && mode.find("[always]") == std::string::npos)
    GTEST_SKIP() << "transparent huge pages are off here (" << (mode.empty() ? "no sysfs entry" : mode) << ")";
  constexpr size_t kBytes = size_t(16) << 20;
  for (bool advise : {false, true}) {
    void* map = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(map, MAP_FAILED);
    char* p = static_cast<char*>(map) + 4096;  // not 2 MiB aligned: only the whole huge pages inside are advised
    const int64_t n = int64_t(kBytes) - 8192;
    if (advise) sattn::advise_huge_pages(p, n);
    std::memset(p, 1, size_t(n));
    const int64_t kib = huge_kib(uintptr_t(map), uintptr_t(map) + kBytes);
    munmap(map, kBytes);
    if (advise) {
      EXPECT_GT(kib, 0) << "no huge page after advising (THP mode " << mode << ")";
    } else if (mode.find("[madvise]") != std::string::npos) {
      EXPECT_EQ(kib, 0);
    }
  }
  sattn::advise_huge_pages(nullptr, 1 << 30);  // nothing to advise: no effect
}

TEST(Workspace, SmallBlocksAre64ByteAlignedAndLargeOnes2MiB) {
  for (size_t bytes : {size_t(0), size_t(1), size_t(100), size_t(4 * kMiB - 1)}) {
    void* p = sattn::workspace_alloc(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes;
    sattn::workspace_free(p);
  }
  for (size_t bytes : {4 * kMiB, 5 * kMiB + 3}) {
    void* p = sattn::workspace_alloc(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (2 * kMiB), 0u) << bytes;
    sattn::workspace_free(p);
  }
  sattn::workspace_free(nullptr);
  sattn::empty_workspace_cache();
}

TEST(Workspace, FreedLargeBlocksAreReusedBestFitUntilEmptied) {
  if (sattn::workspace_cache_limit() < 512 * kMiB)
    GTEST_SKIP() << "SATTN_WORKSPACE_CACHE_MB is under the 512 MiB this test fills";
  sattn::empty_workspace_cache();
  ASSERT_EQ(sattn::workspace_cache_bytes(), 0);
  void* small = sattn::workspace_alloc(kMiB);  // below 4 MiB: never cached
  sattn::workspace_free(small);
  EXPECT_EQ(sattn::workspace_cache_bytes(), 0);

  void* a = sattn::workspace_alloc(8 * kMiB);
  void* b = sattn::workspace_alloc(20 * kMiB);
  sattn::workspace_free(a);
  sattn::workspace_free(b);
  EXPECT_EQ(sattn::workspace_cache_bytes(), int64_t(28 * kMiB));
  void* c = sattn::workspace_alloc(6 * kMiB);  // fits both; the 8 MiB block is the best fit
  EXPECT_EQ(c, a);
  EXPECT_EQ(sattn::workspace_cache_bytes(), int64_t(20 * kMiB));
  void* d = sattn::workspace_alloc(7 * kMiB);  // 8 MiB rounded; 20 MiB is more than twice that: a new block
  EXPECT_NE(d, b);
  sattn::workspace_free(c);
  sattn::workspace_free(d);
  EXPECT_EQ(sattn::workspace_cache_bytes(), int64_t(36 * kMiB));

  // At most 16 blocks: the oldest (the three above) go first.
  std::vector<void*> blocks;
  for (int i = 0; i < 18; ++i) blocks.push_back(sattn::workspace_alloc(24 * kMiB));  // none of the cached fit
  for (void* p : blocks) sattn::workspace_free(p);
  EXPECT_EQ(sattn::workspace_cache_bytes(), int64_t(16 * 24 * kMiB));

  sattn::empty_workspace_cache();
  EXPECT_EQ(sattn::workspace_cache_bytes(), 0);
}

TEST(Workspace, ScratchBlocksAreAlignedAndReusedByTheThreadThatFreedThem) {
  for (size_t bytes : {size_t(0), size_t(1), size_t(5000), 17 * kMiB}) {
    void* p = sattn::scratch_alloc(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes;
    sattn::scratch_free(p, bytes);
  }
  void* a = sattn::scratch_alloc(10000);  // a 16 KiB block
  sattn::scratch_free(a, 10000);
  void* other = nullptr;
  std::thread([&] {  // another thread's cache does not hold it
    other = sattn::scratch_alloc(10000);
    sattn::scratch_free(other, 10000);
  })
      .join();
  EXPECT_NE(other, a);
  void* b = sattn::scratch_alloc(64 << 10);  // another size: not that block
  EXPECT_NE(b, a);
  void* c = sattn::scratch_alloc(12000);  // the same size class: the freed block
  EXPECT_EQ(c, a);
  sattn::scratch_free(b, 64 << 10);
  sattn::scratch_free(c, 12000);
  sattn::scratch_free(nullptr, 10);
  EXPECT_THROW(sattn::scratch_array<double>(SIZE_MAX / 4, "the test's doubles"), sattn::Error);
}

TEST(Workspace, SizesPastTheAddressSpaceAreOutOfMemoryErrorsNamingTheArray) {
  for (size_t bytes : {SIZE_MAX, SIZE_MAX - kMiB}) {
    try {
      sattn::workspace_alloc_or_fail(bytes, "the test's scratch");
      FAIL() << "expected kOutOfMemory for " << bytes << " bytes";
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), sattn::ErrorKind::kOutOfMemory);
      EXPECT_NE(std::string(e.what()).find("the test's scratch: cannot allocate"), std::string::npos) << e.what();
    }
  }
  // n * sizeof(T) past SIZE_MAX must not wrap to a small block.
  EXPECT_THROW(sattn::workspace_array<double>(SIZE_MAX / 4, "the test's doubles"), sattn::Error);
  sattn::WorkspaceAllocator<double> alloc;
  EXPECT_THROW(alloc.allocate(SIZE_MAX / 4), std::bad_array_new_length);
}

// A fork while another thread is inside the cache's lock must not leave the child with that lock taken: the child
// takes a cached block (no malloc in the child) and must exit at once.
TEST(Workspace, ForkedChildUsesTheCacheWhileAnotherThreadWasInIt) {
  if (sattn::workspace_cache_limit() < 8 * kMiB)
    GTEST_SKIP() << "SATTN_WORKSPACE_CACHE_MB is under the 8 MiB this test keeps";
  sattn::empty_workspace_cache();
  sattn::workspace_free(sattn::workspace_alloc(6 * kMiB));  // the child's block
  std::atomic<bool> stop{false};
  std::thread worker([&] {  // holds the lock much of the time; its 16 MiB block never fits the child's request
    while (!stop.load(std::memory_order_relaxed)) sattn::workspace_free(sattn::workspace_alloc(16 * kMiB));
  });
  int hung = 0, forks = 0;
  for (; forks < 100 && hung == 0; ++forks) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      sattn::workspace_free(sattn::workspace_alloc(6 * kMiB));
      ::_exit(0);
    }
    int status = 0;
    bool exited = false;
    for (int ms = 0; ms < 5000 && !exited; ++ms) {
      exited = ::waitpid(pid, &status, WNOHANG) == pid;
      if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!exited) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ++hung;
    } else {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    }
  }
  stop = true;
  worker.join();
  EXPECT_EQ(hung, 0) << "a forked child hung on the workspace cache's lock (fork " << forks << ")";
  sattn::empty_workspace_cache();
}

}  // namespace
