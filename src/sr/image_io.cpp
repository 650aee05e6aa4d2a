// PNG and JPEG decoding (libpng, libjpeg-turbo), with the pixel limit checked from the header before any pixel
// buffer is allocated, and PNG encoding (zlib, compressing bands of rows in parallel), in memory.
//
// Both decoders report errors by longjmp to a setjmp of their caller, the documented way (a C++ exception must
// not cross their C frames). The functions that call setjmp (the *_step functions) own no C++ object with a
// destructor and keep all their state in a plain struct passed by pointer, so the longjmp skips no destructor and
// no local has to be volatile; their callers turn the saved message into sattn::Error.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csetjmp>
#include <cstdio>  // before jpeglib.h, which needs FILE
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>

#include <jpeglib.h>
#include <png.h>
#include <zlib.h>

#include "core/threads.hpp"

#include "sr/png_writer.hpp"
#include "sattn/error.hpp"
#include "sattn/image.hpp"

namespace sattn::sr {
namespace {

// A progressive JPEG has about 10 scans; thousands of tiny scans make a small file decode for minutes (libjpeg-turbo's
// own fuzz targets stop at 500 too).
constexpr int kMaxJpegScans = 500;

bool is_png(const uint8_t* p, size_t n) { return n >= 8 && png_sig_cmp(p, 0, 8) == 0; }
bool is_jpeg(const uint8_t* p, size_t n) { return n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF; }

void check_pixel_limit(const std::string& name, int64_t width, int64_t height, int scale, int64_t max_pixels) {
  const int64_t n = output_pixels(height, width, scale);
  if (n <= max_pixels) return;
  if (scale == 1)
    fail(ErrorKind::kIO, "image '", name, "': ", width, "x", height, " = ", n, " pixels is over the limit of ",
         max_pixels, " pixels");
  fail(ErrorKind::kIO, "image '", name, "': ", width, "x", height, " at x", scale, " = ", n,
       " output pixels is over the limit of ", max_pixels, " output pixels (max_output_pixels)");
}

// ---- PNG ---------------------------------------------------------------------------------------------------

struct PngCodec {
  png_structp png = nullptr;
  png_infop info = nullptr;
  const uint8_t* data = nullptr;  // reading: the file
  size_t size = 0, pos = 0;
  png_uint_32 width = 0, height = 0;
  int file_channels = 0;
  char message[256] = "";
};

void png_on_error(png_structp png, png_const_charp msg) {
  auto* c = static_cast<PngCodec*>(png_get_error_ptr(png));
  std::snprintf(c->message, sizeof c->message, "%s", msg);
  png_longjmp(png, 1);
}
void png_on_warning(png_structp, png_const_charp) {}  // an ancillary chunk was dropped: the pixels are intact

void png_on_read(png_structp png, png_bytep out, size_t n) {
  auto* c = static_cast<PngCodec*>(png_get_io_ptr(png));
  if (n > c->size - c->pos) png_error(png, "unexpected end of file");
  std::memcpy(out, c->data + c->pos, n);
  c->pos += n;
}

// Reads the header and sets up the transforms to 8-bit RGB. false: c->message says why.
bool png_header_step(PngCodec* c) {
  if (setjmp(png_jmpbuf(c->png))) return false;
  png_set_read_fn(c->png, c, png_on_read);
  png_read_info(c->png, c->info);
  int depth = 0, color = 0;
  png_get_IHDR(c->png, c->info, &c->width, &c->height, &depth, &color, nullptr, nullptr, nullptr);
  const int alpha = (color & PNG_COLOR_MASK_ALPHA) || png_get_valid(c->png, c->info, PNG_INFO_tRNS) ? 1 : 0;
  c->file_channels = (color & PNG_COLOR_MASK_COLOR ? 3 : 1) + alpha;
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(c->png);
  if (!(color & PNG_COLOR_MASK_COLOR)) {
    if (depth < 8) png_set_expand_gray_1_2_4_to_8(c->png);
    png_set_gray_to_rgb(c->png);
  }
  if (depth == 16) png_set_strip_16(c->png);  // the high byte of each sample
  png_set_strip_alpha(c->png);                // also the alpha a palette's tRNS expands to
  png_set_interlace_handling(c->png);
  png_read_update_info(c->png, c->info);
  if (png_get_rowbytes(c->png, c->info) != size_t(c->width) * 3) png_error(c->png, "unsupported pixel layout");
  return true;
}

bool png_pixels_step(PngCodec* c, png_bytep* rows) {
  if (setjmp(png_jmpbuf(c->png))) return false;
  png_read_image(c->png, rows);
  png_read_end(c->png, nullptr);  // up to IEND: a file cut after the pixels is still an error
  return true;
}

// ---- PNG encoding ----------------------------------------------------------------------------------------------
// The container (signature, IHDR, IDAT, IEND; CRCs by zlib) is written here so that the compression can run in
// parallel: the filtered rows are cut into bands of about kPngBandBytes, each band is deflated on its own (raw
// deflate with the previous 32 KiB as its dictionary, so the ratio stays that of one stream, ended by a sync flush so
// that the next band starts on a byte boundary), and the bands form one zlib stream (header, the bands, the adler32
// of all the data combined from theirs). The bands do not depend on the thread count, so neither do the bytes.

constexpr int64_t kPngBandBytes = int64_t(1) << 17;

// Row filters (PNG spec 9.2): type t of byte i from x = cur[i], a = the byte bpp to the left, b = above, c = above
// left (0 outside the image): 0 None x, 1 Sub x - a, 2 Up x - b, 3 Average x - floor((a + b) / 2), 4 Paeth x - the
// one of a, b, c nearest to a + b - c (ties in that order). libpng's default choice per row: the type with the
// smallest sum of |byte read as signed| (the first one on ties). out = [type, n filtered bytes]; prev = nullptr for
// the first row; tmp holds 5 n bytes.
void filter_png_row(const uint8_t* __restrict cur, const uint8_t* __restrict prev, int64_t n, int bpp,
                    uint8_t* __restrict tmp, uint8_t* __restrict out) {
  uint32_t sum[5] = {0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; ++i) {
    const int x = cur[i], a = i >= bpp ? cur[i - bpp] : 0, b = prev ? prev[i] : 0;
    const int c = prev && i >= bpp ? prev[i - bpp] : 0;
    const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
    const int paeth = pa <= pb && pa <= pc ? a : (pb <= pc ? b : c);
    const uint8_t v[5] = {uint8_t(x), uint8_t(x - a), uint8_t(x - b), uint8_t(x - ((a + b) >> 1)), uint8_t(x - paeth)};
    for (int t = 0; t < 5; ++t) {
      tmp[t * n + i] = v[t];
      sum[t] += uint32_t(std::abs(int(int8_t(v[t]))));
    }
  }
  int best = 0;
  for (int t = 1; t < 5; ++t)
    if (sum[t] < sum[best]) best = t;
  out[0] = uint8_t(best);
  std::memcpy(out + 1, tmp + best * n, size_t(n));
}

void put_u32_be(std::vector<uint8_t>& o, uint32_t v) {
  const uint8_t b[4] = {uint8_t(v >> 24), uint8_t(v >> 16), uint8_t(v >> 8), uint8_t(v)};
  o.insert(o.end(), b, b + 4);
}

// A chunk: length, type, data, CRC-32 of type and data. IDAT data may span any number of chunks.
void put_png_chunk(std::vector<uint8_t>& o, const char* type, const uint8_t* data, size_t n) {
  put_u32_be(o, uint32_t(n));
  const size_t start = o.size();
  o.insert(o.end(), type, type + 4);
  if (n) o.insert(o.end(), data, data + n);
  put_u32_be(o, uint32_t(crc32(0, o.data() + start, uInt(n + 4))));
}

std::vector<uint8_t> encode_png_bands(const uint8_t* pixels, int64_t height, int64_t width, int channels, int level,
                                      int threads) {
  const int64_t n = width * channels, stride = n + 1;
  const int64_t rows_per_band = std::max<int64_t>(1, kPngBandBytes / stride);
  const int64_t bands = (height + rows_per_band - 1) / rows_per_band;
  std::vector<uint8_t> filtered(size_t(height * stride));
  // 1. filters (stored data at level 0 cannot shrink: type 0, no search); nothing may throw out of the parallel loops
  std::atomic<bool> out_of_memory{false};
  parallel_for(bands, threads, [&](int64_t band) {
    const int64_t y0 = band * rows_per_band, y1 = std::min(height, y0 + rows_per_band);
    if (level == 0) {
      for (int64_t y = y0; y < y1; ++y) {
        filtered[size_t(y * stride)] = 0;
        std::memcpy(&filtered[size_t(y * stride + 1)], pixels + y * n, size_t(n));
      }
      return;
    }
    thread_local std::vector<uint8_t> tmp;
    try {
      tmp.resize(size_t(5 * n));
    } catch (const std::bad_alloc&) {
      out_of_memory = true;
      return;
    }
    for (int64_t y = y0; y < y1; ++y)
      filter_png_row(pixels + y * n, y ? pixels + (y - 1) * n : nullptr, n, channels, tmp.data(),
                     &filtered[size_t(y * stride)]);
  });
  if (out_of_memory) throw std::bad_alloc();
  // 2. each band deflated (it reads the band before it as its dictionary: after all the filters)
  std::vector<std::vector<uint8_t>> parts(static_cast<size_t>(bands));
  std::vector<uLong> adler(static_cast<size_t>(bands)), length(static_cast<size_t>(bands));
  std::vector<int> status(static_cast<size_t>(bands), Z_OK);  // zlib's error of a band (no throwing in the loop)
  parallel_for(bands, threads, [&](int64_t band) {
    const size_t begin = size_t(band * rows_per_band * stride);
    const size_t len = size_t(std::min(height, (band + 1) * rows_per_band) * stride) - begin;
    const uint8_t* src = filtered.data() + begin;
    const bool last = band + 1 == bands;
    z_stream z{};
    int& st = status[size_t(band)];
    // libpng's choice: Z_FILTERED for filtered rows (it favours short matches over literals at levels >= 4)
    const int strategy = level == 0 ? Z_DEFAULT_STRATEGY : Z_FILTERED;
    if ((st = deflateInit2(&z, level, Z_DEFLATED, -15, 8, strategy)) != Z_OK) return;
    const size_t dict = std::min<size_t>(begin, 32768);
    if (dict) st = deflateSetDictionary(&z, src - dict, uInt(dict));
    std::vector<uint8_t>& out = parts[size_t(band)];
    if (st == Z_OK) {
      try {
        out.resize(deflateBound(&z, uLong(len)) + 64);  // + the sync flush's empty stored block
      } catch (const std::bad_alloc&) {
        st = Z_MEM_ERROR;
      }
    }
    if (st == Z_OK) {
      z.next_in = const_cast<Bytef*>(src);
      z.avail_in = uInt(len);
      z.next_out = out.data();
      z.avail_out = uInt(out.size());
      st = deflate(&z, last ? Z_FINISH : Z_SYNC_FLUSH);
      // complete: all input read and, for a sync flush, room left (else the flush may be unfinished)
      if (last ? st == Z_STREAM_END : st == Z_OK && z.avail_in == 0 && z.avail_out > 0) st = Z_OK;
      else if (st == Z_OK || st == Z_STREAM_END) st = Z_BUF_ERROR;
      out.resize(out.size() - z.avail_out);
    }
    deflateEnd(&z);
    adler[size_t(band)] = adler32(adler32(0, nullptr, 0), src, uInt(len));
    length[size_t(band)] = uLong(len);
  });
  for (int st : status) {
    check(st != Z_MEM_ERROR, ErrorKind::kOutOfMemory, "encode_png: out of memory in zlib");
    check(st == Z_OK, ErrorKind::kInternal, "encode_png: zlib error ", st);
  }
  uLong total_adler = adler[0];
  for (size_t b = 1; b < parts.size(); ++b) total_adler = adler32_combine(total_adler, adler[b], z_off_t(length[b]));
  // 3. the file; zlib header: deflate with a 32 KiB window, FLEVEL from the level (informative), FCHECK
  size_t idat_bytes = 6;
  for (const auto& part : parts) idat_bytes += part.size();
  std::vector<uint8_t> zs;
  zs.reserve(idat_bytes);
  const unsigned cmf = 0x78, flevel = level < 2 ? 0 : level < 6 ? 1 : level == 6 ? 2 : 3;
  const unsigned flg = (flevel << 6) + 31 - (cmf * 256 + (flevel << 6)) % 31;
  zs.push_back(uint8_t(cmf));
  zs.push_back(uint8_t(flg));
  for (auto& part : parts) {
    zs.insert(zs.end(), part.begin(), part.end());
    std::vector<uint8_t>().swap(part);
  }
  put_u32_be(zs, uint32_t(total_adler));
  std::vector<uint8_t> o = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  o.reserve(zs.size() + 64 + zs.size() / (size_t(1) << 30) * 12);
  std::vector<uint8_t> ihdr;
  put_u32_be(ihdr, uint32_t(width));
  put_u32_be(ihdr, uint32_t(height));
  // bit depth 8, colour type 2 (RGB) or 0 (gray), compression 0, filter method 0, no interlace
  const uint8_t rest[5] = {8, uint8_t(channels == 3 ? 2 : 0), 0, 0, 0};
  ihdr.insert(ihdr.end(), rest, rest + 5);
  put_png_chunk(o, "IHDR", ihdr.data(), ihdr.size());
  constexpr size_t kMaxChunk = size_t(1) << 30;  // a chunk holds < 2^31 bytes
  for (size_t at = 0; at < zs.size(); at += kMaxChunk)
    put_png_chunk(o, "IDAT", zs.data() + at, std::min(kMaxChunk, zs.size() - at));
  put_png_chunk(o, "IEND", nullptr, 0);
  return o;
}

Image decode_png(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels, int scale) {
  PngCodec c;
  c.data = data;
  c.size = size;
  c.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &c, png_on_error, png_on_warning);
  check(c.png != nullptr, ErrorKind::kOutOfMemory, "image '", name, "': cannot create a PNG decoder");
  struct Free {
    PngCodec& c;
    ~Free() { png_destroy_read_struct(&c.png, &c.info, nullptr); }
  } free_codec{c};
  c.info = png_create_info_struct(c.png);
  check(c.info != nullptr, ErrorKind::kOutOfMemory, "image '", name, "': cannot create a PNG decoder");
  if (!png_header_step(&c))
    fail(ErrorKind::kIO, "image '", name, "': corrupt or truncated PNG (libpng: ", c.message, ")");
  check_pixel_limit(name, c.width, c.height, scale, max_pixels);
  Image img(c.height, c.width, 3);
  img.source_channels = c.file_channels;
  std::vector<png_bytep> rows(c.height);
  for (size_t y = 0; y < rows.size(); ++y) rows[y] = img.data.data() + y * size_t(c.width) * 3;
  if (!png_pixels_step(&c, rows.data()))
    fail(ErrorKind::kIO, "image '", name, "': corrupt or truncated PNG (libpng: ", c.message, ")");
  return img;
}

// ---- JPEG --------------------------------------------------------------------------------------------------

struct JpegDecoder {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr err;
  jpeg_progress_mgr progress;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_stop(JpegDecoder* d, const char* why) {
  std::snprintf(d->message, sizeof d->message, "%s", why);
  std::longjmp(d->jump, 1);
}
[[noreturn]] void jpeg_on_error(j_common_ptr cinfo) {
  auto* d = static_cast<JpegDecoder*>(cinfo->client_data);
  cinfo->err->format_message(cinfo, d->message);
  std::longjmp(d->jump, 1);
}
// Level -1 is a corrupt-data warning: libjpeg would go on with made-up pixels (a truncated scan comes out grey), so
// it stops there, as TurboJPEG's "stop on warning" does. Levels >= 0 are trace messages.
void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level < 0) jpeg_on_error(cinfo);
}
void jpeg_on_progress(j_common_ptr cinfo) {
  auto* d = static_cast<JpegDecoder*>(cinfo->client_data);
  if (d->cinfo.input_scan_number <= kMaxJpegScans) return;
  std::snprintf(d->message, sizeof d->message, "more than %d scans", kMaxJpegScans);
  std::longjmp(d->jump, 1);
}

