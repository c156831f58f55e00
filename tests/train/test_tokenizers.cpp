// TextNormalisation and the vocabularies' fingerprints (graphmoe/train/tokenizers.hpp): the
// normalisation of prepared text is the identity, plain text reads as prepared text does, and two
// vocabularies of the same size but other words, or another normalisation, differ in fingerprint.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "graphmoe/train/tokenizers.hpp"

using namespace graphmoe;

namespace {

// A file under the system's temporary folder, removed at the end of the scope.
struct Temp {
  std::string path;
  Temp(const std::string& name, const std::string& text)
      : path((std::filesystem::temp_directory_path() / ("graphmoe_tok_" + name)).string()) {
    std::ofstream(path, std::ios::binary) << text;
  }
  ~Temp() { std::filesystem::remove(path); }
};

}  // namespace

TEST_CASE("TextNormalisation: lower and punct read plain text as scripts/prepare-kjv.sh prepared it") {
  const TextNormalisation none, lower = TextNormalisation::parse("lower"),
                                punct = TextNormalisation::parse("punct"),
                                both = TextNormalisation::parse("lower,punct");
  CHECK(none.apply("And God said, Let") == "And God said, Let");
  CHECK(lower.apply("And God said, Let") == "and god said, let");
  std::vector<std::string> words;
  const auto split = [&](const std::string& s) {
    words.clear();
    detail::for_each_word(s, [&](std::string_view w) { words.emplace_back(w); });
    return words;
  };
  CHECK(split(punct.apply("And God said, Let (there) be light: and it's God's.")) ==
        std::vector<std::string>{"And", "God", "said", ",", "Let", "(", "there", ")", "be", "light",
                                 ":", "and", "it", "'s", "God", "'s", "."});
  // "'s" only at the end of a word; prepared text is unchanged (up to blanks)
  CHECK(split(punct.apply("the 'sun' isn't")) == std::vector<std::string>{"the", "'sun'", "isn't"});
  const std::string prepared = "And God said , Let there be light : and there was light .";
  CHECK(split(punct.apply(prepared)) == split(prepared));
  CHECK(split(both.apply("Let THERE be; light!")) ==
        std::vector<std::string>{"let", "there", "be", ";", "light", "!"});
  CHECK(both.name() == "lower,punct");
  CHECK(TextNormalisation::parse("punct,lower") == both);
  CHECK(TextNormalisation::parse(lower.name()) == lower);
  CHECK(TextNormalisation::parse("none").none());
  CHECK_THROWS_WITH_AS(TextNormalisation::parse("upper"),
                       doctest::Contains("unknown normalisation 'upper': expected none, lower, punct or lower,punct"),
                       Error);
}

TEST_CASE("WordTokenizer and CharTokenizer: the normalisation is applied to what they build from and encode") {
  Temp f("norm_words.txt", "And God said, Let there be light.\nAnd there was light.\n");
  const WordTokenizer tok = WordTokenizer::build(f.path, 0, 1, TextNormalisation::parse("lower,punct"));
  CHECK(tok.contains("and"));
  CHECK(!tok.contains("And"));
  CHECK(tok.contains(","));
  CHECK(!tok.contains("said,"));
  const std::vector<std::int32_t> ids = tok.encode_line("AND God Said, let");
  CHECK(tok.decode(ids) == "and god said , let");
  CHECK(std::find(ids.begin(), ids.end(), tok.unk()) == ids.end());
  // the same file without normalisation: "said," is a word, "said" unknown
  const WordTokenizer raw = WordTokenizer::build(f.path);
  CHECK(raw.contains("said,"));
  CHECK(raw.encode_line("said")[0] == raw.unk());

  Temp c("norm_chars.txt", "AbC abc\n");
  const CharTokenizer ct = CharTokenizer::build(c.path, TextNormalisation::parse("lower"));
  CHECK(ct.size() == 1 + 5);  // <unk>, '\n', ' ', a, b, c
  CHECK(ct.encode("ABC") == ct.encode("abc"));
  CHECK_THROWS_WITH_AS(CharTokenizer::build(c.path, TextNormalisation::parse("punct")),
                       doctest::Contains("a character-level vocabulary takes none or lower"), Error);
}

TEST_CASE("fingerprint: the same words give the same fingerprint after a save and load, other words of the same size, another order or normalisation another") {
  Temp a("fp_a.txt", "x y y z z z\n");
  Temp b("fp_b.txt", "x y y w w w\n");  // same size, one other word
  Temp c("fp_c.txt", "x x x y y z\n");  // the same words in another order
  const WordTokenizer ta = WordTokenizer::build(a.path), tb = WordTokenizer::build(b.path),
                      tc = WordTokenizer::build(c.path);
  REQUIRE(ta.size() == tb.size());
  REQUIRE(ta.size() == tc.size());
  CHECK(ta.fingerprint().rfind("fnv1a64:", 0) == 0);
  CHECK(ta.fingerprint().size() == 8 + 16);
  CHECK(ta.fingerprint() != tb.fingerprint());
  CHECK(ta.fingerprint() != tc.fingerprint());
  Temp saved("fp_saved.txt", "");
  ta.save(saved.path);
  WordTokenizer back = WordTokenizer::load(saved.path);
  CHECK(back.fingerprint() == ta.fingerprint());
  back.set_normalisation(TextNormalisation::parse("punct"));
  CHECK(back.fingerprint() != ta.fingerprint());
  CHECK(WordTokenizer::build(a.path, 0, 1, TextNormalisation::parse("punct")).fingerprint() == back.fingerprint());

  Temp ca("fp_ca.txt", "abc");
  Temp cb("fp_cb.txt", "abd");
  const CharTokenizer ka = CharTokenizer::build(ca.path), kb = CharTokenizer::build(cb.path);
  CHECK(ka.size() == kb.size());
  CHECK(ka.fingerprint() != kb.fingerprint());
  Temp ks("fp_ks.txt", "");
  ka.save(ks.path);
  CHECK(CharTokenizer::load(ks.path).fingerprint() == ka.fingerprint());
}
