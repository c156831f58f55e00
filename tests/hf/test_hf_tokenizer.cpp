// The Hugging Face tokenizers (graphmoe/hf/tokenizer.hpp, graphmoe/hf/sentencepiece.hpp) against
// the reference libraries. tests/hf/make_tokenizers.py (run by CTest as this program's fixture,
// or by the program itself when its output is missing) trains tokenizers of each kind on the King
// James Bible with the `tokenizers` and `sentencepiece` packages and writes their ids and decoded
// text for 10,000 held-out verses and hostile edge lines; every id and every decoded string must
// be identical here. Then hostile tokenizer files, each refused with a message naming the file
// and the JSON path.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/hf/tokenizer.hpp"
#ifdef GRAPHMOE_TEST_SENTENCEPIECE
#include "graphmoe/hf/sentencepiece.hpp"
#endif
#include "support/errors.hpp"

using namespace graphmoe;
using graphmoe::test::contains;
using graphmoe::test::error_of;
namespace fs = std::filesystem;

#if !defined(GRAPHMOE_TOKENIZER_PYTHON) || !defined(GRAPHMOE_TOKENIZER_SCRIPT) || \
    !defined(GRAPHMOE_TOKENIZER_DIR)
#error "tests/CMakeLists.txt defines GRAPHMOE_TOKENIZER_PYTHON, _SCRIPT and _DIR"
#endif

namespace {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE_MESSAGE(in.good(), "cannot open ", p.string());
  return nlohmann::json::parse(in);
}

// The tokenizers and references; made by the script when the fixture has not made them.
const fs::path& reference_dir() {
  static const fs::path dir = [] {
    const fs::path d = GRAPHMOE_TOKENIZER_DIR;
    if (!fs::exists(d / "done")) {
      const std::string python = GRAPHMOE_TOKENIZER_PYTHON;
      REQUIRE_MESSAGE(!python.empty(),
                      "no Python 3 could `import tokenizers, sentencepiece` when cmake ran: run "
                      "scripts/install-deps.sh, then re-run cmake");
      const std::string cmd = "'" + python + "' '" + std::string(GRAPHMOE_TOKENIZER_SCRIPT) +
                              "' '" + d.string() + "'";
      REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "failed: ", cmd);
    }
    return d;
  }();
  return dir;
}

bool valid_utf8(const std::string& s) {
  return hf::detail::utf8_invalid_at(s) == std::string_view::npos;
}

