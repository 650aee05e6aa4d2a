// nn::MultiheadAttention: torch.nn.MultiheadAttention (PyTorch 2.x) = in-projection,
// sattn::scaled_dot_product_attention, out-projection. The attention itself (masks, softmax, dropout, weights) is
// sattn's; this file only projects, lays out heads as strided views and translates torch's mask conventions (and
// the is_causal hint) into AttentionOptions.
#include "sattn/mha.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>

#include "core/memory.hpp"
#include "core/threads.hpp"
#include "sattn/attention.hpp"
#include "sattn/random.hpp"
#include "sattn/safetensors.hpp"

namespace sattn::nn {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform double in [0, 1) (53 bits) for element `i` of parameter stream `stream`.
double uniform01(uint64_t seed, uint32_t stream, uint64_t i) {
  const auto r =
      philox4x32_10({uint32_t(i), uint32_t(i >> 32), stream, 0x6d6861u}, {uint32_t(seed), uint32_t(seed >> 32)});
  return double(((uint64_t(r[0]) << 32) | r[1]) >> 11) * (1.0 / 9007199254740992.0);
}

Tensor uniform_tensor(const Shape& shape, double bound, uint64_t seed, uint32_t stream) {
  Tensor t(DType::kF64, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = (2.0 * uniform01(seed, stream, i) - 1.0) * bound;
  return t;
}

Tensor normal_tensor(const Shape& shape, double stddev, uint64_t seed, uint32_t stream) {
  Tensor t(DType::kF64, shape);
  for (int64_t i = 0; i < t.numel(); ++i) {  // Box-Muller from two independent uniforms
    const double u1 = 1.0 - uniform01(seed, stream, 2 * uint64_t(i)), u2 = uniform01(seed, stream, 2 * uint64_t(i) + 1);
    t.data<double>()[i] = stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
  return t;
}

// y[r, :] = x[r, :] W^T + b for r < rows; x dense [rows, in], W dense [out, in], y rows `y_stride` apart.
// Accumulates in double. W is transposed once so that the inner loop is a contiguous axpy over the outputs
// (vectorises without reassociating sums); blocks of kRows rows share each pass over W. The summation order
// does not depend on the thread count.
template <typename T>
void linear_fp64_accumulate(const T* x, int64_t rows, int64_t in, const T* w, const T* b, int64_t out, T* y,
                            int64_t y_stride, int threads) {
  constexpr int64_t kRows = 8;
  std::vector<double> wt(size_t(in * out));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) wt[size_t(i * out + o)] = double(w[o * in + i]);
  parallel_for((rows + kRows - 1) / kRows, threads, [&](int64_t blk) {
    const int64_t r0 = blk * kRows, nr = std::min(kRows, rows - r0);
    std::vector<double> acc(size_t(kRows * out));
    for (int64_t rr = 0; rr < nr; ++rr)
      for (int64_t o = 0; o < out; ++o) acc[size_t(rr * out + o)] = b ? double(b[o]) : 0.0;
    for (int64_t i = 0; i < in; ++i) {
      const double* wi = wt.data() + i * out;
      for (int64_t rr = 0; rr < nr; ++rr) {
        const double xv = double(x[(r0 + rr) * in + i]);
        double* a = acc.data() + rr * out;
        for (int64_t o = 0; o < out; ++o) a[o] += xv * wi[o];
      }
    }
    for (int64_t rr = 0; rr < nr; ++rr)
      for (int64_t o = 0; o < out; ++o) y[(r0 + rr) * y_stride + o] = T(acc[size_t(rr * out + o)]);
  });
}

bool is_float_dtype(DType t) { return t == DType::kF32 || t == DType::kF64; }

void check_mask_view(const TensorView& m, const char* name) {
  check(m.strides.size() == m.shape.size(), ErrorKind::kInvalidArgument, name, ": ", m.strides.size(),
        " strides for shape ", shape_text(m.shape));
  for (int64_t s : m.strides)
    check(s >= 0, ErrorKind::kInvalidArgument, name, ": negative strides are not supported, got strides ",
          shape_text(m.strides));
}

// A dense copy of `m` (bool masks become 0/1 bytes; float masks have the query's dtype, checked by forward).
Tensor dense(const TensorView& m) {
  Tensor t = Tensor::from_view(m);
  if (t.dtype() == DType::kBool)
    for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = t.data<uint8_t>()[i] != 0;
  return t;
}

// A mask must be bool or float of the query's dtype (torch 2.x: "only bool and floating types of attn_mask are
// supported"; a float mask of another dtype fails in its matmul, and in its SDPA unless the mask is float32).
void check_mask_dtype(const TensorView& m, const char* name, const char* bool_meaning, DType query) {
  check(m.dtype == DType::kBool || is_floating(m.dtype), ErrorKind::kTypeError, name, ": expected bool (", bool_meaning,
        ") or a float mask of the query's dtype (", to_string(query), ", added to the scores), got ",
        to_string(m.dtype), " (torch 2.x supports only bool and floating ", name, ")");
  check(m.dtype == DType::kBool || m.dtype == query, ErrorKind::kTypeError, name,
        ": a float mask must have the query's dtype (", to_string(query), "), got ", to_string(m.dtype),
        " (as torch 2.x's MultiheadAttention needs it with need_weights=True); convert it");
}

// is_causal is a hint that attn_mask [L, S] (or each [L, S] slice of a 3-D mask) is the causal mask: masked
// exactly where j > i (bool True there, False elsewhere; float -inf there, 0 elsewhere). torch 2.x does not check
// the hint, and what it computes for a wrong one depends on its execution path, so sattn refuses a wrong one.
void check_causal_hint(const TensorView& m, int64_t L, int64_t S) {
  const bool three = m.dim() == 3;
  const int64_t slices = three ? m.shape[0] : 1, s0 = three ? m.strides[0] : 0;
  const int64_t si = m.strides[three ? 1 : 0], sj = m.strides[three ? 2 : 1];
  for (int64_t b = 0; b < slices; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        const int64_t off = b * s0 + i * si + j * sj;
        const bool masked = j > i;
        double value = 0;
        bool ok;
        if (m.dtype == DType::kBool) {
          value = m.ptr<const uint8_t>()[off] != 0;
          ok = (value != 0) == masked;
        } else {
          value = m.dtype == DType::kF64 ? m.ptr<const double>()[off] : double(m.ptr<const float>()[off]);
          ok = masked ? value == -std::numeric_limits<double>::infinity() : value == 0.0;
        }
        if (ok) continue;
        const std::string where =
            three ? message::concat("[", b, ", ", i, ", ", j, "]") : message::concat("[", i, ", ", j, "]");
        const bool is_bool = m.dtype == DType::kBool;
        fail(ErrorKind::kInvalidArgument, "is_causal: a hint that attn_mask is the causal mask, but attn_mask", where,
             " = ", is_bool ? (value != 0 ? "True" : "False") : message::concat(value), ", expected ",
             is_bool ? (masked ? "True" : "False") : (masked ? "-inf" : "0"), " (the causal mask is ",
             is_bool ? "True where j > i, False elsewhere" : "-inf where j > i, 0 elsewhere",
             "). torch 2.x does not check the hint, and its result for a wrong one depends on its execution path "
             "(need_weights, key_padding_mask, fast path); pass is_causal=False to apply attn_mask as given");
      }
}

struct Sizes {
  int64_t N, L, S, Sp, E, H, hd;
};

template <typename T>
std::pair<Tensor, std::optional<Tensor>> run(const MultiheadAttention& m, const Sizes& z, const Tensor& xq,
                                             const Tensor& xk, const Tensor& xv,
                                             const std::vector<std::pair<std::string, Tensor>>& params,
                                             const TensorView& kpm, const TensorView& am, bool causal,
                                             bool need_weights, double dropout_p, uint64_t seed, int threads) {
  const DType dt = std::is_same_v<T, double> ? DType::kF64 : DType::kF32;
  const auto get = [&](const std::string& name) -> Tensor {
    for (const auto& [n, t] : params)
      if (n == name) return t.dtype() == dt ? t : t.to(dt);
    return Tensor();
  };
  const int64_t N = z.N, L = z.L, S = z.S, Sp = z.Sp, E = z.E, H = z.H, hd = z.hd;
  const bool packed = m.qkv_same_embed_dim();
  Tensor w_in = packed ? get("in_proj_weight") : Tensor();
  Tensor wq = packed ? w_in : get("q_proj_weight");
  Tensor wk = packed ? w_in : get("k_proj_weight");
  Tensor wv = packed ? w_in : get("v_proj_weight");
  const T* pwq = wq.data<T>();
  const T* pwk = wk.data<T>() + (packed ? E * E : 0);
  const T* pwv = wv.data<T>() + (packed ? 2 * E * E : 0);
  Tensor b_in = m.has_bias() ? get("in_proj_bias") : Tensor();
  const T* pbq = m.has_bias() ? b_in.data<T>() : nullptr;
  const T* pbk = m.has_bias() ? b_in.data<T>() + E : nullptr;
  const T* pbv = m.has_bias() ? b_in.data<T>() + 2 * E : nullptr;

  // In-projections into [N, L, E] and [N, S', E]; rows S.. of K/V hold bias_k/bias_v and the zero key.
  Tensor q(dt, {N, L, E}), k(dt, {N, Sp, E}), v(dt, {N, Sp, E});
  linear_fp64_accumulate<T>(xq.data<T>(), N * L, m.embed_dim(), pwq, pbq, E, q.data<T>(), E, threads);
  for (int64_t n = 0; n < N; ++n) {
    linear_fp64_accumulate<T>(xk.data<T>() + n * S * m.kdim(), S, m.kdim(), pwk, pbk, E, k.data<T>() + n * Sp * E, E,
                              threads);
    linear_fp64_accumulate<T>(xv.data<T>() + n * S * m.vdim(), S, m.vdim(), pwv, pbv, E, v.data<T>() + n * Sp * E, E,
                              threads);
  }
  if (m.add_bias_kv()) {
    Tensor bk = get("bias_k"), bv = get("bias_v");
    for (int64_t n = 0; n < N; ++n) {
      std::memcpy(k.data<T>() + (n * Sp + S) * E, bk.data<T>(), E * sizeof(T));
      std::memcpy(v.data<T>() + (n * Sp + S) * E, bv.data<T>(), E * sizeof(T));
    }
  }  // add_zero_attn: the last row stays zero (tensors are zero-initialised)

  // Heads as strided views: head h of row r is elements [h*hd, (h+1)*hd) -> [N, H, L, hd], no copy.
  const TensorView q4(q.data(), dt, {N, H, L, hd}, {L * E, hd, E, 1});
  const TensorView k4(k.data(), dt, {N, H, Sp, hd}, {Sp * E, hd, E, 1});
  const TensorView v4(v.data(), dt, {N, H, Sp, hd}, {Sp * E, hd, E, 1});

  // Masks: torch MHA's bool True = may NOT attend; sattn's attn_mask bool True = may attend. A verified causal
  // hint (`causal`: am is exactly the causal mask and S' == S) runs as sattn's top-left causal attention instead of
  // reading the mask (the fused kernel then skips the masked tiles).
  AttentionOptions opts;
  opts.num_threads = threads;
  opts.dropout_p = dropout_p;
  opts.seed = seed;
  if (causal) opts.causal = Causal::kTopLeft;
  const bool am3 = am.data && am.dim() == 3;
  const bool am_float = am.data && is_float_dtype(am.dtype);
  const bool kpm_float = kpm.data && is_float_dtype(kpm.dtype);
  Tensor mask, kp;
  if (am_float || kpm_float) {
    const int64_t Nm = (am3 || kpm_float) ? N : 1, Hm = am3 ? H : 1;
    mask = Tensor(dt, {Nm, Hm, L, Sp});
    Tensor amd = am.data ? dense(am) : Tensor();
    Tensor kpd = kpm_float ? dense(kpm) : Tensor();
    T* out = mask.data<T>();
    const T kNegInf = -std::numeric_limits<T>::infinity();
    for (int64_t n = 0; n < Nm; ++n)
      for (int64_t h = 0; h < Hm; ++h)
        for (int64_t i = 0; i < L; ++i) {
          T* row = out + ((n * Hm + h) * L + i) * Sp;  // padded columns j >= S stay 0 (torch pads with 0/False)
          if (am.data) {
            const int64_t off = ((am3 ? n * H + h : 0) * L + i) * S;
            for (int64_t j = 0; j < S; ++j)
              row[j] = am_float ? amd.data<T>()[off + j] : (amd.data<uint8_t>()[off + j] ? kNegInf : T(0));
          }
          if (kpm_float)
            for (int64_t j = 0; j < S; ++j) row[j] += kpd.data<T>()[n * S + j];
        }
    opts.attn_mask = mask.view();
  } else if (am.data) {
    const int64_t Nm = am3 ? N : 1, Hm = am3 ? H : 1;
    mask = Tensor(DType::kBool, {Nm, Hm, L, Sp});
    Tensor amd = dense(am);
    uint8_t* out = mask.data<uint8_t>();
    for (int64_t r = 0; r < Nm * Hm * L; ++r) {
      for (int64_t j = 0; j < S; ++j) out[r * Sp + j] = amd.data<uint8_t>()[r * S + j] ? 0 : 1;
      for (int64_t j = S; j < Sp; ++j) out[r * Sp + j] = 1;
    }
    opts.attn_mask = mask.view();
  }
  if (kpm.data && !kpm_float) {
    kp = Tensor(DType::kBool, {N, Sp});
    Tensor kpd = dense(kpm);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < S; ++j) kp.data<uint8_t>()[n * Sp + j] = kpd.data<uint8_t>()[n * S + j];
    opts.key_padding_mask = kp.view();
  }

  // Attention, written straight into [N, L, E] (head h at columns h*hd..) for the out-projection.
  Tensor attn(dt, {N, L, E});
  if (need_weights) {  // refuse before allocating (the kernel would refuse its own L x L buffers the same way)
    const double bytes = double(N) * double(H) * double(L) * double(Sp) * double(sizeof(T));
    const double limit = double(memory_limit_bytes());
    check(bytes <= limit, ErrorKind::kOutOfMemory, "need_weights: the attention weights [N, H, L, S'] = [", N, ", ", H,
          ", ", L, ", ", Sp, "] need ", bytes / 1e9, " GB, over half of physical memory (", limit / 1e9,
          " GB); call with need_weights=False");
  }
  Tensor weights = need_weights ? Tensor(dt, {N, H, L, Sp}) : Tensor();
  const TensorView out4(attn.data(), dt, {N, H, L, hd}, {L * E, hd, E, 1});
  if (dropout_p < 1.0) {
    scaled_dot_product_attention(q4, k4, v4, opts,
                                 AttentionOutputs{out4, {}, need_weights ? weights.view() : TensorView()});
  }  // dropout_p == 1 (training): every weight dropped -> attention and weights stay 0, as torch

  Tensor wo = get("out_proj.weight");
  Tensor bo = m.has_bias() ? get("out_proj.bias") : Tensor();
  Tensor y(dt, {N, L, E});
  linear_fp64_accumulate<T>(attn.data<T>(), N * L, E, wo.data<T>(), m.has_bias() ? bo.data<T>() : nullptr, E,
                            y.data<T>(), E, threads);

  std::optional<Tensor> w_out;
  if (need_weights) w_out = std::move(weights);
  return {std::move(y), std::move(w_out)};
}

}  // namespace

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout, bool bias,
                                       bool add_bias_kv, bool add_zero_attn, std::optional<int64_t> kdim,
                                       std::optional<int64_t> vdim, bool batch_first, DType dtype, uint64_t seed)
    : embed_dim_(embed_dim),
      num_heads_(num_heads),
      kdim_(kdim ? *kdim : embed_dim),
      vdim_(vdim ? *vdim : embed_dim),
      dropout_(dropout),
      bias_(bias),
      add_bias_kv_(add_bias_kv),
      add_zero_attn_(add_zero_attn),
      batch_first_(batch_first),
      dtype_(dtype),
      dropout_seed_(seed) {
  check(embed_dim > 0, ErrorKind::kInvalidArgument, "embed_dim: expected a positive integer, got ", embed_dim);
  check(num_heads > 0, ErrorKind::kInvalidArgument, "num_heads: expected a positive integer, got ", num_heads);
  check(embed_dim % num_heads == 0, ErrorKind::kInvalidArgument, "embed_dim must be divisible by num_heads: got ",
        "embed_dim = ", embed_dim, " and num_heads = ", num_heads);
  check(kdim_ > 0, ErrorKind::kInvalidArgument, "kdim: expected a positive integer, got ", kdim_);
  check(vdim_ > 0, ErrorKind::kInvalidArgument, "vdim: expected a positive integer, got ", vdim_);
  check(dropout >= 0.0 && dropout <= 1.0, ErrorKind::kInvalidArgument,
        "dropout: expected a probability in [0, 1], got ", dropout);
  check(dtype == DType::kF32 || dtype == DType::kF64, ErrorKind::kTypeError,
        "dtype: expected float32 or float64 parameters, got ", to_string(dtype));
  for (const auto& [name, shape] : parameter_shapes()) params_.emplace_back(name, Tensor(dtype_, shape));
  reset_parameters(seed);
}

