// nn::MultiheadAttention — PyTorch 2.x's torch.nn.MultiheadAttention on sattn's attention.
//
// Shapes (E = embed_dim, H = num_heads, L = target length, S = source length, N = batch):
//   query [L, N, E] (batch_first: [N, L, E]; unbatched: [L, E]), key [S, N, kdim], value [S, N, vdim]
//   key_padding_mask [N, S] (unbatched: [S]); bool True = padding (ignored), or float added to the scores
//   attn_mask [L, S] or [N*H, L, S] (unbatched: [H, L, S]); bool True = may NOT attend (torch MHA's polarity,
//     the opposite of sattn::AttentionOptions::attn_mask), or float added to the scores
//   Masks are bool or float of the query's dtype, as torch 2.x (uint8 and other dtypes: Error kTypeError).
//   -> attn_output [L, N, E] (batch_first: [N, L, E]; unbatched: [L, E]), in the dtype of query (f32/f64)
//   -> attn_weights (need_weights): [N, L, S'] averaged over heads or [N, H, L, S'] per head (unbatched: no N),
//      after dropout; S' = S + add_bias_kv + add_zero_attn.
//
// is_causal is torch 2.x's hint that attn_mask is the causal mask (True / -inf exactly where j > i): it requires
// attn_mask, and sattn checks it (a wrong hint, or one with add_bias_kv / add_zero_attn, is an error; torch's
// result for those depends on its execution path); a correct hint runs as top-left causal attention.
// Differences from PyTorch (see docs/mha.md): a query row with no allowed key gives attention 0 and weights 0
// (torch 2.x: the same with need_weights=False, except on its eval fast path; NaN with need_weights=True);
// dropout uses sattn's Philox stream (same distribution, not torch's random numbers).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "sattn/tensor.hpp"

namespace sattn::nn {

class MultiheadAttention {
 public:
  // Same arguments and defaults as torch.nn.MultiheadAttention; `dtype` is the parameters' dtype (f32 or f64)
  // and `seed` seeds the initial parameters and the dropout stream.
  // Throws sattn::Error(kInvalidArgument) if embed_dim is not divisible by num_heads, sizes are < 1, or
  // dropout is outside [0, 1].
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true,
                     bool add_bias_kv = false, bool add_zero_attn = false, std::optional<int64_t> kdim = std::nullopt,
                     std::optional<int64_t> vdim = std::nullopt, bool batch_first = false, DType dtype = DType::kF32,
                     uint64_t seed = 0);

  MultiheadAttention(const MultiheadAttention& other);
  MultiheadAttention& operator=(const MultiheadAttention& other);

  // (attn_output, attn_weights if need_weights). Empty views (data == nullptr) mean "absent".
  // Throws sattn::Error naming the argument, the expected and the given shape/dtype.
  std::pair<Tensor, std::optional<Tensor>> forward(const TensorView& query, const TensorView& key,
                                                   const TensorView& value, const TensorView& key_padding_mask = {},
                                                   bool need_weights = true, const TensorView& attn_mask = {},
                                                   bool average_attn_weights = true, bool is_causal = false) const;

  // Thread safety: forward() may run concurrently from several threads; loading or re-initialising the
  // weights waits for running forwards (and vice versa).
  MultiheadAttention& train(bool mode = true) {
    training_ = mode;
    return *this;
  }
  MultiheadAttention& eval() { return train(false); }
  bool training() const { return training_; }

  // Parameters with torch's state_dict names, in torch's order:
  //   in_proj_weight [3E, E] (kdim == vdim == E) or q_proj_weight [E, E], k_proj_weight [E, kdim],
  //   v_proj_weight [E, vdim]; in_proj_bias [3E] (bias); bias_k, bias_v [1, 1, E] (add_bias_kv);
  //   out_proj.weight [E, E]; out_proj.bias [E] (bias).
  std::vector<std::pair<std::string, Tensor>> state_dict() const;  // copies
  std::vector<std::pair<std::string, Shape>> parameter_shapes() const;
  // Copies every parameter from `tensors` (converted to the parameters' dtype; any float dtype accepted).
  // Throws sattn::Error(kInvalidArgument) naming missing keys, unexpected keys, or a key with the wrong shape
  // (expected and given); nothing is changed when it throws.
  void load_state_dict(const std::map<std::string, TensorView>& tensors);
  void load_state_dict(const std::map<std::string, Tensor>& tensors);
  // Loads a torch state_dict saved with safetensors (e.g. safetensors.torch.save_file(m.state_dict(), path)).
  void load_safetensors(const std::string& path);
  // Writes the state_dict with write_safetensors (atomically, as every writer).
  void save_safetensors(const std::string& path) const;
  // Re-initialises the parameters as torch does (xavier_uniform in-projections, zero biases, kaiming-uniform
  // out_proj.weight, xavier_normal bias_k/bias_v), from a counter-based generator keyed by `seed`.
  void reset_parameters(uint64_t seed);
  // Seeds the dropout stream; call i (0, 1, ...) after this uses seed mix(seed, i).
  void set_dropout_seed(uint64_t seed);

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  int64_t kdim() const { return kdim_; }
  int64_t vdim() const { return vdim_; }
  double dropout() const { return dropout_; }
  bool has_bias() const { return bias_; }
  bool add_bias_kv() const { return add_bias_kv_; }
  bool add_zero_attn() const { return add_zero_attn_; }
  bool batch_first() const { return batch_first_; }
  bool qkv_same_embed_dim() const { return kdim_ == embed_dim_ && vdim_ == embed_dim_; }
  DType dtype() const { return dtype_; }
  int num_threads = 0;  // for the attention and the projections; 0 = sattn's default

 private:
  Tensor& param(const std::string& name);
  const Tensor& param(const std::string& name) const;

  int64_t embed_dim_, num_heads_, kdim_, vdim_;
  double dropout_;
  bool bias_, add_bias_kv_, add_zero_attn_, batch_first_;
  DType dtype_;
  std::atomic<bool> training_{true};  // torch modules start in training mode
  std::vector<std::pair<std::string, Tensor>> params_;
  uint64_t dropout_seed_ = 0;
  mutable std::atomic<uint64_t> calls_{0};
  mutable std::shared_mutex mutex_;  // guards params_
};

}  // namespace sattn::nn
