// Packed variable-length attention: each sequence runs as a B = 1 problem on views into the packed tensors
// (no copies, no padding), through the same kernel registry as scaled_dot_product_attention.
#include "sattn/varlen.hpp"

#include <cmath>
#include <vector>

#include "sattn/error.hpp"

namespace sattn {
namespace {

std::vector<int64_t> read_cu(const TensorView& cu, const char* name, int64_t total, int64_t max_seqlen,
                             const char* max_name) {
  check(cu.data != nullptr, ErrorKind::kInvalidArgument, name, ": required");
  check(cu.dtype == DType::kI32 || cu.dtype == DType::kI64, ErrorKind::kTypeError, name,
        ": expected int32 or int64, got ", to_string(cu.dtype));
  check(cu.dim() == 1 && cu.shape[0] >= 2, ErrorKind::kInvalidArgument, name,
        ": expected a 1-D array [num_sequences + 1] with at least 2 entries, got shape ", shape_text(cu.shape));
  std::vector<int64_t> v(static_cast<size_t>(cu.shape[0]));
  for (int64_t s = 0; s < cu.shape[0]; ++s) v[size_t(s)] = int64_t(cu.get({s}));
  check(v[0] == 0, ErrorKind::kInvalidArgument, name, "[0]: expected 0, got ", v[0]);
  for (size_t s = 1; s < v.size(); ++s) {
    check(v[s] >= v[s - 1], ErrorKind::kInvalidArgument, name, ": expected non-decreasing offsets, got ", v[s - 1],
          " then ", v[s], " at index ", s);
    check(v[s] - v[s - 1] <= max_seqlen, ErrorKind::kInvalidArgument, max_name,
          ": expected >= every sequence length, got ", max_seqlen, " but sequence ", s - 1, " has length ",
          v[s] - v[s - 1]);
  }
  check(v.back() == total, ErrorKind::kInvalidArgument, name, "[-1]: expected the total number of rows ", total,
        ", got ", v.back());
  return v;
}

void check_packed(const TensorView& t, const char* name, const char* layout) {
  check(t.data != nullptr, ErrorKind::kInvalidArgument, name, ": required");
  check(t.dim() == 3, ErrorKind::kInvalidArgument, name, ": expected a 3-D tensor ", layout, ", got shape ",
        shape_text(t.shape));
  check(t.strides.size() == 3, ErrorKind::kInvalidArgument, name, ": strides do not match the shape");
}

// Rows [r0, r1) of a packed [total, H, X] tensor as a [1, H, r1 - r0, X] view.
TensorView seq_view(const TensorView& t, int64_t r0, int64_t r1) {
  TensorView v;
  v.data = static_cast<unsigned char*>(t.data) + r0 * t.strides[0] * int64_t(dtype_size(t.dtype));
  v.dtype = t.dtype;
  v.shape = {1, t.shape[1], r1 - r0, t.shape[2]};
  v.strides = {0, t.strides[1], t.strides[0], t.strides[2]};
  return v;
}
// Columns [r0, r1) of lse [H, total] as [1, H, r1 - r0].
TensorView lse_view(const TensorView& t, int64_t r0, int64_t r1) {
  TensorView v;
  v.data = static_cast<unsigned char*>(t.data) + r0 * t.strides[1] * int64_t(dtype_size(t.dtype));
  v.dtype = t.dtype;
  v.shape = {1, t.shape[0], r1 - r0};
  v.strides = {0, t.strides[0], t.strides[1]};
  return v;
}

AttentionOptions to_options(const VarlenOptions& o) {
  AttentionOptions a;
  a.causal = o.causal ? Causal::kBottomRight : Causal::kNone;
  a.scale = o.scale;
  a.kernel = o.kernel;
  a.num_threads = o.num_threads;
  a.float32_precision = o.float32_precision;
  return a;
}

struct Layout {
  std::vector<int64_t> cq, ck;
};

Layout validate(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_q,
                const TensorView& cu_k, int64_t max_q, int64_t max_k) {
  check_packed(q, "query", "[total_q, Hq, D]");
  check_packed(k, "key", "[total_k, Hkv, D]");
  check_packed(v, "value", "[total_k, Hkv, Dv]");
  check(k.shape[0] == v.shape[0] && k.shape[1] == v.shape[1], ErrorKind::kInvalidArgument,
        "value: expected [total_k, Hkv, Dv] with total_k and Hkv of key ", shape_text(k.shape), ", got ",
        shape_text(v.shape));
  check(max_q >= 0 && max_k >= 0, ErrorKind::kInvalidArgument, "max_seqlen_q/max_seqlen_k: expected >= 0, got ", max_q,
        " and ", max_k);
  Layout l{read_cu(cu_q, "cu_seqlens_q", q.shape[0], max_q, "max_seqlen_q"),
           read_cu(cu_k, "cu_seqlens_k", k.shape[0], max_k, "max_seqlen_k")};
  check(l.cq.size() == l.ck.size(), ErrorKind::kInvalidArgument, "cu_seqlens_k: expected ", l.cq.size(),
        " entries (as cu_seqlens_q), got ", l.ck.size());
  return l;
}

}  // namespace

void flash_attn_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_q,
                       const TensorView& cu_k, int64_t max_q, int64_t max_k, const VarlenOptions& options,
                       const TensorView& out, const TensorView& lse) {
  const Layout l = validate(q, k, v, cu_q, cu_k, max_q, max_k);
  check_packed(out, "out", "[total_q, Hq, Dv]");
  check(out.shape == Shape{q.shape[0], q.shape[1], v.shape[2]}, ErrorKind::kInvalidArgument, "out: expected shape ",
        shape_text({q.shape[0], q.shape[1], v.shape[2]}), ", got ", shape_text(out.shape));
  if (lse.data)
    check(lse.dim() == 2 && lse.shape == Shape{q.shape[1], q.shape[0]}, ErrorKind::kInvalidArgument,
          "lse: expected shape [Hq, total_q] = ", shape_text({q.shape[1], q.shape[0]}), ", got ",
          shape_text(lse.shape));
  const AttentionOptions o = to_options(options);
  for (size_t s = 0; s + 1 < l.cq.size(); ++s) {
    const int64_t q0 = l.cq[s], q1 = l.cq[s + 1], k0 = l.ck[s], k1 = l.ck[s + 1];
    if (q1 == q0) continue;
    if (k1 == k0) {  // no keys: out = 0, lse = -inf
      for (int64_t i = q0; i < q1; ++i)
        for (int64_t h = 0; h < q.shape[1]; ++h) {
          for (int64_t x = 0; x < out.shape[2]; ++x) {
            const int64_t idx[3] = {i, h, x};
            out.set(idx, 0.0);
          }
          if (lse.data) {
            const int64_t idx[2] = {h, i};
            lse.set(idx, -HUGE_VAL);
          }
        }
      continue;
    }
    AttentionOutputs outs{seq_view(out, q0, q1), lse.data ? lse_view(lse, q0, q1) : TensorView{}, {}};
    scaled_dot_product_attention(seq_view(q, q0, q1), seq_view(k, k0, k1), seq_view(v, k0, k1), o, outs);
  }
}