MultiheadAttention::MultiheadAttention(const MultiheadAttention& o)
    : embed_dim_(o.embed_dim_),
      num_heads_(o.num_heads_),
      kdim_(o.kdim_),
      vdim_(o.vdim_),
      dropout_(o.dropout_),
      bias_(o.bias_),
      add_bias_kv_(o.add_bias_kv_),
      add_zero_attn_(o.add_zero_attn_),
      batch_first_(o.batch_first_),
      dtype_(o.dtype_),
      training_(o.training_.load()),
      params_(o.state_dict()),
      dropout_seed_(o.dropout_seed_),
      calls_(o.calls_.load()) {
  num_threads = o.num_threads;
}

MultiheadAttention& MultiheadAttention::operator=(const MultiheadAttention& o) {
  if (this == &o) return *this;
  embed_dim_ = o.embed_dim_;
  num_heads_ = o.num_heads_;
  kdim_ = o.kdim_;
  vdim_ = o.vdim_;
  dropout_ = o.dropout_;
  bias_ = o.bias_;
  add_bias_kv_ = o.add_bias_kv_;
  add_zero_attn_ = o.add_zero_attn_;
  batch_first_ = o.batch_first_;
  dtype_ = o.dtype_;
  training_ = o.training_.load();
  auto copied = o.state_dict();
  std::unique_lock lock(mutex_);
  params_ = std::move(copied);
  dropout_seed_ = o.dropout_seed_;
  calls_ = o.calls_.load();
  num_threads = o.num_threads;
  return *this;
}

