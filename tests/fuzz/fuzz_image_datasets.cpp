// Fuzz target: the image readers (graphmoe/train/image_datasets.hpp) and the gzip reader under
// them (graphmoe/train/gzip.hpp).
//
// Input: one selector byte, then the payload. selector % 3:
//   0  read_idx_images(images, labels): payload = 2 bytes n (little-endian), then the images
//      file (the next n bytes, or all that is left), then the labels file (the rest)
//   1  read_digits_csv: payload = the (possibly gzip-compressed) CSV file
//   2  read_file_gunzip: payload = the file; a file that does not start with the gzip magic
//      1f 8b must come back byte for byte (zlib passes plain files through)
// Invariants of an accepted file: sizes agree with count, rows and cols; pixels in [0, 1];
// labels in range.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_support.hpp"
#include "graphmoe/train/gzip.hpp"
#include "graphmoe/train/image_datasets.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

void check_pixels(const ImageDataset& ds) {
  FUZZ_REQUIRE(ds.count >= 0 && ds.rows >= 0 && ds.cols >= 0, "non-negative sizes");
  FUZZ_REQUIRE(ds.pixels.size() == static_cast<std::size_t>(ds.count) *
                                       static_cast<std::size_t>(ds.rows) *
                                       static_cast<std::size_t>(ds.cols),
               "count * rows * cols pixels");
  FUZZ_REQUIRE(ds.labels.size() == static_cast<std::size_t>(ds.count), "one label per image");
  for (float p : ds.pixels) FUZZ_REQUIRE(p >= 0.0f && p <= 1.0f, "pixels in [0, 1]");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned selector = data[0] % 3u;
  const std::uint8_t* payload = data + 1;
  const std::size_t n = size - 1;
  auto& files = graphmoe_fuzz::files();
  switch (selector) {
    case 0: {
      if (n < 2) return 0;
      const std::size_t rest = n - 2;
      std::size_t split = static_cast<std::size_t>(payload[0]) |
                          (static_cast<std::size_t>(payload[1]) << 8);
      if (split > rest) split = rest;
      const std::string images = files.write("images-idx3-ubyte", payload + 2, split);
      const std::string labels = files.write("labels-idx1-ubyte", payload + 2 + split, rest - split);
      ImageDataset ds;
      if (expect_clean([&] { ds = read_idx_images(images, labels); })) {
        check_pixels(ds);
        for (std::int32_t l : ds.labels) FUZZ_REQUIRE(l >= 0 && l <= 255, "idx labels are bytes");
      }
      break;
    }
    case 1: {
      const std::string path = files.write("digits.csv", payload, n);
      ImageDataset ds;
      if (expect_clean([&] { ds = read_digits_csv(path); })) {
        FUZZ_REQUIRE(ds.rows == 8 && ds.cols == 8, "digits are 8x8");
        check_pixels(ds);
        for (std::int32_t l : ds.labels) FUZZ_REQUIRE(l >= 0 && l <= 9, "digit labels are 0-9");
      }
      break;
    }
    default: {
      const std::string path = files.write("file.gz", payload, n);
      std::string out;
      if (expect_clean([&] { out = read_file_gunzip(path); }) && (n == 0 || payload[0] != 0x1f)) {
        FUZZ_REQUIRE(out == std::string(reinterpret_cast<const char*>(payload), n),
                     "a plain file reads back unchanged");
      }
      break;
    }
  }
  return 0;
}
