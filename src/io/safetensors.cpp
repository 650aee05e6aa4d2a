// safetensors reader and writer on nlohmann-json (format: https://github.com/huggingface/safetensors).
#include "sattn/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "io/writers.hpp"

namespace sattn {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference implementation

[[noreturn]] void bad(const std::string& file, const std::string& why) {
  fail(ErrorKind::kIO, "safetensors file '", file, "': ", why);
}

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::kF32}, {"F64", DType::kF64}, {"F16", DType::kF16},   {"BF16", DType::kBF16},
      {"I64", DType::kI64}, {"I32", DType::kI32}, {"BOOL", DType::kBool}, {"U8", DType::kU8}};
  for (const auto& [name, t] : kNames)
    if (s == name) {
      *out = t;
      return true;
    }
  return false;
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// Parses and validates the JSON header against a byte buffer of `buffer_size` bytes.
std::vector<Entry> parse_header(const std::string& file, const std::string& text, uint64_t buffer_size,
                                std::map<std::string, std::string>* metadata) {
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(file, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) bad(file, "header is not a JSON object");
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) bad(file, "\"__metadata__\" is not a JSON object of strings");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) bad(file, "\"__metadata__\"[\"" + k + "\"] is not a string");
        (*metadata)[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "': ";
    if (!info.is_object()) bad(file, where + "entry is not a JSON object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!info.contains(field)) bad(file, where + "missing field \"" + field + "\"");
    Entry e;
    e.name = name;
    const auto& dt = info["dtype"];
    if (!dt.is_string()) bad(file, where + "\"dtype\" is not a string");
    if (!parse_dtype(dt.get<std::string>(), &e.dtype))
      bad(file, where + "unsupported dtype '" + dt.get<std::string>() +
                    "' (expected F32, F64, F16, BF16, I64, I32, BOOL or U8)");
    const auto& sh = info["shape"];
    if (!sh.is_array()) bad(file, where + "\"shape\" is not an array");
    // numel * element size, saturating (a zero dimension makes it 0), so nothing can overflow.
    uint64_t bytes = dtype_size(e.dtype);
    bool saturated = false;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned())
        bad(file, where + "shape " + sh.dump() + " has an entry that is not a non-negative integer");
      const uint64_t n = d.get<uint64_t>();
      if (n > (uint64_t(1) << 62)) bad(file, where + "shape " + sh.dump() + " is absurdly large");
      e.shape.push_back(int64_t(n));
      if (n == 0) bytes = 0;
      else if (bytes > UINT64_MAX / n) saturated = true;
      else bytes *= n;
    }
    if (bytes == 0) saturated = false;
    const auto& off = info["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(file, where + "\"data_offsets\" is not a pair of non-negative integers: " + off.dump());
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > buffer_size)
      bad(file, where + "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                    "] out of range for a data buffer of " + std::to_string(buffer_size) + " bytes");
    if (saturated || e.end - e.begin != bytes)
      bad(file, where + "data_offsets span " + std::to_string(e.end - e.begin) + " bytes but shape " + sh.dump() +
                    " of " + dt.get<std::string>() + " needs " +
                    (saturated ? std::string("more than 2^64") : std::to_string(bytes)));
    if (!strides_fit(e.shape)) bad(file, where + "shape " + sh.dump() + " is too large (its strides exceed 2^52)");
    entries.push_back(std::move(e));
  }
  // Tensors must tile the buffer exactly: no overlaps, no holes, no trailing bytes.
  std::vector<const Entry*> sorted;
  for (const auto& e : entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t pos = 0;
  for (const Entry* e : sorted) {
    if (e->begin < pos)
      bad(file, "tensor '" + e->name + "' overlaps another tensor (data_offsets [" + std::to_string(e->begin) + ", " +
                    std::to_string(e->end) + "])");
    if (e->begin > pos)
      bad(file,
          "the data buffer has a hole of " + std::to_string(e->begin - pos) + " bytes before tensor '" + e->name + "'");
    pos = e->end;
  }
  if (pos != buffer_size)
    bad(file, "the data buffer has " + std::to_string(buffer_size - pos) + " trailing bytes not owned by any tensor");
  return entries;
}