std::vector<std::pair<std::string, Shape>> MultiheadAttention::parameter_shapes() const {
  const int64_t E = embed_dim_;
  std::vector<std::pair<std::string, Shape>> s;
  if (qkv_same_embed_dim()) {
    s.emplace_back("in_proj_weight", Shape{3 * E, E});
  } else {
    s.emplace_back("q_proj_weight", Shape{E, E});
    s.emplace_back("k_proj_weight", Shape{E, kdim_});
    s.emplace_back("v_proj_weight", Shape{E, vdim_});
  }
  if (bias_) s.emplace_back("in_proj_bias", Shape{3 * E});
  if (add_bias_kv_) {
    s.emplace_back("bias_k", Shape{1, 1, E});
    s.emplace_back("bias_v", Shape{1, 1, E});
  }
  s.emplace_back("out_proj.weight", Shape{E, E});
  if (bias_) s.emplace_back("out_proj.bias", Shape{E});
  return s;
}

Tensor& MultiheadAttention::param(const std::string& name) {
  for (auto& [n, t] : params_)
    if (n == name) return t;
  fail(ErrorKind::kInternal, "MultiheadAttention: no parameter '", name, "'");
}
const Tensor& MultiheadAttention::param(const std::string& name) const {
  return const_cast<MultiheadAttention*>(this)->param(name);
}

