// Fuzz target: the sentence-classification readers (graphmoe/train/text_datasets.hpp) and
// graphmoe/train/files.hpp under them.
//
// Input: one selector byte, then the file. selector % 4:
//   0  read_sst2_tsv             (GLUE SST-2 TSV)
//   1  read_sst5_trees           (SST PTB trees)
//   2  read_banking77_csv        (RFC 4180 CSV), then again with the category names it returned,
//                                which must give the same examples, and with one name fewer
//   3  read_banking77_categories (a JSON array of strings)
// Invariants of an accepted file: labels in their range, texts non-empty and trimmed.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/text_datasets.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

bool trimmed_non_empty(const std::string& s) {
  return !s.empty() && !detail::is_space(s.front()) && !detail::is_space(s.back());
}

void check_examples(const std::vector<TextExample>& xs, std::int32_t labels) {
  for (const TextExample& x : xs) {
    FUZZ_REQUIRE(x.label >= 0 && x.label < labels, "labels stay in their range");
    FUZZ_REQUIRE(trimmed_non_empty(x.text), "texts are trimmed and non-empty");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned selector = data[0] % 4u;
  const std::string path = graphmoe_fuzz::files().write("input.txt", data + 1, size - 1);
  switch (selector) {
    case 0: {
      std::vector<TextExample> xs;
      if (expect_clean([&] { xs = read_sst2_tsv(path); })) check_examples(xs, 2);
      break;
    }
    case 1: {
      std::vector<TextExample> xs;
      if (expect_clean([&] { xs = read_sst5_trees(path); })) {
        for (const TextExample& x : xs)
          FUZZ_REQUIRE(x.label >= 0 && x.label <= 4, "SST-5 labels are 0-4");
      }
      break;
    }
    case 2: {
      std::vector<TextExample> xs;
      std::vector<std::string> names;
      if (!expect_clean([&] { xs = read_banking77_csv(path, &names); })) break;
      check_examples(xs, static_cast<std::int32_t>(names.size()));
      std::vector<TextExample> again;
      FUZZ_REQUIRE(expect_clean([&] { again = read_banking77_csv(path, names); }),
                   "a file read with its own category names is accepted");
      FUZZ_REQUIRE(again.size() == xs.size(), "the same number of examples with the names given");
      for (std::size_t i = 0; i < xs.size(); ++i)
        FUZZ_REQUIRE(again[i].text == xs[i].text && again[i].label == xs[i].label,
                     "the same examples with the names given");
      if (!names.empty()) {
        // The last name first appears in some record, so without it the file is refused.
        std::vector<std::string> fewer(names.begin(), names.end() - 1);
        FUZZ_REQUIRE(!expect_clean([&] { (void)read_banking77_csv(path, fewer); }),
                     "a category outside the names given is refused");
      }
      break;
    }
    default: {
      std::vector<std::string> names;
      expect_clean([&] { names = read_banking77_categories(path); });
      break;
    }
  }
  return 0;
}
