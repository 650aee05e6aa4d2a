// .npy round trips (every dtype, 0-d / 1-d / n-d, strided sources, Fortran order, format 2.0) and malformed
// or truncated files -> sattn::Error(kIO) naming the file; parse_npy (from memory) agrees with read_npy.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <unistd.h>

#include "sattn/io.hpp"

using sattn::DType;
using sattn::ErrorKind;
using sattn::Tensor;

namespace {

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("sattn_npy_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A v1.0 file with the given header dict (padded like numpy) and payload.
std::string npy_bytes(const std::string& dict, const std::string& payload, int major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out = std::string("\x93NUMPY", 6) + char(major) + char(0);
  const uint32_t n = uint32_t(header.size());
  out += char(n & 0xff);
  out += char((n >> 8) & 0xff);
  if (major != 1) {
    out += char((n >> 16) & 0xff);
    out += char((n >> 24) & 0xff);
  }
  return out + header + payload;
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// read_npy(path), checked against parse_npy of the file's bytes (the same tensor).
Tensor read_both(const std::string& path) {
  const Tensor t = sattn::read_npy(path);
  const std::string bytes = file_bytes(path);
  const Tensor m = sattn::parse_npy(bytes.data(), bytes.size(), path);
  EXPECT_EQ(m.dtype(), t.dtype());
  EXPECT_EQ(m.shape(), t.shape());
  EXPECT_EQ(m.nbytes(), t.nbytes());
  if (m.nbytes() == t.nbytes()) {
    EXPECT_EQ(0, std::memcmp(m.data(), t.data(), t.nbytes())) << path;
  }
  return t;
}

// read_npy(path) throws kIO naming the file and containing `needle`; for a regular file parse_npy of its bytes
// throws the same message.
void expect_io_error(const std::string& path, const std::string& needle) {
  std::string message;
  try {
    sattn::read_npy(path);
    ADD_FAILURE() << path << ": no error (expected '" << needle << "')";
  } catch (const sattn::Error& e) {
    message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kIO) << e.what();
    EXPECT_NE(message.find(needle), std::string::npos) << e.what();
    EXPECT_NE(message.find(path), std::string::npos) << "message should name the file: " << e.what();
  }
  if (!std::filesystem::is_regular_file(path)) return;
  const std::string bytes = file_bytes(path);
  try {
    sattn::parse_npy(bytes.data(), bytes.size(), path);
    ADD_FAILURE() << path << ": parse_npy gave no error (expected '" << needle << "')";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO) << e.what();
    EXPECT_EQ(std::string(e.what()), message);
  }
}

}  // namespace

TEST(Npy, RoundTripEveryDtypeAndRank) {
  const std::vector<sattn::Shape> shapes = {{}, {1}, {7}, {3, 4}, {2, 3, 5}, {2, 0, 3}, {1, 2, 1, 3}};
  for (DType dt : {DType::kF32, DType::kF64, DType::kF16, DType::kBool, DType::kI32, DType::kI64, DType::kU8}) {
    for (const auto& shape : shapes) {
      Tensor t(dt, shape);
      for (int64_t n = 0; n < t.numel(); ++n) {
        const int64_t idx = n;
        sattn::TensorView flat(t.data(), dt, {t.numel()});
        flat.set(&idx, dt == DType::kBool ? double(n % 3 == 0)
                                          : double((n * 7) % 23) - 11.0 + (sattn::is_floating(dt) ? 0.25 : 0.0));
      }
      const std::string path = temp_path("rt.npy");
      sattn::write_npy(path, t);
      const Tensor r = read_both(path);
      EXPECT_EQ(r.dtype(), dt);
      ASSERT_EQ(r.shape(), shape) << sattn::to_string(dt);
      EXPECT_EQ(0, std::memcmp(r.data(), t.data(), t.nbytes()))
          << sattn::to_string(dt) << sattn::shape_to_string(shape);
    }
  }
}

TEST(Npy, WritesStridedViewsInCOrderAndRefusesBf16) {
  Tensor base(DType::kF32, {4, 6});
  for (int64_t n = 0; n < 24; ++n) base.data<float>()[n] = float(n);
  // The transpose [6, 4] of base, a non-contiguous view.
  const sattn::TensorView tr(base.data(), DType::kF32, {6, 4}, {1, 6});
  const std::string path = temp_path("tr.npy");
  sattn::write_npy(path, tr);
  const Tensor r = sattn::read_npy(path);
  ASSERT_EQ(r.shape(), (sattn::Shape{6, 4}));
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(r.data<float>()[i * 4 + j], float(j * 6 + i));
  try {
    sattn::write_npy(temp_path("bf.npy"), Tensor(DType::kBF16, {2}));
    ADD_FAILURE() << "bf16 written";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTypeError);
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos);
  }
  try {
    sattn::write_npy("/nonexistent_dir_sattn/x.npy", Tensor(DType::kF32, {2}));
    ADD_FAILURE() << "wrote into a missing directory";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO);
    EXPECT_NE(std::string(e.what()).find("/nonexistent_dir_sattn/x.npy"), std::string::npos);
  }
}

