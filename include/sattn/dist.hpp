// Ring (context-parallel) attention over MPI: exact self-attention over a sequence sharded across the ranks of a
// communicator. Each rank holds its shard of q, k and v; the K/V shards travel around the ring while every rank
// attends its queries to the block it holds, and the partial results merge through their log-sum-exp. The
// backward sends each block's dK/dV accumulators around the ring with it, so no rank holds more than two K/V
// blocks and two dK/dV blocks. See docs/distributed.md.
//
// Semantics: the result equals sattn's fused kernel on the gathered sequence (same options, same dropout seed),
// for any number of ranks and layout. Results are bitwise identical from run to run and for any thread count per
// rank (the merge order depends only on the number of ranks and the layout).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sattn/problem.hpp"
#include "sattn/tensor.hpp"

namespace sattn::dist {

// How the global sequence of length L is split over P ranks.
//   kContiguous  rank r holds one contiguous run; shard lengths may differ between ranks.
//   kZigzag      L divisible by 2P; rank r holds chunks r and 2P-1-r of 2P equal chunks, in that order
//                (ring-flash-attention's layout: every rank gets the same causal work).
//   kStriped     L divisible by P; rank r holds positions r, r+P, r+2P, ...
enum class Layout : uint8_t { kContiguous, kZigzag, kStriped };
const char* to_string(Layout layout);
// Parses "contiguous", "zigzag" or "striped" (throws sattn::Error naming `argument_name` otherwise).
Layout parse_layout(const std::string& text, const char* argument_name = "layout");

// A run of a shard's rows with evenly spaced global positions: local rows [local_start, local_start + length) sit
// at global positions global_start + stride·t, t = 0, 1, ...
struct Segment {
  int64_t local_start = 0, length = 0, global_start = 0, stride = 1;
};
// The segments of rank `rank`'s shard, given every rank's shard length (zigzag and striped need equal ones).
std::vector<Segment> shard_segments(Layout layout, int rank, const std::vector<int64_t>& shard_lengths);

struct RingOptions {
  Layout layout = Layout::kContiguous;
  bool causal = false;          // top-left on the global positions (PyTorch's is_causal)
  std::optional<double> scale;  // default 1/sqrt(D)
  TensorView key_lengths;       // optional int32/int64 [B]: global key lengths, the same on every rank
  double dropout_p = 0.0;       // keep(b, h, i, j) keyed by global positions i, j (random.hpp)
  uint64_t seed = 0;
  int num_threads = 0;  // per rank; 0 = SATTN_NUM_THREADS, else the hardware's
  Float32Precision float32_precision = Float32Precision::kHighest;
};

// What one call did on this rank.
struct RingStats {
  int steps = 0;                     // ring steps (= ranks)
  int64_t bytes_sent = 0;            // bytes this rank sent
  int64_t blocks_computed = 0;       // (query segment, key segment) pairs attended
  int64_t blocks_skipped = 0;        // pairs skipped as fully masked (causal or key lengths)
  double seconds = 0;                // wall time of the call
  double compute_seconds = 0;        // in the attention kernel and the merges
  std::vector<double> wait_seconds;  // per step: time spent waiting for messages after the step's compute
};

// q [B, Hq, Ls, D], k [B, Hkv, Ls, D], v [B, Hkv, Ls, Dv]: this rank's shard (Ls rows, as `layout` defines),
// f32, bf16 or f16; Hq a multiple of Hkv. out [B, Hq, Ls, Dv] (f32, bf16 or f16) and, optionally, lse
// [B, Hq, Ls] (f32) are caller-allocated. Collective over `comm`: every rank calls it. Arguments that differ
// between ranks, or that one rank gets wrong, raise sattn::Error on every rank (one collective check at entry);
// an error on one rank during the ring raises on every rank at the end of that step.
void ring_attention(const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& options,
                    MPI_Comm comm, const TensorView& out, const TensorView& lse = {}, RingStats* stats = nullptr);

// Gradients from the forward's out and lse (this rank's shards). dq, dk, dv: same shapes as q, k, v (f32, bf16 or
// f16), caller-allocated.
void ring_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const RingOptions& options, MPI_Comm comm,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             RingStats* stats = nullptr);

}  // namespace sattn::dist
