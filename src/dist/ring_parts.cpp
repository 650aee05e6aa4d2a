// Ring attention's entry check, K/V blocks and accumulators (src/dist/ring_internal.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "dist/ring_internal.hpp"
#include "sattn/attention.hpp"

namespace sattn::dist {

TensorView narrow_rows(const TensorView& t, int64_t start, int64_t n) {
  TensorView r = t;
  r.shape[2] = n;
  r.data = static_cast<char*>(t.data) + start * t.strides[2] * int64_t(dtype_size(t.dtype));
  return r;
}

AttentionOptions pair_options(const Ring& ring, const Segment& qs, const Segment& ks) {
  AttentionOptions o = ring.base;
  o.query_offset = qs.global_start;
  o.key_offset = ks.global_start;
  o.position_stride = qs.stride;
  return o;
}

bool pair_masked(const Ring& ring, const Segment& qs, const Segment& ks) {
  if (qs.length == 0 || ks.length == 0) return true;
  if (ring.causal && ks.global_start > qs.global_start + qs.stride * (qs.length - 1)) return true;
  return ring.max_key_length >= 0 && ks.global_start >= ring.max_key_length;
}

namespace {

float load_float(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[index];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(base)[index]);
    default: return float(static_cast<const double*>(base)[index]);
  }
}

void store_float(void* base, DType dtype, int64_t index, float x) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(base)[index] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[index] = float_to_bf16(x); break;
    case DType::kF16: static_cast<uint16_t*>(base)[index] = float_to_fp16(x); break;
    default: static_cast<double*>(base)[index] = x; break;
  }
}

int64_t offset_of(const TensorView& t, int64_t b, int64_t h, int64_t i, int64_t d = 0) {
  return b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + (t.dim() == 4 ? d * t.strides[3] : 0);
}

// dst = src element by element (any strides and float dtypes; same shape).
void copy_converting(const TensorView& src, const TensorView& dst) {
  const int64_t D = src.dim() == 4 ? src.shape[3] : 1;
  for (int64_t b = 0; b < src.shape[0]; ++b)
    for (int64_t h = 0; h < src.shape[1]; ++h)
      for (int64_t i = 0; i < src.shape[2]; ++i)
        for (int64_t d = 0; d < D; ++d)
          store_float(dst.data, dst.dtype, offset_of(dst, b, h, i, d),
                      load_float(src.data, src.dtype, offset_of(src, b, h, i, d)));
}

// dst += src (float32 views of the same shape).
void add_into(const TensorView& dst, const TensorView& src) {
  auto* d = static_cast<float*>(dst.data);
  const auto* s = static_cast<const float*>(src.data);
  for (int64_t b = 0; b < src.shape[0]; ++b)
    for (int64_t h = 0; h < src.shape[1]; ++h)
      for (int64_t i = 0; i < src.shape[2]; ++i)
        for (int64_t x = 0; x < src.shape[3]; ++x) d[offset_of(dst, b, h, i, x)] += s[offset_of(src, b, h, i, x)];
}

TensorView dense_f32(float* data, Shape shape) { return TensorView(data, DType::kF32, std::move(shape)); }

// ---- the entry check ----

enum Field : int {
  kBatch,
  kHeadsQ,
  kHeadsKV,
  kHeadDim,
  kHeadDimV,
  kDtypeQ,
  kDtypeKV,
  kDtypeOut,
  kLayout,
  kCausal,
  kScale,
  kDropout,
  kSeed,
  kKeyLengths,
  kPrecision,
  kLength,
  kFieldCount
};
constexpr const char* kFieldNames[kFieldCount] = {
    "batch",  "heads_q", "heads_kv", "head_dim",  "head_dim_v", "query dtype", "key/value dtype",   "out dtype",
    "layout", "causal",  "scale",    "dropout_p", "seed",       "key_lengths", "float32_precision", "shard length"};

struct Descriptor {  // one rank's call, gathered at entry
  std::array<int64_t, kFieldCount> field{};
  int64_t failed = 0;
  std::array<char, 240> error{};
};

