// The reference kernel: plain loops over a materialised [B, Hq, Lq, Lk] score matrix, like PyTorch's "math"
// path. It is the oracle for every other kernel, so it favours clarity over speed: inputs are first copied to
// dense arrays of the accumulation type (double when the inputs are float64 or accumulate_fp64 is set).
#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "core/memory.hpp"
#include "core/threads.hpp"
#include "kernels/kernel.hpp"
#include "sattn/random.hpp"

namespace sattn {
namespace {

int64_t memory_limit_bytes(const AttentionOptions& o) { return sattn::memory_limit_bytes(o.memory_limit_bytes); }

// Dense row-major copy of a (possibly strided, any float dtype) 4-D view in type T.
template <typename T>
std::vector<T> dense_copy(const TensorView& t) {
  std::vector<T> out(size_t(t.numel()));
  size_t n = 0;
  int64_t idx[4];
  for (idx[0] = 0; idx[0] < t.shape[0]; ++idx[0])
    for (idx[1] = 0; idx[1] < t.shape[1]; ++idx[1])
      for (idx[2] = 0; idx[2] < t.shape[2]; ++idx[2])
        for (idx[3] = 0; idx[3] < t.shape[3]; ++idx[3]) out[n++] = T(t.get(idx));
  return out;
}

template <typename T>
void store_dense(const TensorView& t, const std::vector<T>& values) {
  size_t n = 0;
  std::vector<int64_t> idx(t.shape.size(), 0);
  const int64_t total = t.numel();
  for (int64_t lin = 0; lin < total; ++lin) {
    t.set(idx.data(), double(values[n++]));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Scores, allowed flags, and probabilities for one problem, materialised for all (b, h, i, j).
template <typename T>
struct Materialised {
  int64_t B, H, Lq, Lk;
  std::vector<T> prob;           // softmax probabilities P (before dropout); 0 where not allowed
  std::vector<T> lse;            // [B, H, Lq]; -inf for rows with no allowed key
  std::vector<uint8_t> allowed;  // [B, H, Lq, Lk]
  size_t at(int64_t b, int64_t h, int64_t i, int64_t j) const { return size_t(((b * H + h) * Lq + i) * Lk + j); }
};

// Refuses (kOutOfMemory, naming the size) a problem whose L x L buffers would exceed the memory limit:
// probabilities + allowed flags, plus weights (forward) or dS for dmask (backward).
template <typename T>
void check_memory(const AttentionProblem& p, const AttentionOptions& o) {
  const bool extra = p.backward ? p.need_dmask : p.need_weights;
  const double bytes = p.score_matrix_bytes(sizeof(T) * (extra ? 2 : 1) + 1);
  const int64_t limit = memory_limit_bytes(o);
  check(bytes <= double(limit), ErrorKind::kOutOfMemory,
        "reference attention: the materialised score matrices [B, Hq, Lq, Lk] = ",
        shape_text({p.batch, p.heads_q, p.len_q, p.len_k}), " need ", bytes / (1 << 20),
        " MiB, over the memory limit of ", double(limit) / (1 << 20),
        " MiB (AttentionOptions::memory_limit_bytes; default half of physical memory)");
}

template <typename T>
Materialised<T> compute_probabilities(const AttentionProblem& p, const MaskData& m, const std::vector<T>& q,
                                      const std::vector<T>& k, int threads) {
  Materialised<T> r{p.batch, p.heads_q, p.len_q, p.len_k, {}, {}, {}};
  r.prob.assign(size_t(p.batch * p.heads_q * p.len_q * p.len_k), T(0));
  r.allowed.assign(r.prob.size(), 0);
  r.lse.assign(size_t(p.batch * p.heads_q * p.len_q), -std::numeric_limits<T>::infinity());
  const int64_t D = p.head_dim, g = p.group_size();
  const T scale = T(p.scale);
  parallel_for(p.batch * p.heads_q, threads, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / g;
    std::vector<T> s(size_t(p.len_k));
    for (int64_t i = 0; i < p.len_q; ++i) {
      const T* qi = &q[size_t(((b * p.heads_q + h) * p.len_q + i) * D)];
      T row_max = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < p.len_k; ++j) {
        bool ok = p.causal_allows(i, j) && !m.key_is_padding(b, j);
        T bias = 0;
        if (p.mask == MaskKind::kBool) ok = ok && m.mask_value(b, h, i, j) != 0.0;
        if (p.mask == MaskKind::kAdditive) {
          const double value = m.mask_value(b, h, i, j);
          ok = ok && value != -std::numeric_limits<double>::infinity();  // only -inf masks; a finite bias never does
          bias = T(value);
        }
        if (!ok) continue;
        const T* kj = &k[size_t(((b * p.heads_kv + hk) * p.len_k + j) * D)];
        T dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        s[j] = scale * dot + bias;
        r.allowed[r.at(b, h, i, j)] = 1;
        if (s[j] > row_max || std::isnan(s[j])) row_max = s[j];
      }
      if (row_max == -std::numeric_limits<T>::infinity()) continue;  // no allowed key: P = 0, lse = -inf
      T sum = 0;
      for (int64_t j = 0; j < p.len_k; ++j)
        if (r.allowed[r.at(b, h, i, j)]) sum += std::exp(s[j] - row_max);
      for (int64_t j = 0; j < p.len_k; ++j)
        if (r.allowed[r.at(b, h, i, j)]) r.prob[r.at(b, h, i, j)] = std::exp(s[j] - row_max) / sum;
      r.lse[size_t((b * p.heads_q + h) * p.len_q + i)] = row_max + std::log(sum);
    }
  });
  return r;
}

// Dropout multiplier for weight (b, h, i, j): 0 or 1/(1-p).
template <typename T>
T dropout_factor(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!p.has_dropout()) return T(1);
  return dropout_keep(p.seed, p.dropout_p, uint32_t(b), uint32_t(h), uint32_t(p.query_position(i)),
                      uint32_t(p.key_position(j)))
             ? T(1.0 / (1.0 - p.dropout_p))
             : T(0);
}

template <typename T>
void forward_impl(const ForwardArgs& a) {
  const AttentionProblem& p = a.problem;
  check_memory<T>(p, a.options);  // before any allocation
  const std::vector<T> q = dense_copy<T>(a.q), k = dense_copy<T>(a.k), v = dense_copy<T>(a.v);
  const Materialised<T> m = compute_probabilities<T>(p, a.masks, q, k, a.num_threads);
  const int64_t Dv = p.head_dim_v, g = p.group_size();
  std::vector<T> out(size_t(p.batch * p.heads_q * p.len_q * Dv), T(0));
  std::vector<T> weights;
  if (p.need_weights) weights.assign(m.prob.size(), T(0));
  parallel_for(p.batch * p.heads_q, a.num_threads, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / g;
    for (int64_t i = 0; i < p.len_q; ++i) {
      T* oi = &out[size_t(((b * p.heads_q + h) * p.len_q + i) * Dv)];
      for (int64_t j = 0; j < p.len_k; ++j) {
        const T w = m.prob[m.at(b, h, i, j)] * dropout_factor<T>(p, b, h, i, j);  // P' = dropout(P)
        if (p.need_weights) weights[m.at(b, h, i, j)] = w;
        if (w == T(0)) continue;
        const T* vj = &v[size_t(((b * p.heads_kv + hk) * p.len_k + j) * Dv)];
        for (int64_t d = 0; d < Dv; ++d) oi[d] += w * vj[d];
      }
    }
  });
  store_dense(a.outputs.out, out);
  if (p.need_lse) store_dense(a.outputs.lse, m.lse);
  if (p.need_weights) store_dense(a.outputs.weights, weights);
}