void normalise_bool(Tensor& t) {
  if (t.dtype() != DType::kBool) return;
  for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = t.data<uint8_t>()[i] != 0;
}

uint64_t read_u64_le(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

uint64_t check_header_length(const std::string& file, uint64_t header_len, uint64_t size) {
  if (size < 8) bad(file, "too short (" + std::to_string(size) + " bytes) for the 8-byte header length");
  if (header_len > kMaxHeaderBytes)
    bad(file, "header length " + std::to_string(header_len) + " exceeds the limit of 100 MB");
  if (header_len > size - 8)
    bad(file, "header length " + std::to_string(header_len) + " extends beyond the end of the file (" +
                  std::to_string(size) + " bytes)");
  if (header_len < 2) bad(file, "header length " + std::to_string(header_len) + " is too short for a JSON object");
  return size - 8 - header_len;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kBool: return "BOOL";
    case DType::kU8: return "U8";
  }
  return "?";
}

SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (size < 8) check_header_length(name, 0, size);
  const uint64_t header_len = read_u64_le(bytes);
  const uint64_t buffer_size = check_header_length(name, header_len, size);
  SafetensorsFile out;
  const std::string text(reinterpret_cast<const char*>(bytes) + 8, size_t(header_len));
  const unsigned char* buffer = bytes + 8 + header_len;
  for (const Entry& e : parse_header(name, text, buffer_size, &out.metadata)) {
    Tensor t(e.dtype, e.shape);
    if (t.nbytes()) std::memcpy(t.data(), buffer + e.begin, t.nbytes());
    normalise_bool(t);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) bad(path, "cannot open for reading");
  const auto end = f.tellg();
  if (end < 0) bad(path, "cannot determine the file size");
  const uint64_t size = uint64_t(end);
  f.seekg(0);
  unsigned char lb[8] = {};
  if (size >= 8 && !f.read(reinterpret_cast<char*>(lb), 8)) bad(path, "cannot read the header length");
  const uint64_t header_len = size >= 8 ? read_u64_le(lb) : 0;
  const uint64_t buffer_size = check_header_length(path, header_len, size);
  std::string text(size_t(header_len), '\0');
  if (!f.read(text.data(), std::streamsize(header_len))) bad(path, "truncated header");
  SafetensorsFile out;
  const uint64_t buffer_start = 8 + header_len;
  for (const Entry& e : parse_header(path, text, buffer_size, &out.metadata)) {
    Tensor t(e.dtype, e.shape);
    if (t.nbytes()) {
      f.seekg(std::streamoff(buffer_start + e.begin));
      if (!f.read(static_cast<char*>(t.data()), std::streamsize(t.nbytes())))
        bad(path, "could not read the data of tensor '" + e.name + "'");
    }
    normalise_bool(t);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

void write_safetensors(io::OutputFile& out, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> dense;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    check(!name.empty() && name != "__metadata__", ErrorKind::kInvalidArgument,
          "write_safetensors: invalid tensor name '", name, "'");
    dense.push_back(Tensor::from_view(view));
    const uint64_t n = dense.back().nbytes();
    header[name] = {
        {"dtype", safetensors_dtype_name(view.dtype)}, {"shape", view.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the buffer 8-byte aligned, as the reference writer
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[size_t(i)] = static_cast<char>(uint64_t(text.size()) >> (8 * i));
  out.write(head + text);
  for (const Tensor& t : dense) out.write(t.data(), t.nbytes());
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  io::write_file(path, [&](io::OutputFile& out) { write_safetensors(out, tensors, metadata); });
}

}  // namespace sattn
