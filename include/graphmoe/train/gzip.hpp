// graphmoe/train/gzip.hpp: reading a file that may be gzip-compressed, through zlib.
//
//   read_file_gunzip(path)   the decompressed bytes of a .gz file (all members), or the bytes of
//                            a plain file as they are (zlib's gzread passes those through)
//
// Needs zlib: the header <zlib.h> (Debian: zlib1g-dev) and linking the library. graphmoe's CMake
// target does not link it; a program that calls these readers (or read_idx_images /
// read_digits_csv) adds
//     find_package(ZLIB REQUIRED)
//     target_link_libraries(app PRIVATE ZLIB::ZLIB)
#pragma once

#include <string>

#include "graphmoe/config.hpp"
#include "graphmoe/train/files.hpp"

#if !__has_include(<zlib.h>)
#error "graphmoe/train/gzip.hpp needs zlib (<zlib.h>; Debian package zlib1g-dev) and ZLIB::ZLIB"
#endif
#include <zlib.h>

namespace graphmoe {

namespace detail {

// As read_file_gunzip; errors name `op`.
inline std::string read_file_gunzip(const char* op, const std::string& path) {
  require_regular_file(op, path);  // gzopen would block on a FIFO
  gzFile f = gzopen(path.c_str(), "rb");
  GRAPHMOE_CHECK(f != nullptr, op, "cannot open '", path, "'");
  gzbuffer(f, 1u << 18);
  std::string out;
  constexpr unsigned kChunk = 1u << 20;
  for (;;) {
    const std::size_t old = out.size();
    out.resize(old + kChunk);
    const int n = gzread(f, out.data() + old, kChunk);
    if (n < 0) {
      int code = 0;
      const std::string msg = gzerror(f, &code);
      gzclose_r(f);
      detail::throw_error(op, "'", path, "': corrupt gzip data (", msg, ")");
    }
    out.resize(old + static_cast<std::size_t>(n));
    if (n == 0) break;
  }
  // A gzip stream cut short reads as a short file: gzread returns what it has and gzerror then
  // reports Z_BUF_ERROR ("unexpected end of file").
  int code = Z_OK;
  const std::string msg = gzerror(f, &code);
  gzclose_r(f);
  GRAPHMOE_CHECK(code == Z_OK, op, "'", path, "': corrupt or truncated gzip data (", msg, ")");
  return out;
}

}  // namespace detail

// The decompressed bytes of `path` (gzip, possibly several members), or its bytes as they are
// when it is not gzip-compressed. Throws "graphmoe::read_file_gunzip: cannot open '<path>'" and
// on corrupt or truncated gzip data.
inline std::string read_file_gunzip(const std::string& path) {
  return detail::read_file_gunzip("read_file_gunzip", path);
}

}  // namespace graphmoe
