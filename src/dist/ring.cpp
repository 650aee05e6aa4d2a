// Ring attention over MPI (sattn/dist.hpp). Per step, every rank attends the segments of its query shard to the
// segments of the K/V block it holds (the fused kernel, told the global positions through query_offset,
// key_offset and position_stride), while the next block travels in the background; partial results merge through
// their log-sum-exp in step order. The backward adds each block's dK/dV contribution to accumulators that travel
// with the block and come home after P hops.
#include "sattn/dist.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>

#include "core/env.hpp"
#include "dist/ring_internal.hpp"
#include "sattn/attention.hpp"

namespace sattn::dist {

const char* to_string(Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kZigzag: return "zigzag";
    case Layout::kStriped: return "striped";
  }
  return "?";
}

Layout parse_layout(const std::string& text, const char* argument_name) {
  if (text == "contiguous") return Layout::kContiguous;
  if (text == "zigzag") return Layout::kZigzag;
  if (text == "striped") return Layout::kStriped;
  fail(ErrorKind::kInvalidArgument, argument_name, ": expected \"contiguous\", \"zigzag\" or \"striped\", got \"", text,
       "\"");
}

std::vector<Segment> shard_segments(Layout layout, int rank, const std::vector<int64_t>& shard_lengths) {
  const int size = int(shard_lengths.size());
  check(rank >= 0 && rank < size, ErrorKind::kInvalidArgument, "rank: expected one in [0, ", size, "), got ", rank);
  const int64_t len = shard_lengths[size_t(rank)];
  switch (layout) {
    case Layout::kContiguous: {
      int64_t start = 0;
      for (int r = 0; r < rank; ++r) start += shard_lengths[size_t(r)];
      return {{0, len, start, 1}};
    }
    case Layout::kZigzag: {
      const int64_t chunk = len / 2;  // rank r: chunks r and 2P-1-r of 2P
      return {{0, chunk, rank * chunk, 1}, {chunk, chunk, (2 * int64_t(size) - 1 - rank) * chunk, 1}};
    }
    case Layout::kStriped: return {{0, len, rank, size}};
  }
  return {};
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Non-blocking sends and receives, progressed by a background thread (MPI_Testall every 100 µs; Open MPI moves
// large messages only inside MPI calls) while the kernel computes. The thread is the only one calling MPI until
// wait(), so MPI_THREAD_SERIALIZED suffices; with less, progress happens in wait() alone.
class Exchange {
 public:
  Exchange(MPI_Comm comm, bool threaded) : comm_(comm), threaded_(threaded) {}
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;
  ~Exchange() {
    if (!requests_.empty()) wait();
  }

  void send(const void* buf, int64_t bytes, int dest, int tag) {
    bytes_sent_ += bytes;
    for_chunks(bytes, [&](int64_t off, int n) {
      requests_.emplace_back();
      MPI_Isend(static_cast<const char*>(buf) + off, n, MPI_BYTE, dest, tag, comm_, &requests_.back());
    });
  }
  void recv(void* buf, int64_t bytes, int source, int tag) {
    for_chunks(bytes, [&](int64_t off, int n) {
      requests_.emplace_back();
      MPI_Irecv(static_cast<char*>(buf) + off, n, MPI_BYTE, source, tag, comm_, &requests_.back());
    });
  }
  void start() {
    if (!threaded_ || requests_.empty()) return;
    stop_ = false;
    thread_ = std::thread([this] {
      int done = 0;
      while (!stop_.load(std::memory_order_relaxed)) {
        MPI_Testall(int(requests_.size()), requests_.data(), &done, MPI_STATUSES_IGNORE);
        if (done) return;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
  }
  // Completes everything posted; returns the seconds spent waiting here.
  double wait() {
    const auto t0 = Clock::now();
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
    }
    if (!requests_.empty()) MPI_Waitall(int(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
    return seconds_since(t0);
  }
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  template <typename F>
  static void for_chunks(int64_t bytes, F&& f) {  // MPI counts are int: messages go in pieces of <= 1 GiB
    constexpr int64_t kPiece = int64_t(1) << 30;
    for (int64_t off = 0; off < bytes; off += kPiece) f(off, int(std::min(kPiece, bytes - off)));
  }
  MPI_Comm comm_;
  bool threaded_;
  std::vector<MPI_Request> requests_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  int64_t bytes_sent_ = 0;
};

bool mpi_threads_allow_progress_thread() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return provided >= MPI_THREAD_SERIALIZED;
}

// Raises on every rank when any rank failed during a step (the failing rank rethrows its own error).
void agree_on_failure(const Ring& ring, std::exception_ptr& error, ErrorKind kind, int step) {
  int code = error ? ((int(kind) + 1) << 16) | (ring.rank + 1) : 0;
  MPI_Allreduce(MPI_IN_PLACE, &code, 1, MPI_INT, MPI_MAX, ring.comm);
  if (code == 0) return;
  if (error) std::rethrow_exception(error);
  fail(ErrorKind((code >> 16) - 1), ring.name, ": rank ", (code & 0xffff) - 1, " failed at ring step ", step,
       " (its own error says why); every rank stops");
}

// SATTN_TEST_RING_FAULT=RANK:STEP makes that rank fail at that step, after the entry check (the tests of the
// error agreement use it); anything else leaves the ring alone.
void injected_fault(const Ring& ring, int step) {
  const auto spec = env::get("SATTN_TEST_RING_FAULT");
  int rank = -1, at = -1;
  if (spec && std::sscanf(spec->c_str(), "%d:%d", &rank, &at) == 2 && rank == ring.rank && at == step)
    fail(ErrorKind::kInternal, ring.name, ": rank ", rank, " failed at ring step ", step,
         " (injected: SATTN_TEST_RING_FAULT)");
}

// Posts the exchange of a step's K/V block: the one held goes to rank + 1 while rank − 1's arrives (none after
// the last step).
void pass_block_on(const Ring& ring, const KVBlocks& blocks, int step, Exchange& ex) {
  const int P = ring.size, src = (ring.rank - step + P) % P;
  if (step + 1 < P) {
    ex.recv(blocks.next(), blocks.bytes_of((src - 1 + P) % P), (ring.rank - 1 + P) % P, 1);
    ex.send(blocks.current(), blocks.bytes_of(src), (ring.rank + 1) % P, 1);
  }
  ex.start();
}

}  // namespace

// ---- forward ------------------------------------------------------------------------------------------------

void ring_attention(const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& options,
                    MPI_Comm comm, const TensorView& out, const TensorView& lse, RingStats* stats) {
  const auto t0 = Clock::now();
  Ring ring = enter_ring("ring_attention", q, k, v, options, comm, out, lse, nullptr);
  const int P = ring.size;
  const int64_t B = ring.B, Hq = ring.Hq, Dv = ring.Dv;
  Accumulator acc(ring, out, lse);
  KVBlocks blocks(ring, k, v);
  std::vector<float> part_out, part_lse;
  std::vector<bool> written(ring.segments[size_t(ring.rank)].size(), false);
  RingStats st;
  st.steps = P;
  const bool threaded = mpi_threads_allow_progress_thread();
  for (int step = 0; step < P; ++step) {
    const int src = (ring.rank - step + P) % P;
    Exchange ex(comm, threaded);
    pass_block_on(ring, blocks, step, ex);
    const auto tc = Clock::now();
    std::exception_ptr error;
    ErrorKind kind = ErrorKind::kInternal;
    try {
      injected_fault(ring, step);
      const auto& qsegs = ring.segments[size_t(ring.rank)];
      for (size_t a = 0; a < qsegs.size(); ++a)
        for (const Segment& ks : ring.segments[size_t(src)]) {
          const Segment& qs = qsegs[a];
          if (pair_masked(ring, qs, ks)) {
            ++st.blocks_skipped;
            continue;
          }
          ++st.blocks_computed;
          const AttentionOptions o = pair_options(ring, qs, ks);
          const TensorView qv = narrow_rows(q, qs.local_start, qs.length);
          const TensorView kv = narrow_rows(blocks.k_view(src), ks.local_start, ks.length);
          const TensorView vv = narrow_rows(blocks.v_view(src), ks.local_start, ks.length);
          if (!written[a]) {  // the first contribution goes straight into the accumulator
            scaled_dot_product_attention(qv, kv, vv, o, {acc.out_rows(qs), acc.lse_rows(qs), {}});
            written[a] = true;
            continue;
          }
          part_out.resize(size_t(B * Hq * qs.length * Dv));
          part_lse.resize(size_t(B * Hq * qs.length));
          const TensorView po(part_out.data(), DType::kF32, {B, Hq, qs.length, Dv});
          const TensorView pl(part_lse.data(), DType::kF32, {B, Hq, qs.length});
          scaled_dot_product_attention(qv, kv, vv, o, {po, pl, {}});
          acc.merge(qs, part_out.data(), part_lse.data());
        }
    } catch (const Error& e) {
      error = std::current_exception(), kind = e.kind();
    } catch (const std::bad_alloc&) {
      error = std::current_exception(), kind = ErrorKind::kOutOfMemory;
    }
    st.compute_seconds += seconds_since(tc);
    st.wait_seconds.push_back(ex.wait());
    st.bytes_sent += ex.bytes_sent();
    agree_on_failure(ring, error, kind, step);
    blocks.rotate();
  }
  acc.finish(written, out);
  st.seconds = seconds_since(t0);
  if (stats) *stats = std::move(st);
}

// ---- backward -----------------------------------------------------------------------------------------------

void ring_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const RingOptions& options, MPI_Comm comm,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv, RingStats* stats) {
  const auto t0 = Clock::now();
  const GradViews grads{dout, out, lse, dq, dk, dv};
  Ring ring = enter_ring("ring_attention_backward", q, k, v, options, comm, out, lse, &grads);
  const int P = ring.size;
  KVBlocks blocks(ring, k, v);
  GradAccumulators g(ring);
  RingStats st;
  st.steps = P;
  const bool threaded = mpi_threads_allow_progress_thread();
  Exchange dkv_exchange(comm, threaded);  // the dK/dV accumulators of the block held next
  for (int step = 0; step < P; ++step) {
    const int src = (ring.rank - step + P) % P;
    Exchange ex(comm, threaded);
    pass_block_on(ring, blocks, step, ex);
    const auto tc = Clock::now();
    std::exception_ptr error;
    ErrorKind kind = ErrorKind::kInternal;
    try {
      injected_fault(ring, step);
      g.compute_step(q, blocks, src, grads, st);
    } catch (const Error& e) {
      error = std::current_exception(), kind = e.kind();
    } catch (const std::bad_alloc&) {
      error = std::current_exception(), kind = ErrorKind::kOutOfMemory;
    }
    double waited = dkv_exchange.wait();  // src's accumulators (step 0: our own, zero)
    if (!error) g.add_block_contributions(src);
    st.compute_seconds += seconds_since(tc) - waited;
    if (P > 1) {  // pass them on: to the next holder, and after the last step home to their owner (rank + 1)
      dkv_exchange.recv(g.dkv_next(), g.dkv_bytes_of((src - 1 + P) % P), (ring.rank - 1 + P) % P, 2);
      dkv_exchange.send(g.dkv_current(), g.dkv_bytes_of(src), (ring.rank + 1) % P, 2);
      dkv_exchange.start();
    }
    waited += ex.wait();
    st.wait_seconds.push_back(waited);
    st.bytes_sent += ex.bytes_sent();
    agree_on_failure(ring, error, kind, step);
    blocks.rotate();
    if (P > 1) g.rotate();
  }
  st.wait_seconds.back() += dkv_exchange.wait();  // our own block's accumulators, home
  st.bytes_sent += dkv_exchange.bytes_sent();
  g.finish(dq, dk, dv);
  st.seconds = seconds_since(t0);
  if (stats) *stats = std::move(st);
}

}  // namespace sattn::dist