void flash_attn_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse, const TensorView& cu_q,
                                const TensorView& cu_k, int64_t max_q, int64_t max_k, const VarlenOptions& options,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  const Layout l = validate(q, k, v, cu_q, cu_k, max_q, max_k);
  check_packed(dout, "dout", "[total_q, Hq, Dv]");
  check_packed(out, "out", "[total_q, Hq, Dv]");
  check(lse.data != nullptr && lse.dim() == 2 && lse.shape == Shape{q.shape[1], q.shape[0]},
        ErrorKind::kInvalidArgument, "lse: expected shape [Hq, total_q] = ", shape_text({q.shape[1], q.shape[0]}),
        ", got ", shape_text(lse.shape));
  check_packed(dq, "dq", "[total_q, Hq, D]");
  check_packed(dk, "dk", "[total_k, Hkv, D]");
  check_packed(dv, "dv", "[total_k, Hkv, Dv]");
  check(dq.shape == q.shape && dk.shape == k.shape && dv.shape == v.shape, ErrorKind::kInvalidArgument,
        "dq/dk/dv: expected the shapes of q, k, v");
  const AttentionOptions o = to_options(options);
  auto zero = [](const TensorView& t, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < t.shape[1]; ++h)
        for (int64_t x = 0; x < t.shape[2]; ++x) {
          const int64_t idx[3] = {r, h, x};
          t.set(idx, 0.0);
        }
  };
  for (size_t s = 0; s + 1 < l.cq.size(); ++s) {
    const int64_t q0 = l.cq[s], q1 = l.cq[s + 1], k0 = l.ck[s], k1 = l.ck[s + 1];
    if (q1 == q0 || k1 == k0) {  // nothing attends: zero gradients
      zero(dq, q0, q1);
      zero(dk, k0, k1);
      zero(dv, k0, k1);
      continue;
    }
    scaled_dot_product_attention_backward(seq_view(dout, q0, q1), seq_view(q, q0, q1), seq_view(k, k0, k1),
                                          seq_view(v, k0, k1), seq_view(out, q0, q1), lse_view(lse, q0, q1), o,
                                          {seq_view(dq, q0, q1), seq_view(dk, k0, k1), seq_view(dv, k0, k1), {}});
  }
}

}  // namespace sattn
