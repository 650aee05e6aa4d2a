#include "core/workspace.hpp"

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#if defined(__linux__)
#include <pthread.h>
#include <sys/mman.h>
#endif

#include "core/env.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"

namespace sattn {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kCachedFrom = 2 * kHugePage;
// Sixteen: BlockTopK's backward holds eleven large blocks at once (its own packing, the engine's, the key
// gradients and the bf16 pairs); with eight, a BlockTopK backward after a sliding-window one found too few of its
// blocks cached and took 1.7x as long (page faults).
constexpr size_t kMaxBlocks = 16;

// Freed large blocks, best fit, at most kMaxBlocks and `limit` bytes (SATTN_WORKSPACE_CACHE_MB, default 1024;
// 0 disables): glibc serves requests of 32 MiB and more with a fresh mmap every time, whose pages are faulted in
// and zeroed one by one on first touch.
struct BlockCache {
  std::mutex mu;
  std::vector<std::pair<void*, size_t>> blocks;  // (pointer, size), oldest first
  std::unordered_map<void*, size_t> sizes;       // every live or cached large block
  size_t cached = 0;
  size_t limit = cache_limit();

  static size_t cache_limit() {
    const long long kMax = (1LL << 30);
    // The older name of the variable is still read when the new one is not set.
    const long long old = env::get_integer("SATTN_SPARSE_CACHE_MB", 0, kMax, 1024);
    return size_t(env::get_integer("SATTN_WORKSPACE_CACHE_MB", 0, kMax, old)) << 20;
  }
};
BlockCache& block_cache() {
  // Never destroyed: blocks may be freed during static destruction. A fork holds the lock, so that the child does
  // not inherit it taken by a thread that the child does not have (the child would hang on its first large block).
  static BlockCache* c = [] {
    auto* cache = new BlockCache;
#if defined(__linux__)
    pthread_atfork([] { block_cache().mu.lock(); }, [] { block_cache().mu.unlock(); },
                   [] { block_cache().mu.unlock(); });
#endif
    return cache;
  }();
  return *c;
}

}  // namespace

void* workspace_alloc(size_t bytes) {
  if (bytes < kCachedFrom) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + (bytes == 0 ? 64 : 0));
    if (!p) throw std::bad_alloc();
    return p;
  }
  if (bytes > SIZE_MAX - kHugePage) throw std::bad_alloc();
  const size_t size = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  BlockCache& c = block_cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    size_t best = c.blocks.size();
    for (size_t x = 0; x < c.blocks.size(); ++x)
      if (c.blocks[x].second >= size && c.blocks[x].second <= 2 * size &&
          (best == c.blocks.size() || c.blocks[x].second < c.blocks[best].second))
        best = x;
    if (best < c.blocks.size()) {
      void* p = c.blocks[best].first;
      c.cached -= c.blocks[best].second;
      c.blocks.erase(c.blocks.begin() + std::ptrdiff_t(best));
      return p;
    }
  }
  void* p = std::aligned_alloc(kHugePage, size);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, size, MADV_HUGEPAGE);  // a hint: ignored where transparent huge pages are off
#endif
  std::lock_guard<std::mutex> lock(c.mu);
  c.sizes[p] = size;
  return p;
}

void workspace_free(void* p) noexcept {
  if (!p) return;
  BlockCache& c = block_cache();
  std::vector<void*> release;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    const auto it = c.sizes.find(p);
    if (it == c.sizes.end()) {  // a small block
      std::free(p);
      return;
    }
    const size_t size = it->second;
    if (size > c.limit) {
      c.sizes.erase(it);
      release.push_back(p);
    } else {
      c.blocks.emplace_back(p, size);
      c.cached += size;
      while (c.cached > c.limit || c.blocks.size() > kMaxBlocks) {  // evict the oldest
        c.cached -= c.blocks.front().second;
        c.sizes.erase(c.blocks.front().first);
        release.push_back(c.blocks.front().first);
        c.blocks.erase(c.blocks.begin());
      }
    }
  }
  for (void* q : release) std::free(q);
}

namespace {

constexpr size_t kScratchMin = size_t(4) << 10, kScratchMaxCached = size_t(16) << 20, kScratchMaxBlocks = 32;

// A scratch request's block size: the power of two at least `bytes` (and 4 KiB); 0 past kScratchMaxCached.
size_t scratch_block_size(size_t bytes) {
  if (bytes > kScratchMaxCached) return 0;
  size_t size = kScratchMin;
  while (size < bytes) size *= 2;
  return size;
}

// The calling thread's freed scratch blocks, most recent last.
struct ScratchCache {
  std::vector<std::pair<void*, size_t>> blocks;
  size_t cached = 0;
  ScratchCache() = default;
  ScratchCache(const ScratchCache&) = delete;
  ScratchCache& operator=(const ScratchCache&) = delete;
  ~ScratchCache() {
    for (const auto& b : blocks) std::free(b.first);
  }
};
thread_local ScratchCache scratch_cache;

}  // namespace

void* scratch_alloc(size_t bytes) {
  const size_t size = scratch_block_size(bytes);
  if (size == 0) {
    if (bytes > SIZE_MAX - 64) throw std::bad_alloc();
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  ScratchCache& c = scratch_cache;
  for (size_t x = c.blocks.size(); x-- > 0;)
    if (c.blocks[x].second == size) {
      void* p = c.blocks[x].first;
      c.cached -= size;
      c.blocks.erase(c.blocks.begin() + std::ptrdiff_t(x));
      return p;
    }
  void* p = std::aligned_alloc(64, size);
  if (!p) throw std::bad_alloc();
  return p;
}

void scratch_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  const size_t size = scratch_block_size(bytes);
  if (size == 0) {
    std::free(p);
    return;
  }
  ScratchCache& c = scratch_cache;
  while (!c.blocks.empty() && (c.blocks.size() == kScratchMaxBlocks || c.cached + size > kScratchMaxCached)) {
    std::free(c.blocks.front().first);  // the oldest go back to the system first
    c.cached -= c.blocks.front().second;
    c.blocks.erase(c.blocks.begin());
  }
  try {
    c.blocks.emplace_back(p, size);
  } catch (...) {  // the list itself could not grow
    std::free(p);
    return;
  }
  c.cached += size;
}

void* scratch_alloc_or_fail(size_t bytes, const char* what) {
  try {
    return scratch_alloc(bytes);
  } catch (const std::bad_alloc&) {
    fail(ErrorKind::kOutOfMemory, what, ": cannot allocate ", bytes, " bytes");
  }
}

void* workspace_alloc_or_fail(size_t bytes, const char* what) {
  try {
    return workspace_alloc(bytes);
  } catch (const std::bad_alloc&) {
    fail(ErrorKind::kOutOfMemory, what, ": cannot allocate ", bytes, " bytes");
  }
}

size_t workspace_cache_limit() { return block_cache().limit; }

int64_t workspace_cache_bytes() {
  BlockCache& c = block_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return int64_t(c.cached);
}

void empty_workspace_cache() {
  BlockCache& c = block_cache();
  std::vector<std::pair<void*, size_t>> release;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    release.swap(c.blocks);
    for (const auto& b : release) c.sizes.erase(b.first);
    c.cached = 0;
  }
  for (const auto& b : release) std::free(b.first);
}

}  // namespace sattn
