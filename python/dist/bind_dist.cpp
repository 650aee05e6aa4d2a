// sattn._dist: ring attention over MPI for numpy arrays (the public API is sattn/dist.py). Built when MPI is found;
// the communicator arrives as its Fortran handle (mpi4py's Comm.py2f()), so mpi4py and this module must use the
// same MPI library (both Debian's Open MPI here).
#include <mpi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bind_common.hpp"
#include "sattn/dist.hpp"

namespace pyb = pybind11;

namespace sattn::py {
namespace {

dist::RingOptions ring_options(const std::string& layout, bool causal, std::optional<double> scale,
                               const TensorView& key_lengths, double dropout_p, uint64_t seed, int num_threads,
                               const std::string& float32_precision) {
  dist::RingOptions o;
  o.layout = dist::parse_layout(layout);
  o.causal = causal;
  o.scale = scale;
  o.key_lengths = key_lengths;
  o.dropout_p = dropout_p;
  o.seed = seed;
  o.num_threads = num_threads;
  o.float32_precision = parse_float32_precision(float32_precision);
  return o;
}

MPI_Comm comm_of(int64_t fortran_handle) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  check(initialized != 0, ErrorKind::kInvalidArgument,
        "comm: MPI is not initialised in this process (import mpi4py.MPI first, or run under python -m mpi4py)");
  return MPI_Comm_f2c(MPI_Fint(fortran_handle));
}

pyb::tuple forward(const pyb::object& q_obj, const pyb::object& k_obj, const pyb::object& v_obj, int64_t comm,
                   const std::string& layout, bool causal, std::optional<double> scale, const pyb::object& lengths,
                   double dropout_p, uint64_t seed, int num_threads, const std::string& float32_precision) {
  ArrayKeeper keep;
  const TensorView q = view_of(q_obj, "query", keep), k = view_of(k_obj, "key", keep),
                   v = view_of(v_obj, "value", keep);
  const dist::RingOptions o = ring_options(layout, causal, scale, view_of(lengths, "key_lengths", keep), dropout_p,
                                           seed, num_threads, float32_precision);
  check(q.dim() == 4 && v.dim() == 4, ErrorKind::kInvalidArgument, "query, value: expected 4-D arrays");
  TensorView out, lse;
  pyb::array out_a = new_array(result_dtype(q), {q.shape[0], q.shape[1], q.shape[2], v.shape[3]}, &out);
  pyb::array lse_a = new_array(DType::kF32, {q.shape[0], q.shape[1], q.shape[2]}, &lse);
  const MPI_Comm c = comm_of(comm);
  {
    pyb::gil_scoped_release release;
    dist::ring_attention(q, k, v, o, c, out, lse);
  }
  return pyb::make_tuple(out_a, lse_a);
}

pyb::tuple backward(const pyb::object& dout_obj, const pyb::object& q_obj, const pyb::object& k_obj,
                    const pyb::object& v_obj, const pyb::object& out_obj, const pyb::object& lse_obj, int64_t comm,
                    const std::string& layout, bool causal, std::optional<double> scale, const pyb::object& lengths,
                    double dropout_p, uint64_t seed, int num_threads, const std::string& float32_precision) {
  ArrayKeeper keep;
  const TensorView dout = view_of(dout_obj, "grad_out", keep), q = view_of(q_obj, "query", keep),
                   k = view_of(k_obj, "key", keep), v = view_of(v_obj, "value", keep),
                   out = view_of(out_obj, "out", keep), lse = view_of(lse_obj, "lse", keep);
  const dist::RingOptions o = ring_options(layout, causal, scale, view_of(lengths, "key_lengths", keep), dropout_p,
                                           seed, num_threads, float32_precision);
  TensorView dq, dk, dv;
  const DType dt = result_dtype(q);
  pyb::array dq_a = new_array(dt, q.shape, &dq), dk_a = new_array(dt, k.shape, &dk), dv_a = new_array(dt, v.shape, &dv);
  const MPI_Comm c = comm_of(comm);
  {
    pyb::gil_scoped_release release;
    dist::ring_attention_backward(dout, q, k, v, out, lse, o, c, dq, dk, dv);
  }
  return pyb::make_tuple(dq_a, dk_a, dv_a);
}

}  // namespace
}  // namespace sattn::py

PYBIND11_MODULE(_dist, m) {
  using pyb::arg;
  m.doc() = "sattn ring attention over MPI (use sattn.dist)";
  m.def("_ring_forward", &sattn::py::forward, arg("query"), arg("key"), arg("value"), arg("comm"), arg("layout"),
        arg("causal"), arg("scale"), arg("key_lengths"), arg("dropout_p"), arg("seed"), arg("num_threads"),
        arg("float32_precision"),
        "Private: 4-D ring forward over the communicator's Fortran handle. Returns (out, lse).");
  m.def("_ring_backward", &sattn::py::backward, arg("grad_out"), arg("query"), arg("key"), arg("value"), arg("out"),
        arg("lse"), arg("comm"), arg("layout"), arg("causal"), arg("scale"), arg("key_lengths"), arg("dropout_p"),
        arg("seed"), arg("num_threads"), arg("float32_precision"), "Private: 4-D ring backward. Returns (dq, dk, dv).");
}
