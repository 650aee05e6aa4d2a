// safetensors reader (sattn::parse_safetensors): any bytes give tensors or sattn::Error. The tensors of an
// accepted file tile its data buffer exactly (no overlap, hole or trailing byte).
#include <cstddef>
#include <cstdint>

#include "fuzz_check.hpp"
#include "sattn/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sattn::SafetensorsFile file;
  if (!sattn::fuzz::accepted([&] { file = sattn::parse_safetensors(data, size, "fuzz.safetensors"); })) return 0;
  // 8-byte little-endian header length, header, data buffer.
  if (size < 8) sattn::fuzz::finding("accepted ", size, " bytes, too few for the header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  if (header_len > size - 8) sattn::fuzz::finding("accepted a header length of ", header_len, " in ", size, " bytes");
  const uint64_t buffer_size = size - 8 - header_len;
  uint64_t covered = 0;
  for (const auto& [name, t] : file.tensors) {
    sattn::fuzz::check_tensor(t, "tensor '" + name + "'");
    covered += t.nbytes();
  }
  if (covered != buffer_size)
    sattn::fuzz::finding("the tensors hold ", covered, " bytes of a ", buffer_size, "-byte data buffer");
  return 0;
}