// Backward by recomputation from q, k, v (the saved out/lse are not needed by the oracle):
//   dV_j  = sum_i P'_ij dO_i                       (P' = dropout(P))
//   dP'_ij = dO_i · V_j,  dP_ij = dP'_ij · keep_ij / (1 - p)
//   dS_ij = P_ij (dP_ij - sum_l P_il dP_il)        (softmax backward; 0 where not allowed)
//   dQ_i  = scale sum_j dS_ij K_j,  dK_j = scale sum_i dS_ij Q_i,  dmask = dS reduced to the mask's shape
template <typename T>
void backward_impl(const BackwardArgs& a) {
  const AttentionProblem& p = a.problem;
  check_memory<T>(p, a.options);  // before any allocation
  const std::vector<T> q = dense_copy<T>(a.q), k = dense_copy<T>(a.k), v = dense_copy<T>(a.v);
  const std::vector<T> dout = dense_copy<T>(a.dout);
  const Materialised<T> m = compute_probabilities<T>(p, a.masks, q, k, a.num_threads);
  const int64_t D = p.head_dim, Dv = p.head_dim_v, g = p.group_size();
  std::vector<T> dq(q.size(), T(0)), dk(k.size(), T(0)), dv(v.size(), T(0));
  std::vector<T> ds;
  if (p.need_dmask) ds.assign(m.prob.size(), T(0));
  const T scale = T(p.scale);
  // One task per (b, kv head): it owns dK/dV of that head and dQ of its group's query heads.
  parallel_for(p.batch * p.heads_kv, a.num_threads, [&](int64_t bhk) {
    const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
    std::vector<T> dp(size_t(p.len_k));
    for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
      for (int64_t i = 0; i < p.len_q; ++i) {
        const size_t qrow = size_t((b * p.heads_q + h) * p.len_q + i);
        const T* doi = &dout[qrow * Dv];
        T row_dot = 0;  // sum_l P_il dP_il
        for (int64_t j = 0; j < p.len_k; ++j) {
          dp[j] = 0;
          if (!m.allowed[m.at(b, h, i, j)]) continue;
          const T keep = dropout_factor<T>(p, b, h, i, j);
          const T* vj = &v[size_t(((b * p.heads_kv + hk) * p.len_k + j) * Dv)];
          T* dvj = &dv[size_t(((b * p.heads_kv + hk) * p.len_k + j) * Dv)];
          const T pw = m.prob[m.at(b, h, i, j)] * keep;
          T dpj = 0;
          for (int64_t d = 0; d < Dv; ++d) {
            dvj[d] += pw * doi[d];
            dpj += doi[d] * vj[d];
          }
          dp[j] = dpj * keep;
          row_dot += m.prob[m.at(b, h, i, j)] * dp[j];
        }
        const T* qi = &q[qrow * D];
        T* dqi = &dq[qrow * D];
        for (int64_t j = 0; j < p.len_k; ++j) {
          if (!m.allowed[m.at(b, h, i, j)]) continue;
          const T dsij = m.prob[m.at(b, h, i, j)] * (dp[j] - row_dot);
          if (p.need_dmask) ds[m.at(b, h, i, j)] = dsij;
          const T* kj = &k[size_t(((b * p.heads_kv + hk) * p.len_k + j) * D)];
          T* dkj = &dk[size_t(((b * p.heads_kv + hk) * p.len_k + j) * D)];
          for (int64_t d = 0; d < D; ++d) {
            dqi[d] += scale * dsij * kj[d];
            dkj[d] += scale * dsij * qi[d];
          }
        }
      }
    }
  });
  store_dense(a.grads.dq, dq);
  store_dense(a.grads.dk, dk);
  store_dense(a.grads.dv, dv);
  if (p.need_dmask) {
    // Reduce dS [B, Hq, Lq, Lk] over the mask's broadcast dimensions, in a fixed order.
    const Shape& ms = p.mask_shape;
    std::vector<T> dmask(size_t(numel(ms)), T(0));
    const int64_t off = 4 - int64_t(ms.size());
    const Shape full = {p.batch, p.heads_q, p.len_q, p.len_k};
    Shape mstride(4, 0);  // stride of each full dim into the dense mask-shaped buffer (0 where broadcast)
    {
      const Shape cs = contiguous_strides(ms);
      for (int64_t d = 0; d < int64_t(ms.size()); ++d) mstride[off + d] = ms[d] == 1 ? 0 : cs[d];
    }
    for (int64_t b = 0; b < full[0]; ++b)
      for (int64_t h = 0; h < full[1]; ++h)
        for (int64_t i = 0; i < full[2]; ++i)
          for (int64_t j = 0; j < full[3]; ++j)
            dmask[size_t(b * mstride[0] + h * mstride[1] + i * mstride[2] + j * mstride[3])] += ds[m.at(b, h, i, j)];
    store_dense(a.grads.dmask, dmask);
  }
}

