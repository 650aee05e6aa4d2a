// .npy reader (sattn::parse_npy, which read_npy shares): any bytes give a tensor or sattn::Error. An accepted
// file's data lies inside the input after its header.
#include <cstddef>
#include <cstdint>

#include "fuzz_check.hpp"
#include "sattn/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sattn::Tensor t;
  if (!sattn::fuzz::accepted([&] { t = sattn::parse_npy(data, size, "fuzz.npy"); })) return 0;
  // Magic (6 bytes), version (2), header length (2 bytes little-endian in format 1, else 4), header, data.
  const size_t length_bytes = size > 6 && data[6] == 1 ? 2 : 4;
  if (size < 8 + length_bytes) sattn::fuzz::finding("accepted ", size, " bytes, too few for a .npy preamble");
  size_t header_len = 0;
  for (size_t i = 0; i < length_bytes; ++i) header_len |= size_t(data[8 + i]) << (8 * i);
  const size_t data_start = 8 + length_bytes + header_len;
  if (data_start > size || t.nbytes() > size - data_start)
    sattn::fuzz::finding("accepted ", t.nbytes(), " bytes of data from ", size, " bytes, the data starting at ",
                         data_start);
  sattn::fuzz::check_tensor(t, "npy tensor");
  return 0;
}