int64_t bits_of(double x) {
  int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

std::string field_text(int f, int64_t value) {
  switch (f) {
    case kDtypeQ:
    case kDtypeKV:
    case kDtypeOut: return to_string(DType(value));
    case kLayout: return to_string(Layout(value));
    case kPrecision: return to_string(Float32Precision(value));
    case kScale:
    case kDropout: {
      double x = 0;
      std::memcpy(&x, &value, sizeof x);
      return value == -1 ? std::string("default") : message::concat(x);
    }
    case kKeyLengths: return value == -1 ? std::string("none") : message::concat("hash ", value);
    default: return message::concat(value);
  }
}

void check_float_dtype(const TensorView& t, const char* name) {
  check(t.dtype == DType::kF32 || t.dtype == DType::kBF16 || t.dtype == DType::kF16, ErrorKind::kTypeError, name,
        ": expected float32, bfloat16 or float16, got ", to_string(t.dtype));
}

// This rank's own checks; fills the descriptor's fields.
void describe_local(const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o,
                    const TensorView& out, const TensorView& lse, const GradViews* g, Descriptor& d) {
  AttentionOptions plain;
  plain.scale = o.scale;
  plain.dropout_p = o.dropout_p;
  const AttentionProblem p = describe_attention(q, k, v, plain, nullptr);
  check_float_dtype(q, "query");
  check(k.dtype == q.dtype && v.dtype == q.dtype, ErrorKind::kTypeError, "key, value: expected the query's dtype ",
        to_string(q.dtype), ", got ", to_string(k.dtype), " and ", to_string(v.dtype));
  check(p.len_q == p.len_k, ErrorKind::kInvalidArgument,
        "key: self-attention shards cover the same positions: expected Lk = Lq = ", p.len_q, ", got ", p.len_k);
  check(out.data != nullptr, ErrorKind::kInvalidArgument, "out: required");
  check_float_dtype(out, "out");
  check(out.shape == Shape{p.batch, p.heads_q, p.len_q, p.head_dim_v}, ErrorKind::kInvalidArgument,
        "out: expected shape [B, Hq, Ls, Dv] = ", shape_text({p.batch, p.heads_q, p.len_q, p.head_dim_v}), ", got ",
        shape_text(out.shape));
  if (lse.data || g) {
    check(lse.data != nullptr && lse.dtype == DType::kF32 && lse.shape == Shape{p.batch, p.heads_q, p.len_q},
          ErrorKind::kInvalidArgument, "lse: expected float32 of shape ", shape_text({p.batch, p.heads_q, p.len_q}),
          ", got ", to_string(lse.dtype), " ", shape_text(lse.shape));
  }
  if (g) {
    const std::pair<const TensorView*, const TensorView*> pairs[] = {
        {&g->dout, &out}, {&g->dq, &q}, {&g->dk, &k}, {&g->dv, &v}};
    const char* names[] = {"grad_out", "dq", "dk", "dv"};
    for (int x = 0; x < 4; ++x) {
      check(pairs[x].first->data != nullptr && pairs[x].first->shape == pairs[x].second->shape,
            ErrorKind::kInvalidArgument, names[x], ": expected shape ", shape_text(pairs[x].second->shape), ", got ",
            shape_text(pairs[x].first->shape));
      check_float_dtype(*pairs[x].first, names[x]);
    }
  }
  int64_t hash = -1;
  if (o.key_lengths.data) {
    const TensorView& kl = o.key_lengths;
    check(kl.dtype == DType::kI32 || kl.dtype == DType::kI64, ErrorKind::kTypeError,
          "key_lengths: expected int32 or int64 (global lengths), got ", to_string(kl.dtype));
    check(kl.shape == Shape{p.batch}, ErrorKind::kInvalidArgument, "key_lengths: expected shape [", p.batch, "], got ",
          shape_text(kl.shape));
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the lengths
    for (int64_t b = 0; b < p.batch; ++b) {
      const double len = kl.get({b});
      check(len >= 0 && len < 4294967296.0, ErrorKind::kInvalidArgument, "key_lengths[", b,
            "]: expected a global length in [0, 2^32), got ", int64_t(len));
      h = (h ^ uint64_t(len)) * 1099511628211ull;
    }
    hash = int64_t(h & 0x7fffffffffffffffull);
  }
  auto& f = d.field;
  f = {p.batch,
       p.heads_q,
       p.heads_kv,
       p.head_dim,
       p.head_dim_v,
       int64_t(q.dtype),
       int64_t(k.dtype),
       int64_t(out.dtype),
       int64_t(o.layout),
       o.causal ? 1 : 0,
       o.scale ? bits_of(*o.scale) : -1,
       bits_of(o.dropout_p),
       int64_t(o.seed),
       hash,
       int64_t(o.float32_precision),
       p.len_q};
}

// The first disagreement between the gathered descriptors, or "".
std::string find_disagreement(const std::vector<Descriptor>& all, Layout layout) {
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r].failed) return message::concat("rank ", r, ": ", all[r].error.data());
  for (int f = 0; f < kFieldCount; ++f) {
    if (f == kLength && layout == Layout::kContiguous) continue;  // any shard lengths
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r].field[size_t(f)] != all[0].field[size_t(f)])
        return message::concat("the ranks disagree on ", kFieldNames[f],
                               f == kLength ? message::concat(" (", to_string(layout), " needs equal shards)") : "",
                               ": rank 0 has ", field_text(f, all[0].field[size_t(f)]), ", rank ", r, " has ",
                               field_text(f, all[r].field[size_t(f)]));
  }
  for (size_t r = 0; r < all.size(); ++r) {
    const int64_t len = all[r].field[kLength];
    if (len < 1) return message::concat("rank ", r, ": every shard needs at least one row, got length ", len);
    if (layout == Layout::kZigzag && len % 2 != 0)
      return message::concat("rank ", r, ": zigzag shards hold two equal chunks, so their length must be even, got ",
                             len);
  }
  return {};
}

}  // namespace