bool reference_supports(const AttentionProblem&, std::string*) { return true; }

[[noreturn]] void out_of_memory(const AttentionProblem& p) {
  fail(ErrorKind::kOutOfMemory, "reference attention: cannot allocate the score matrices [B, Hq, Lq, Lk] = ",
       shape_to_string({p.batch, p.heads_q, p.len_q, p.len_k}), " (", p.score_matrix_bytes(1) / (1 << 20),
       " MiB per byte of element); lower AttentionOptions::memory_limit_bytes to fail earlier");
}

void reference_forward(const ForwardArgs& a) {
  try {
    if (a.problem.dtype_q == DType::kF64 || a.options.accumulate_fp64) forward_impl<double>(a);
    else forward_impl<float>(a);
  } catch (const std::bad_alloc&) {
    out_of_memory(a.problem);
  }
}

void reference_backward(const BackwardArgs& a) {
  try {
    if (a.problem.dtype_q == DType::kF64 || a.options.accumulate_fp64) backward_impl<double>(a);
    else backward_impl<float>(a);
  } catch (const std::bad_alloc&) {
    out_of_memory(a.problem);
  }
}

}  // namespace

KernelEntry reference_kernel() { return {"reference", reference_supports, reference_forward, reference_backward}; }

}  // namespace sattn