std::string show(const std::vector<std::int32_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

// Every line of the reference: ids (with and without special tokens), decode both ways, the
// random id sequences' decode, the special ids, and the stream decoder. Returns the lines compared.
std::size_t compare(const std::string& name, const std::string& lines_file) {
  const fs::path dir = reference_dir();
  const nlohmann::json lines = read_json(dir / lines_file);
  const nlohmann::json ref = read_json(dir / (name + ".ref.json"));
  auto tok = hf::load_tokenizer((dir / name).string());
  INFO("tokenizer ", name);
  REQUIRE(ref["ids"].size() == lines.size());
  CHECK(tok->vocab_size() == ref["vocab_size"].get<std::int32_t>());
  for (const char* k : {"bos", "eos", "pad"}) {
    const std::optional<std::int32_t> got = std::string(k) == "bos"   ? tok->bos_id()
                                            : std::string(k) == "eos" ? tok->eos_id()
                                                                      : tok->pad_id();
    const bool same = ref[k].is_null() ? !got.has_value()
                                       : got == std::optional<std::int32_t>(ref[k].get<std::int32_t>());
    CHECK_MESSAGE(same, k);
  }
  std::size_t bad = 0, bad_stream = 0;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string line = lines[i].get<std::string>();
    const auto want = ref["ids"][i].get<std::vector<std::int32_t>>();
    const auto want_plain = ref["ids_plain"][i].get<std::vector<std::int32_t>>();
    const auto got = tok->encode(line);
    const auto got_plain = tok->encode(line, false);
    const std::string dec = tok->decode(want, false), skipped = tok->decode(want, true);
    const bool ok = got == want && got_plain == want_plain &&
                    dec == ref["decoded"][i].get<std::string>() &&
                    skipped == ref["skipped"][i].get<std::string>();
    if (!ok && ++bad <= 5) {
      MESSAGE(name, " line ", i, " ", nlohmann::json(line).dump(), "\n  ids  ", show(got),
              "\n  want ", show(want), "\n  plain ", show(got_plain), " want ", show(want_plain),
              "\n  decoded ", nlohmann::json(dec).dump(), " want ", ref["decoded"][i].dump(),
              "\n  skipped ", nlohmann::json(skipped).dump(), " want ", ref["skipped"][i].dump());
    }
    // The stream: whole characters at every step, and all of decode in the end.
    hf::StreamDecoder stream(*tok);
    std::string streamed;
    bool chunks_valid = true;
    for (std::int32_t id : want) {
      const std::string piece = stream.step(id);
      chunks_valid = chunks_valid && valid_utf8(piece);
      streamed += piece;
    }
    streamed += stream.finish();
    if ((streamed != dec || !chunks_valid) && ++bad_stream <= 5)
      MESSAGE(name, " line ", i, ": streamed ", nlohmann::json(streamed).dump(), " decode ",
              nlohmann::json(dec).dump());
  }
  CHECK_MESSAGE(bad == 0, name, ": ", bad, " of ", lines.size(), " lines differ");
  CHECK_MESSAGE(bad_stream == 0, name, ": the stream differs on ", bad_stream, " lines");
  std::size_t bad_random = 0;
  for (std::size_t i = 0; i < ref["random_ids"].size(); ++i) {
    const auto ids = ref["random_ids"][i].get<std::vector<std::int32_t>>();
    const std::string got = tok->decode(ids, false);
    if (got != ref["random_decoded"][i].get<std::string>() && ++bad_random <= 5)
      MESSAGE(name, " random ", show(ids), ": ", nlohmann::json(got).dump(), " want ",
              ref["random_decoded"][i].dump());
  }
  CHECK_MESSAGE(bad_random == 0, name, ": ", bad_random, " random id sequences decode differently");
  return lines.size();
}

// A JSON tokenizer read from a string named "hostile.json": the error, or "(no graphmoe::Error)".
std::string load_error(const std::string& text) {
  return error_of([&] { hf::JsonTokenizer::from_string(text, "hostile.json"); });
}

nlohmann::json base_json() { return read_json(reference_dir() / "gpt2" / "tokenizer.json"); }

}  // namespace

TEST_CASE("GPT-2 byte-level BPE: ids and text as the tokenizers library's") {
  CHECK(compare("gpt2", "lines.json") == 10000 + 40);
  compare("gpt2+prefix_space", "lines_few.json");
}

TEST_CASE("Qwen2 (NFC, Split regex, ByteLevel) and Llama-3 layouts as the tokenizers library's") {
  compare("qwen2", "lines.json");
  compare("qwen2+llama3", "lines_few.json");
}

TEST_CASE("Llama-2 and Mistral (SentencePiece BPE, byte fallback) as the tokenizers library's") {
  compare("llama2", "lines.json");
  compare("mistral", "lines.json");
  compare("mistral+split_always", "lines_few.json");
  compare("mistral+never", "lines_few.json");
}

#ifdef GRAPHMOE_TEST_SENTENCEPIECE
TEST_CASE("tokenizer.model through libsentencepiece as the sentencepiece package's") {
  compare("spm", "lines.json");
  const fs::path dir = fs::temp_directory_path() / ("graphmoe_spm_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream(dir / "tokenizer.model") << "not a protobuf at all";
  }
  const std::string e = error_of([&] { hf::load_tokenizer(dir.string()); });
  CHECK_MESSAGE((contains(e, "graphmoe::hf::load_tokenizer: '") && contains(e, "tokenizer.model': sentencepiece")), e);
  fs::remove_all(dir);
}
#endif