void MultiheadAttention::reset_parameters(uint64_t seed) {
  std::unique_lock lock(mutex_);
  const int64_t E = embed_dim_;
  const uint64_t key = splitmix64(seed ^ 0x6d68615f696e6974ull);
  const auto set = [&](const std::string& name, const Tensor& f64) { param(name) = f64.to(dtype_); };
  // xavier_uniform: bound = sqrt(6 / (fan_in + fan_out)), fan_in = columns, fan_out = rows.
  const auto xavier = [&](const std::string& name, int64_t rows, int64_t cols, uint32_t stream) {
    set(name, uniform_tensor({rows, cols}, std::sqrt(6.0 / double(rows + cols)), key, stream));
  };
  if (qkv_same_embed_dim()) {
    xavier("in_proj_weight", 3 * E, E, 1);
  } else {
    xavier("q_proj_weight", E, E, 2);
    xavier("k_proj_weight", E, kdim_, 3);
    xavier("v_proj_weight", E, vdim_, 4);
  }
  if (bias_) {
    set("in_proj_bias", Tensor(DType::kF64, {3 * E}));
    set("out_proj.bias", Tensor(DType::kF64, {E}));
  }
  // nn.Linear's kaiming_uniform(a = sqrt(5)): bound = 1 / sqrt(fan_in).
  set("out_proj.weight", uniform_tensor({E, E}, 1.0 / std::sqrt(double(E)), key, 5));
  if (add_bias_kv_) {
    // xavier_normal on [1, 1, E]: fan_in = fan_out = E, std = sqrt(2 / (2E)).
    set("bias_k", normal_tensor({1, 1, E}, 1.0 / std::sqrt(double(E)), key, 6));
    set("bias_v", normal_tensor({1, 1, E}, 1.0 / std::sqrt(double(E)), key, 7));
  }
}