bool jpeg_header_step(JpegDecoder* d, const uint8_t* data, size_t size) {
  if (setjmp(d->jump)) return false;
  jpeg_create_decompress(&d->cinfo);
  d->cinfo.progress = &d->progress;
  jpeg_mem_src(&d->cinfo, data, size);
  jpeg_read_header(&d->cinfo, TRUE);
  const J_COLOR_SPACE in = d->cinfo.jpeg_color_space;
  d->cinfo.out_color_space = in == JCS_CMYK || in == JCS_YCCK ? JCS_CMYK : JCS_RGB;
  jpeg_calc_output_dimensions(&d->cinfo);
  return true;
}

// Adobe CMYK is stored inverted (255 = no ink): R = C K / 255, rounded.
uint8_t ink_product(unsigned a, unsigned b) {
  const unsigned t = a * b + 128;
  return uint8_t((t + (t >> 8)) >> 8);
}

// Decodes every row into `rgb` (3 * width bytes per row); CMYK rows go through `cmyk_row` (4 * width bytes).
bool jpeg_pixels_step(JpegDecoder* d, uint8_t* rgb, uint8_t* cmyk_row) {
  if (setjmp(d->jump)) return false;
  jpeg_start_decompress(&d->cinfo);
  const size_t width = d->cinfo.output_width;
  while (d->cinfo.output_scanline < d->cinfo.output_height) {
    uint8_t* out = rgb + size_t(d->cinfo.output_scanline) * width * 3;
    JSAMPROW row = cmyk_row ? cmyk_row : out;
    if (jpeg_read_scanlines(&d->cinfo, &row, 1) != 1) jpeg_stop(d, "no scanline read");
    if (cmyk_row)
      for (size_t x = 0; x < width; ++x)
        for (size_t k = 0; k < 3; ++k) out[3 * x + k] = ink_product(cmyk_row[4 * x + k], cmyk_row[4 * x + 3]);
  }
  jpeg_finish_decompress(&d->cinfo);
  return true;
}

