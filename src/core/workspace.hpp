// The kernels' large scratch arrays, in one place: 2 MiB-aligned blocks advised as transparent huge pages, kept
// after use in a small best-fit cache of freed blocks so that repeated calls do not fault in fresh pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

namespace sattn {

// At least `bytes` bytes, 64-byte aligned (2 MiB-aligned from 4 MiB on), contents unspecified; throws
// std::bad_alloc when out of memory. From 4 MiB on, a freed block of at least that size (and at most twice it) is
// reused when the cache holds one; smaller requests are plain malloc (glibc keeps those in its arenas).
void* workspace_alloc(size_t bytes);
// Returns a block of workspace_alloc to the cache (at most 16 blocks and the cache limit; the oldest are released
// first), or to the system.
void workspace_free(void* p) noexcept;
// The most bytes the cache keeps (SATTN_WORKSPACE_CACHE_MB, read once per process; 0: no cache).
size_t workspace_cache_limit();

// An owned workspace array of n elements (n may be 0); out of memory is an OutOfMemory error starting with
// `what` ("fused attention backward: the partial dQ tiles").
template <typename T>
struct WorkspaceDeleter {
  void operator()(T* p) const noexcept { workspace_free(p); }
};
template <typename T>
using WorkspacePtr = std::unique_ptr<T[], WorkspaceDeleter<T>>;
void* workspace_alloc_or_fail(size_t bytes, const char* what);
template <typename T>
WorkspacePtr<T> workspace_array(size_t n, const char* what) {
  const size_t bytes = n > SIZE_MAX / sizeof(T) ? SIZE_MAX : n * sizeof(T);  // SIZE_MAX: fails as out of memory
  return WorkspacePtr<T>(static_cast<T*>(workspace_alloc_or_fail(bytes, what)));
}

// The per-task scratch of the tile loops (a few KiB to a few MiB that every task allocates and frees): 64-byte
// aligned blocks of a power of two from 4 KiB on, taken from the blocks the calling thread freed before (at most 32
// blocks and 16 MiB per thread; larger ones are plain allocations). Through malloc alone, a task could grow the
// heap and its free trim it again, task after task: system calls and freshly zeroed pages, a third of a short
// backward's time. scratch_alloc throws std::bad_alloc when out of memory; scratch_free takes the same byte count.
void* scratch_alloc(size_t bytes);
void scratch_free(void* p, size_t bytes) noexcept;
// An owned scratch_alloc block of n elements; out of memory is an OutOfMemory error starting with `what`.
struct ScratchDeleter {
  size_t bytes = 0;
  void operator()(void* p) const noexcept { scratch_free(p, bytes); }
};
template <typename T>
using ScratchPtr = std::unique_ptr<T[], ScratchDeleter>;
void* scratch_alloc_or_fail(size_t bytes, const char* what);
template <typename T>
ScratchPtr<T> scratch_array(size_t n, const char* what) {
  const size_t bytes = n > SIZE_MAX / sizeof(T) ? SIZE_MAX : n * sizeof(T);  // SIZE_MAX: fails as out of memory
  return ScratchPtr<T>(static_cast<T*>(scratch_alloc_or_fail(bytes, what)), ScratchDeleter{bytes});
}

// A std::vector allocator over workspace_alloc / workspace_free.
template <typename T>
struct WorkspaceAllocator {
  using value_type = T;
  WorkspaceAllocator() = default;
  template <typename U>
  WorkspaceAllocator(const WorkspaceAllocator<U>&) {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(workspace_alloc(n * sizeof(T)));
  }
  void deallocate(T* p, size_t) noexcept { workspace_free(p); }
  template <typename U>
  bool operator==(const WorkspaceAllocator<U>&) const {
    return true;
  }
};
template <typename T>
using WorkspaceVector = std::vector<T, WorkspaceAllocator<T>>;

}  // namespace sattn