TEST_CASE("special tokens come from tokenizer_config.json, then config.json") {
  const fs::path dir = fs::temp_directory_path() / ("graphmoe_tokcfg_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(reference_dir() / "llama2" / "tokenizer.json", dir / "tokenizer.json");
  auto tok = hf::load_tokenizer(dir.string());
  CHECK(!tok->bos_id().has_value());
  std::ofstream(dir / "config.json") << R"({"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": null})";
  tok = hf::load_tokenizer(dir.string());
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  CHECK(!tok->pad_id().has_value());
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": "</s>", "pad_token": {"content": "<unk>"}})";
  tok = hf::load_tokenizer(dir.string());
  CHECK(tok->bos_id() == 2);  // tokenizer_config.json wins
  CHECK(tok->eos_id() == 2);  // from config.json
  CHECK(tok->pad_id() == 0);
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "<nope>"})";
  std::string e = error_of([&] { hf::load_tokenizer(dir.string()); });
  CHECK_MESSAGE(contains(e, "tokenizer_config.json': $.eos_token = '<nope>' is not a token"), e);
  fs::remove(dir / "tokenizer_config.json");
  std::ofstream(dir / "config.json") << R"({"eos_token_id": 99999})";
  e = error_of([&] { hf::load_tokenizer(dir.string()); });
  CHECK_MESSAGE(contains(e, "config.json': $.eos_token_id = 99999 is not an id"), e);
  fs::remove(dir / "config.json");
  fs::remove(dir / "tokenizer.json");
  e = error_of([&] { hf::load_tokenizer(dir.string()); });
  CHECK_MESSAGE(contains(e, "has neither tokenizer.json nor tokenizer.model"), e);
#ifndef GRAPHMOE_TEST_SENTENCEPIECE
  std::ofstream(dir / "tokenizer.model") << "x";
  e = error_of([&] { hf::load_tokenizer(dir.string()); });
  CHECK_MESSAGE(contains(e, "include <graphmoe/hf/sentencepiece.hpp>"), e);
#endif
  fs::remove_all(dir);
}

TEST_CASE("encode and decode refuse bad input") {
  auto tok = hf::load_tokenizer((reference_dir() / "gpt2").string());
  std::string e = error_of([&] { tok->encode("ok \xC3\x28 bad"); });
  CHECK_MESSAGE(contains(e, "graphmoe::hf::Tokenizer::encode: the text is not valid UTF-8 (byte 3)"), e);
  e = error_of([&] { tok->encode(std::string("\xED\xA0\x80")); });  // a surrogate
  CHECK_MESSAGE(contains(e, "not valid UTF-8"), e);
  const std::vector<std::int32_t> out_of_range = {5, tok->vocab_size()};
  e = error_of([&] { tok->decode(out_of_range); });
  CHECK_MESSAGE((contains(e, "graphmoe::hf::Tokenizer::decode: ids[1] = ") && contains(e, "is out of range")), e);
  const std::vector<std::int32_t> negative = {-1};
  e = error_of([&] { tok->decode(negative); });
  CHECK_MESSAGE(contains(e, "ids[0] = -1 is out of range"), e);
  // A byte token split across steps: nothing until the character is whole.
  hf::StreamDecoder stream(*tok);
  const auto ids = tok->encode("\xF0\x9F\x98\x80", false);  // U+1F600, four byte-level tokens
  REQUIRE(ids.size() >= 2);
  std::string got;
  for (std::size_t i = 0; i + 1 < ids.size(); ++i) CHECK(stream.step(ids[i]).empty());
  got = stream.step(ids.back());
  CHECK(got == "\xF0\x9F\x98\x80");
  CHECK(stream.step(ids[0]).empty());
  CHECK(stream.finish() == "\xEF\xBF\xBD");  // an incomplete character at the end
}

