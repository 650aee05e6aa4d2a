// The pattern API: a Pattern's block mask and element predicate, plus the built-in score mods, run by the engine.
#include "sattn/sparse.hpp"

#include <cmath>

#include "sattn/error.hpp"
#include "sparse/engine.hpp"
#include "sparse/adaptive.hpp"
#include "sparse/pattern_node.hpp"

namespace sattn::sparse {

namespace {

// Built-in score mods (see SparseOptions). Parameters (for gradients): [bias (Hb*Lq*Lk)] [rel_pos_bias].
struct BuiltinMod {
  float cap = 0.0f;
  const float* slopes = nullptr;
  int64_t off = 0, lq = 0, lk = 0;
  const float* bias = nullptr;
  int64_t bias_heads = 1, bias_params = 0;
  const float* rel = nullptr;
  int64_t rel_heads = 0, win = 0, width = 0, rel_params = 0;

  bool identity() const { return cap == 0.0f && !slopes && !bias && !rel; }
  int64_t num_params() const { return bias_params + rel_params; }
  int64_t rel_index(int64_t i, int64_t j) const {
    const int64_t dr = i / width - j / width, dc = i % width - j % width;
    if (std::abs(dr) >= win || std::abs(dc) >= win) return -1;
    return (dr + win - 1) * (2 * win - 1) + (dc + win - 1);
  }
  int64_t bias_index(int64_t h, int64_t i, int64_t j) const { return ((bias_heads == 1 ? 0 : h) * lq + i) * lk + j; }
  float operator()(float s, int64_t, int64_t h, int64_t i, int64_t j) const {
    if (cap > 0.0f) s = cap * std::tanh(s / cap);
    if (slopes) s -= slopes[h] * float(std::abs(i + off - j));
    if (bias) s += bias[bias_index(h, i, j)];
    if (rel) {
      const int64_t x = rel_index(i, j);
      if (x >= 0) s += rel[x * rel_heads + h];
    }
    return s;
  }
  float backward(float s, float ds, int64_t, int64_t h, int64_t i, int64_t j, float* g) const {
    if (g) {
      if (bias) g[bias_index(h, i, j)] += ds;
      if (rel) {
        const int64_t x = rel_index(i, j);
        if (x >= 0) g[bias_params + x * rel_heads + h] += ds;
      }
    }
    if (cap > 0.0f) {
      const float t = std::tanh(s / cap);
      ds *= 1.0f - t * t;
    }
    return ds;
  }
};

struct PatternMask {
  const Pattern::Node* node;
  int64_t lq, lk;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const { return node->allowed(h, i, j, lq, lk); }
  bool interval(int64_t, int64_t h, int64_t i, int64_t kp0, int64_t kp1, int64_t& lo, int64_t& hi) const {
    return node->layout_interval(h, i, kp0, kp1, lq, lk, lo, hi);
  }
};

// A MaskFunction in the engine's MaskMod form.
struct FunctionMask {
  const MaskFunction* f;
  bool operator()(int64_t b, int64_t h, int64_t i, int64_t j) const { return (*f)(b, h, i, j); }
};

struct DenseMask {
  const uint8_t* d;
  int64_t sh, si, sj;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const { return d[h * sh + i * si + j * sj] != 0; }
};

// Dense fp32 copy of a 2-D or 3-D float table.
std::vector<float> dense_table(const TensorView& t) {
  std::vector<float> out(size_t(t.numel()));
  std::vector<int64_t> idx(t.shape.size(), 0);
  for (size_t n = 0; n < out.size(); ++n) {
    out[n] = float(t.get(idx.data()));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

void store_table(const TensorView& t, const float* values) {
  std::vector<int64_t> idx(t.shape.size(), 0);
  const int64_t n = t.numel();
  for (int64_t x = 0; x < n; ++x) {
    t.set(idx.data(), double(values[x]));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Validates the score-mod options against the problem and builds the mod (tables copied into `storage`).
BuiltinMod make_mod(const AttentionProblem& problem, const Pattern* pattern, const SparseOptions& o,
                    std::vector<float>& bias_storage, std::vector<float>& rel_storage) {
  BuiltinMod m;
  const int64_t hq = problem.heads_q, lq = problem.len_q, lk = problem.len_k;
  m.lq = lq;
  m.lk = lk;
  m.off = lk - lq;
  check(std::isfinite(o.softcap) && o.softcap >= 0, ErrorKind::kInvalidArgument,
        "softcap: expected a finite value >= 0 (0 = off), got ", o.softcap);
  m.cap = float(o.softcap);
  if (!o.alibi_slopes.empty()) {
    check(int64_t(o.alibi_slopes.size()) == hq, ErrorKind::kInvalidArgument, "alibi_slopes: expected ", hq,
          " slopes (one per query head), got ", o.alibi_slopes.size());
    m.slopes = o.alibi_slopes.data();
  }
  if (o.bias.data) {
    const TensorView& b = o.bias;
    check(b.dtype == DType::kF32 || b.dtype == DType::kF64, ErrorKind::kTypeError,
          "bias: expected float32 or float64, got ", to_string(b.dtype));
    const bool ok = (b.dim() == 2 && b.shape == Shape{lq, lk}) ||
                    (b.dim() == 3 && (b.shape[0] == 1 || b.shape[0] == hq) && b.shape[1] == lq && b.shape[2] == lk);
    check(ok, ErrorKind::kInvalidArgument, "bias: expected shape [Lq, Lk] or [H, Lq, Lk] with H in {1, ", hq,
          "}, Lq = ", lq, ", Lk = ", lk, ", got ", shape_text(b.shape));
    bias_storage = dense_table(b);
    m.bias = bias_storage.data();
    m.bias_heads = b.dim() == 3 ? b.shape[0] : 1;
    m.bias_params = int64_t(bias_storage.size());
  }
  if (o.rel_pos_bias.data) {
    int64_t width = 0, win = 0;
    check(pattern && pattern->node().window2d(width, win), ErrorKind::kInvalidArgument,
          "rel_pos_bias: only valid with a WindowAttention2D pattern");
    const TensorView& r = o.rel_pos_bias;
    check(r.dtype == DType::kF32 || r.dtype == DType::kF64, ErrorKind::kTypeError,
          "rel_pos_bias: expected float32 or float64, got ", to_string(r.dtype));
    const Shape want = {(2 * win - 1) * (2 * win - 1), hq};
    check(r.shape == want, ErrorKind::kInvalidArgument,
          "rel_pos_bias: expected shape [(2w-1)^2, Hq] = ", shape_text(want), ", got ", shape_text(r.shape));
    rel_storage = dense_table(r);
    m.rel = rel_storage.data();
    m.rel_heads = hq;
    m.win = win;
    m.width = width;
    m.rel_params = int64_t(rel_storage.size());
  }
  return m;
}

void check_param_grad(const TensorView& g, const TensorView& param, const char* name) {
  if (!g.data) return;
  check(param.data != nullptr, ErrorKind::kInvalidArgument, name,
        ": given, but the option it is the gradient of is not");
  check(g.shape == param.shape, ErrorKind::kInvalidArgument, name, ": expected shape ", shape_text(param.shape),
        ", got ", shape_text(g.shape));
  check(g.dtype == DType::kF32 || g.dtype == DType::kF64, ErrorKind::kTypeError, name,
        ": expected float32 or float64, got ", to_string(g.dtype));
}

template <typename MaskMod>
void backward_with(const AttentionProblem& problem, const TensorView& dout, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& out, const TensorView& lse, const BlockMask& bm,
                   MaskMod mask_mod, const Pattern* pattern, const SparseOptions& o, const SparseGrads& g) {
  std::vector<float> bias_storage, rel_storage;
  const BuiltinMod mod = make_mod(problem, pattern, o, bias_storage, rel_storage);
  check_param_grad(g.dbias, o.bias, "dbias");
  check_param_grad(g.drel_pos_bias, o.rel_pos_bias, "drel_pos_bias");
  std::vector<float> pg(size_t(mod.num_params()), 0.0f);
  block_sparse_attention_backward(problem, dout, q, k, v, out, lse, bm, mask_mod, mod, o, g.dq, g.dk, g.dv, pg.data());
  if (g.dbias.data) store_table(g.dbias, pg.data());
  if (g.drel_pos_bias.data) store_table(g.drel_pos_bias, pg.data() + mod.bias_params);
}

DenseMask dense_mask_mod(const TensorView& m, const BlockMask& bm) {
  if (!m.data) return DenseMask{nullptr, 0, 0, 0};
  check(m.dtype == DType::kBool, ErrorKind::kTypeError, "dense_mask: expected bool, got ", to_string(m.dtype));
  check((m.dim() == 2 || m.dim() == 3) && m.shape[m.dim() - 2] == bm.len_q && m.shape[m.dim() - 1] == bm.len_k,
        ErrorKind::kInvalidArgument, "dense_mask: expected [Lq, Lk] or [H, Lq, Lk] with Lq = ", bm.len_q,
        ", Lk = ", bm.len_k, ", got ", shape_text(m.shape));
  check(m.dim() == 2 || m.shape[0] == bm.heads, ErrorKind::kInvalidArgument, "dense_mask: expected ", bm.heads,
        " heads (those of the block mask), got ", m.shape[0]);
  const int64_t o = m.dim() - 2;
  return DenseMask{static_cast<const uint8_t*>(m.data), m.dim() == 3 ? m.strides[0] : 0, m.strides[o],
                   m.strides[o + 1]};
}

}  // namespace

std::vector<float> alibi_slopes(int64_t heads) {
  check(heads >= 1, ErrorKind::kInvalidArgument, "heads: expected >= 1, got ", heads);
  std::vector<float> s(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) s[size_t(h)] = float(std::exp2(-8.0 * double(h + 1) / double(heads)));
  return s;
}

void sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const Pattern& pattern,
                      const SparseOptions& o, const TensorView& out, const TensorView& lse, const TensorView& indices) {
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const AdaptiveNode* adaptive = nullptr;
  Pattern fixed;
  split_adaptive(pattern, adaptive, fixed);
  if (adaptive) {
    if (fixed.defined()) fixed.check_lengths(lq, lk);
    adaptive_forward(problem, *adaptive, fixed, q, k, v, o, out, lse, indices);
    return;
  }
  check(!indices.data, ErrorKind::kInvalidArgument,
        "indices: only content-adaptive patterns (TopK, BlockTopK) "
        "return a selection, got ",
        pattern.repr());
  const BlockMask bm = pattern.block_mask(lq, lk, problem.heads_q, o.block);
  std::vector<float> bias_storage, rel_storage;
  const BuiltinMod mod = make_mod(problem, &pattern, o, bias_storage, rel_storage);
  block_sparse_attention(problem, q, k, v, bm, PatternMask{&pattern.node(), lq, lk}, mod, o, out, lse);
}

void sparse_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& lse, const Pattern& pattern,
                               const SparseOptions& o, const SparseGrads& g, const TensorView& indices) {
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const AdaptiveNode* adaptive = nullptr;
  Pattern fixed;
  split_adaptive(pattern, adaptive, fixed);
  if (adaptive) {
    if (fixed.defined()) fixed.check_lengths(lq, lk);
    adaptive_backward(problem, *adaptive, fixed, dout, q, k, v, out, lse, o, g, indices);
    return;
  }
  check(!g.dlogits.data, ErrorKind::kInvalidArgument, "dlogits: only MixedAttention has logits");
  const BlockMask bm = pattern.block_mask(lq, lk, problem.heads_q, o.block);
  backward_with(problem, dout, q, k, v, out, lse, bm, PatternMask{&pattern.node(), lq, lk}, &pattern, o, g);
}

Shape selection_shape(const Pattern& pattern, int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_k) {
  const AdaptiveNode* adaptive = nullptr;
  Pattern fixed;
  split_adaptive(pattern, adaptive, fixed);
  if (!adaptive) return {};
  return adaptive_indices_shape(*adaptive, batch, heads_q, len_q, len_k);
}

bool has_logits(const Pattern& pattern) {
  const AdaptiveNode* a = nullptr;
  Pattern fixed;
  split_adaptive(pattern, a, fixed);
  return a && a->kind == AdaptiveNode::kMixed;
}

Tensor selection_mask(const Pattern& pattern, const TensorView& indices, int64_t len_q, int64_t len_k) {
  const AdaptiveNode* a = nullptr;
  Pattern fixed;
  split_adaptive(pattern, a, fixed);
  check(a && (a->kind == AdaptiveNode::kTopK || a->kind == AdaptiveNode::kBlockTopK), ErrorKind::kInvalidArgument,
        "selection_mask: expected a TopK or BlockTopK pattern, got ", pattern.repr());
  check(indices.dtype == DType::kI64 && indices.dim() == 4, ErrorKind::kInvalidArgument,
        "indices: expected a 4-D int64 array, got ", to_string(indices.dtype), " ", shape_text(indices.shape));
  const int64_t B = indices.shape[0], H = indices.shape[1];
  check(indices.shape == adaptive_indices_shape(*a, B, H, len_q, len_k), ErrorKind::kInvalidArgument,
        "indices: expected shape ", shape_text(adaptive_indices_shape(*a, B, H, len_q, len_k)), ", got ",
        shape_text(indices.shape));
  Tensor m(DType::kBool, {B, H, len_q, len_k});
  auto* d = m.data<uint8_t>();
  auto at = [&](int64_t b, int64_t h, int64_t x, int64_t y) {
    return static_cast<const int64_t*>(indices.data)[b * indices.strides[0] + h * indices.strides[1] +
                                                     x * indices.strides[2] + y * indices.strides[3]];
  };
  const int64_t off = len_k - len_q;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      if (a->kind == AdaptiveNode::kTopK) {
        for (int64_t i = 0; i < len_q; ++i)
          for (int64_t x = 0; x < a->k; ++x)
            if (const int64_t j = at(b, h, i, x); j >= 0 && j < len_k) d[((b * H + h) * len_q + i) * len_k + j] = 1;
        continue;
      }
      // BlockTopK: the chosen key blocks of each aligned query block, intersected with the fixed pattern and causality.
      const int64_t blk = a->block;
      int64_t qb = 0;
      for (int64_t i = 0; i < len_q; ++i) {
        if (i > 0 && ((i + off) % blk + blk) % blk == 0) ++qb;
        for (int64_t x = 0; x < a->k_blocks; ++x) {
          const int64_t kb = at(b, h, qb, x);
          if (kb < 0) continue;
          for (int64_t j = kb * blk; j < std::min(len_k, (kb + 1) * blk); ++j) {
            const bool ok =
                (!a->causal || j <= i + off) &&
                (!fixed.defined() || fixed.node().allowed(fixed.head_dependent() ? h : 0, i, j, len_q, len_k));
            if (ok) d[((b * H + h) * len_q + i) * len_k + j] = 1;
          }
        }
      }
    }
  return m;
}

void block_sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
                            const TensorView& dense_mask, const SparseOptions& o, const TensorView& out,
                            const TensorView& lse) {
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  std::vector<float> bias_storage, rel_storage;
  const BuiltinMod mod = make_mod(problem, nullptr, o, bias_storage, rel_storage);
  const DenseMask dm = dense_mask_mod(dense_mask, mask);
  if (dm.d) block_sparse_attention(problem, q, k, v, mask, dm, mod, o, out, lse);
  else block_sparse_attention(problem, q, k, v, mask, AllowAll{}, mod, o, out, lse);
}

void block_sparse_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out, const TensorView& lse,
                                     const BlockMask& mask, const TensorView& dense_mask, const SparseOptions& o,
                                     const SparseGrads& g) {
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  const DenseMask dm = dense_mask_mod(dense_mask, mask);
  if (dm.d) backward_with(problem, dout, q, k, v, out, lse, mask, dm, nullptr, o, g);
  else backward_with(problem, dout, q, k, v, out, lse, mask, AllowAll{}, nullptr, o, g);
}

void flex_attention(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
                    const MaskFunction& mask_mod, const SparseOptions& o, const TensorView& out,
                    const TensorView& lse) {
  check(bool(mask_mod), ErrorKind::kInvalidArgument, "flex_attention: mask_mod is empty");
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  std::vector<float> bias_storage, rel_storage;
  const BuiltinMod mod = make_mod(problem, nullptr, o, bias_storage, rel_storage);
  block_sparse_attention(problem, q, k, v, mask, FunctionMask{&mask_mod}, mod, o, out, lse);
}

void flex_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const BlockMask& mask,
                             const MaskFunction& mask_mod, const SparseOptions& o, const SparseGrads& g) {
  check(bool(mask_mod), ErrorKind::kInvalidArgument, "flex_attention_backward: mask_mod is empty");
  const AttentionProblem problem = detail::describe_inputs(q, k, v, o, o.enable_gqa);
  backward_with(problem, dout, q, k, v, out, lse, mask, FunctionMask{&mask_mod}, nullptr, o, g);
}

}  // namespace sattn::sparse
