// Every bad input (shapes, dtypes, strides, masks, options, outputs) gives a sattn::Error of the right kind whose
// message names the argument and what was expected / given. Never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "sattn/attention.hpp"
#include "scoped.hpp"

using sattn::AttentionOptions;
using sattn::DType;
using sattn::ErrorKind;
using sattn::Tensor;
using sattn::TensorView;

namespace {

// Runs f, expects sattn::Error of `kind` whose message contains every one of `needles`.
void expect_error(const std::function<void()>& f, ErrorKind kind, const std::vector<std::string>& needles,
                  const std::string& label) {
  try {
    f();
    ADD_FAILURE() << label << ": no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), kind) << label << ": kind " << sattn::to_string(e.kind()) << ", message: " << e.what();
    const std::string msg = e.what();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << label << ": '" << n << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << label << ": not a sattn::Error: " << e.what();
  }
}

struct Inputs {
  Tensor q{DType::kF32, {2, 4, 5, 8}}, k{DType::kF32, {2, 2, 6, 8}}, v{DType::kF32, {2, 2, 6, 3}};
  Tensor out{DType::kF32, {2, 4, 5, 3}}, lse{DType::kF32, {2, 4, 5}}, weights{DType::kF32, {2, 4, 5, 6}};
};

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
             const sattn::AttentionOutputs& outs) {
  sattn::scaled_dot_product_attention(q, k, v, o, outs);
}

using sattn::testing::ScopedEnv;

}  // namespace

