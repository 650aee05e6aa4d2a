// Core of the Python module: exception translation, version, kernel registry queries, thread count.
//
// Exceptions: every sattn::Error becomes an instance of a sattn.Error subclass that ALSO derives from the
// builtin Python exception users expect, so `except ValueError` works as with PyTorch/numpy:
//   kInvalidArgument -> sattn.InvalidArgumentError(sattn.Error, ValueError)
//   kTypeError       -> sattn.DTypeError(sattn.Error, TypeError)
//   kOutOfMemory     -> sattn.OutOfMemoryError(sattn.Error, MemoryError)
//   kUnsupported     -> sattn.UnsupportedError(sattn.Error, NotImplementedError)
//   kIO              -> sattn.FileFormatError(sattn.Error, ValueError, OSError)
//   kInternal        -> sattn.InternalError(sattn.Error, RuntimeError)
// std::bad_alloc and std::length_error (a size past what a buffer can hold) become sattn.OutOfMemoryError too.
#include <pybind11/stl.h>

#include <atomic>
#include <new>
#include <stdexcept>
#include <string>

#include "bindings.hpp"
#include "bind_common.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/simd.hpp"

#ifndef SATTN_VERSION
#define SATTN_VERSION "unknown"
#endif

namespace sattn {
int resolve_num_threads(int requested);  // src/core/threads.hpp (not included: it needs OpenMP flags)
}  // namespace sattn

namespace sattn::py {

namespace {

// Python exception classes, created once at import (kept alive by the module's attributes).
PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_dtype = nullptr;
PyObject* g_memory = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_io = nullptr;
PyObject* g_internal = nullptr;

// Module-wide default thread count for calls made with num_threads=None (0 = library default).
std::atomic<int> g_default_threads{0};

PyObject* new_exception(pybind11::module_& m, const char* name, std::initializer_list<PyObject*> bases,
                        const char* doc) {
  pybind11::tuple t(bases.size());
  size_t i = 0;
  for (PyObject* b : bases) t[i++] = pybind11::reinterpret_borrow<pybind11::object>(b);
  const std::string qualified = std::string("sattn.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, t.ptr(), nullptr);
  if (!cls) throw pybind11::error_already_set();
  m.attr(name) = pybind11::reinterpret_steal<pybind11::object>(cls);
  return cls;
}

}  // namespace

int default_num_threads() { return g_default_threads.load(); }

int resolve_python_threads(const pybind11::object& num_threads) {
  if (num_threads.is_none()) return g_default_threads.load();
  if (!pybind11::isinstance<pybind11::int_>(num_threads) || pybind11::isinstance<pybind11::bool_>(num_threads))
    throw Error(ErrorKind::kTypeError,
                message::concat("num_threads: expected None or a positive int, got ",
                                std::string(pybind11::str(pybind11::type::of(num_threads).attr("__name__")))));
  const long n = num_threads.cast<long>();
  check(n >= 1 && n <= 4096, ErrorKind::kInvalidArgument, "num_threads: expected None or an int in [1, 4096], got ", n);
  return int(n);
}

void bind_core(pybind11::module_& m) {
  g_error = new_exception(m, "Error", {PyExc_Exception},
                          "Base class of every error raised by sattn (each also derives from a builtin exception).");
  g_invalid = new_exception(m, "InvalidArgumentError", {g_error, PyExc_ValueError},
                            "A shape, value or option is wrong (a ValueError).");
  g_dtype = new_exception(m, "DTypeError", {g_error, PyExc_TypeError}, "A dtype is wrong (a TypeError).");
  g_memory = new_exception(m, "OutOfMemoryError", {g_error, PyExc_MemoryError},
                           "A buffer would exceed sattn's memory limit (a MemoryError).");
  g_unsupported = new_exception(m, "UnsupportedError", {g_error, PyExc_NotImplementedError},
                                "Valid, but no (allowed) kernel supports it, e.g. in strict mode "
                                "(a NotImplementedError).");
  g_io = new_exception(m, "FileFormatError", {g_error, PyExc_ValueError, PyExc_OSError},
                       "A file could not be read or is malformed (a ValueError and an OSError).");
  g_internal = new_exception(m, "InternalError", {g_error, PyExc_RuntimeError}, "A bug in sattn (a RuntimeError).");

  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* cls = g_internal;
      switch (e.kind()) {
        case ErrorKind::kInvalidArgument: cls = g_invalid; break;
        case ErrorKind::kTypeError: cls = g_dtype; break;
        case ErrorKind::kOutOfMemory: cls = g_memory; break;
        case ErrorKind::kUnsupported: cls = g_unsupported; break;
        case ErrorKind::kIO: cls = g_io; break;
        case ErrorKind::kInternal: cls = g_internal; break;
      }
      PyErr_SetString(cls, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(g_memory, "sattn: out of memory (std::bad_alloc)");
    } catch (const std::length_error& e) {  // a size past what a buffer can hold ("larger than max_size()")
      PyErr_SetString(g_memory, message::concat("sattn: out of memory: a buffer larger than any this machine can "
                                                "address was asked for (std::length_error: ",
                                                e.what(), ")")
                                    .c_str());
    }
  });

