// The workspace allocator of the kernels' large scratch (src/core/workspace.cpp): alignment, the cache of freed
// blocks and its limits, errors that name the array, and a fork while another thread uses the cache.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "core/workspace.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"

namespace {

constexpr size_t kMiB = size_t(1) << 20;

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

  // At most 8 blocks: the oldest (the three above) go first.
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(sattn::workspace_alloc(40 * kMiB));  // none of the cached fit
  for (void* p : blocks) sattn::workspace_free(p);
  EXPECT_EQ(sattn::workspace_cache_bytes(), int64_t(8 * 40 * kMiB));

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
