// graphmoe/train/image_datasets.hpp: small grey-scale image classification sets.
//
//   read_idx_images(images, labels)   MNIST / Fashion-MNIST idx files: images idx3-ubyte (magic
//                                     2051, big-endian count, rows, cols, then count*rows*cols
//                                     bytes), labels idx1-ubyte (magic 2049, count, then count
//                                     bytes). Plain or gzip-compressed (Debian's
//                                     dataset-fashion-mnist ships
//                                     /usr/share/datasets/fashion-mnist/*-ubyte.gz). Pixels / 255.
//   read_digits_csv(path)             UCI / scikit-learn 8x8 digits: (gzip) CSV, one image per
//                                     line, 64 pixel values 0-16 then the label 0-9. Pixels / 16.
//
// Both read gzip through zlib (graphmoe/train/gzip.hpp): link ZLIB::ZLIB. Malformed input throws
// graphmoe::Error naming the file and the line (CSV) or the header field / byte count (idx).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/gzip.hpp"

namespace graphmoe {

// count images of rows x cols pixels, row-major, image after image.
struct ImageDataset {
  index_t count = 0, rows = 0, cols = 0;
  std::vector<float> pixels;          // (count, rows, cols), in [0, 1]
  std::vector<std::int32_t> labels;   // (count)
};

namespace detail {

inline std::uint32_t read_be32(const std::string& b, std::size_t at) {
  return (static_cast<std::uint32_t>(static_cast<unsigned char>(b[at])) << 24) |
         (static_cast<std::uint32_t>(static_cast<unsigned char>(b[at + 1])) << 16) |
         (static_cast<std::uint32_t>(static_cast<unsigned char>(b[at + 2])) << 8) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(b[at + 3]));
}

// Checks an idx header of `ndims` dimensions and the file size; returns the dimensions.
inline std::vector<std::uint64_t> idx_header(const char* op, const std::string& path,
                                             const std::string& b, std::uint32_t magic,
                                             int ndims, const char* kind) {
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(ndims);
  GRAPHMOE_CHECK(b.size() >= header, op, "'", path, "': truncated idx header (", b.size(),
                 " bytes, a ", kind, " file starts with ", header, ")");
  const std::uint32_t m = read_be32(b, 0);
  GRAPHMOE_CHECK(m == magic, op, "'", path, "': bad idx magic ", m, ", expected ", magic, " (",
                 kind, " file)");
  std::vector<std::uint64_t> dims;
  std::uint64_t body = 1;
  for (int d = 0; d < ndims; ++d) {
    dims.push_back(read_be32(b, 4 + 4 * static_cast<std::size_t>(d)));
    GRAPHMOE_CHECK(dims.back() == 0 || body <= b.size() / dims.back(), op, "'", path,
                   "': truncated idx data: the header announces dimensions beyond the file's ",
                   b.size(), " bytes");
    body *= dims.back();
  }
  GRAPHMOE_CHECK(b.size() - header == body, op, "'", path, "': ",
                 b.size() - header < body ? "truncated idx data" : "trailing bytes after idx data",
                 ": the header announces ", body, " bytes, the file holds ", b.size() - header);
  return dims;
}

}  // namespace detail

inline ImageDataset read_idx_images(const std::string& images_path, const std::string& labels_path) {
  constexpr const char* op = "read_idx_images";
  const std::string img = detail::read_file_gunzip(op, images_path);
  const std::vector<std::uint64_t> idim = detail::idx_header(op, images_path, img, 2051, 3, "idx3-ubyte images");
  const std::string lab = detail::read_file_gunzip(op, labels_path);
  const std::vector<std::uint64_t> ldim = detail::idx_header(op, labels_path, lab, 2049, 1, "idx1-ubyte labels");
  GRAPHMOE_CHECK(idim[0] == ldim[0], op, "'", images_path, "' holds ", idim[0], " images but '",
                 labels_path, "' holds ", ldim[0], " labels");
  ImageDataset ds;
  ds.count = static_cast<index_t>(idim[0]);
  ds.rows = static_cast<index_t>(idim[1]);
  ds.cols = static_cast<index_t>(idim[2]);
  const std::size_t n = img.size() - 16;
  ds.pixels.resize(n);
  const auto* p = reinterpret_cast<const unsigned char*>(img.data() + 16);
  for (std::size_t i = 0; i < n; ++i) ds.pixels[i] = static_cast<float>(p[i]) * (1.0f / 255.0f);
  ds.labels.resize(static_cast<std::size_t>(ds.count));
  for (std::size_t i = 0; i < ds.labels.size(); ++i)
    ds.labels[i] = static_cast<unsigned char>(lab[8 + i]);
  return ds;
}

inline ImageDataset read_digits_csv(const std::string& path) {
  constexpr const char* op = "read_digits_csv";
  constexpr int kPixels = 64;
  const std::string text = detail::read_file_gunzip(op, path);
  ImageDataset ds;
  ds.rows = 8;
  ds.cols = 8;
  for_each_line(text, [&](std::string_view line, std::size_t n) {
    std::size_t fields = 0, start = 0;
    for (;;) {
      const std::size_t comma = line.find(',', start);
      const std::string_view f =
          detail::trim(line.substr(start, comma == std::string_view::npos ? line.npos : comma - start));
      long long v = 0;
      if (fields < kPixels) {
        if (!detail::parse_int(f, 0, 16, v))
          detail::parse_error(op, path, n, "pixel ", fields + 1, " ", detail::quoted(f),
                              " is not an integer in 0-16");
        ds.pixels.push_back(static_cast<float>(v) * (1.0f / 16.0f));
      } else if (fields == kPixels) {
        if (!detail::parse_int(f, 0, 9, v))
          detail::parse_error(op, path, n, "label ", detail::quoted(f), " is not an integer in 0-9");
        ds.labels.push_back(static_cast<std::int32_t>(v));
      }
      ++fields;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (fields != kPixels + 1) {
      detail::parse_error(op, path, n, "expected ", kPixels + 1,
                          " comma-separated fields (64 pixels, label), found ", fields);
    }
    ++ds.count;
  });
  return ds;
}

}  // namespace graphmoe
