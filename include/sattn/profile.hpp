// sattn profiler: forward time and peak memory of attention kernels against sequence length L and heads,
// beside the analytic size of one materialised score matrix, B·h·L²·4 bytes (fp32).
//
// Method. Each (kernel, L, heads) point runs in a forked child process, so one point cannot inflate the next:
// the child allocates q, k, v [B, h, L, D] (fp32, random) and out, touches them, resets the kernel's
// resident-set high-water mark (writes "5" to /proc/self/clear_refs, Linux >= 4.0), runs the forward once,
// and reports peak_mib = VmHWM − VmRSS-before (from /proc/self/status): the extra resident memory the call
// needed (score buffers, copies, thread stacks). Then it times `repeats` further forward calls and reports the
// median wall time. If clear_refs cannot be written the child falls back to VmHWM-after − VmHWM-before, a lower
// estimate (the earlier high-water mark may hide part of the call's peak); ProfilePoint::memory_method says which.
// libgomp is not fork-safe once a parallel region has run: call run_profile before this process has run any
// OpenMP work (the CLI's `profile` and `report` do so first).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sattn {

struct ProfileOptions {
  std::vector<int64_t> lengths = {256, 512, 1024};  // L (Lq = Lk)
  std::vector<int64_t> heads = {4, 8};
  std::vector<std::string> kernels = {"reference"};  // names from kernel_names()
  // Sparse and linear attention, profiled beside the kernels: a sparse::Pattern spec (docs/sparse.md syntax, e.g.
  // "SlidingWindow(128, 128)", "BlockTopK(64, 8)") run through sparse::sparse_attention, or "linear:elu" /
  // "linear:favor+" run through sparse::linear_attention. Listed in the results under the pattern's repr() (or
  // the linear name). causal applies to linear attention; for a pattern, write causality into it
  // ("SlidingWindow(128, 0)"): causal with a pattern is an error.
  std::vector<std::string> patterns;
  int64_t batch = 1, head_dim = 64;
  int repeats = 3;
  bool causal = false;
  int num_threads = 0;  // 0: the library default
  // Called before each point with (index, total, description); may be empty.
  std::function<void(size_t, size_t, const std::string&)> progress;
};

struct ProfilePoint {
  std::string kernel;
  int64_t length = 0, heads = 0;
  double ms = 0;              // median forward time
  double peak_mib = 0;        // measured extra peak resident memory of one forward call
  double analytic_mib = 0;    // B·h·L²·4 bytes
  std::string memory_method;  // "clear_refs" or "hwm_delta"
  std::string error;          // non-empty when the point could not run (unsupported, over the memory limit, ...)
};

// Runs the sweep. Throws sattn::Error naming the unknown kernel and listing the registered ones, or the bad
// pattern spec (with the position of the error).
std::vector<ProfilePoint> run_profile(const ProfileOptions& options);

// CSV with the header kernel,L,heads,ms,peak_mib,analytic_mib (failed points have empty numbers); a kernel
// name with a comma or quote (a pattern) is quoted as RFC 4180 says.
std::string profile_to_csv(const std::vector<ProfilePoint>& points);
// A fixed-width table for the terminal.
std::string profile_to_table(const std::vector<ProfilePoint>& points);

}  // namespace sattn
