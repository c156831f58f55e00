// Fuzz target: the tokenizer vocabulary readers and builders (graphmoe/train/tokenizers.hpp).
//
// Input: one selector byte, then the file. selector % 4:
//   0  WordTokenizer::load; an accepted vocabulary saved and loaded again is the same
//   1  CharTokenizer::load; the same round trip
//   2  WordTokenizer::build and encode_file on the file as a corpus: ids in range, <unk> and
//      <eos> at 0 and 1, and the vocabulary survives save and load
//   3  CharTokenizer::build and encode_file: decode(encode_file(f)) is f's bytes
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/tokenizers.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

void word_round_trip(const WordTokenizer& tok) {
  const std::string saved = graphmoe_fuzz::files().path("saved-word.vocab");
  tok.save(saved);
  WordTokenizer again;
  FUZZ_REQUIRE(expect_clean([&] { again = WordTokenizer::load(saved); }),
               "a saved WordTokenizer loads");
  FUZZ_REQUIRE(again.words() == tok.words(), "a saved WordTokenizer loads unchanged");
}

void char_round_trip(const CharTokenizer& tok) {
  const std::string saved = graphmoe_fuzz::files().path("saved-char.vocab");
  tok.save(saved);
  CharTokenizer again;
  FUZZ_REQUIRE(expect_clean([&] { again = CharTokenizer::load(saved); }),
               "a saved CharTokenizer loads");
  FUZZ_REQUIRE(again.size() == tok.size(), "a saved CharTokenizer keeps its size");
  for (int b = 0; b < 256; ++b)
    FUZZ_REQUIRE(again.id(static_cast<char>(b)) == tok.id(static_cast<char>(b)),
                 "a saved CharTokenizer keeps every id");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned selector = data[0] % 4u;
  const std::string path = graphmoe_fuzz::files().write("input.txt", data + 1, size - 1);
  switch (selector) {
    case 0: {
      WordTokenizer tok;
      if (!expect_clean([&] { tok = WordTokenizer::load(path); })) break;
      FUZZ_REQUIRE(tok.size() >= 2 && tok.decode(tok.unk()) == "<unk>" &&
                       tok.decode(tok.eos()) == "<eos>",
                   "a loaded WordTokenizer starts with <unk>, <eos>");
      for (std::size_t i = 0; i < tok.size(); ++i)
        FUZZ_REQUIRE(tok.id(tok.words()[i]) == static_cast<std::int32_t>(i),
                     "a loaded WordTokenizer maps each word to its line");
      word_round_trip(tok);
      break;
    }
    case 1: {
      CharTokenizer tok;
      if (!expect_clean([&] { tok = CharTokenizer::load(path); })) break;
      for (int b = 0; b < 256; ++b) {
        const std::int32_t id = tok.id(static_cast<char>(b));
        FUZZ_REQUIRE(id >= 0 && static_cast<std::size_t>(id) < tok.size(), "ids in range");
        if (id != tok.unk())
          FUZZ_REQUIRE(tok.decode(id) == std::string(1, static_cast<char>(b)),
                       "a loaded CharTokenizer decodes each byte to itself");
      }
      char_round_trip(tok);
      break;
    }
    case 2: {
      WordTokenizer tok;
      std::vector<std::int32_t> ids;
      FUZZ_REQUIRE(expect_clean([&] {
                     tok = WordTokenizer::build(path, 64, 1);
                     ids = tok.encode_file(path);
                   }),
                   "any regular file builds a WordTokenizer");
      FUZZ_REQUIRE(tok.size() >= 2 && tok.size() <= 64, "the vocabulary respects max_size");
      for (std::int32_t id : ids)
        FUZZ_REQUIRE(id >= 0 && static_cast<std::size_t>(id) < tok.size(), "ids in range");
      (void)tok.decode(ids);
      word_round_trip(tok);
      break;
    }
    default: {
      CharTokenizer tok;
      std::vector<std::int32_t> ids;
      FUZZ_REQUIRE(expect_clean([&] {
                     tok = CharTokenizer::build(path);
                     ids = tok.encode_file(path);
                   }),
                   "any regular file builds a CharTokenizer");
      FUZZ_REQUIRE(tok.decode(ids) == std::string(reinterpret_cast<const char*>(data + 1), size - 1),
                   "decode(encode_file(f)) is f");
      char_round_trip(tok);
      break;
    }
  }
  return 0;
}