Ring enter_ring(const char* name, const TensorView& q, const TensorView& k, const TensorView& v, const RingOptions& o,
                MPI_Comm comm, const TensorView& out, const TensorView& lse, const GradViews* grads) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  check(initialized != 0, ErrorKind::kInvalidArgument, name,
        ": MPI is not initialised (C++: call MPI_Init_thread first; Python: import mpi4py.MPI)");
  Ring ring;
  ring.name = name;
  ring.comm = comm;
  MPI_Comm_rank(comm, &ring.rank);
  MPI_Comm_size(comm, &ring.size);
  Descriptor mine;
  try {
    describe_local(q, k, v, o, out, lse, grads, mine);
  } catch (const Error& e) {
    mine.failed = 1;
    std::strncpy(mine.error.data(), e.what(), mine.error.size() - 1);
  }
  std::vector<Descriptor> all(size_t(ring.size));
  MPI_Allgather(&mine, sizeof(Descriptor), MPI_BYTE, all.data(), sizeof(Descriptor), MPI_BYTE, comm);
  const std::string why = find_disagreement(all, o.layout);
  check(why.empty(), ErrorKind::kInvalidArgument, name, ": ", why);

  ring.B = q.shape[0], ring.Hq = q.shape[1], ring.Hkv = k.shape[1], ring.len = q.shape[2];
  ring.D = q.shape[3], ring.Dv = v.shape[3], ring.dtype_kv = k.dtype;
  for (const Descriptor& d : all) ring.lengths.push_back(d.field[kLength]);
  for (int r = 0; r < ring.size; ++r) ring.segments.push_back(shard_segments(o.layout, r, ring.lengths));
  ring.causal = o.causal;
  AttentionOptions& b = ring.base;
  b.kernel = "fused";
  b.strict = true;
  b.causal = o.causal ? Causal::kTopLeft : Causal::kNone;
  b.scale = o.scale;
  b.dropout_p = o.dropout_p, b.seed = o.seed;
  b.key_lengths = o.key_lengths;
  b.num_threads = o.num_threads;
  b.float32_precision = o.float32_precision;
  if (o.key_lengths.data)
    for (int64_t x = 0; x < ring.B; ++x)
      ring.max_key_length = std::max(ring.max_key_length, int64_t(o.key_lengths.get({x})));
  return ring;
}