TEST(ReferenceErrors, ShapesOfQueryKeyValue) {
  Inputs in;
  const sattn::AttentionOutputs outs{in.out, {}, {}};
  expect_error(
      [&] {
        forward(Tensor(DType::kF32, {4, 5, 8}), in.k, in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"query", "4-D", "[4, 5, 8]"}, "3-D query");
  expect_error(
      [&] {
        forward(Tensor(DType::kF32, {2, 4, 0, 8}), in.k, in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"query", "zero-size", "[2, 4, 0, 8]"}, "Lq = 0");
  expect_error(
      [&] {
        forward(in.q, Tensor(DType::kF32, {2, 2, 0, 8}), in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"key", "zero-size"}, "Lk = 0");
  expect_error(
      [&] {
        forward(Tensor(DType::kF32, {0, 4, 5, 8}), in.k, in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"query", "zero-size"}, "B = 0");
  expect_error(
      [&] {
        forward(Tensor(DType::kF32, {2, 4, 5, 0}), Tensor(DType::kF32, {2, 2, 6, 0}), in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"query", "zero-size", "[2, 4, 5, 0]"}, "D = 0");
  expect_error(
      [&] {
        forward(in.q, in.k, Tensor(DType::kF32, {2, 2, 6, 0}), {}, outs);
      },
      ErrorKind::kInvalidArgument, {"value", "zero-size"}, "Dv = 0");
  expect_error(
      [&] {
        forward(Tensor(DType::kF32, {2, 3, 5, 8}), in.k, in.v, {}, {Tensor(DType::kF32, {2, 3, 5, 3}), {}, {}});
      },
      ErrorKind::kInvalidArgument, {"Hq = 3", "multiple", "Hkv = 2"}, "Hq not a multiple of Hkv");
  expect_error(
      [&] {
        forward(in.q, Tensor(DType::kF32, {2, 2, 6, 7}), in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"key", "E = 8", "[2, 2, 6, 7]"}, "D mismatch");
  expect_error(
      [&] {
        forward(in.q, in.k, Tensor(DType::kF32, {2, 2, 7, 3}), {}, outs);
      },
      ErrorKind::kInvalidArgument, {"value", "expected shape [2, 2, 6, 3]", "[2, 2, 7, 3]"}, "Lk mismatch");
  expect_error(
      [&] {
        forward(in.q, in.k, Tensor(DType::kF32, {2, 1, 6, 3}), {}, outs);
      },
      ErrorKind::kInvalidArgument, {"value", "expected shape [2, 2, 6, 3]", "[2, 1, 6, 3]"}, "Hkv mismatch");
  expect_error(
      [&] {
        forward(in.q, Tensor(DType::kF32, {1, 2, 6, 8}), in.v, {}, outs);
      },
      ErrorKind::kInvalidArgument, {"batch dimensions [2]", "[1, 2, 6, 8]"}, "batch mismatch");
}

TEST(ReferenceErrors, DtypesStridesPointers) {
  Inputs in;
  const sattn::AttentionOutputs outs{in.out, {}, {}};
  expect_error(
      [&] {
        forward(Tensor(DType::kI32, {2, 4, 5, 8}), in.k, in.v, {}, outs);
      },
      ErrorKind::kTypeError, {"query", "float32", "int32"}, "int query");
  expect_error(
      [&] {
        forward(in.q, Tensor(DType::kF64, {2, 2, 6, 8}), in.v, {}, outs);
      },
      ErrorKind::kTypeError, {"key", "float32", "float64"}, "mixed dtypes");
  expect_error(
      [&] {
        forward(in.q, in.k, Tensor(DType::kBool, {2, 2, 6, 3}), {}, outs);
      },
      ErrorKind::kTypeError, {"value", "bool"}, "bool value");
  TensorView neg = in.q.view();
  neg.strides[2] = -8;
  expect_error([&] { forward(neg, in.k, in.v, {}, outs); }, ErrorKind::kInvalidArgument, {"query", "negative strides"},
               "negative stride");
  TensorView null = in.q.view();
  null.data = nullptr;
  expect_error([&] { forward(null, in.k, in.v, {}, outs); }, ErrorKind::kInvalidArgument, {"query", "null"},
               "null data");
  TensorView bad_rank = in.q.view();
  bad_rank.strides.pop_back();
  expect_error([&] { forward(bad_rank, in.k, in.v, {}, outs); }, ErrorKind::kInvalidArgument, {"query", "strides"},
               "strides of the wrong rank");
}

TEST(ReferenceErrors, Masks) {
  Inputs in;
  const sattn::AttentionOutputs outs{in.out, {}, {}};
  auto with_mask = [&](const Tensor& m) {
    AttentionOptions o;
    o.attn_mask = m;
    forward(in.q, in.k, in.v, o, outs);
  };
  expect_error(
      [&] {
        with_mask(Tensor(DType::kBool, {5, 7}));
      },
      ErrorKind::kInvalidArgument, {"attn_mask", "[5, 7]", "does not broadcast", "[2, 4, 5, 6]"}, "mask Lk mismatch");
  expect_error(
      [&] {
        with_mask(Tensor(DType::kBool, {3, 1, 1}));
      },
      ErrorKind::kInvalidArgument, {"attn_mask", "does not broadcast"}, "mask heads mismatch");
  expect_error(
      [&] {
        with_mask(Tensor(DType::kBool, {1, 2, 4, 5, 6}));
      },
      ErrorKind::kInvalidArgument, {"attn_mask", "[1, 2, 4, 5, 6]", "does not broadcast", "[2, 4, 5, 6]"}, "5-D mask");
  expect_error(
      [&] {
        with_mask(Tensor(DType::kI32, {5, 6}));
      },
      ErrorKind::kTypeError, {"attn_mask", "bool", "additive", "int32"}, "int mask");
  EXPECT_NO_THROW(with_mask(Tensor(DType::kF16, {5, 6})));     // additive, as float32/float64/bfloat16
  EXPECT_NO_THROW(with_mask(Tensor(DType::kBool, {})));        // 0-d broadcasts
  EXPECT_NO_THROW(with_mask(Tensor(DType::kF32, {4, 1, 6})));  // [Hq, 1, Lk]
  EXPECT_NO_THROW(with_mask(Tensor(DType::kF64, {2, 1, 5, 1})));

  auto with_padding = [&](const Tensor& kpm, const Tensor& lengths) {
    AttentionOptions o;
    if (kpm.defined()) o.key_padding_mask = kpm;
    if (lengths.defined()) o.key_lengths = lengths;
    forward(in.q, in.k, in.v, o, outs);
  };
  expect_error(
      [&] {
        with_padding(Tensor(DType::kBool, {2, 5}), {});
      },
      ErrorKind::kInvalidArgument, {"key_padding_mask", "expected shape [2, 6]", "[2, 5]"}, "kpm shape");
  expect_error(
      [&] {
        with_padding(Tensor(DType::kF32, {2, 6}), {});
      },
      ErrorKind::kTypeError, {"key_padding_mask", "True = padding", "float32"}, "kpm dtype");
  Tensor lengths(DType::kI64, {2});
  lengths.data<int64_t>()[0] = 3;
  lengths.data<int64_t>()[1] = int64_t(1) << 32;
  expect_error([&] { with_padding({}, lengths); }, ErrorKind::kInvalidArgument,
               {"key_lengths[1]", "[0, 2^32 - 1]", "4294967296"}, "length >= 2^32");
  lengths.data<int64_t>()[1] = 7;  // past the last key (Lk = 6): every key valid, as a shard's global length may be
  EXPECT_NO_THROW(with_padding({}, lengths));
  lengths.data<int64_t>()[1] = -1;
  expect_error([&] { with_padding({}, lengths); }, ErrorKind::kInvalidArgument, {"key_lengths[1]", "-1"},
               "negative length");
  expect_error([&] { with_padding({}, Tensor(DType::kF32, {2})); }, ErrorKind::kTypeError,
               {"key_lengths", "int32 or int64", "float32"}, "float lengths");
  expect_error([&] { with_padding({}, Tensor(DType::kI32, {3})); }, ErrorKind::kInvalidArgument,
               {"key_lengths", "[2]", "[3]"}, "lengths shape");
  expect_error(
      [&] {
        with_padding(Tensor(DType::kBool, {2, 6}), Tensor(DType::kI32, {2}));
      },
      ErrorKind::kInvalidArgument, {"key_padding_mask", "key_lengths", "not both"}, "both paddings");
  expect_error([] { sattn::parse_causal("upper", "--causal"); }, ErrorKind::kInvalidArgument,
               {"--causal", "top_left", "bottom_right", "upper"}, "bad causal name");
}

TEST(ReferenceErrors, Options) {
  Inputs in;
  const sattn::AttentionOutputs outs{in.out, {}, {}};
  auto with = [&](auto edit) {
    AttentionOptions o;
    edit(o);
    forward(in.q, in.k, in.v, o, outs);
  };
  for (double p : {1.0, -0.1, std::nan("")})
    expect_error([&] { with([&](AttentionOptions& o) { o.dropout_p = p; }); }, ErrorKind::kInvalidArgument,
                 {"dropout_p", "[0, 1)"}, "dropout " + std::to_string(p));
  for (double s : {std::numeric_limits<double>::infinity(), std::nan("")})
    expect_error([&] { with([&](AttentionOptions& o) { o.scale = s; }); }, ErrorKind::kInvalidArgument,
                 {"scale", "finite"}, "scale");
  expect_error([&] { with([](AttentionOptions& o) { o.num_threads = -2; }); }, ErrorKind::kInvalidArgument,
               {"num_threads", "-2"}, "negative threads");
  expect_error([&] { with([](AttentionOptions& o) { o.memory_limit_bytes = -1; }); }, ErrorKind::kInvalidArgument,
               {"memory_limit_bytes"}, "negative memory limit");
  expect_error([&] { with([](AttentionOptions& o) { o.kernel = "flash9"; }); }, ErrorKind::kInvalidArgument,
               {"unknown kernel 'flash9'", "reference"}, "unknown kernel");
  {
    ScopedEnv env("SATTN_KERNEL", "nope");
    expect_error([&] { with([](AttentionOptions&) {}); }, ErrorKind::kInvalidArgument, {"unknown kernel 'nope'"},
                 "SATTN_KERNEL unknown");
  }
  {
    ScopedEnv env("SATTN_NUM_THREADS", "two");
    expect_error([&] { with([](AttentionOptions&) {}); }, ErrorKind::kInvalidArgument, {"SATTN_NUM_THREADS", "two"},
                 "SATTN_NUM_THREADS");
  }
}

TEST(ReferenceErrors, StrictModeRefusesTheReferenceFallback) {
  Inputs in;
  // Attention weights are only produced by the materialising reference, so asking for them needs the fall-back.
  const sattn::AttentionOutputs outs{in.out, {}, in.weights};
  AttentionOptions strict;
  strict.strict = true;
  expect_error([&] { forward(in.q, in.k, in.v, strict, outs); }, ErrorKind::kUnsupported,
               {"strict", "B=2 Hq=4 Hkv=2 Lq=5 Lk=6 D=8 Dv=3"}, "strict option");
  // Without weights a fast kernel is eligible, so strict mode has nothing to refuse.
  EXPECT_NO_THROW(forward(in.q, in.k, in.v, strict, {in.out, in.lse, {}}));
  {
    ScopedEnv env("SATTN_STRICT", "1");
    expect_error([&] { forward(in.q, in.k, in.v, {}, outs); }, ErrorKind::kUnsupported, {"strict", "SATTN_STRICT"},
                 "SATTN_STRICT=1");
    // Naming the reference explicitly is not a silent fall-back.
    AttentionOptions named;
    named.kernel = "reference";
    EXPECT_NO_THROW(forward(in.q, in.k, in.v, named, outs));
  }
  {
    ScopedEnv env("SATTN_STRICT", "0");
    EXPECT_NO_THROW(forward(in.q, in.k, in.v, {}, outs));
  }
}

TEST(ReferenceErrors, Outputs) {
  Inputs in;
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {Tensor(DType::kF32, {2, 4, 5, 8}), {}, {}});
      },
      ErrorKind::kInvalidArgument, {"out", "[2, 4, 5, 3]", "[2, 4, 5, 8]"}, "out shape");
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {Tensor(DType::kI64, {2, 4, 5, 3}), {}, {}});
      },
      ErrorKind::kTypeError, {"out", "int64"}, "out dtype");
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {{}, {}, {}});
      },
      ErrorKind::kInvalidArgument, {"out", "required"}, "no out");
  TensorView bcast = in.out.view();
  bcast.strides[2] = 0;
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {bcast, {}, {}});
      },
      ErrorKind::kInvalidArgument, {"out", "broadcast"}, "broadcast out");
  Tensor big(DType::kF32, {200});
  const TensorView overlap(big.data(), DType::kF32, {2, 4, 5, 3}, {60, 15, 3, 2});  // rows of 3 overlap by one
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {overlap, {}, {}});
      },
      ErrorKind::kInvalidArgument, {"out", "overlap", "[60, 15, 3, 2]"}, "self-overlapping out");
  // Padded and permuted (but non-overlapping) outputs are fine.
  EXPECT_NO_THROW(
      forward(in.q, in.k, in.v, {}, {TensorView(big.data(), DType::kF32, {2, 4, 5, 3}, {1, 2, 8, 40}), {}, {}}));
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {in.out, Tensor(DType::kF32, {2, 4, 6}), {}});
      },
      ErrorKind::kInvalidArgument, {"lse", "[2, 4, 5]", "[2, 4, 6]"}, "lse shape");
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {in.out, Tensor(DType::kF16, {2, 4, 5}), {}});
      },
      ErrorKind::kTypeError, {"lse", "float16"}, "lse dtype");
  expect_error(
      [&] {
        forward(in.q, in.k, in.v, {}, {in.out, {}, Tensor(DType::kF32, {2, 4, 6, 5})});
      },
      ErrorKind::kInvalidArgument, {"weights", "[2, 4, 5, 6]", "[2, 4, 6, 5]"}, "weights shape");
}

