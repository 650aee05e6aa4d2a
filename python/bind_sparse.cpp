// Python bindings of the sparse area: pattern classes, sparse_attention(_backward), block_mask_from_dense.
//
// numpy <-> TensorView: bind_common.hpp (inputs whose layout a view cannot express are copied, as for SDPA).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "sattn/error.hpp"
#include "sattn/linear.hpp"
#include "sattn/sparse.hpp"

namespace sattn::py {
// An integer argument of a pattern constructor: any Python object, converted by int_arg / uint64_arg, whose errors
// name the argument (pybind11's own conversion refuses a float, NaN or an int beyond 64 bits with a multi-line
// TypeError that lists the signatures).
struct IntArg {
  pybind11::object value;
};
}  // namespace sattn::py

namespace pybind11::detail {
template <>
struct type_caster<sattn::py::IntArg> {
  PYBIND11_TYPE_CASTER(sattn::py::IntArg, make_caster<int64_t>::name);  // an int in signatures and stubs
  bool load(handle src, bool) {
    value.value = reinterpret_borrow<object>(src);
    return true;
  }
  static handle cast(const sattn::py::IntArg& x, return_value_policy, handle) { return x.value.inc_ref(); }
};
}  // namespace pybind11::detail

namespace sattn::py {
namespace {

// x as a Python int (ints and objects with __index__, e.g. numpy integers; not floats): a TypeError naming the
// argument otherwise.
pybind11::object python_int(const IntArg& x, const char* pattern, const char* name) {
  PyObject* index = pybind11::isinstance<pybind11::float_>(x.value) ? nullptr : PyNumber_Index(x.value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    fail(ErrorKind::kTypeError, pattern, ": expected ", name, " to be an int, got ",
         std::string(pybind11::str(pybind11::type::of(x.value).attr("__name__"))), " ",
         std::string(pybind11::repr(x.value)));
  }
  return pybind11::reinterpret_steal<pybind11::object>(index);
}

int64_t int_arg(const IntArg& x, const char* pattern, const char* name) {
  const pybind11::object v = python_int(x, pattern, name);
  int overflow = 0;
  const long long i = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  check(overflow == 0, ErrorKind::kInvalidArgument, pattern, ": expected ", name, " in ",
        std::numeric_limits<int64_t>::min(), "..", std::numeric_limits<int64_t>::max(), ", got ",
        [&] { return std::string(pybind11::str(v)); });
  return int64_t(i);
}

uint64_t uint64_arg(const IntArg& x, const char* pattern, const char* name) {
  const pybind11::object v = python_int(x, pattern, name);
  const unsigned long long u = PyLong_AsUnsignedLongLong(v.ptr());
  const bool out_of_range = PyErr_Occurred() != nullptr;
  if (out_of_range) PyErr_Clear();
  check(!out_of_range, ErrorKind::kInvalidArgument, pattern, ": expected ", name, " in 0..",
        std::numeric_limits<uint64_t>::max(), ", got ", [&] { return std::string(pybind11::str(v)); });
  return uint64_t(u);
}

sparse::Alignment parse_alignment(const std::string& s) {
  if (s == "bottom_right" || s == "bottom-right") return sparse::Alignment::kBottomRight;
  if (s == "top_left" || s == "top-left") return sparse::Alignment::kTopLeft;
  fail(ErrorKind::kInvalidArgument, "alignment: expected 'bottom_right' or 'top_left', got '", s, "'");
}

// Keeps numpy arrays (and copies of those with negative or unaligned strides) alive and fills SparseOptions.
struct CallOptions {
  ArrayKeeper keeper;
  sparse::SparseOptions o;
};

CallOptions make_options(std::optional<double> scale, bool enable_gqa, const std::optional<pybind11::array>& kpm,
                         int64_t block, const std::optional<std::vector<float>>& alibi, double softcap,
                         const std::optional<pybind11::array>& bias, const std::optional<pybind11::array>& rel_pos_bias,
                         int num_threads) {
  CallOptions c;
  c.o.scale = scale;
  c.o.enable_gqa = enable_gqa;
  c.o.block = block;
  c.o.num_threads = num_threads;
  c.o.softcap = softcap;
  if (alibi) c.o.alibi_slopes = *alibi;
  if (kpm) c.o.key_padding_mask = view_of(*kpm, "key_padding_mask", c.keeper);
  if (bias) c.o.bias = view_of(*bias, "bias", c.keeper);
  if (rel_pos_bias) c.o.rel_pos_bias = view_of(*rel_pos_bias, "rel_pos_bias", c.keeper);
  return c;
}

pybind11::object sparse_attention_py(const pybind11::array& q, const pybind11::array& k, const pybind11::array& v,
                                     const sparse::Pattern& pattern, std::optional<double> scale, bool enable_gqa,
                                     const std::optional<pybind11::array>& key_padding_mask, bool return_lse,
                                     bool return_indices, int64_t block,
                                     const std::optional<std::vector<float>>& alibi_slopes, double softcap,
                                     const std::optional<pybind11::array>& bias,
                                     const std::optional<pybind11::array>& rel_pos_bias, int num_threads,
                                     const std::string& float32_precision) {
  ArrayKeeper keeper;
  const TensorView qv = view_of(q, "query", keeper), kv = view_of(k, "key", keeper), vv = view_of(v, "value", keeper);
  check(qv.dim() == 4 && vv.dim() == 4, ErrorKind::kInvalidArgument,
        "query/value: expected 4-D arrays [B, H, L, D], got query ", shape_text(qv.shape), " and value ",
        shape_text(vv.shape));
  CallOptions c =
      make_options(scale, enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias, rel_pos_bias, num_threads);
  c.o.float32_precision = parse_float32_precision(float32_precision);
  TensorView ov, lv;
  pybind11::array out = new_array(result_dtype(qv), {qv.shape[0], qv.shape[1], qv.shape[2], vv.shape[3]}, &ov);
  pybind11::array lse = new_array(stats_dtype(qv), {qv.shape[0], qv.shape[1], qv.shape[2]}, &lv);
  pybind11::array idx;
  TensorView iv;
  if (return_indices) {
    const Shape is =
        sparse::selection_shape(pattern, qv.shape[0], qv.shape[1], qv.shape[2], kv.dim() == 4 ? kv.shape[2] : 0);
    check(!is.empty(), ErrorKind::kInvalidArgument,
          "return_indices: only TopK and BlockTopK patterns return a "
          "selection, got ",
          pattern.repr());
    idx = new_array(DType::kI64, is, &iv);
  }
  {
    pybind11::gil_scoped_release nogil;
    sparse::sparse_attention(qv, kv, vv, pattern, c.o, ov, lv, iv);
  }
  if (return_lse && return_indices) return pybind11::make_tuple(out, lse, idx);
  if (return_lse) return pybind11::make_tuple(out, lse);
  if (return_indices) return pybind11::make_tuple(out, idx);
  return out;
}

pybind11::tuple sparse_attention_backward_py(
    const pybind11::array& dout, const pybind11::array& q, const pybind11::array& k, const pybind11::array& v,
    const pybind11::array& out, const pybind11::array& lse, const sparse::Pattern& pattern, std::optional<double> scale,
    bool enable_gqa, const std::optional<pybind11::array>& key_padding_mask, int64_t block,
    const std::optional<std::vector<float>>& alibi_slopes, double softcap, const std::optional<pybind11::array>& bias,
    const std::optional<pybind11::array>& rel_pos_bias, int num_threads, const std::optional<pybind11::array>& indices,
    const std::string& float32_precision) {
  ArrayKeeper keeper;
  const TensorView qv = view_of(q, "query", keeper), kv = view_of(k, "key", keeper), vv = view_of(v, "value", keeper),
                   dov = view_of(dout, "dout", keeper), outv = view_of(out, "out", keeper),
                   lsev = view_of(lse, "lse", keeper);
  CallOptions c =
      make_options(scale, enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias, rel_pos_bias, num_threads);
  c.o.float32_precision = parse_float32_precision(float32_precision);
  const DType odt = result_dtype(qv);
  sparse::SparseGrads g;
  pybind11::array dq = new_array(odt, qv.shape, &g.dq), dk = new_array(odt, kv.shape, &g.dk),
                  dv = new_array(odt, vv.shape, &g.dv);
  pybind11::dict extra;
  pybind11::array dbias, drel;
  if (c.o.bias.data) {
    dbias = new_array(DType::kF32, c.o.bias.shape, &g.dbias);
    extra["bias"] = dbias;
  }
  if (c.o.rel_pos_bias.data) {
    drel = new_array(DType::kF32, c.o.rel_pos_bias.shape, &g.drel_pos_bias);
    extra["rel_pos_bias"] = drel;
  }
  pybind11::array dlogits;
  if (sparse::has_logits(pattern)) {
    dlogits = new_array(DType::kF32, {2}, &g.dlogits);
    extra["logits"] = dlogits;
  }
  TensorView iv;
  if (indices) iv = view_of(*indices, "indices", keeper);
  {
    pybind11::gil_scoped_release nogil;
    sparse::sparse_attention_backward(dov, qv, kv, vv, outv, lsev, pattern, c.o, g, iv);
  }
  return pybind11::make_tuple(dq, dk, dv, extra);
}

sparse::LinearOptions linear_options(const std::string& feature_map, std::optional<int64_t> num_features, bool causal,
                                     uint64_t seed, bool enable_gqa, int num_threads) {
  sparse::LinearOptions o;
  o.feature_map = feature_map;
  o.num_features = num_features.value_or(0);
  check(o.num_features >= 0 && (!num_features || *num_features > 0), ErrorKind::kInvalidArgument,
        "num_features: expected a positive integer or None, got ", o.num_features);
  o.causal = causal;
  o.seed = seed;
  o.enable_gqa = enable_gqa;
  o.num_threads = num_threads;
  return o;
}

void bind_block_mask(pybind11::module_& m) {
  using namespace pybind11::literals;
  pybind11::class_<sparse::BlockMask>(m, "BlockMask", "Work list of the block-sparse kernel (see docs/sparse.md).")
      .def_readonly("len_q", &sparse::BlockMask::len_q)
      .def_readonly("len_k", &sparse::BlockMask::len_k)
      .def_readonly("heads", &sparse::BlockMask::heads)
      .def_property_readonly("num_q_blocks", &sparse::BlockMask::num_q_blocks)
      .def_property_readonly("q_perm", [](const sparse::BlockMask& b) { return to_numpy(b.q_perm); })
      .def_property_readonly("k_perm", [](const sparse::BlockMask& b) { return to_numpy(b.k_perm); })
      .def_property_readonly("q_block_start", [](const sparse::BlockMask& b) { return to_numpy(b.q_block_start); })
      .def_property_readonly("row_ptr", [](const sparse::BlockMask& b) { return to_numpy(b.row_ptr); })
      .def_property_readonly("ranges",
                             [](const sparse::BlockMask& b) {
                               // (begin, end, full, q_lo, q_hi): q rows [q_lo, q_hi) of the block, q_hi = 0: to its end
                               std::vector<int32_t> r;
                               r.reserve(b.ranges.size() * 5);
                               for (const auto& x : b.ranges)
                                 r.insert(r.end(), {x.begin, x.end, x.full, x.q_lo, x.q_hi});
                               return to_numpy(std::move(r), {pybind11::ssize_t(b.ranges.size()), 5});
                             })
      .def("computed_pairs", &sparse::BlockMask::computed_pairs, "head_slot"_a = 0)
      .def("partial_pairs", &sparse::BlockMask::partial_pairs, "head_slot"_a = 0);
}

// Pattern and its constructors (Python names and keywords as in the spec syntax, docs/sparse.md).
void bind_patterns(pybind11::module_& m) {
  using namespace pybind11::literals;
  using sparse::Pattern;
  pybind11::class_<Pattern>(m, "Pattern", "A sparse attention pattern; combine with | and &.")
      .def_static("parse", &Pattern::parse, "spec"_a, "Parse a pattern spec such as 'SlidingWindow(256, 256)'.")
      .def("__repr__", &Pattern::repr)
      .def("__or__", [](const Pattern& a, const Pattern& b) { return a | b; })
      .def("__and__", [](const Pattern& a, const Pattern& b) { return a & b; })
      .def("__eq__", [](const Pattern& a, const Pattern& b) { return a == b; })
      .def("__hash__", [](const Pattern& a) { return std::hash<std::string>{}(a.repr()); })
      .def(
          "allowed",
          [](const Pattern& p, int64_t h, int64_t i, int64_t j, int64_t lq, int64_t lk) {
            return p.allowed(0, h, i, j, lq, lk);
          },
          "h"_a, "i"_a, "j"_a, "len_q"_a, "len_k"_a)
      .def(
          "dense_mask",
          [](const Pattern& p, int64_t lq, std::optional<int64_t> lk, int64_t heads) {
            return to_numpy(p.dense_mask(lq, lk.value_or(lq), heads));
          },
          "len_q"_a, "len_k"_a = pybind11::none(), "heads"_a = 1, "Bool mask (True = may attend) [heads or 1, Lq, Lk].")
      .def("block_mask", &Pattern::block_mask, "len_q"_a, "len_k"_a, "heads"_a = 1, "block"_a = 64)
      .def_property_readonly("head_dependent", &Pattern::head_dependent);

  pybind11::class_<sparse::SlidingWindow, Pattern>(m, "SlidingWindow")
      .def(pybind11::init([](const IntArg& l, const IntArg& r, const std::string& al) {
             return sparse::SlidingWindow(int_arg(l, "SlidingWindow", "left"), int_arg(r, "SlidingWindow", "right"),
                                          parse_alignment(al));
           }),
           "left"_a, "right"_a, "alignment"_a = "bottom_right");
  pybind11::class_<sparse::Dilated, Pattern>(m, "Dilated")
      .def(pybind11::init([](const IntArg& w, const IntArg& d, const std::string& al) {
             return sparse::Dilated(int_arg(w, "Dilated", "window"), int_arg(d, "Dilated", "dilation"),
                                    parse_alignment(al));
           }),
           "window"_a, "dilation"_a, "alignment"_a = "bottom_right");
  pybind11::class_<sparse::BlockLocal, Pattern>(m, "BlockLocal")
      .def(pybind11::init([](const IntArg& b, const std::string& al) {
             return sparse::BlockLocal(int_arg(b, "BlockLocal", "block"), parse_alignment(al));
           }),
           "block"_a, "alignment"_a = "bottom_right");
  pybind11::class_<sparse::GlobalTokens, Pattern>(m, "GlobalTokens")
      .def(pybind11::init([](const std::vector<IntArg>& idx, const Pattern& base, const std::string& al) {
             std::vector<int64_t> indices;
             for (const IntArg& x : idx) indices.push_back(int_arg(x, "GlobalTokens", "indices"));
             return sparse::GlobalTokens(std::move(indices), base, parse_alignment(al));
           }),
           "indices"_a, "base"_a, "alignment"_a = "bottom_right");
  pybind11::class_<sparse::BigBird, Pattern>(m, "BigBird")
      .def(pybind11::init([](const IntArg& b, const IntArg& w, const IntArg& g, const IntArg& r, const IntArg& seed,
                             const std::string& al) {
             return sparse::BigBird(int_arg(b, "BigBird", "block"), int_arg(w, "BigBird", "window_blocks"),
                                    int_arg(g, "BigBird", "global_blocks"), int_arg(r, "BigBird", "random_blocks"),
                                    uint64_arg(seed, "BigBird", "seed"), parse_alignment(al));
           }),
           "block"_a, "window_blocks"_a, "global_blocks"_a, "random_blocks"_a, "seed"_a = 0,
           "alignment"_a = "bottom_right");
  pybind11::class_<sparse::Neighborhood2D, Pattern>(m, "Neighborhood2D")
      .def(pybind11::init([](const IntArg& h, const IntArg& w, const IntArg& k, const IntArg& d, bool causal) {
             return sparse::Neighborhood2D(
                 int_arg(h, "Neighborhood2D", "height"), int_arg(w, "Neighborhood2D", "width"),
                 int_arg(k, "Neighborhood2D", "kernel"), int_arg(d, "Neighborhood2D", "dilation"), causal);
           }),
           "height"_a, "width"_a, "kernel"_a, "dilation"_a = 1, "causal"_a = false);
  pybind11::class_<sparse::WindowAttention2D, Pattern>(m, "WindowAttention2D")
      .def(pybind11::init([](const IntArg& h, const IntArg& w, const IntArg& win, const IntArg& shift) {
             return sparse::WindowAttention2D(
                 int_arg(h, "WindowAttention2D", "height"), int_arg(w, "WindowAttention2D", "width"),
                 int_arg(win, "WindowAttention2D", "window"), int_arg(shift, "WindowAttention2D", "shift"));
           }),
           "height"_a, "width"_a, "window"_a, "shift"_a = 0);
  pybind11::class_<sparse::Full, Pattern>(m, "Full").def(pybind11::init<>());
  pybind11::class_<sparse::TopK, Pattern>(m, "TopK").def(
      pybind11::init([](const IntArg& k) { return sparse::TopK(int_arg(k, "TopK", "k")); }), "k"_a);
  pybind11::class_<sparse::BlockTopK, Pattern>(m, "BlockTopK")
      .def(pybind11::init([](const IntArg& b, const IntArg& kb, bool local, bool causal) {
             return sparse::BlockTopK(int_arg(b, "BlockTopK", "block"), int_arg(kb, "BlockTopK", "k_blocks"), local,
                                      causal);
           }),
           "block"_a, "k_blocks"_a, "local"_a = true, "causal"_a = false);
  pybind11::class_<sparse::ReLUAttention, Pattern>(m, "ReLUAttention")
      .def(pybind11::init<double, const std::string&>(), "power"_a = 2.0, "normalize"_a = "none");
  pybind11::class_<sparse::MixedAttention, Pattern>(m, "MixedAttention")
      .def(pybind11::init(
               [](std::pair<double, double> logits) { return sparse::MixedAttention(logits.first, logits.second); }),
           "logits"_a = std::pair<double, double>(0.0, 0.0));
}

// The functions: sparse and linear attention forward and backward, selections, masks, helpers.
void bind_sparse_functions(pybind11::module_& m) {
  using namespace pybind11::literals;
  using sparse::Pattern;
  m.def(
      "selection_mask",
      [](const Pattern& p, const pybind11::array& indices, int64_t lq, int64_t lk) {
        ArrayKeeper keeper;
        return to_numpy(sparse::selection_mask(p, view_of(indices, "indices", keeper), lq, lk));
      },
      "pattern"_a, "indices"_a, "len_q"_a, "len_k"_a,
      "Bool [B, Hq, Lq, Lk] mask of the selection returned by sparse_attention(..., return_indices=True).");

  m.def("parse_pattern", &Pattern::parse, "spec"_a, "Parse a pattern spec (the Python constructor syntax).");
  m.def("alibi_slopes", &sparse::alibi_slopes, "heads"_a);
  m.def(
      "block_mask_from_dense",
      [](const pybind11::array& mask, int64_t block, std::optional<int64_t> block_k) {
        ArrayKeeper keeper;
        return sparse::block_mask_from_dense(view_of(mask, "mask", keeper), block, block_k.value_or(block));
      },
      "mask"_a, "block"_a = 64, "block_k"_a = pybind11::none(),
      "FlexAttention's create_block_mask: bool [Lq, Lk] or [H, Lq, Lk] (True = may attend) -> BlockMask.");

  m.def(
      "linear_attention",
      [](const pybind11::array& q, const pybind11::array& k, const pybind11::array& v, const std::string& feature_map,
         std::optional<int64_t> num_features, bool causal, uint64_t seed, bool enable_gqa, int num_threads) {
        ArrayKeeper keeper;
        const TensorView qv = view_of(q, "query", keeper), kv = view_of(k, "key", keeper),
                         vv = view_of(v, "value", keeper);
        const auto o = linear_options(feature_map, num_features, causal, seed, enable_gqa, num_threads);
        check(qv.dim() == 4 && vv.dim() == 4, ErrorKind::kInvalidArgument, "query/value: expected 4-D arrays");
        TensorView ov;
        pybind11::array out = new_array(result_dtype(qv), {qv.shape[0], qv.shape[1], qv.shape[2], vv.shape[3]}, &ov);
        {
          pybind11::gil_scoped_release nogil;
          sparse::linear_attention(qv, kv, vv, o, ov);
        }
        return out;
      },
      "query"_a, "key"_a, "value"_a, "feature_map"_a = "elu", "num_features"_a = pybind11::none(), "causal"_a = false,
      "seed"_a = 0, "enable_gqa"_a = true, "num_threads"_a = 0,
      "Linear attention phi(Q)(phi(K)^T V) / phi(Q)(phi(K)^T 1) with phi = elu+1 or FAVOR+ ('favor+').");
  m.def(
      "linear_attention_backward",
      [](const pybind11::array& dout, const pybind11::array& q, const pybind11::array& k, const pybind11::array& v,
         const std::string& feature_map, std::optional<int64_t> num_features, bool causal, uint64_t seed,
         bool enable_gqa, int num_threads) {
        ArrayKeeper keeper;
        const TensorView qv = view_of(q, "query", keeper), kv = view_of(k, "key", keeper),
                         vv = view_of(v, "value", keeper), dov = view_of(dout, "dout", keeper);
        const auto o = linear_options(feature_map, num_features, causal, seed, enable_gqa, num_threads);
        const DType odt = result_dtype(qv);
        TensorView a, b, c;
        pybind11::array dq = new_array(odt, qv.shape, &a), dk = new_array(odt, kv.shape, &b),
                        dv = new_array(odt, vv.shape, &c);
        {
          pybind11::gil_scoped_release nogil;
          sparse::linear_attention_backward(dov, qv, kv, vv, o, a, b, c);
        }
        return pybind11::make_tuple(dq, dk, dv);
      },
      "dout"_a, "query"_a, "key"_a, "value"_a, "feature_map"_a = "elu", "num_features"_a = pybind11::none(),
      "causal"_a = false, "seed"_a = 0, "enable_gqa"_a = true, "num_threads"_a = 0,
      "Backward of linear_attention: (dq, dk, dv).");
  m.def(
      "favor_projection",
      [](int64_t d, int64_t m_, uint64_t seed) { return to_numpy_of<double>(sparse::favor_projection(d, m_, seed)); },
      "head_dim"_a, "num_features"_a, "seed"_a = 0, "The FAVOR+ projection omega [m, D] used by linear_attention.");
  m.def("sparse_attention", &sparse_attention_py, "query"_a, "key"_a, "value"_a, "pattern"_a,
        "scale"_a = pybind11::none(), "enable_gqa"_a = false, pybind11::kw_only(),
        "key_padding_mask"_a = pybind11::none(), "return_lse"_a = false, "return_indices"_a = false, "block"_a = 64,
        "alibi_slopes"_a = pybind11::none(), "softcap"_a = 0.0, "bias"_a = pybind11::none(),
        "rel_pos_bias"_a = pybind11::none(), "num_threads"_a = 0, "float32_precision"_a = "highest",
        "Sparse attention of q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] under `pattern`; "
        "returns out [B, Hq, Lq, Dv] (and lse [B, Hq, Lq] with return_lse=True). float32_precision='bf16' lets "
        "float32 inputs take the bf16 products where the CPU has them (docs/sparse.md).");
  m.def("sparse_attention_backward", &sparse_attention_backward_py, "dout"_a, "query"_a, "key"_a, "value"_a, "out"_a,
        "lse"_a, "pattern"_a, "scale"_a = pybind11::none(), "enable_gqa"_a = false, pybind11::kw_only(),
        "key_padding_mask"_a = pybind11::none(), "block"_a = 64, "alibi_slopes"_a = pybind11::none(), "softcap"_a = 0.0,
        "bias"_a = pybind11::none(), "rel_pos_bias"_a = pybind11::none(), "num_threads"_a = 0,
        "indices"_a = pybind11::none(), "float32_precision"_a = "highest",
        "Backward of sparse_attention: returns (dq, dk, dv, grads) with grads a dict of parameter gradients "
        "('bias', 'rel_pos_bias', 'logits' for MixedAttention) for the options given. float32_precision='bf16' "
        "lets float32 inputs take the bf16 products where the CPU has them (docs/sparse.md).");
}

}  // namespace

void bind_sparse(pybind11::module_& m) {
  bind_block_mask(m);
  bind_patterns(m);
  bind_sparse_functions(m);
}

}  // namespace sattn::py