void MultiheadAttention::set_dropout_seed(uint64_t seed) {
  dropout_seed_ = seed;
  calls_ = 0;
}

std::vector<std::pair<std::string, Tensor>> MultiheadAttention::state_dict() const {
  std::shared_lock lock(mutex_);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [n, t] : params_) out.emplace_back(n, Tensor::from_view(t.view()));
  return out;
}

void MultiheadAttention::load_state_dict(const std::map<std::string, TensorView>& tensors) {
  const auto expected = parameter_shapes();
  std::vector<std::string> missing, unexpected;
  std::set<std::string> known;
  for (const auto& [name, shape] : expected) {
    known.insert(name);
    if (!tensors.count(name)) missing.push_back(name);
  }
  for (const auto& [name, t] : tensors)
    if (!known.count(name)) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty()) {
    std::string msg = "MultiheadAttention.load_state_dict:";
    const auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& n : v) s += (s.empty() ? "'" : ", '") + n + "'";
      return s;
    };
    if (!missing.empty()) msg += " missing key(s): " + list(missing) + ";";
    if (!unexpected.empty()) msg += " unexpected key(s): " + list(unexpected) + ";";
    std::string names;
    for (const auto& [name, shape] : expected) names += (names.empty() ? "" : ", ") + name;
    fail(ErrorKind::kInvalidArgument, msg, " expected exactly: ", names, " (embed_dim=", embed_dim_,
         ", num_heads=", num_heads_, ", kdim=", kdim_, ", vdim=", vdim_, ", bias=", bias_ ? "True" : "False",
         ", add_bias_kv=", add_bias_kv_ ? "True" : "False", ")");
  }
  for (const auto& [name, shape] : expected) {
    const TensorView& t = tensors.at(name);
    check(t.shape == shape, ErrorKind::kInvalidArgument, "MultiheadAttention.load_state_dict: '", name,
          "': expected shape ", shape_text(shape), ", got ", shape_text(t.shape));
    check(is_floating(t.dtype), ErrorKind::kTypeError, "MultiheadAttention.load_state_dict: '", name,
          "': expected a floating-point tensor, got ", to_string(t.dtype));
    check(t.data != nullptr || t.numel() == 0, ErrorKind::kInvalidArgument, "MultiheadAttention.load_state_dict: '",
          name, "': null data");
    check_mask_view(t, name.c_str());
  }
  std::vector<std::pair<std::string, Tensor>> fresh;
  for (const auto& [name, shape] : expected) fresh.emplace_back(name, Tensor::from_view(tensors.at(name)).to(dtype_));
  std::unique_lock lock(mutex_);
  params_ = std::move(fresh);
}

