// safetensors reader/writer: round trips, hand-made malformed files, truncation and byte-flip fuzzing.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "sattn/safetensors.hpp"

namespace {

using sattn::DType;
using sattn::Tensor;
using sattn::TensorView;

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("sattn_st_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::string with_header(const std::string& json, const std::string& buffer) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out + json + buffer;
}

// Expects parse_safetensors(bytes) to throw kIO with `needle` (and the name) in the message.
void expect_io_error(const std::string& bytes, const std::string& needle) {
  try {
    sattn::parse_safetensors(bytes.data(), bytes.size(), "case.safetensors");
    ADD_FAILURE() << "no error for a file that should contain: " << needle;
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), sattn::ErrorKind::kIO);
    EXPECT_NE(std::string(e.what()).find("case.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

Tensor filled(DType dt, sattn::Shape shape, int salt) {
  Tensor t(dt, shape);
  auto* b = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) b[i] = static_cast<unsigned char>(i * 31 + salt);
  if (dt == DType::kBool)
    for (size_t i = 0; i < t.nbytes(); ++i) b[i] &= 1;
  return t;
}

TEST(Safetensors, RoundTripEveryDtypeAndStridedViews) {
  std::map<std::string, Tensor> keep;
  int salt = 0;
  for (DType dt :
       {DType::kF32, DType::kF64, DType::kF16, DType::kBF16, DType::kI64, DType::kI32, DType::kBool, DType::kU8})
    keep.emplace(std::string("t_") + sattn::safetensors_dtype_name(dt), filled(dt, {2, 3, ++salt}, salt));
  keep.emplace("scalar", filled(DType::kF32, {}, 7));
  keep.emplace("empty", Tensor(DType::kF64, {0, 4}));
  std::map<std::string, TensorView> views;
  for (const auto& [n, t] : keep) views.emplace(n, t.view());
  // A transposed (non-contiguous) view is written densely in its logical order.
  Tensor base = filled(DType::kF32, {3, 4}, 1);
  views.emplace("transposed", TensorView(base.data(), DType::kF32, {4, 3}, {1, 4}));
  const std::string path = temp_path("roundtrip.safetensors");
  sattn::write_safetensors(path, views, {{"format", "pt"}});
  const auto file = sattn::read_safetensors(path);
  EXPECT_EQ(file.metadata.at("format"), "pt");
  ASSERT_EQ(file.tensors.size(), views.size());
  for (const auto& [n, v] : views) {
    const Tensor& got = file.tensors.at(n);
    ASSERT_EQ(got.dtype(), v.dtype) << n;
    ASSERT_EQ(got.shape(), v.shape) << n;
    const Tensor want = Tensor::from_view(v);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << n;
  }
  // The same bytes parse from memory.
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(sattn::parse_safetensors(bytes.data(), bytes.size()).tensors.size(), views.size());
}

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_NO_THROW(sattn::parse_safetensors(with_header(good, std::string(8, '\0')).data(), 8 + good.size() + 8));
  expect_io_error("abc", "too short");
  expect_io_error(with_header("{}", "").substr(0, 8), "beyond the end");
  {
    std::string b = with_header("{}", "");
    b[7] = char(0x7f);  // header length ~ 2^63
    expect_io_error(b, "exceeds the limit");
  }
  expect_io_error(with_header("{not json", ""), "not valid JSON");
  expect_io_error(with_header("[1,2]", ""), "not a JSON object");
  expect_io_error(with_header(R"({"a":{"dtype":"Q8","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "unsupported dtype 'Q8'");
  expect_io_error(with_header(good, std::string(4, '\0')), "out of range");
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "needs 12");
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                              std::string(12, '\0')),
                  "overlaps");
  expect_io_error(with_header(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", std::string(8, '\0')),
                  "hole");
  expect_io_error(with_header(good, std::string(9, '\0')), "trailing");
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "non-negative");
  expect_io_error(with_header(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],)"
                              R"("data_offsets":[0,8]}})",
                              std::string(8, '\0')),
                  "more than 2^64");
  // An empty tensor whose strides would overflow int64 (as the .npy reader, refused even though it holds no byte).
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],)"
                              R"("data_offsets":[0,0]}})",
                              ""),
                  "is too large");
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')), "missing field");
  expect_io_error(with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", std::string(8, '\0')),
                  "data_offsets");
  expect_io_error(with_header(R"({"__metadata__":{"k":3}})", ""), "not a string");
  try {
    sattn::read_safetensors(temp_path("does_not_exist.safetensors"));
    ADD_FAILURE();
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), sattn::ErrorKind::kIO);
    EXPECT_NE(std::string(e.what()).find("does_not_exist.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, TruncationsAndByteFlipsNeverCrash) {
  Tensor a = filled(DType::kF32, {3, 5}, 3), b = filled(DType::kI64, {4}, 5);
  const std::string path = temp_path("fuzz.safetensors");
  sattn::write_safetensors(path, {{"a", a.view()}, {"b", b.view()}}, {{"x", "y"}});
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string cut = bytes.substr(0, n);
    EXPECT_THROW(sattn::parse_safetensors(cut.data(), cut.size()), sattn::Error) << "truncated at " << n;
  }
  std::mt19937 rng(42);
  for (int it = 0; it < 2000; ++it) {
    std::string m = bytes;
    const int flips = 1 + int(rng() % 3);
    for (int k = 0; k < flips; ++k) m[rng() % m.size()] = char(rng() & 0xff);
    try {
      sattn::parse_safetensors(m.data(), m.size());
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), sattn::ErrorKind::kIO) << e.what();
    }
  }
}

}  // namespace