Image decode_jpeg(const uint8_t* data, size_t size, const std::string& name, int64_t max_pixels, int scale) {
  JpegDecoder d{};
  d.cinfo.err = jpeg_std_error(&d.err);
  d.err.error_exit = jpeg_on_error;
  d.err.emit_message = jpeg_on_message;
  d.progress.progress_monitor = jpeg_on_progress;
  d.cinfo.client_data = &d;
  struct Free {
    JpegDecoder& d;
    ~Free() { jpeg_destroy_decompress(&d.cinfo); }
  } free_decoder{d};
  if (!jpeg_header_step(&d, data, size))
    fail(ErrorKind::kIO, "image '", name, "': corrupt or truncated JPEG (libjpeg-turbo: ", d.message, ")");
  const jpeg_decompress_struct& ci = d.cinfo;
  check_pixel_limit(name, ci.output_width, ci.output_height, scale, max_pixels);
  const bool cmyk = ci.out_color_space == JCS_CMYK;
  check(ci.output_components == (cmyk ? 4 : 3), ErrorKind::kIO, "image '", name, "': unsupported JPEG with ",
        ci.num_components, " components");
  Image img(ci.output_height, ci.output_width, 3);
  img.source_channels = ci.num_components;
  std::vector<uint8_t> cmyk_row(cmyk ? size_t(ci.output_width) * 4 : 0);
  if (!jpeg_pixels_step(&d, img.data.data(), cmyk ? cmyk_row.data() : nullptr))
    fail(ErrorKind::kIO, "image '", name, "': corrupt or truncated JPEG (libjpeg-turbo: ", d.message, ")");
  return img;
}

}  // namespace