TEST(Npy, ReadsFortranOrderAndFormat2) {
  // A 2x3 float64 array [[0,1,2],[3,4,5]] stored column-major: 0 3 1 4 2 5.
  std::string payload;
  for (double x : {0.0, 3.0, 1.0, 4.0, 2.0, 5.0}) payload.append(reinterpret_cast<const char*>(&x), 8);
  const std::string path = temp_path("fortran.npy");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }", payload));
  const Tensor t = read_both(path);
  ASSERT_EQ(t.shape(), (sattn::Shape{2, 3}));
  for (int n = 0; n < 6; ++n) EXPECT_EQ(t.data<double>()[n], double(n));
  // Fortran order of a 3-D array: element (i, j, l) at i + 2 j + 6 l.
  std::string p3;
  for (int n = 0; n < 24; ++n) {
    const int i = n % 2, j = (n / 2) % 3, l = n / 6;
    const int32_t value = (i * 3 + j) * 4 + l;  // its C-order index
    p3.append(reinterpret_cast<const char*>(&value), 4);
  }
  write_bytes(path, npy_bytes("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3, 4), }", p3));
  const Tensor t3 = read_both(path);
  for (int n = 0; n < 24; ++n) EXPECT_EQ(t3.data<int32_t>()[n], n);
  // Format 2.0 (4-byte header length), 1-d.
  const float f[3] = {1.5f, -2.f, 3.f};
  write_bytes(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",
                              std::string(reinterpret_cast<const char*>(f), 12), 2));
  const Tensor t2 = read_both(path);
  ASSERT_EQ(t2.shape(), (sattn::Shape{3}));
  EXPECT_EQ(t2.data<float>()[1], -2.f);
  // Bool bytes other than 0/1 are normalised.
  write_bytes(path, npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (2,), }", std::string("\x00\x07", 2)));
  const Tensor b = read_both(path);
  EXPECT_EQ(b.data<uint8_t>()[0], 0);
  EXPECT_EQ(b.data<uint8_t>()[1], 1);
}

TEST(Npy, MalformedAndTruncatedFilesGiveIOErrors) {
  const std::string path = temp_path("bad.npy");
  expect_io_error(temp_path("does_not_exist.npy"), "cannot open");
  write_bytes(path, "");
  expect_io_error(path, "bad magic");
  write_bytes(path, "PK\x03\x04 this is a zip, not npy");
  expect_io_error(path, "bad magic");
  write_bytes(path, std::string("\x93NUMPY\x01\x00", 8));
  expect_io_error(path, "truncated header");
  write_bytes(path, std::string("\x93NUMPY\x01\x00\x40\x00{'descr'", 17));
  expect_io_error(path, "truncated header");
  write_bytes(path, std::string("\x93NUMPY\x07\x00\x10\x00", 10) + std::string(16, ' '));
  expect_io_error(path, "format version 7");
  const std::string f8(48, '\0');
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 4), }", f8));
  expect_io_error(path, "truncated data");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", ""));
  expect_io_error(path, "truncated data");
  write_bytes(path, npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", f8));
  expect_io_error(path, "unsupported dtype '>f4'");
  write_bytes(path, npy_bytes("{'descr': '<c16', 'fortran_order': False, 'shape': (2,), }", f8));
  expect_io_error(path, "unsupported dtype");
  write_bytes(path, npy_bytes("{'fortran_order': False, 'shape': (2,), }", f8));
  expect_io_error(path, "'descr'");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'shape': (2,), }", f8));
  expect_io_error(path, "'fortran_order'");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': Maybe, 'shape': (2,), }", f8));
  expect_io_error(path, "fortran_order");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (-2,), }", f8));
  expect_io_error(path, "bad shape entry '-2'");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, x), }", f8));
  expect_io_error(path, "bad shape entry 'x'");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3", f8));
  expect_io_error(path, "malformed header");
  // Huge shapes: refused before any allocation, including an empty array whose strides would overflow.
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (100000, 100000), }", f8));
  expect_io_error(path, "truncated data");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000, 1000000000), }", f8));
  expect_io_error(path, "too large");
  write_bytes(path,
              npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 1000000000000, 1000000000000), }", ""));
  expect_io_error(path, "too large");
  write_bytes(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,), }", f8));
  expect_io_error(path, "bad shape entry");
  // A directory is not a file.
  expect_io_error(std::filesystem::path(path).parent_path().string(), "npy file");
}