void MultiheadAttention::load_state_dict(const std::map<std::string, Tensor>& tensors) {
  std::map<std::string, TensorView> views;
  for (const auto& [n, t] : tensors) views.emplace(n, t.view());
  load_state_dict(views);
}

void MultiheadAttention::load_safetensors(const std::string& path) { load_state_dict(read_safetensors(path).tensors); }

void MultiheadAttention::save_safetensors(const std::string& path) const {
  const auto params = state_dict();
  std::map<std::string, TensorView> views;
  for (const auto& [n, t] : params) views.emplace(n, t.view());
  write_safetensors(path, views, {{"format", "pt"}});
}

std::pair<Tensor, std::optional<Tensor>> MultiheadAttention::forward(const TensorView& query, const TensorView& key,
                                                                     const TensorView& value,
                                                                     const TensorView& key_padding_mask,
                                                                     bool need_weights, const TensorView& attn_mask,
                                                                     bool average_attn_weights, bool is_causal) const {
  // ---- validate (torch's _mha_shape_check plus dtypes) ----
  for (const auto* t : {&query, &key, &value}) {
    const char* name = t == &query ? "query" : t == &key ? "key" : "value";
    check(t->data != nullptr || (t->numel() == 0 && !t->shape.empty()), ErrorKind::kInvalidArgument, name,
          ": required");
    check_mask_view(*t, name);
    check(t->dtype == DType::kF32 || t->dtype == DType::kF64, ErrorKind::kTypeError, name,
          ": expected float32 or float64, got ", to_string(t->dtype));
  }
  check(query.dim() == 2 || query.dim() == 3, ErrorKind::kInvalidArgument, "query: expected a 3-D tensor ",
        batch_first_ ? "[N, L, E]" : "[L, N, E]", " or a 2-D unbatched tensor [L, E], got shape ",
        shape_text(query.shape));
  const bool batched = query.dim() == 3;
  const char* layout_kv = !batched ? "[S, E]" : batch_first_ ? "[N, S, E]" : "[S, N, E]";
  check(key.dim() == query.dim() && value.dim() == query.dim(), ErrorKind::kInvalidArgument, "key/value: expected ",
        query.dim(), "-D tensors ", layout_kv, " like query ", shape_text(query.shape), ", got key ",
        shape_text(key.shape), " and value ", shape_text(value.shape));
  check(key.dtype == query.dtype && value.dtype == query.dtype, ErrorKind::kTypeError,
        "key/value: expected the dtype of query (", to_string(query.dtype), "), got key ", to_string(key.dtype),
        " and value ", to_string(value.dtype));
  // Index of the batch and sequence dims.
  const int bd = batch_first_ ? 0 : 1, sd = batch_first_ ? 1 : 0;
  Sizes z{};
  z.N = batched ? query.shape[bd] : 1;
  z.L = batched ? query.shape[sd] : query.shape[0];
  z.S = batched ? key.shape[sd] : key.shape[0];
  z.E = embed_dim_;
  z.H = num_heads_;
  z.hd = embed_dim_ / num_heads_;
  z.Sp = z.S + (add_bias_kv_ ? 1 : 0) + (add_zero_attn_ ? 1 : 0);
  check(query.shape.back() == embed_dim_, ErrorKind::kInvalidArgument,
        "query: expected last dimension embed_dim = ", embed_dim_, ", got shape ", shape_text(query.shape));
  check(key.shape.back() == kdim_, ErrorKind::kInvalidArgument, "key: expected last dimension kdim = ", kdim_,
        ", got shape ", shape_text(key.shape));
  check(value.shape.back() == vdim_, ErrorKind::kInvalidArgument, "value: expected last dimension vdim = ", vdim_,
        ", got shape ", shape_text(value.shape));
  if (batched) {
    check(key.shape[bd] == z.N && value.shape[bd] == z.N, ErrorKind::kInvalidArgument,
          "key/value: expected batch size N = ", z.N, " (from query ", shape_text(query.shape), "), got key ",
          shape_text(key.shape), " and value ", shape_text(value.shape));
    check(value.shape[sd] == z.S, ErrorKind::kInvalidArgument, "value: expected source length S = ", z.S, " (from key ",
          shape_text(key.shape), "), got ", shape_text(value.shape));
  } else {
    check(value.shape[0] == z.S, ErrorKind::kInvalidArgument, "value: expected source length S = ", z.S, " (from key ",
          shape_text(key.shape), "), got ", shape_text(value.shape));
  }
  check(z.N > 0 && z.L > 0 && z.S > 0, ErrorKind::kInvalidArgument, "query/key: zero-size dimension (N = ", z.N,
        ", L = ", z.L, ", S = ", z.S, "); every size must be >= 1");

  if (key_padding_mask.data) {
    const TensorView& m = key_padding_mask;
    check_mask_view(m, "key_padding_mask");
    check_mask_dtype(m, "key_padding_mask", "True = padding", query.dtype);
    const Shape want = batched ? Shape{z.N, z.S} : Shape{z.S};
    check(m.shape == want, ErrorKind::kInvalidArgument, "key_padding_mask: expected shape ",
          batched ? "[N, S] = " : "[S] = ", shape_text(want), ", got ", shape_text(m.shape));
  }
  if (attn_mask.data) {
    const TensorView& m = attn_mask;
    check_mask_view(m, "attn_mask");
    check_mask_dtype(m, "attn_mask", "True = may NOT attend", query.dtype);
    const Shape want2{z.L, z.S}, want3{z.N * z.H, z.L, z.S};
    check((m.dim() == 2 && m.shape == want2) || (m.dim() == 3 && m.shape == want3), ErrorKind::kInvalidArgument,
          "attn_mask: expected a 2-D mask [L, S] = ", shape_text(want2), " or a 3-D mask ",
          batched ? "[N*num_heads, L, S] = " : "[num_heads, L, S] = ", shape_text(want3), ", got shape ",
          shape_text(m.shape));
  }
  // is_causal: torch 2.x's hint that attn_mask is the causal mask ("Need attn_mask if specifying the is_causal
  // hint"). Checked here, because torch's result for a wrong hint depends on its execution path.
  if (is_causal) {
    check(attn_mask.data != nullptr, ErrorKind::kInvalidArgument,
          "is_causal: a hint that attn_mask is the causal mask; it requires attn_mask (as torch 2.x). Pass "
          "attn_mask = upper-triangular True [L, S], or call sattn.scaled_dot_product_attention(is_causal=True)");
    check(!add_bias_kv_ && !add_zero_attn_, ErrorKind::kInvalidArgument,
          "is_causal: not supported with add_bias_kv or add_zero_attn: torch 2.x hides the appended key column(s) "
          "from queries i < S on one execution path (need_weights=False without key_padding_mask) and lets every "
          "query attend them on the others; pass is_causal=False to apply attn_mask as given (the appended "
          "columns allowed)");
    check_causal_hint(attn_mask, z.L, z.S);
  }

  // ---- gather inputs into dense [N, L, E] ----
  const auto canonical = [&](const TensorView& t) {
    if (!batched)
      return Tensor::from_view(
          TensorView(t.data, t.dtype, {1, t.shape[0], t.shape[1]}, {0, t.strides[0], t.strides[1]}));
    if (batch_first_) return Tensor::from_view(t);
    return Tensor::from_view(
        TensorView(t.data, t.dtype, {t.shape[1], t.shape[0], t.shape[2]}, {t.strides[1], t.strides[0], t.strides[2]}));
  };
  const Tensor xq = canonical(query), xk = &key == &query ? xq : canonical(key),
               xv = &value == &key ? xk : canonical(value);
  TensorView kpm = key_padding_mask;
  if (kpm.data && !batched) kpm = TensorView(kpm.data, kpm.dtype, {1, z.S}, {0, kpm.strides[0]});

  const double p = training_ ? dropout_ : 0.0;
  const uint64_t seed = p > 0 ? splitmix64(dropout_seed_ ^ splitmix64(calls_.fetch_add(1))) : 0;
  const int threads = resolve_num_threads(num_threads);
  std::shared_lock lock(mutex_);
  auto [y, w] = query.dtype == DType::kF64
                    ? run<double>(*this, z, xq, xk, xv, params_, kpm, is_causal ? TensorView() : attn_mask, is_causal,
                                  need_weights, p, seed, threads)
                    : run<float>(*this, z, xq, xk, xv, params_, kpm, is_causal ? TensorView() : attn_mask, is_causal,
                                 need_weights, p, seed, threads);

  // ---- output layout ----
  const DType dt = query.dtype;
  Tensor out;
  if (!batched) out = y.reshape({z.L, z.E});
  else if (batch_first_) out = std::move(y);
  else out = Tensor::from_view(TensorView(y.data(), dt, {z.L, z.N, z.E}, {z.E, z.L * z.E, 1}));
  std::optional<Tensor> weights;
  if (w) {
    if (average_attn_weights) {
      Tensor avg(dt, {z.N, z.L, z.Sp});
      const int64_t plane = z.L * z.Sp;
      for (int64_t n = 0; n < z.N; ++n)
        for (int64_t e = 0; e < plane; ++e) {
          double s = 0;
          for (int64_t h = 0; h < z.H; ++h) {
            const int64_t src = (n * z.H + h) * plane + e;
            s += dt == DType::kF64 ? w->data<double>()[src] : double(w->data<float>()[src]);
          }
          const double mean = s / double(z.H);
          if (dt == DType::kF64) avg.data<double>()[n * plane + e] = mean;
          else avg.data<float>()[n * plane + e] = float(mean);
        }
      weights = batched ? std::move(avg) : avg.reshape({z.L, z.Sp});
    } else {
      weights = batched ? std::move(*w) : w->reshape({z.H, z.L, z.Sp});
    }
  }
  return {std::move(out), std::move(weights)};
}

}  // namespace sattn::nn