int64_t output_pixels(int64_t height, int64_t width, int64_t scale) {
  int64_t n = 0;
  if (__builtin_mul_overflow(height, width, &n) || __builtin_mul_overflow(n, scale, &n) ||
      __builtin_mul_overflow(n, scale, &n))
    return INT64_MAX;
  return n;
}

Image decode_image(const void* data, size_t size, const std::string& name, int64_t max_pixels, int scale) {
  check(scale >= 1 && scale <= 16, ErrorKind::kInvalidArgument, "decode_image: scale must be in [1, 16], given ",
        scale);
  const auto* p = static_cast<const uint8_t*>(data);
  check(size > 0, ErrorKind::kIO, "image '", name, "': empty file");
  if (is_png(p, size)) return decode_png(p, size, name, max_pixels, scale);
  if (is_jpeg(p, size)) return decode_jpeg(p, size, name, max_pixels, scale);
  fail(ErrorKind::kIO, "image '", name, "': unsupported format (expected PNG or JPEG by signature)");
}

Image read_image(const std::string& path, int64_t max_pixels, int scale) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  check(bool(f), ErrorKind::kIO, "image '", path, "': cannot open (", std::strerror(errno), ")");
  const std::streamoff n = f.tellg();
  check(n >= 0, ErrorKind::kIO, "image '", path, "': cannot read (not a regular file?)");
  check(n <= std::streamoff(INT32_MAX), ErrorKind::kIO, "image '", path, "': file too large (", int64_t(n), " bytes)");
  std::vector<uint8_t> buf(static_cast<size_t>(n));
  f.seekg(0);
  if (n > 0) f.read(reinterpret_cast<char*>(buf.data()), n);
  check(bool(f), ErrorKind::kIO, "image '", path, "': read error");
  return decode_image(buf.data(), buf.size(), path, max_pixels, scale);
}