  m.attr("__version__") = SATTN_VERSION;

  m.def("kernel_names", &sattn::kernel_names,
        "Names of the registered attention kernels, in the order the registry tries them (reference last).");

  m.def(
      "simd_targets",
      [] {
        const SimdTargets t = sattn::simd_targets();
        pybind11::dict d;
        d["selected"] = t.selected;
        d["available"] = t.available;
        d["fused"] = t.fused;
        d["sparse_tiles"] = t.sparse_tiles;
        d["topk"] = t.topk;
        d["nn"] = t.nn;
        return d;
      },
      "The SIMD target selected for the process ('selected': $SATTN_SIMD, set_simd_target()'s, or the widest this "
      "CPU runs), the targets this CPU runs ('available', widest first), and the build each component runs "
      "('fused', 'sparse_tiles', 'topk', 'nn': the widest it was compiled for, no wider than 'selected').");
  m.def(
      "set_simd_target", [](const std::string& name) { sattn::set_simd_target(name); }, pybind11::arg("name"),
      "Selects the SIMD target of every component: 'amx', 'avx512bf16', 'avx512', 'avx2', 'sse4', 'portable' or "
      "'auto' (the widest this CPU runs). Raises InvalidArgumentError for an unknown name and UnsupportedError when "
      "this CPU cannot run it. "
      "Takes effect for calls that start after it returns.");
  m.def(
      "get_num_threads", []() { return resolve_num_threads(g_default_threads.load()); },
      "Threads a call with num_threads=None uses: set_num_threads()'s value, else $SATTN_NUM_THREADS, else the "
      "number of online cores.");
  m.def(
      "set_num_threads",
      [](const pybind11::object& n) {
        if (n.is_none() || (pybind11::isinstance<pybind11::int_>(n) && !pybind11::isinstance<pybind11::bool_>(n) &&
                            n.cast<long>() == 0)) {
          g_default_threads.store(0);
          return;
        }
        g_default_threads.store(resolve_python_threads(n));
      },
      pybind11::arg("num_threads"),
      "Sets the default thread count of calls made with num_threads=None (process-wide). None or 0 restores the "
      "default ($SATTN_NUM_THREADS, else the number of online cores).");
  m.def("workspace_cache_bytes", &sattn::workspace_cache_bytes,
        "Bytes of freed large kernel scratch (4 MiB and more: packed tiles, partial gradients) kept for the next "
        "call, at most 8 blocks and $SATTN_WORKSPACE_CACHE_MB MiB (default 1024; 0 disables the cache).");
  m.def("empty_workspace_cache", &sattn::empty_workspace_cache,
        "Returns the scratch kept for the next call (workspace_cache_bytes()) to the system.");
}

}  // namespace sattn::py
