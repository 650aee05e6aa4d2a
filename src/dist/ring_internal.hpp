// The parts of ring attention (src/dist/ring.cpp): the validated call, the K/V blocks that travel, and the
// accumulators of the forward and the backward.
#pragma once

#include <memory>
#include <vector>

#include "sattn/dist.hpp"

namespace sattn::dist {

// One validated ring call, the same on every rank except `rank`.
struct Ring {
  const char* name = "";
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  int64_t B = 0, Hq = 0, Hkv = 0, len = 0, D = 0, Dv = 0;  // len: this rank's shard length
  DType dtype_kv = DType::kF32;
  std::vector<int64_t> lengths;                // every rank's shard length
  std::vector<std::vector<Segment>> segments;  // every rank's segments
  AttentionOptions base;                       // fused kernel, scale, dropout, key_lengths (global), threads
  bool causal = false;
  int64_t max_key_length = -1;  // the largest global key length; -1 without key_lengths
};

// The backward's extra arguments.
struct GradViews {
  const TensorView &dout, &out, &lse, &dq, &dk, &dv;
};

// Rows [start, start + n) of dimension 2 (the sequence) of a 3-D or 4-D view; no copy.
TensorView narrow_rows(const TensorView& t, int64_t start, int64_t n);

// Attention options of one (query segment, key segment) pair: the global positions of both.
AttentionOptions pair_options(const Ring& ring, const Segment& qs, const Segment& ks);
// Whether the pair has no allowed key for any query: causal with every key after every query, or every key past
// every batch entry's key length. Such pairs are skipped.
bool pair_masked(const Ring& ring, const Segment& qs, const Segment& ks);

// Validates this rank's arguments, then checks collectively that every rank's agree (one MPI_Allgather). Throws
// the same sattn::Error on every rank when any rank's arguments are wrong or they disagree.
Ring enter_ring(const char* name, const TensorView& q, const TensorView& k, const TensorView& v,
                const RingOptions& options, MPI_Comm comm, const TensorView& out, const TensorView& lse,
                const GradViews* grads);

// Two buffers holding a K/V block each ([B, Hkv, L_src, D] keys, then [B, Hkv, L_src, Dv] values, dense, in the
// inputs' dtype): the current one is attended and sent on while the next one is received.
class KVBlocks {
 public:
  KVBlocks(const Ring& ring, const TensorView& k, const TensorView& v);
  void* current() const { return buf_[cur_].get(); }
  void* next() const { return buf_[cur_ ^ 1].get(); }
  int64_t bytes_of(int rank) const;
  TensorView k_view(int src) const;  // of the current buffer, holding rank src's block
  TensorView v_view(int src) const;
  void rotate() { cur_ ^= 1; }

 private:
  const Ring& ring_;
  std::unique_ptr<unsigned char[]> buf_[2];
  int cur_ = 0;
};

// The forward's running (out, lse) in float32: the caller's out/lse when they are float32, else its own.
class Accumulator {
 public:
  Accumulator(const Ring& ring, const TensorView& out, const TensorView& lse);
  TensorView out_rows(const Segment& s) const { return narrow_rows(out_, s.local_start, s.length); }
  TensorView lse_rows(const Segment& s) const { return narrow_rows(lse_, s.local_start, s.length); }
  // Folds a partial result (dense [B, Hq, s.length, Dv] and [B, Hq, s.length]) into the rows of segment s.
  void merge(const Segment& s, const float* part_out, const float* part_lse) const;
  // Rows that no key reached get out = 0, lse = -inf; then out goes to the caller's (lse already is the caller's).
  void finish(const std::vector<bool>& written, const TensorView& out) const;

 private:
  const Ring& ring_;
  std::vector<float> own_out_, own_lse_;
  TensorView out_, lse_;
};

// The backward's accumulators: dq of this rank's queries, and the dK/dV of the block held, which travel with it.
class GradAccumulators {
 public:
  explicit GradAccumulators(const Ring& ring);
  // Every unmasked (query segment, key segment) pair against rank src's block: dq += its part; the block's part of
  // dK/dV into the step's buffer (added by add_block_contributions once the travelling accumulators arrived).
  void compute_step(const TensorView& q, const KVBlocks& blocks, int src, const GradViews& g, RingStats& stats);
  void add_block_contributions(int src);
  void* dkv_current() const { return dkv_[cur_].get(); }
  void* dkv_next() const { return dkv_[cur_ ^ 1].get(); }
  int64_t dkv_bytes_of(int rank) const;
  void rotate() { cur_ ^= 1; }
  void finish(const TensorView& dq, const TensorView& dk, const TensorView& dv) const;

 private:
  const Ring& ring_;
  std::vector<float> dq_, step_dk_, step_dv_, scratch_q_, scratch_k_, scratch_v_;
  std::vector<Segment> q_pieces_, k_pieces_;  // this rank's query segments and the step's key segments in pieces
  std::vector<bool> q_written_, step_written_;
  std::unique_ptr<float[]> dkv_[2];
  int cur_ = 0;
};

}  // namespace sattn::dist