std::vector<uint8_t> encode_png(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels,
                                int compression_level, int num_threads) {
  check(channels == 1 || channels == 3, ErrorKind::kInvalidArgument, "encode_png: channels must be 1 or 3, given ",
        channels);
  check(compression_level >= 0 && compression_level <= 9, ErrorKind::kInvalidArgument,
        "encode_png: compression_level must be in 0..9, given ", compression_level);
  check(height > 0 && width > 0 && height <= PNG_UINT_31_MAX && width <= PNG_UINT_31_MAX / 3,
        ErrorKind::kInvalidArgument, "encode_png: invalid image size ", width, "x", height);
  check(num_threads >= 0, ErrorKind::kInvalidArgument, "encode_png: num_threads must be >= 0, given ", num_threads);
  try {
    return encode_png_bands(pixels, height, width, int(channels), compression_level, resolve_num_threads(num_threads));
  } catch (const std::bad_alloc&) {
    fail(ErrorKind::kOutOfMemory, "encode_png: ", width, "x", height, " image: out of memory");
  }
}

std::vector<uint8_t> encode_png(const Image& image, int compression_level, int num_threads) {
  check(image.data.size() == size_t(image.height * image.width * image.channels), ErrorKind::kInvalidArgument,
        "encode_png: image data size ", image.data.size(), " does not match ", image.width, "x", image.height, "x",
        image.channels);
  return encode_png(image.data.data(), image.height, image.width, image.channels, compression_level, num_threads);
}

void write_png(io::OutputFile& out, const Image& image, int compression_level, int num_threads) {
  out.write(encode_png(image, compression_level, num_threads));
}

void write_png(const std::string& path, const Image& image, int compression_level, int num_threads) {
  // a bad level fails before the file opens
  const std::vector<uint8_t> bytes = encode_png(image, compression_level, num_threads);
  io::write_file(path, [&](io::OutputFile& out) { out.write(bytes); });
}

}  // namespace sattn::sr
