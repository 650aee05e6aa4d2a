// The profiler (see include/sattn/profile.hpp for the measurement method).
#include "sattn/profile.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/linear.hpp"
#include "sattn/patterns.hpp"
#include "sattn/sparse.hpp"
#include "viz/viz.hpp"

namespace sattn {
namespace {

// Reads a "Name:   123 kB" line of /proc/self/status, in bytes (-1 when unavailable).
double status_bytes(const char* name) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(name);
  while (std::getline(f, line)) {
    if (line.compare(0, n, name) == 0 && line.size() > n && line[n] == ':') {
      return std::strtod(line.c_str() + n + 1, nullptr) * 1024.0;
    }
  }
  return -1;
}

bool reset_peak_rss() {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

struct ChildResult {
  double ms = 0, peak_bytes = 0;
  int method = 0;  // 1 clear_refs, 2 hwm delta
  char error[600] = {0};
};

void fill_random(Tensor& t, uint32_t seed) {
  float* p = t.data<float>();
  uint32_t x = seed * 2654435761u + 12345u;
  for (int64_t n = 0; n < t.numel(); ++n) {
    x = x * 1664525u + 1013904223u;  // LCG: the values only need to be ordinary, not good random numbers
    p[n] = float(int32_t(x >> 8) - (1 << 23)) / float(1 << 23);
  }
}

// What one profiled entry runs: a registered kernel, a sparse pattern, or linear attention.
struct Entry {
  std::string label;
  enum class Kind { kKernel, kPattern, kLinear } kind = Kind::kKernel;
  std::string name;  // kernel name, pattern spec, or feature map
};

constexpr const char* kLinearPrefix = "linear:";

ChildResult measure_point(const ProfileOptions& o, const Entry& entry, int64_t L, int64_t heads) {
  ChildResult r;
  try {
    Tensor q(DType::kF32, {o.batch, heads, L, o.head_dim}), k(DType::kF32, {o.batch, heads, L, o.head_dim});
    Tensor v(DType::kF32, {o.batch, heads, L, o.head_dim}), out(DType::kF32, {o.batch, heads, L, o.head_dim});
    fill_random(q, 1);
    fill_random(k, 2);
    fill_random(v, 3);
    AttentionOptions opt;
    opt.causal = o.causal ? Causal::kTopLeft : Causal::kNone;
    opt.num_threads = o.num_threads;
    AttentionOutputs outs{out.view(), {}, {}};
    std::function<void()> forward;
    std::optional<sparse::Pattern> pattern;
    sparse::SparseOptions so;
    sparse::LinearOptions lo;
    switch (entry.kind) {
      case Entry::Kind::kKernel:
        opt.kernel = entry.name;
        forward = [&] { scaled_dot_product_attention(q, k, v, opt, outs); };
        break;
      case Entry::Kind::kPattern:
        pattern = sparse::Pattern::parse(entry.name);
        so.num_threads = o.num_threads;
        forward = [&] { sparse::sparse_attention(q, k, v, *pattern, so, out); };
        break;
      case Entry::Kind::kLinear:
        lo.feature_map = entry.name;
        lo.causal = o.causal;
        lo.num_threads = o.num_threads;
        forward = [&] { sparse::linear_attention(q, k, v, lo, out); };
        break;
    }
    const bool cleared = reset_peak_rss();
    const double before = cleared ? status_bytes("VmRSS") : status_bytes("VmHWM");
    forward();
    const double after = status_bytes("VmHWM");
    r.method = cleared ? 1 : 2;
    r.peak_bytes = (before >= 0 && after >= 0) ? std::max(0.0, after - before) : -1;
    std::vector<double> times;
    for (int rep = 0; rep < std::max(1, o.repeats); ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      forward();
      const auto t1 = std::chrono::steady_clock::now();
      times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(times.begin(), times.end());
    r.ms = times[times.size() / 2];
  } catch (const std::exception& e) {
    std::snprintf(r.error, sizeof r.error, "%s", e.what());
  }
  return r;
}

}  // namespace

std::vector<ProfilePoint> run_profile(const ProfileOptions& o) {
  const std::vector<std::string> names = kernel_names();
  std::string available;
  for (const auto& n : names) available += (available.empty() ? "" : ", ") + n;
  check(!o.kernels.empty() || !o.patterns.empty(), ErrorKind::kInvalidArgument,
        "kernels: expected at least one of: ", available, " (or a sparse pattern)");
  std::vector<Entry> entries;
  for (const auto& k : o.kernels) {
    check(std::find(names.begin(), names.end(), k) != names.end(), ErrorKind::kInvalidArgument, "kernels: '", k,
          "' is not a registered kernel; available: ", available);
    entries.push_back({k, Entry::Kind::kKernel, k});
  }
  for (const auto& spec : o.patterns) {
    if (spec.rfind(kLinearPrefix, 0) == 0) {
      const std::string fm = spec.substr(std::strlen(kLinearPrefix));
      check(fm == "elu" || fm == "favor+", ErrorKind::kInvalidArgument, "patterns: '", spec,
            "': expected linear:elu or linear:favor+");
      entries.push_back({spec, Entry::Kind::kLinear, fm});
      continue;
    }
    const sparse::Pattern p = sparse::Pattern::parse(spec);  // throws with the position of a syntax error
    check(!o.causal, ErrorKind::kInvalidArgument, "patterns: '", spec,
          "' with causal: write causality into the "
          "pattern instead (e.g. \"SlidingWindow(128, 0)\" or \"TopK(8) & SlidingWindow(-1, 0)\")");
    entries.push_back({p.repr(), Entry::Kind::kPattern, spec});
  }
  check(!o.lengths.empty() && !o.heads.empty(), ErrorKind::kInvalidArgument,
        "L/heads: expected at least one value each");
  for (int64_t L : o.lengths) check(L >= 1, ErrorKind::kInvalidArgument, "L: expected lengths >= 1, got ", L);
  for (int64_t h : o.heads) check(h >= 1, ErrorKind::kInvalidArgument, "heads: expected heads >= 1, got ", h);
  check(o.batch >= 1 && o.head_dim >= 1, ErrorKind::kInvalidArgument,
        "B/D: expected B >= 1 and D >= 1, got B=", o.batch, " D=", o.head_dim);
  check(o.repeats >= 1 && o.repeats <= 1000, ErrorKind::kInvalidArgument, "repeats: expected 1..1000, got ", o.repeats);

  std::vector<ProfilePoint> points;
  const size_t total = entries.size() * o.lengths.size() * o.heads.size();
  size_t index = 0;
  for (const Entry& entry : entries)
    for (int64_t heads : o.heads)
      for (int64_t L : o.lengths) {
        ProfilePoint pt;
        pt.kernel = entry.label;
        pt.length = L;
        pt.heads = heads;
        pt.analytic_mib = double(o.batch) * double(heads) * double(L) * double(L) * 4.0 / (1024.0 * 1024.0);
        if (o.progress)
          o.progress(index, total, entry.label + " L=" + std::to_string(L) + " heads=" + std::to_string(heads));
        ++index;
        int fds[2];
        check(pipe(fds) == 0, ErrorKind::kInternal, "profile: pipe() failed: ", std::strerror(errno));
        std::fflush(nullptr);
        const pid_t pid = fork();
        if (pid < 0) {
          close(fds[0]);
          close(fds[1]);
          fail(ErrorKind::kInternal, "profile: fork() failed: ", std::strerror(errno));
        }
        if (pid == 0) {  // child: measure, write the result, leave without running atexit handlers
          close(fds[0]);
          const ChildResult r = measure_point(o, entry, L, heads);
          const char* p = reinterpret_cast<const char*>(&r);
          size_t left = sizeof r;
          while (left > 0) {
            const ssize_t w = write(fds[1], p, left);
            if (w <= 0) break;
            p += w;
            left -= size_t(w);
          }
          close(fds[1]);
          _exit(0);
        }
        close(fds[1]);
        ChildResult r;
        char* p = reinterpret_cast<char*>(&r);
        size_t got = 0;
        while (got < sizeof r) {
          const ssize_t n = read(fds[0], p + got, sizeof r - got);
          if (n <= 0) break;
          got += size_t(n);
        }
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        if (got != sizeof r) {
          pt.error = WIFSIGNALED(status) ? "the measuring process was killed by signal " +
                                               std::to_string(WTERMSIG(status)) + " (out of memory?)"
                                         : "the measuring process exited without a result";
        } else if (r.error[0]) {
          pt.error = r.error;
        } else {
          pt.ms = r.ms;
          pt.peak_mib = r.peak_bytes / (1024.0 * 1024.0);
          pt.memory_method = r.method == 1 ? "clear_refs" : "hwm_delta";
        }
        points.push_back(pt);
      }
  if (o.progress) o.progress(total, total, "done");
  return points;
}

std::string profile_to_csv(const std::vector<ProfilePoint>& points) {
  std::ostringstream os;
  os << "kernel,L,heads,ms,peak_mib,analytic_mib\n";
  for (const auto& p : points) {
    if (p.kernel.find_first_of(",\"\n") == std::string::npos) {
      os << p.kernel;
    } else {  // RFC 4180: quoted, quotes doubled
      os << '"';
      for (char c : p.kernel) os << (c == '"' ? "\"\"" : std::string(1, c));
      os << '"';
    }
    os << "," << p.length << "," << p.heads << ",";
    if (p.error.empty()) os << p.ms << "," << p.peak_mib << ",";
    else os << ",,";
    os << p.analytic_mib << "\n";
  }
  return os.str();
}

std::string profile_to_table(const std::vector<ProfilePoint>& points) {
  std::ostringstream os;
  char buf[1024];
  int kw = 12;  // the kernel column fits the longest name (patterns are long)
  for (const auto& p : points) kw = std::max(kw, int(std::min<size_t>(p.kernel.size(), 120)));
  std::snprintf(buf, sizeof buf, "%-*s %7s %6s %12s %12s %14s\n", kw, "kernel", "L", "heads", "ms", "peak MiB",
                "analytic MiB");
  os << buf;
  for (const auto& p : points) {
    if (p.error.empty())
      std::snprintf(buf, sizeof buf, "%-*s %7lld %6lld %12.3f %12.2f %14.2f\n", kw, p.kernel.c_str(),
                    (long long)p.length, (long long)p.heads, p.ms, p.peak_mib, p.analytic_mib);
    else
      std::snprintf(buf, sizeof buf, "%-*s %7lld %6lld %12s %12s %14.2f  (%.300s)\n", kw, p.kernel.c_str(),
                    (long long)p.length, (long long)p.heads, "-", "-", p.analytic_mib, p.error.c_str());
    os << buf;
  }
  return os.str();
}

std::vector<viz::PlotSpec> profile_plot_specs(const std::vector<ProfilePoint>& points) {
  viz::PlotSpec time{"forward time", "L", "ms", true, true, {}};
  viz::PlotSpec mem{"peak memory", "L", "MiB", true, true, {}};
  std::vector<std::pair<std::string, int64_t>> keys;
  for (const auto& p : points)
    if (std::find(keys.begin(), keys.end(), std::make_pair(p.kernel, p.heads)) == keys.end())
      keys.emplace_back(p.kernel, p.heads);
  std::vector<int64_t> heads_seen;
  for (const auto& [kernel, heads] : keys) {
    viz::Series t{kernel + " h=" + std::to_string(heads), {}, {}, false};
    viz::Series m{kernel + " h=" + std::to_string(heads), {}, {}, false};
    for (const auto& p : points) {
      if (p.kernel != kernel || p.heads != heads || !p.error.empty()) continue;
      t.x.push_back(double(p.length));
      t.y.push_back(p.ms);
      m.x.push_back(double(p.length));
      m.y.push_back(p.peak_mib);
    }
    time.series.push_back(t);
    mem.series.push_back(m);
  }
  for (const auto& [kernel, heads] : keys) {
    if (std::find(heads_seen.begin(), heads_seen.end(), heads) != heads_seen.end()) continue;
    heads_seen.push_back(heads);
    viz::Series a{"analytic B*h*L^2*4 h=" + std::to_string(heads), {}, {}, true};
    for (const auto& p : points)
      if (p.heads == heads && p.kernel == kernel) {
        a.x.push_back(double(p.length));
        a.y.push_back(p.analytic_mib);
      }
    mem.series.push_back(a);
  }
  return {time, mem};
}

}  // namespace sattn
