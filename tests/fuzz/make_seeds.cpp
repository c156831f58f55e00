// tests/fuzz/make_seeds.cpp: writes the seed corpus of the fuzz targets, valid files made by
// graphmoe's own writers (save_safetensors, save_training_state, the tokenizers' save), copied
// from the Hugging Face golden fixtures (tests/hf/fixtures/*/config.json) or written out here,
// each prefixed with its target's selector byte where the target has one.
//
//   fuzz_make_seeds OUT    writes OUT/<target>/<seed> for the seven targets of tests/fuzz and
//                          reads every seed back through its reader, which must accept it
//
// No data file is part of the repository: every seed is made here, at build or run time.
// GRAPHMOE_HF_FIXTURES (a compile definition: tests/hf/fixtures) is where the config.json seeds
// come from. GRAPHMOE_FUZZ_HF_TOKENIZER is defined where the program links graphmoe::hf_tokenizer
// (PCRE2 and utf8proc): the tokenizer.json seeds are then read back too; without it they are
// written unchecked (the hf_tokenizer target is not built either).
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/hf/config.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/gzip.hpp"
#include "graphmoe/train/image_datasets.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/text_datasets.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"
#ifdef GRAPHMOE_FUZZ_HF_TOKENIZER
#include "graphmoe/hf/tokenizer.hpp"
#endif

#ifndef GRAPHMOE_HF_FIXTURES
#error "GRAPHMOE_HF_FIXTURES (the folder of the Hugging Face golden fixtures) must be defined"
#endif

namespace fs = std::filesystem;
using namespace graphmoe;

namespace {

fs::path g_out;      // OUT
fs::path g_scratch;  // OUT/.scratch: files the writers make before they become seeds
int g_count = 0;

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", what);
    std::exit(1);
  }
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() ||
      std::fclose(f) != 0) {
    std::fprintf(stderr, "fuzz_make_seeds: cannot write '%s'\n", p.c_str());
    std::exit(1);
  }
}

// OUT/<target>/<name> = selector byte (when >= 0) + bytes.
void seed(const char* target, const char* name, int selector, const std::string& bytes) {
  const fs::path dir = g_out / target;
  fs::create_directories(dir);
  std::string content;
  if (selector >= 0) content += static_cast<char>(selector);
  content += bytes;
  write_bytes(dir / name, content);
  ++g_count;
}

std::string scratch(const char* name) { return (g_scratch / name).string(); }