// ---- K/V blocks ----

KVBlocks::KVBlocks(const Ring& ring, const TensorView& k, const TensorView& v) : ring_(ring) {
  const int64_t cap = bytes_of(int(std::max_element(ring.lengths.begin(), ring.lengths.end()) - ring.lengths.begin()));
  buf_[0].reset(new unsigned char[size_t(cap)]);
  if (ring.size > 1) buf_[1].reset(new unsigned char[size_t(cap)]);
  copy_converting(k, k_view(ring.rank));
  copy_converting(v, v_view(ring.rank));
}

int64_t KVBlocks::bytes_of(int rank) const {
  return ring_.B * ring_.Hkv * ring_.lengths[size_t(rank)] * (ring_.D + ring_.Dv) * int64_t(dtype_size(ring_.dtype_kv));
}

TensorView KVBlocks::k_view(int src) const {
  return TensorView(current(), ring_.dtype_kv, {ring_.B, ring_.Hkv, ring_.lengths[size_t(src)], ring_.D});
}

TensorView KVBlocks::v_view(int src) const {
  const int64_t len = ring_.lengths[size_t(src)];
  auto* base =
      static_cast<unsigned char*>(current()) + ring_.B * ring_.Hkv * len * ring_.D * dtype_size(ring_.dtype_kv);
  return TensorView(base, ring_.dtype_kv, {ring_.B, ring_.Hkv, len, ring_.Dv});
}

// ---- the forward's accumulator ----

Accumulator::Accumulator(const Ring& ring, const TensorView& out, const TensorView& lse) : ring_(ring) {
  if (out.dtype == DType::kF32) {
    out_ = out;
  } else {
    own_out_.resize(size_t(ring.B * ring.Hq * ring.len * ring.Dv));
    out_ = dense_f32(own_out_.data(), {ring.B, ring.Hq, ring.len, ring.Dv});
  }
  if (lse.data) {
    lse_ = lse;
  } else {
    own_lse_.resize(size_t(ring.B * ring.Hq * ring.len));
    lse_ = dense_f32(own_lse_.data(), {ring.B, ring.Hq, ring.len});
  }
}

void Accumulator::merge(const Segment& s, const float* part_out, const float* part_lse) const {
  const TensorView o = out_rows(s), l = lse_rows(s);
  auto* od = static_cast<float*>(o.data);
  auto* ld = static_cast<float*>(l.data);
  const int64_t Dv = ring_.Dv;
  for (int64_t b = 0; b < ring_.B; ++b)
    for (int64_t h = 0; h < ring_.Hq; ++h)
      for (int64_t i = 0; i < s.length; ++i) {
        const int64_t row = (b * ring_.Hq + h) * s.length + i;
        const double l2 = part_lse[row];
        if (l2 == -std::numeric_limits<double>::infinity()) continue;  // no key of this block for this row
        float& l1f = ld[offset_of(l, b, h, i)];
        const double l1 = l1f;
        // (o1, l1) ⊕ (o2, l2) = (w1·o1 + w2·o2) / (w1 + w2), with w = e^(l − max(l1, l2)); lse = max + log(w1 + w2).
        const double m = std::max(l1, l2);
        const double w1 = l1 == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(l1 - m);
        const double w2 = std::exp(l2 - m), inv = 1.0 / (w1 + w2);
        for (int64_t x = 0; x < Dv; ++x) {
          float& y = od[offset_of(o, b, h, i, x)];
          y = float((w1 * y + w2 * part_out[row * Dv + x]) * inv);
        }
        l1f = float(m + std::log(w1 + w2));
      }
}

