// Fuzz target: the Hugging Face tokenizer.json reader and its BPE pipeline
// (graphmoe/hf/tokenizer.hpp; PCRE2 and utf8proc, the CMake target graphmoe::hf_tokenizer).
//
// Input: the bytes of a tokenizer.json, read with hf::JsonTokenizer::from_string. An accepted
// tokenizer encodes a few fixed texts (ASCII, UTF-8 with 2-, 3- and 4-byte characters and a
// decomposed accent, the empty text, the usual special tokens' texts), with and without the
// post-processor's special tokens, and decodes the ids, with and without the special tokens and
// one id at a time through a StreamDecoder. Invariants: every id is in [0, vocab_size()); decode
// accepts every id list encode returns; text that is not valid UTF-8 is refused; nothing throws
// but graphmoe::Error.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.hpp"
#include "graphmoe/hf/tokenizer.hpp"

using namespace graphmoe;
using graphmoe_fuzz::expect_clean;

namespace {

const char* const kTexts[] = {
    "Hello world, it's 42!\n  two  spaces\tand a tab. The end",
    "caf\xc3\xa9 na\xc3\xafve \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \xe2\x82\xac" "5 "
    "e\xcc\x81 \xef\xac\x81 \xe2\x96\x81x",
    "",
    "<s>Hello</s> <unk><|endoftext|>x<|im_start|>user\n<|im_end|><pad><0x41>",
};

void check_ids(const hf::Tokenizer& tok, const std::vector<std::int32_t>& ids) {
  for (std::int32_t id : ids)
    FUZZ_REQUIRE(id >= 0 && id < tok.vocab_size(), "encode's ids are in [0, vocab_size())");
  FUZZ_REQUIRE(expect_clean([&] { (void)tok.decode(ids); }), "decode accepts encode's ids");
  FUZZ_REQUIRE(expect_clean([&] { (void)tok.decode(ids, /*skip_special_tokens=*/true); }),
               "decode accepts encode's ids, skipping the special tokens");
  expect_clean([&] {
    hf::StreamDecoder stream(tok);
    for (std::int32_t id : ids) (void)stream.step(id);
    (void)stream.finish();
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<hf::JsonTokenizer> tok;
  if (!expect_clean([&] { tok = hf::JsonTokenizer::from_string(text, "tokenizer.json"); }))
    return 0;
  FUZZ_REQUIRE(tok != nullptr, "an accepted tokenizer.json gives a tokenizer");
  FUZZ_REQUIRE(tok->vocab_size() >= 0, "the vocabulary size is not negative");

  for (const char* t : kTexts) {
    for (bool special : {true, false}) {
      std::vector<std::int32_t> ids;
      if (!expect_clean([&] { ids = tok->encode(t, special); })) continue;  // e.g. PCRE2's limits
      check_ids(*tok, ids);
    }
  }
  FUZZ_REQUIRE(!expect_clean([&] { (void)tok->encode("ok \xff\xfe bad"); }),
               "encode refuses text that is not valid UTF-8");
  // A few ids that need not come from encode: out of range or naming no token is a clean refusal.
  const std::int32_t probes[] = {0, 1, tok->vocab_size() - 1, tok->vocab_size(), -1};
  for (std::int32_t id : probes) {
    const std::vector<std::int32_t> one = {id};
    const bool ok = expect_clean([&] { (void)tok->decode(one); });
    if (id < 0 || id >= tok->vocab_size()) FUZZ_REQUIRE(!ok, "decode refuses an id out of range");
    (void)tok->id_to_token(id);
    (void)tok->is_special(id);
  }
  return 0;
}
