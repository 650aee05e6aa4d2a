// Python bindings for the nn area: sattn.MultiheadAttention and safetensors I/O.
#include <pybind11/stl.h>

#include <map>
#include <optional>
#include <string>

#include "bindings.hpp"
#include "bind_common.hpp"
#include "sattn/error.hpp"
#include "sattn/mha.hpp"
#include "sattn/safetensors.hpp"

namespace sattn::py {
namespace pyb = pybind11;
using namespace pybind11::literals;

namespace {

DType parse_param_dtype(const pyb::object& obj) {
  if (obj.is_none()) return DType::kF32;
  const pyb::dtype dt = pyb::dtype::from_args(obj);
  const DType t = dtype_of(dt, "dtype");
  check(t == DType::kF32 || t == DType::kF64, ErrorKind::kTypeError, "dtype: expected float32 or float64, got ",
        std::string(pyb::str(static_cast<const pyb::handle&>(dt))));
  return t;
}

}  // namespace

void bind_nn(pyb::module_& m) {
  using MHA = nn::MultiheadAttention;

  pyb::class_<MHA>(m, "MultiheadAttention", R"doc(
torch.nn.MultiheadAttention (PyTorch 2.x semantics) on sattn's exact attention; numpy in and out.

MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                   kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, seed=0)

Masks are bool or float of the query's dtype (uint8 raises DTypeError, as torch 2.x refuses it). Bool masks
keep torch MHA's polarity: True = may NOT attend / is padding. is_causal is a hint that attn_mask is the causal
mask; sattn checks it. A query row with no allowed key gives attention 0 (torch 2.x: the same with
need_weights=False outside its eval fast path, NaN otherwise). See docs/mha.md.)doc")
      .def(pyb::init([](int64_t embed_dim, int64_t num_heads, double dropout, bool bias, bool add_bias_kv,
                        bool add_zero_attn, std::optional<int64_t> kdim, std::optional<int64_t> vdim, bool batch_first,
                        const pyb::object& device, const pyb::object& dtype, uint64_t seed) {
             if (!device.is_none())
               check(std::string(pyb::str(device)) == "cpu", ErrorKind::kInvalidArgument,
                     "device: sattn runs on the CPU; expected None or 'cpu', got '", std::string(pyb::str(device)),
                     "'");
             return MHA(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                        parse_param_dtype(dtype), seed);
           }),
           "embed_dim"_a, "num_heads"_a, "dropout"_a = 0.0, "bias"_a = true, "add_bias_kv"_a = false,
           "add_zero_attn"_a = false, "kdim"_a = pyb::none(), "vdim"_a = pyb::none(), "batch_first"_a = false,
           "device"_a = pyb::none(), "dtype"_a = pyb::none(), pyb::kw_only(), "seed"_a = 0)
      .def(
          "forward",
          [](const MHA& self, const pyb::object& query, const pyb::object& key, const pyb::object& value,
             const pyb::object& key_padding_mask, bool need_weights, const pyb::object& attn_mask,
             bool average_attn_weights, bool is_causal) -> pyb::tuple {
            const NumpyView q = numpy_view(query, "query");
            const NumpyView k = key.is(query) ? q : numpy_view(key, "key");
            const NumpyView v = value.is(key) ? k : numpy_view(value, "value");
            const NumpyView kpm = optional_numpy_view(key_padding_mask, "key_padding_mask");
            const NumpyView am = optional_numpy_view(attn_mask, "attn_mask");
            std::pair<Tensor, std::optional<Tensor>> r;
            {
              pyb::gil_scoped_release release;
              r = self.forward(q.view, k.view, v.view, kpm.view, need_weights, am.view, average_attn_weights,
                               is_causal);
            }
            return pyb::make_tuple(to_numpy(r.first), r.second ? pyb::object(to_numpy(*r.second)) : pyb::none());
          },
          "query"_a, "key"_a, "value"_a, "key_padding_mask"_a = pyb::none(), "need_weights"_a = true,
          "attn_mask"_a = pyb::none(), "average_attn_weights"_a = true, "is_causal"_a = false,
          "Returns (attn_output, attn_weights or None); shapes as torch.nn.MultiheadAttention.forward.")
      .def("__call__",
           [](pyb::object self, pyb::args args, pyb::kwargs kwargs) { return self.attr("forward")(*args, **kwargs); })
      .def(
          "train", [](MHA& self, bool mode) -> MHA& { return self.train(mode); }, "mode"_a = true,
          pyb::return_value_policy::reference_internal)
      .def("eval", &MHA::eval, pyb::return_value_policy::reference_internal)
      .def_property_readonly("training", &MHA::training)
      .def_property_readonly("embed_dim", &MHA::embed_dim)
      .def_property_readonly("num_heads", &MHA::num_heads)
      .def_property_readonly("head_dim", &MHA::head_dim)
      .def_property_readonly("kdim", &MHA::kdim)
      .def_property_readonly("vdim", &MHA::vdim)
      .def_property_readonly("dropout", &MHA::dropout)
      .def_property_readonly("batch_first", &MHA::batch_first)
      .def_property_readonly("add_zero_attn", &MHA::add_zero_attn)
      .def_property_readonly("_qkv_same_embed_dim", &MHA::qkv_same_embed_dim)
      .def_property_readonly("dtype", [](const MHA& self) { return numpy_dtype(self.dtype()); })
      .def_readwrite("num_threads", &MHA::num_threads)
      .def(
          "state_dict",
          [](const MHA& self) {
            pyb::dict d;
            for (const auto& [name, t] : self.state_dict()) d[pyb::str(name)] = to_numpy(t);
            return d;
          },
          "A dict of numpy arrays with torch's state_dict key names (copies).")
      .def(
          "load_state_dict",
          [](MHA& self, const pyb::dict& state_dict, bool strict) {
            std::map<std::string, NumpyView> views = numpy_views(state_dict, "state_dict");
            std::map<std::string, TensorView> tv;
            std::vector<std::pair<std::string, Tensor>> current;
            if (!strict) {  // as torch: ignore unknown keys, keep current values for missing ones
              current = self.state_dict();
              for (const auto& [name, t] : current) tv[name] = views.count(name) ? views.at(name).view : t.view();
            } else {
              for (const auto& [name, nv] : views) tv[name] = nv.view;
            }
            pyb::gil_scoped_release release;
            self.load_state_dict(tv);
          },
          "state_dict"_a, "strict"_a = true,
          "Copies parameters from a dict of arrays keyed by torch's names; strict: error on missing or "
          "unexpected keys (a wrong shape is always an error).")
      .def(
          "load_safetensors",
          [](MHA& self, const std::string& path) {
            pyb::gil_scoped_release release;
            self.load_safetensors(path);
          },
          "path"_a, "Loads a torch state_dict saved as safetensors.")
      .def(
          "save_safetensors",
          [](const MHA& self, const std::string& path) {
            pyb::gil_scoped_release release;
            self.save_safetensors(path);
          },
          "path"_a)
      .def("reset_parameters", &MHA::reset_parameters, "seed"_a = 0)
      .def("set_dropout_seed", &MHA::set_dropout_seed, "seed"_a)
      .def("__repr__", [](const MHA& self) {
        return message::concat("MultiheadAttention(embed_dim=", self.embed_dim(), ", num_heads=", self.num_heads(),
                               ", dropout=", self.dropout(), ", kdim=", self.kdim(), ", vdim=", self.vdim(),
                               ", batch_first=", self.batch_first() ? "True" : "False", ")");
      });