TEST_CASE("hostile tokenizer.json files are refused by name") {
  const nlohmann::json base = base_json();
  CHECK(load_error(base.dump()) == "(no graphmoe::Error)");
  const std::string text = base.dump();
  std::string e = load_error(text.substr(0, text.size() / 2));
  CHECK_MESSAGE(contains(e, "graphmoe::hf::load_tokenizer: 'hostile.json': not valid JSON"), e);
  e = load_error("[1, 2]");
  CHECK_MESSAGE(contains(e, "'hostile.json': $: is an array, not an object"), e);
  // nested 75,000 deep: refused before nlohmann_json builds (and would recursively copy) it
  e = load_error("{\"model\": " + std::string(75000, '[') + std::string(75000, ']') + "}");
  CHECK_MESSAGE(contains(e, "'hostile.json' nests JSON arrays and objects more than 256 levels"), e);

  auto edited = [&](auto&& edit) {
    nlohmann::json j = base;
    edit(j);
    return load_error(j.dump());
  };
  e = edited([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; });
  CHECK_MESSAGE(contains(e, "$.model.type: is 'WordPiece': graphmoe reads BPE models only"), e);
  e = edited([](nlohmann::json& j) { j["normalizer"] = {{"type", "Lowercase"}}; });
  CHECK_MESSAGE((contains(e, "$.normalizer.type: is 'Lowercase'") && contains(e, "normalizer")), e);
  e = edited([](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; });
  CHECK_MESSAGE(contains(e, "$.pre_tokenizer.type: is 'Whitespace'"), e);
  e = edited([](nlohmann::json& j) { j["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}}; });
  CHECK_MESSAGE(contains(e, "$.decoder.type: is 'WordPiece'"), e);
  e = edited([](nlohmann::json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; });
  CHECK_MESSAGE(contains(e, "$.post_processor.type: is 'BertProcessing'"), e);
  e = edited([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}},
                          {"behavior", "Isolated"}, {"invert", false}};
  });
  CHECK_MESSAGE(contains(e, "$.pre_tokenizer.pattern.Regex: PCRE2 refuses the pattern"), e);
  e = edited([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", " "}}},
                          {"behavior", "Sideways"}, {"invert", false}};
  });
  CHECK_MESSAGE(contains(e, "$.pre_tokenizer.behavior: is 'Sideways'"), e);
  e = edited([](nlohmann::json& j) { j["pre_tokenizer"]["shiny"] = true; });
  CHECK_MESSAGE(contains(e, "$.pre_tokenizer.shiny: is not understood"), e);
  e = edited([](nlohmann::json& j) { j["extra"] = 1; });
  CHECK_MESSAGE(contains(e, "$.extra: is not understood"), e);
  e = edited([](nlohmann::json& j) { j["truncation"] = {{"max_length", 8}}; });
  CHECK_MESSAGE(contains(e, "$.truncation: is set"), e);
  e = edited([](nlohmann::json& j) { j["model"]["dropout"] = 0.1; });
  CHECK_MESSAGE(contains(e, "$.model.dropout: is 0.1: BPE dropout is not supported"), e);
  e = edited([](nlohmann::json& j) { j["model"]["vocab"]["Ġthe"] = 1 << 30; });
  CHECK_MESSAGE(contains(e, "$.model.vocab[\"Ġthe\"]: = 1073741824 is out of range"), e);
  e = edited([](nlohmann::json& j) { j["model"]["vocab"]["Ġthe"] = -3; });
  CHECK_MESSAGE(contains(e, "is out of range"), e);
  e = edited([](nlohmann::json& j) { j["model"]["vocab"]["Ġthe"] = "7"; });
  CHECK_MESSAGE(contains(e, "$.model.vocab[\"Ġthe\"]: is a string, not an integer"), e);
  e = edited([](nlohmann::json& j) { j["model"]["vocab"]["Ġthe"] = j["model"]["vocab"]["Ġa"]; });
  CHECK_MESSAGE((contains(e, "$.model.vocab: id ") && contains(e, "is given to two tokens")), e);
  e = edited([](nlohmann::json& j) { j["model"]["merges"][5] = "Ġqq zz"; });
  CHECK_MESSAGE(contains(e, "$.model.merges[5]: names 'Ġqq', which is not in the vocabulary"), e);
  e = edited([](nlohmann::json& j) { j["model"]["merges"][5] = "t"; });
  CHECK_MESSAGE(contains(e, "$.model.merges[5]: 't' is not two tokens"), e);
  e = edited([](nlohmann::json& j) { j["model"]["merges"][5] = {"a", "b", "c"}; });
  CHECK_MESSAGE(contains(e, "$.model.merges[5]: is neither"), e);
  e = edited([](nlohmann::json& j) { j["model"]["merges"][5] = "<|endoftext|> <|endoftext|>"; });
  CHECK_MESSAGE(contains(e, "makes '<|endoftext|><|endoftext|>', which is not in the vocabulary"), e);
  e = edited([](nlohmann::json& j) { j["added_tokens"][2]["id"] = 4000; });
  CHECK_MESSAGE(contains(e, "$.added_tokens[2].id: 4000, but the tokenizers library gives '<|im_end|>' "
                            "the id 3001"), e);
  e = edited([](nlohmann::json& j) { j["added_tokens"][0]["id"] = 7; });
  CHECK_MESSAGE(contains(e, "$.added_tokens[0].id: 7, but the tokenizers library gives "
                            "'<|endoftext|>' the id 0"), e);
  e = edited([](nlohmann::json& j) { j["model"]["unk_token"] = "<nope>"; });
  CHECK_MESSAGE(contains(e, "$.model.unk_token: '<nope>' is not in the vocabulary"), e);
  e = edited([](nlohmann::json& j) { j["added_tokens"][1]["id"] = j["added_tokens"][0]["id"]; });
  CHECK_MESSAGE(contains(e, "$.added_tokens[1].id: 0 is also the id of $.added_tokens[0]"), e);
  e = edited([](nlohmann::json& j) { j["added_tokens"][1]["content"] = ""; });
  CHECK_MESSAGE(contains(e, "$.added_tokens[1].content: is an empty token"), e);
  e = edited([](nlohmann::json& j) { j["added_tokens"][1]["id"] = 5000000000LL; });
  CHECK_MESSAGE(contains(e, "$.added_tokens[1].id: = 5000000000 is out of range"), e);
  e = edited([](nlohmann::json& j) { j["model"]["merges"] = "nope"; });
  CHECK_MESSAGE(contains(e, "$.model.merges: is a string, not an array"), e);
  e = edited([](nlohmann::json& j) { j["model"].erase("vocab"); });
  CHECK_MESSAGE(contains(e, "$.model.vocab: is missing"), e);
  e = edited([](nlohmann::json& j) {
    nlohmann::json n = {{"type", "NFC"}};
    for (int i = 0; i < 40; ++i) n = {{"type", "Sequence"}, {"normalizers", {n}}};
    j["normalizer"] = n;
  });
  CHECK_MESSAGE(contains(e, "nests Sequences deeper than the limit"), e);
  e = edited([](nlohmann::json& j) {
    j["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}], "pair": null,
        "special_tokens": {"<x>": {"id": "<x>", "ids": [123456], "tokens": ["<x>"]}}})");
  });
  CHECK_MESSAGE(contains(e, "$.post_processor.special_tokens[\"<x>\"].ids[0]: = 123456 is out of range"), e);
  e = edited([](nlohmann::json& j) {
    j["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<y>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": null, "special_tokens": {}})");
  });
  CHECK_MESSAGE(contains(e, "$.post_processor.single[0].SpecialToken.id: '<y>' is not in special_tokens"), e);
  // The file itself: missing, a directory.
  e = error_of([] { hf::JsonTokenizer::from_file("/nonexistent/tokenizer.json"); });
  CHECK_MESSAGE(contains(e, "graphmoe::hf::load_tokenizer: cannot open '/nonexistent/tokenizer.json'"), e);
  e = error_of([] { hf::JsonTokenizer::from_file("/tmp"); });
  CHECK_MESSAGE(contains(e, "'/tmp' is not a regular file"), e);
}

TEST_CASE("added tokens: specials split first, skip_special_tokens, single_word") {
  auto tok = hf::load_tokenizer((reference_dir() / "gpt2").string());
  const auto im_end = tok->token_to_id("<|im_end|>");
  REQUIRE(im_end.has_value());
  CHECK(tok->is_special(*im_end));
  const auto ids = tok->encode("a<|im_end|>b");
  CHECK(std::count(ids.begin(), ids.end(), *im_end) == 1);
  CHECK(tok->decode(ids, true) == "ab");
  CHECK(tok->decode(ids, false) == "a<|im_end|>b");
  const auto lord = tok->token_to_id("LORD God");
  REQUIRE(lord.has_value());
  CHECK(!tok->is_special(*lord));
  auto has = [&](const std::string& s) {
    const auto v = tok->encode(s);
    return std::count(v.begin(), v.end(), *lord) > 0;
  };
  CHECK(has("the LORD God said"));
  CHECK(!has("the LORD Godly"));  // single_word: not inside a word
}
