// tests/fuzz/make_seeds.cpp: writes the seed corpus of the fuzz targets, valid files made by
// graphmoe's own writers (save_safetensors, save_training_state, the tokenizers' save) or written
// out here, each prefixed with its target's selector byte where the target has one.
//
//   fuzz_make_seeds OUT    writes OUT/<target>/<seed> for the five targets of tests/fuzz and
//                          reads every seed back through its reader, which must accept it
//
// No data file is part of the repository: every seed is made here, at build or run time.
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/gzip.hpp"
#include "graphmoe/train/image_datasets.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/text_datasets.hpp"
#include "graphmoe/train/tokenizers.hpp"
#include "graphmoe/train/training_state.hpp"

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
    check_seeds();
    fs::remove_all(g_scratch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", e.what());
    return 1;
  }
  std::printf("fuzz_make_seeds: %d seeds in %s\n", g_count, argv[1]);
  return 0;
}