void Accumulator::finish(const std::vector<bool>& written, const TensorView& out) const {
  const auto& segs = ring_.segments[size_t(ring_.rank)];
  for (size_t a = 0; a < segs.size(); ++a) {
    if (written[a]) continue;  // never reached by any key: out = 0, lse = -inf
    const TensorView o = out_rows(segs[a]), l = lse_rows(segs[a]);
    for (int64_t b = 0; b < ring_.B; ++b)
      for (int64_t h = 0; h < ring_.Hq; ++h)
        for (int64_t i = 0; i < segs[a].length; ++i) {
          static_cast<float*>(l.data)[offset_of(l, b, h, i)] = -std::numeric_limits<float>::infinity();
          for (int64_t x = 0; x < ring_.Dv; ++x) static_cast<float*>(o.data)[offset_of(o, b, h, i, x)] = 0.f;
        }
  }
  if (out.data != out_.data) copy_converting(out_, out);  // lse_ is the caller's lse when one is given
}

// ---- the backward's accumulators ----

namespace {

// The backward runs each (query segment, key segment) pair in pieces of an eighth of a shard (256 to 2048 rows) on
// both sides: the fused backward's scratch (packed query tiles, a partial dQ per group of key tiles) and the
// scratch of the contributions after a piece's first grow with the rows of a call, so pieces keep them a small
// fraction of the ring's own memory. Their extra work (packing, adding dQ or dK/dV) is O(rows·D) a call.
std::vector<Segment> backward_pieces(const std::vector<Segment>& segments, int64_t shard_len) {
  const int64_t piece = std::clamp<int64_t>(shard_len / 8, 256, 2048);
  std::vector<Segment> pieces;
  for (const Segment& s : segments)
    for (int64_t t = 0; t < s.length; t += piece)
      pieces.push_back({s.local_start + t, std::min(piece, s.length - t), s.global_start + s.stride * t, s.stride});
  return pieces;
}

}  // namespace

GradAccumulators::GradAccumulators(const Ring& ring) : ring_(ring) {
  const int64_t lmax = *std::max_element(ring.lengths.begin(), ring.lengths.end());
  dq_.assign(size_t(ring.B * ring.Hq * ring.len * ring.D), 0.f);
  step_dk_.resize(size_t(ring.B * ring.Hkv * lmax * ring.D));
  step_dv_.resize(size_t(ring.B * ring.Hkv * lmax * ring.Dv));
  q_pieces_ = backward_pieces(ring.segments[size_t(ring.rank)], ring.len);
  q_written_.assign(q_pieces_.size(), false);
  const size_t cap = size_t(ring.B * ring.Hkv * lmax * (ring.D + ring.Dv));
  dkv_[0].reset(new float[cap]);
  std::fill_n(dkv_[0].get(), cap, 0.f);  // our own block's accumulators start at zero
  if (ring.size > 1) dkv_[1].reset(new float[cap]);
}

int64_t GradAccumulators::dkv_bytes_of(int rank) const {
  return ring_.B * ring_.Hkv * ring_.lengths[size_t(rank)] * (ring_.D + ring_.Dv) * int64_t(sizeof(float));
}