  m.def(
      "read_safetensors",
      [](const std::string& path, bool with_metadata) -> pyb::object {
        SafetensorsFile f;
        {
          pyb::gil_scoped_release release;
          f = read_safetensors(path);
        }
        pyb::dict d;
        for (const auto& [name, t] : f.tensors) {
          try {
            d[pyb::str(name)] = to_numpy(t);  // BF16 as ml_dtypes.bfloat16
          } catch (const Error& e) {
            fail(e.kind(), "read_safetensors: tensor '", name, "': ", e.what());
          }
        }
        if (!with_metadata) return d;
        return pyb::make_tuple(d, pyb::cast(f.metadata));
      },
      "path"_a, "with_metadata"_a = false,
      "Reads a safetensors file into {name: numpy array} (and the __metadata__ dict when with_metadata); BF16\n"
      "tensors come back as ml_dtypes.bfloat16 arrays (a DTypeError naming the tensor without ml_dtypes).");
  m.def(
      "write_safetensors",
      [](const std::string& path, const pyb::dict& tensors,
         const std::optional<std::map<std::string, std::string>>& metadata) {
        std::map<std::string, NumpyView> views = numpy_views(tensors, "tensors");
        std::map<std::string, TensorView> tv;
        for (const auto& [name, nv] : views) tv[name] = nv.view;
        pyb::gil_scoped_release release;
        write_safetensors(path, tv, metadata ? *metadata : std::map<std::string, std::string>{});
      },
      "path"_a, "tensors"_a, "metadata"_a = pyb::none(), "Writes {name: numpy array} as a safetensors file.");
}

}  // namespace sattn::py