// gzip (one member) of `s`, as gzip(1) writes it.
std::string gzip(const std::string& s) {
  z_stream z{};
  require(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK, "deflateInit2");
  std::string out(deflateBound(&z, static_cast<uLong>(s.size())) + 32, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  z.avail_in = static_cast<uInt>(s.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  require(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string be32(std::uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string le16(std::size_t v) { return {static_cast<char>(v & 0xff), static_cast<char>(v >> 8)}; }

// An idx3-ubyte file of `count` images of rows x cols, and its idx1-ubyte labels.
std::string idx_images(std::uint32_t count, std::uint32_t rows, std::uint32_t cols) {
  std::string b = be32(2051) + be32(count) + be32(rows) + be32(cols);
  for (std::uint32_t i = 0; i < count * rows * cols; ++i) b += static_cast<char>((i * 37) & 0xff);
  return b;
}
std::string idx_labels(std::uint32_t count) {
  std::string b = be32(2049) + be32(count);
  for (std::uint32_t i = 0; i < count; ++i) b += static_cast<char>(i % 10);
  return b;
}

std::string digits_csv(int lines) {
  std::string s;
  for (int l = 0; l < lines; ++l) {
    for (int p = 0; p < 64; ++p) s += std::to_string((p + l) % 17) + ",";
    s += std::to_string(l % 10) + (l % 2 ? "\r\n" : "\n");
  }
  return s;
}

void safetensors_seeds() {
  const std::vector<float> w = {1, 2, 3, 4, 5, 6}, b = {0.5f, -0.5f, 0};
  const std::vector<double> d = {3.25, -1e-300};
  const std::vector<std::int32_t> ids = {0, -1, 7, 2147483647};
  const std::vector<std::int64_t> big = {-(std::int64_t(1) << 62)};
  const std::vector<std::uint8_t> u8 = {0, 128, 255};
  const std::vector<std::uint16_t> half = {0x3c00, 0xbc00};  // 1.0 and -1.0 in F16; BF16 bits too
  const std::string path = scratch("t.safetensors");

  save_safetensors(path,
                   {{"w", DType::F32, Shape{2, 3}, w.data()},
                    {"b", DType::F32, Shape{3}, b.data()},
                    {"d", DType::F64, Shape{2}, d.data()},
                    {"ids", DType::I32, Shape{2, 2}, ids.data()},
                    {"big", DType::I64, Shape{1}, big.data()},
                    {"u8", DType::U8, Shape{3}, u8.data()},
                    {"h", DType::F16, Shape{2}, half.data()},
                    {"bf", DType::BF16, Shape{1, 2}, half.data()}},
                   {{"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\""}});
  seed("safetensors", "all_dtypes.safetensors", -1, read_file(path));

  save_safetensors(path, {{"model.w", DType::F32, Shape{2, 3}, w.data()},
                          {"model.b", DType::F32, Shape{3}, b.data()}});
  seed("safetensors", "model_prefix.safetensors", -1, read_file(path));

  save_safetensors(path, {{"w", DType::F32, Shape{2, 3}, w.data()},
                          {"b", DType::F32, Shape{3}, b.data()},
                          {"empty", DType::F32, Shape{0, 4}, nullptr}},
                   {{"step", "12"}});
  seed("safetensors", "arena_and_empty_tensor.safetensors", -1, read_file(path));

  save_safetensors(path, {}, {{"only", "metadata"}});
  seed("safetensors", "no_tensors.safetensors", -1, read_file(path));
}

void small_arena(ParameterArena<float>& a) {
  a.add("w", Shape{2, 3});
  a.add("b", Shape{3});
  a.add("frozen", Shape{2}, false);
  a.allocate();
  for (index_t i = 0; i < a.values().numel(); ++i)
    a.values().data()[i] = 0.125f * static_cast<float>(i) - 0.5f;
}

void training_state_seeds() {
  const std::string path = scratch("state.safetensors");
  {
    ParameterArena<float> a;
    small_arena(a);
    AdamW<float> adam(a, AdamWConfig{});
    save_training_state(path, a, adam, {});
    seed("training_state", "fresh.safetensors", -1, read_file(path));
  }
  {
    ParameterArena<float> a;
    small_arena(a);
    AdamW<float> adam(a, AdamWConfig{});
    for (int s = 0; s < 2; ++s) {
      for (index_t i = 0; i < a.grads().numel(); ++i)
        a.grads().data()[i] = 0.25f * static_cast<float>(i % 3) - 0.1f;
      adam.step(a, 1e-3);
    }
    save_training_state(path, a, adam,
                        {{"step", "2"}, {"config", "{\"d_model\": 4, \"router\": \"similarity\"}"}});
    seed("training_state", "two_steps.safetensors", -1, read_file(path));
  }
}

void text_seeds() {
  seed("text_datasets", "sst2.tsv", 0,
       "sentence\tlabel\nit 's a charming and often affecting journey . \t1\n"
       "unflinchingly bleak and desperate\t0\r\n");
  seed("text_datasets", "sst5.txt", 1,
       "(3 (2 It) (4 (4 (2 's) (4 (3 (2 a) (4 (3 lovely) (2 film))) (3 (2 with) (4 (3 (3 lovely) "
       "(2 performances)) (2 (2 by) (2 (2 (2 Buy) (2 and)) (2 Accorsi))))))) (2 .)))\n"
       "(1 (2 -LRB-) (1 (1 dull) (2 -RRB-)))\n");
  seed("text_datasets", "banking77.csv", 2,
       "text,category\nHow do I top up my card?,top_up_by_card_charge\n"
       "\"My card, \"\"the new one\"\",\nhas not arrived\",card_arrival\r\n"
       "  where is my money  ,top_up_by_card_charge\n");
  seed("text_datasets", "categories.json", 3,
       "[\"card_arrival\", \"top_up_by_card_charge\",\n \"caf\\u00e9 \\ud83d\\ude00\", "
       "\"a\\\"b\\\\c\\/d\\n\"]\n");
}

void image_seeds() {
  const std::string images = idx_images(2, 3, 4), labels = idx_labels(2);
  seed("image_datasets", "idx.bin", 0, le16(images.size()) + images + labels);
  const std::string gz_images = gzip(images), gz_labels = gzip(labels);
  seed("image_datasets", "idx_gzip.bin", 0, le16(gz_images.size()) + gz_images + gz_labels);
  seed("image_datasets", "digits.csv", 1, digits_csv(3));
  seed("image_datasets", "digits.csv.gz", 1, gzip(digits_csv(2)));
  seed("image_datasets", "two_members.gz", 2, gzip("first member\n") + gzip("second\n"));
  seed("image_datasets", "plain.txt", 2, "not compressed\n");
}

void tokenizer_seeds() {
  const std::string corpus = scratch("corpus.txt");
  write_bytes(corpus, " = Valkyria Chronicles = \n\n the game <unk> the series , the\r\n"
                      "caf\xc3\xa9 tab\there\n");
  const std::string vocab = scratch("vocab.txt");
  WordTokenizer::build(corpus).save(vocab);
  seed("tokenizers", "word.vocab", 0, read_file(vocab));
  CharTokenizer::build(corpus).save(vocab);
  seed("tokenizers", "char.vocab", 1, read_file(vocab));
  seed("tokenizers", "word_corpus.txt", 2, read_file(corpus));
  seed("tokenizers", "char_corpus.txt", 3, read_file(corpus));
}

// ---- Hugging Face model directories and tokenizers ----------------------------------------------

const char* const kIndexSeparator = "\n#index#\n";  // fuzz_hf_config.cpp's

// The config.json of every golden fixture, as transformers wrote it.
void hf_config_seeds() {
  int n = 0;
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(GRAPHMOE_HF_FIXTURES))
    if (e.is_directory() && fs::is_regular_file(e.path() / "config.json")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  for (const fs::path& d : dirs) {
    const std::string name = d.filename().string() + ".json";
    seed("hf_config", name.c_str(), -1, read_file((d / "config.json").string()));
    ++n;
  }
  require(n >= 6, "hf_config: expected the six golden fixtures under GRAPHMOE_HF_FIXTURES");
  // config.json, then an index naming shards (absent: Checkpoint::open reads the index through
  // and refuses the first missing shard).
  const fs::path fixtures(GRAPHMOE_HF_FIXTURES);
  const std::string llama = read_file((fixtures / "llama" / "config.json").string());
  seed("hf_config", "llama_index_one_shard", -1,
       llama + kIndexSeparator +
           "{\"metadata\": {\"total_size\": 1024}, \"weight_map\": {\"model.embed_tokens.weight\": "
           "\"model-00001-of-00001.safetensors\", \"lm_head.weight\": "
           "\"model-00001-of-00001.safetensors\"}}\n");
  const std::string mixtral = read_file((fixtures / "mixtral" / "config.json").string());
  seed("hf_config", "mixtral_index_two_shards", -1,
       mixtral + kIndexSeparator +
           "{\n  \"metadata\": {\"total_parameters\": 66880, \"total_size\": 133760},\n"
           "  \"weight_map\": {\n    \"lm_head.weight\": \"model-00001-of-00002.safetensors\",\n"
           "    \"model.layers.0.block_sparse_moe.gate.weight\":\n"
           "      \"model-00002-of-00002.safetensors\",\n"
           "    \"model.norm.weight\": \"model-00002-of-00002.safetensors\"\n  }\n}\n");
}

using ojson = nlohmann::ordered_json;

// A BPE model: `base` tokens get ids 0, 1, ... in order, then each merge's result (when new).
ojson bpe_model(const std::vector<std::string>& base,
                const std::vector<std::pair<std::string, std::string>>& merges,
                bool string_merges) {
  ojson vocab = ojson::object(), list = ojson::array();
  int next = 0;
  for (const auto& t : base)
    if (!vocab.contains(t)) vocab[t] = next++;
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    if (string_merges) list.push_back(a + " " + b);
    else list.push_back(ojson::array({a, b}));
  }
  ojson m = ojson::object();
  m["type"] = "BPE";
  m["dropout"] = nullptr;
  m["unk_token"] = nullptr;
  m["continuing_subword_prefix"] = nullptr;
  m["end_of_word_suffix"] = nullptr;
  m["fuse_unk"] = false;
  m["byte_fallback"] = false;
  m["ignore_merges"] = false;
  m["vocab"] = vocab;
  m["merges"] = list;
  return m;
}

ojson added(int id, const std::string& content, bool special, bool normalized, bool lstrip = false,
            bool rstrip = false, bool single_word = false) {
  return ojson{{"id", id},          {"content", content}, {"single_word", single_word},
               {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
               {"special", special}};
}

ojson tokenizer_json(const ojson& model, const ojson& added_tokens, const ojson& normalizer,
                     const ojson& pre_tokenizer, const ojson& post_processor,
                     const ojson& decoder) {
  ojson j = ojson::object();
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = added_tokens;
  j["normalizer"] = normalizer;
  j["pre_tokenizer"] = pre_tokenizer;
  j["post_processor"] = post_processor;
  j["decoder"] = decoder;
  j["model"] = model;
  return j;
}

ojson bos_template(const std::string& bos, int id) {
  return ojson{{"type", "TemplateProcessing"},
               {"single", ojson::array({ojson{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                        ojson{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
               {"pair", ojson::array({ojson{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                      ojson{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                      ojson{{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
               {"special_tokens",
                {{bos,
                  {{"id", bos}, {"ids", ojson::array({id})}, {"tokens", ojson::array({bos})}}}}}};
}

const char* const kMeta = "\xe2\x96\x81";  // U+2581, sentencepiece's space
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Small hand-written tokenizer.json files in the layouts of tests/hf/make_tokenizers.py (the
// reader reads BPE models only).
void hf_tokenizer_seeds() {
  const std::string M = kMeta;
  // Llama-2 / Mixtral: sentencepiece-style BPE with byte fallback, in the normalizer form; byte
  // tokens for the UTF-8 bytes of the fuzz target's texts.
  {
    std::vector<std::string> base = {"<unk>", "<s>", "</s>"};
    for (const char* b : {"<0x0A>", "<0x09>", "<0x41>", "<0xC3>", "<0xA9>", "<0xE2>", "<0x82>",
                          "<0xAC>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0xE4>", "<0xB8>",
                          "<0xAD>"})
      base.push_back(b);
    for (const char* c : {"e", "l", "o", "H", "w", "r", "d", "t", "h", "a", "c", "n", "i", ","})
      base.push_back(c);
    base.push_back(M);
    const ojson model = [&] {
      ojson m = bpe_model(base, {{"l", "l"}, {"ll", "o"}, {"e", "llo"}, {"H", "ello"},
                                 {M, "Hello"}, {M, "w"}, {"o", "r"}, {M + "w", "or"},
                                 {M + "wor", "l"}, {M + "worl", "d"}, {"h", "e"}, {M, "t"},
                                 {M + "t", "he"}},
                          /*string_merges=*/true);
      m["unk_token"] = "<unk>";
      m["fuse_unk"] = true;
      m["byte_fallback"] = true;
      return m;
    }();
    const ojson added_tokens = ojson::array({added(0, "<unk>", true, false),
                                             added(1, "<s>", true, false),
                                             added(2, "</s>", true, false)});
    const ojson normalizer = {
        {"type", "Sequence"},
        {"normalizers", ojson::array({ojson{{"type", "Prepend"}, {"prepend", M}},
                                      ojson{{"type", "Replace"},
                                            {"pattern", {{"String", " "}}},
                                            {"content", M}}})}};
    const ojson decoder = {
        {"type", "Sequence"},
        {"decoders",
         ojson::array({ojson{{"type", "Replace"}, {"pattern", {{"String", M}}}, {"content", " "}},
                       ojson{{"type", "ByteFallback"}}, ojson{{"type", "Fuse"}},
                       ojson{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
    seed("hf_tokenizer", "llama2_byte_fallback.json", -1,
         tokenizer_json(model, added_tokens, normalizer, nullptr, bos_template("<s>", 1), decoder)
             .dump());
  }
  // GPT-2: ByteLevel pre-tokenizer with GPT-2's regex, ByteLevel decoder; "a b" merges; special
  // tokens in and after the model's vocabulary, a single_word and an lstrip / rstrip token.
  const std::string G = "\xc4\xa0", C = "\xc4\x8a";  // U+0120 (space), U+010A (newline)
  std::vector<std::string> bytes_base = {"<|endoftext|>"};
  for (const char* c : {"H", "e", "l", "o", "w", "r", "d", "t", "h", "a", "c", "f", "i", "s", "n",
                        ",", "!", "'", "4", "2", ".", "T", "\xc3\x83", "\xc2\xa9", "\xc3\xa2"})
    bytes_base.push_back(c);
  bytes_base.push_back(G);
  bytes_base.push_back(C);
  const std::vector<std::pair<std::string, std::string>> bytes_merges = {
      {"l", "l"}, {"ll", "o"}, {"H", "e"}, {"He", "llo"}, {G, "w"}, {"o", "r"}, {G + "w", "or"},
      {G + "wor", "l"}, {G + "worl", "d"}, {"h", "e"}, {G, "t"}, {G + "t", "he"}, {"i", "t"},
      {"\xc3\x83", "\xc2\xa9"}, {"c", "a"}, {"ca", "f"}, {"caf", "\xc3\x83\xc2\xa9"}, {G, G}};
  {
    const ojson model = bpe_model(bytes_base, bytes_merges, /*string_merges=*/true);
    const int n = static_cast<int>(model["vocab"].size());
    const ojson added_tokens =
        ojson::array({added(0, "<|endoftext|>", true, false), added(n, "<|im_start|>", true, false),
                      added(n + 1, "<|im_end|>", true, false),
                      added(n + 2, "<|tool|>", false, true, /*lstrip=*/true, /*rstrip=*/true),
                      added(n + 3, "the end", false, true, false, false, /*single_word=*/true)});
    const ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                              {"trim_offsets", true}, {"use_regex", true}};
    seed("hf_tokenizer", "gpt2_byte_level.json", -1,
         tokenizer_json(model, added_tokens, nullptr, byte_level,
                        {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
                         {"use_regex", true}},
                        byte_level)
             .dump());
  }
  // Qwen2: NFC, Split(regex) then ByteLevel without its regex; ["a", "b"] merges, ignore_merges.
  {
    ojson model = bpe_model(bytes_base, bytes_merges, /*string_merges=*/false);
    model["ignore_merges"] = true;
    const int n = static_cast<int>(model["vocab"].size());
    const ojson added_tokens =
        ojson::array({added(0, "<|endoftext|>", true, false), added(n, "<|im_start|>", true, false),
                      added(n + 1, "<|im_end|>", true, false),
                      added(n + 2, "LORD God", false, false)});
    const ojson pre = {
        {"type", "Sequence"},
        {"pretokenizers",
         ojson::array({ojson{{"type", "Split"}, {"pattern", {{"Regex", kQwen2Regex}}},
                             {"behavior", "Isolated"}, {"invert", false}},
                       ojson{{"type", "ByteLevel"}, {"add_prefix_space", false},
                             {"trim_offsets", false}, {"use_regex", false}}})}};
    seed("hf_tokenizer", "qwen2_split_byte_level.json", -1,
         tokenizer_json(model, added_tokens, {{"type", "NFC"}}, pre,
                        {{"type", "Sequence"},
                         {"processors", ojson::array({ojson{{"type", "ByteLevel"},
                                                            {"add_prefix_space", false},
                                                            {"trim_offsets", false},
                                                            {"use_regex", true}},
                                                      bos_template("<|im_start|>", n)})}},
                        {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
                         {"use_regex", true}})
             .dump());
  }
  // Mistral: NFKC, Metaspace pre-tokenizer (prepend_scheme first, no split) and decoder, byte
  // fallback without fused unknowns; a model without "type" (its merges say BPE).
  {
    std::vector<std::string> base = {"<unk>", "<s>", "</s>", "<0x41>", "<0xC3>", "<0xA9>"};
    for (const char* c : {"e", "l", "o", "H", "w", "r", "d", "f", "i", "x"}) base.push_back(c);
    base.push_back(M);
    ojson model = bpe_model(base, {{"l", "l"}, {"H", "e"}, {"He", "ll"}, {"Hell", "o"},
                                   {M, "Hello"}, {"f", "i"}},
                            /*string_merges=*/false);
    model.erase("type");
    model["unk_token"] = "<unk>";
    model["byte_fallback"] = true;
    const ojson metaspace = {{"type", "Metaspace"}, {"replacement", M}, {"prepend_scheme", "first"},
                             {"split", false}};
    seed("hf_tokenizer", "mistral_metaspace.json", -1,
         tokenizer_json(model,
                        ojson::array({added(0, "<unk>", true, false), added(1, "<s>", true, false),
                                      added(2, "</s>", true, false)}),
                        {{"type", "NFKC"}}, metaspace, bos_template("<s>", 1),
                        {{"type", "Sequence"},
                         {"decoders", ojson::array({ojson{{"type", "ByteFallback"}}, metaspace})}})
             .dump());
  }
  // The least a file may hold: a model, no pipeline (decode joins the tokens with spaces).
  seed("hf_tokenizer", "minimal.json", -1,
       R"({"model": {"vocab": {"a": 0, "b": 1, "ab": 2, "c": 3}, "merges": ["a b"]}})");
}

// Every seed through its own reader: a seed the reader refuses would start the fuzzer from
// rejected input only, so it fails here instead.
void check_seeds() {
  const auto payload = [](const fs::path& p, bool selector) {
    const std::string b = read_file(p.string());
    const std::string out = scratch("payload");
    write_bytes(out, selector ? b.substr(1) : b);
    return out;
  };
  for (const auto& e : fs::directory_iterator(g_out / "safetensors")) (void)load_safetensors(e.path());
  for (const auto& e : fs::directory_iterator(g_out / "training_state")) {
    ParameterArena<float> a;
    small_arena(a);
    AdamW<float> adam(a, AdamWConfig{});
    load_training_state(load_safetensors(e.path()), a, adam);
  }
  (void)read_sst2_tsv(payload(g_out / "text_datasets" / "sst2.tsv", true));
  (void)read_sst5_trees(payload(g_out / "text_datasets" / "sst5.txt", true));
  require(read_banking77_csv(payload(g_out / "text_datasets" / "banking77.csv", true)).size() == 3,
          "banking77.csv: expected 3 examples");
  require(read_banking77_categories(payload(g_out / "text_datasets" / "categories.json", true))
                  .size() == 4,
          "categories.json: expected 4 names");
  require(read_digits_csv(payload(g_out / "image_datasets" / "digits.csv", true)).count == 3,
          "digits.csv: expected 3 images");
  require(read_digits_csv(payload(g_out / "image_datasets" / "digits.csv.gz", true)).count == 2,
          "digits.csv.gz: expected 2 images");
  require(read_file_gunzip(payload(g_out / "image_datasets" / "two_members.gz", true)) ==
              "first member\nsecond\n",
          "two_members.gz: both members");
  for (const char* name : {"idx.bin", "idx_gzip.bin"}) {
    const std::string b = read_file((g_out / "image_datasets" / name).string());
    const std::size_t n = static_cast<unsigned char>(b[1]) | (static_cast<unsigned char>(b[2]) << 8);
    const std::string img = scratch("img"), lab = scratch("lab");
    write_bytes(img, b.substr(3, n));
    write_bytes(lab, b.substr(3 + n));
    require(read_idx_images(img, lab).count == 2, "idx seeds: expected 2 images");
  }
  require(read_file_gunzip(payload(g_out / "image_datasets" / "plain.txt", true)) ==
              "not compressed\n",
          "plain.txt: passed through");
  (void)WordTokenizer::load(payload(g_out / "tokenizers" / "word.vocab", true));
  (void)CharTokenizer::load(payload(g_out / "tokenizers" / "char.vocab", true));
  require(WordTokenizer::build(payload(g_out / "tokenizers" / "word_corpus.txt", true)).size() > 2,
          "word_corpus.txt: builds a vocabulary");
  require(CharTokenizer::build(payload(g_out / "tokenizers" / "char_corpus.txt", true)).size() > 2,
          "char_corpus.txt: builds a vocabulary");
  for (const auto& e : fs::directory_iterator(g_out / "hf_config")) {
    const std::string b = read_file(e.path().string());
    const std::size_t sep = b.find(kIndexSeparator);
    const fs::path dir = g_scratch / "hf_model";
    fs::create_directories(dir);
    write_bytes(dir / "config.json", b.substr(0, sep));
    (void)hf::read_config((dir / "config.json").string());
    if (sep == std::string::npos) continue;
    // an index seed: read through to the first shard, which is missing
    write_bytes(dir / "model.safetensors.index.json",
                b.substr(sep + std::string(kIndexSeparator).size()));
    std::string what;
    try {
      (void)hf::Checkpoint::open(dir.string());
    } catch (const Error& err) {
      what = err.what();
    }
    require(what.find("does not exist") != std::string::npos,
            "hf_config index seeds: Checkpoint::open should read the index through and refuse "
            "its missing shard");
  }
#ifdef GRAPHMOE_FUZZ_HF_TOKENIZER
  for (const auto& e : fs::directory_iterator(g_out / "hf_tokenizer")) {
    const std::string path = e.path().string();
    const auto tok = hf::JsonTokenizer::from_string(read_file(path), path);
    (void)tok->decode(tok->encode("Hello world caf\xc3\xa9"));
  }
#endif
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT\n");
    return 2;
  }
  try {
    g_out = argv[1];
    g_scratch = g_out / ".scratch";
    fs::create_directories(g_scratch);
    safetensors_seeds();
    training_state_seeds();
    text_seeds();
    image_seeds();
    tokenizer_seeds();
    hf_config_seeds();
    hf_tokenizer_seeds();
    check_seeds();
    fs::remove_all(g_scratch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", e.what());
    return 1;
  }
  std::printf("fuzz_make_seeds: %d seeds in %s\n", g_count, argv[1]);
  return 0;
}