void GradAccumulators::compute_step(const TensorView& q, const KVBlocks& blocks, int src, const GradViews& g,
                                    RingStats& stats) {
  const int64_t B = ring_.B, Hq = ring_.Hq, Hkv = ring_.Hkv, D = ring_.D, Dv = ring_.Dv,
                Lb = ring_.lengths[size_t(src)];
  const TensorView step_dk = dense_f32(step_dk_.data(), {B, Hkv, Lb, D});
  const TensorView step_dv = dense_f32(step_dv_.data(), {B, Hkv, Lb, Dv});
  const TensorView dq_all = dense_f32(dq_.data(), {B, Hq, ring_.len, D});
  const auto& qsegs = q_pieces_;
  k_pieces_ = backward_pieces(ring_.segments[size_t(src)], Lb);
  const auto& ksegs = k_pieces_;
  step_written_.assign(ksegs.size(), false);
  for (size_t a = 0; a < qsegs.size(); ++a)
    for (size_t c = 0; c < ksegs.size(); ++c) {
      const Segment &qs = qsegs[a], &ks = ksegs[c];
      if (pair_masked(ring_, qs, ks)) {
        ++stats.blocks_skipped;
        continue;
      }
      ++stats.blocks_computed;
      const AttentionOptions o = pair_options(ring_, qs, ks);
      // First contributions go straight into the accumulators; later ones through scratch, then added.
      const bool dq_direct = !q_written_[a], dkv_direct = !step_written_[c];
      scratch_q_.resize(dq_direct ? 0 : size_t(B * Hq * qs.length * D));
      scratch_k_.resize(dkv_direct ? 0 : size_t(B * Hkv * ks.length * D));
      scratch_v_.resize(dkv_direct ? 0 : size_t(B * Hkv * ks.length * Dv));
      const TensorView dq_to = dq_direct ? narrow_rows(dq_all, qs.local_start, qs.length)
                                         : dense_f32(scratch_q_.data(), {B, Hq, qs.length, D});
      const TensorView dk_to = dkv_direct ? narrow_rows(step_dk, ks.local_start, ks.length)
                                          : dense_f32(scratch_k_.data(), {B, Hkv, ks.length, D});
      const TensorView dv_to = dkv_direct ? narrow_rows(step_dv, ks.local_start, ks.length)
                                          : dense_f32(scratch_v_.data(), {B, Hkv, ks.length, Dv});
      scaled_dot_product_attention_backward(
          narrow_rows(g.dout, qs.local_start, qs.length), narrow_rows(q, qs.local_start, qs.length),
          narrow_rows(blocks.k_view(src), ks.local_start, ks.length),
          narrow_rows(blocks.v_view(src), ks.local_start, ks.length), narrow_rows(g.out, qs.local_start, qs.length),
          narrow_rows(g.lse, qs.local_start, qs.length), o, {dq_to, dk_to, dv_to, {}});
      if (!dq_direct) add_into(narrow_rows(dq_all, qs.local_start, qs.length), dq_to);
      if (!dkv_direct) {
        add_into(narrow_rows(step_dk, ks.local_start, ks.length), dk_to);
        add_into(narrow_rows(step_dv, ks.local_start, ks.length), dv_to);
      }
      q_written_[a] = step_written_[c] = true;
    }
}

void GradAccumulators::add_block_contributions(int src) {
  const int64_t B = ring_.B, Hkv = ring_.Hkv, D = ring_.D, Dv = ring_.Dv, Lb = ring_.lengths[size_t(src)];
  float* dk = dkv_[cur_].get();
  float* dv = dk + B * Hkv * Lb * D;
  const TensorView acc_k = dense_f32(dk, {B, Hkv, Lb, D}), acc_v = dense_f32(dv, {B, Hkv, Lb, Dv});
  const TensorView step_k = dense_f32(step_dk_.data(), {B, Hkv, Lb, D});
  const TensorView step_v = dense_f32(step_dv_.data(), {B, Hkv, Lb, Dv});
  const auto& ksegs = k_pieces_;  // of src's block, from compute_step
  for (size_t c = 0; c < ksegs.size(); ++c) {
    if (c >= step_written_.size() || !step_written_[c]) continue;
    add_into(narrow_rows(acc_k, ksegs[c].local_start, ksegs[c].length),
             narrow_rows(step_k, ksegs[c].local_start, ksegs[c].length));
    add_into(narrow_rows(acc_v, ksegs[c].local_start, ksegs[c].length),
             narrow_rows(step_v, ksegs[c].local_start, ksegs[c].length));
  }
}

void GradAccumulators::finish(const TensorView& dq, const TensorView& dk, const TensorView& dv) const {
  const int64_t B = ring_.B, Hkv = ring_.Hkv, D = ring_.D, Dv = ring_.Dv, L = ring_.len;
  copy_converting(dense_f32(const_cast<float*>(dq_.data()), {B, ring_.Hq, L, D}), dq);
  float* k = dkv_[cur_].get();
  copy_converting(dense_f32(k, {B, Hkv, L, D}), dk);
  copy_converting(dense_f32(k + B * Hkv * L * D, {B, Hkv, L, Dv}), dv);
}

}  // namespace sattn::dist