TEST(ReferenceErrors, Backward) {
  Inputs in;
  sattn::scaled_dot_product_attention(in.q, in.k, in.v, {}, {in.out, in.lse, {}});
  Tensor dq(DType::kF32, in.q.shape()), dk(DType::kF32, in.k.shape()), dv(DType::kF32, in.v.shape());
  auto backward = [&](const TensorView& dout, const TensorView& lse, const AttentionOptions& o,
                      const sattn::AttentionGrads& g) {
    sattn::scaled_dot_product_attention_backward(dout, in.q, in.k, in.v, in.out, lse, o, g);
  };
  expect_error(
      [&] {
        backward(Tensor(DType::kF32, {2, 4, 5, 4}), in.lse, {}, {dq, dk, dv, {}});
      },
      ErrorKind::kInvalidArgument, {"dout", "[2, 4, 5, 3]", "[2, 4, 5, 4]"}, "dout shape");
  expect_error(
      [&] {
        backward(in.out, {}, {}, {dq, dk, dv, {}});
      },
      ErrorKind::kInvalidArgument, {"lse", "required"}, "missing lse");
  expect_error(
      [&] {
        backward(in.out, in.lse, {}, {dq, {}, dv, {}});
      },
      ErrorKind::kInvalidArgument, {"dq/dk/dv", "required"}, "missing dk");
  expect_error(
      [&] {
        backward(in.out, in.lse, {}, {dq, dv, dk, {}});
      },
      ErrorKind::kInvalidArgument, {"dk", "[2, 2, 6, 8]"}, "dk shape");
  AttentionOptions bool_mask;
  Tensor m(DType::kBool, {5, 6});
  bool_mask.attn_mask = m;
  expect_error(
      [&] {
        backward(in.out, in.lse, bool_mask, {dq, dk, dv, Tensor(DType::kF32, {5, 6})});
      },
      ErrorKind::kInvalidArgument, {"dmask", "float (additive)"}, "dmask of a bool mask");
  AttentionOptions add_mask;
  Tensor am(DType::kF32, {4, 1, 6});
  add_mask.attn_mask = am;
  expect_error(
      [&] {
        backward(in.out, in.lse, add_mask, {dq, dk, dv, Tensor(DType::kF32, {2, 4, 5, 6})});
      },
      ErrorKind::kInvalidArgument, {"dmask", "[4, 1, 6]", "[2, 4, 5, 6]"}, "dmask shape");
  EXPECT_NO_THROW(backward(in.out, in.lse, add_mask, {dq, dk, dv, Tensor(DType::kF32, {4, 1, 6})}));
}

TEST(ReferenceErrors, ErrorKindsHaveNames) {
  EXPECT_STREQ(sattn::to_string(ErrorKind::kOutOfMemory), "out of memory");
  EXPECT_STREQ(sattn::to_string(ErrorKind::kIO), "I/O error");
}
