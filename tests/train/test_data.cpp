// Data loading: the readers on the real files of ../shared/data and Debian's Fashion-MNIST,
// tokenizers (round trips, save/load), LMBatcher layout, and bad input with file:line messages.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "graphmoe/train/datasets.hpp"

using namespace graphmoe;

namespace {

std::string data_file(const std::string& rel) {
  const std::string path = data_dir() + "/" + rel;
  REQUIRE_MESSAGE(std::filesystem::exists(path), "missing data file '", path,
                  "': set GRAPHMOE_DATA_DIR to the shared data folder (see shared/data/README.md)");
  return path;
}

// A file in the temp directory holding `content`, removed at scope exit.
class TempFile {
 public:
  TempFile(const std::string& name, const std::string& content) {
    path_ = (std::filesystem::temp_directory_path() /
             ("graphmoe_test_data_" + std::to_string(counter()++) + "_" + name))
                .string();
    std::ofstream out(path_, std::ios::binary);
    out << content;
    REQUIRE(out.good());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string path_;
};

// The message of the graphmoe::Error that f throws ("" when it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define CHECK_ERROR_AT(expr, path, line, what)                                   \
  do {                                                                           \
    const std::string msg_ = error_of([&] { (void)(expr); });                    \
    CAPTURE(msg_);                                                               \
    CHECK(msg_.find((path) + ":" + std::to_string(line) + ":") != std::string::npos); \
    CHECK(msg_.find(what) != std::string::npos);                                 \
  } while (0)

const std::string kFashionDir = "/usr/share/datasets/fashion-mnist/";

}  // namespace

// ---- files --------------------------------------------------------------------------------------

TEST_CASE("data_dir: GRAPHMOE_DATA_DIR, else ../shared/data") {
  const char* env = std::getenv("GRAPHMOE_DATA_DIR");
  REQUIRE_MESSAGE(env != nullptr, "ctest sets GRAPHMOE_DATA_DIR for every test");
  const std::string saved = env;
  CHECK(data_dir() == saved);
  CHECK(std::filesystem::exists(data_dir() + "/SHA256SUMS"));
  ::unsetenv("GRAPHMOE_DATA_DIR");
  CHECK(data_dir() == "../shared/data");
  ::setenv("GRAPHMOE_DATA_DIR", saved.c_str(), 1);
  CHECK(data_dir() == saved);
}

TEST_CASE("for_each_line: LF and CRLF, final newline, empty lines") {
  std::vector<std::string> lines;
  std::vector<std::size_t> numbers;
  for_each_line("a\r\n\nb c\nd", [&](std::string_view l, std::size_t n) {
    lines.emplace_back(l);
    numbers.push_back(n);
  });
  CHECK(lines == std::vector<std::string>{"a", "", "b c", "d"});
  CHECK(numbers == std::vector<std::size_t>{1, 2, 3, 4});
  lines.clear();
  for_each_line("x\n", [&](std::string_view l, std::size_t) { lines.emplace_back(l); });
  CHECK(lines == std::vector<std::string>{"x"});
}

TEST_CASE("bad input: missing files name the path") {
  const std::string p = "/nonexistent/graphmoe/file.txt";
  const std::string want = "cannot open '" + p + "'";
  auto has = [&](const std::string& m) { return m.find(want) != std::string::npos; };
  CHECK(has(error_of([&] { read_sst2_tsv(p); })));
  CHECK(has(error_of([&] { read_sst5_trees(p); })));
  CHECK(has(error_of([&] { read_banking77_csv(p); })));
  CHECK(has(error_of([&] { read_banking77_categories(p); })));
  CHECK(has(error_of([&] { read_digits_csv(p); })));
  CHECK(has(error_of([&] { read_idx_images(p, p); })));
  CHECK(has(error_of([&] { WordTokenizer::build(p); })));
  CHECK(has(error_of([&] { WordTokenizer::load(p); })));
  CHECK(has(error_of([&] { WordTokenizer().encode_file(p); })));
  CHECK(has(error_of([&] { CharTokenizer::build(p); })));
  CHECK(has(error_of([&] { CharTokenizer::load(p); })));
  CHECK(has(error_of([&] { read_file(p); })));
  CHECK(has(error_of([&] { read_file_gunzip(p); })));
}

// ---- SST-2 --------------------------------------------------------------------------------------

TEST_CASE("read_sst2_tsv: GLUE SST-2 train (67,349) and dev (872)") {
  const auto train = read_sst2_tsv(data_file("sst2/train.tsv"));
  REQUIRE(train.size() == 67349);
  CHECK(train[0].text == "hide new secretions from the parental units");
  CHECK(train[0].label == 0);
  std::size_t positives = 0;
  for (const auto& ex : train) positives += ex.label == 1;
  CHECK(positives == 37569);
  const auto dev = read_sst2_tsv(data_file("sst2/dev.tsv"));
  CHECK(dev.size() == 872);
}

TEST_CASE("bad input: read_sst2_tsv") {
  {
    TempFile f("bad input header.tsv", "text\tlabel\nfine\t1\n");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 1, "header");
  }
  {
    TempFile f("bad input fields.tsv", "sentence\tlabel\nfine\t1\nno label here\n");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 3, "expected 2 tab-separated fields");
  }
  {
    TempFile f("bad input extra field.tsv", "sentence\tlabel\na\t1\t0\n");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 2, "found 3");
  }
  {
    TempFile f("bad input label.tsv", "sentence\tlabel\nfine\t1\nworse\tone\n");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 3, "label 'one' is not 0 or 1");
  }
  {
    TempFile f("bad input range.tsv", "sentence\tlabel\nfine\t2\n");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 2, "label '2' is not 0 or 1");
  }
  {
    TempFile f("bad input empty.tsv", "");
    CHECK_ERROR_AT(read_sst2_tsv(f.path()), f.path(), 1, "empty file");
  }
  TempFile ok("crlf.tsv", "sentence\tlabel\r\n a b \t1\r\n");
  const auto rows = read_sst2_tsv(ok.path());
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].text == "a b");
  CHECK(rows[0].label == 1);
}

// ---- SST-5 --------------------------------------------------------------------------------------

TEST_CASE("read_sst5_trees: standard split 8,544 / 1,101 / 2,210, root labels, leaves") {
  const auto train = read_sst5_trees(data_file("sst5/train.txt"));
  REQUIRE(train.size() == 8544);
  CHECK(train[0].label == 3);
  CHECK(train[0].text.rfind("The Rock is destined to be the 21st Century 's new `` Conan ''", 0) == 0);
  CHECK(train[0].text.ends_with("Jean-Claud Van Damme or Steven Segal ."));
  std::map<std::int32_t, std::size_t> counts;
  for (const auto& ex : train) ++counts[ex.label];
  CHECK(counts == std::map<std::int32_t, std::size_t>{{0, 1092}, {1, 2218}, {2, 1624}, {3, 2322}, {4, 1288}});
  CHECK(read_sst5_trees(data_file("sst5/dev.txt")).size() == 1101);
  CHECK(read_sst5_trees(data_file("sst5/test.txt")).size() == 2210);
}

TEST_CASE("read_sst5_trees: small trees") {
  TempFile f("trees.txt", "(1 (2 a) (0 (3 b) (2 c)))\n(4 single)\n");
  const auto t = read_sst5_trees(f.path());
  REQUIRE(t.size() == 2);
  CHECK(t[0].label == 1);
  CHECK(t[0].text == "a b c");
  CHECK(t[1].label == 4);
  CHECK(t[1].text == "single");
}

TEST_CASE("bad input: read_sst5_trees") {
  const std::string good = "(3 (2 ok) (2 fine))\n";
  {
    TempFile f("bad input unclosed.txt", good + "(3 (2 The) (2 Rock)\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 2, "unbalanced parentheses");
  }
  {
    TempFile f("bad input extra close.txt", good + good + "(3 (2 The) (2 Rock)))\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 3,
                   "unbalanced parentheses: ')' at column 21 closes nothing");
  }
  {
    TempFile f("bad input label.txt", good + "(x (2 a))\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 2, "label 'x'");
  }
  {
    TempFile f("bad input label range.txt", "(5 (2 a))\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 1, "not an integer in 0-4");
  }
  {
    TempFile f("bad input two trees.txt", "(3 (2 a)) (2 b)\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 1, "after the root tree");
  }
  {
    TempFile f("bad input empty line.txt", good + "\n" + good);
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 2, "empty line");
  }
  {
    TempFile f("bad input empty node.txt", "(3 (2 a) (1))\n");
    CHECK_ERROR_AT(read_sst5_trees(f.path()), f.path(), 1, "empty node");
  }
}

// ---- Banking77 ----------------------------------------------------------------------------------

TEST_CASE("read_banking77_csv: train 10,003 rows, 77 classes in categories.json order, test 3,080") {
  std::vector<std::string> names;
  const auto train = read_banking77_csv(data_file("banking77/train.csv"), &names);
  REQUIRE(train.size() == 10003);
  CHECK(names.size() == 77);
  CHECK(train[0].text == "I am still waiting on my card?");
  CHECK(names[static_cast<std::size_t>(train[0].label)] == "card_arrival");
  const auto categories = read_banking77_categories(data_file("banking77/categories.json"));
  REQUIRE(categories.size() == 77);
  CHECK(categories == names);  // the file lists categories in order of first appearance
  // Quoted fields: embedded commas, doubled quotes and line breaks.
  std::size_t with_quotes = 0, with_newline = 0;
  for (const auto& ex : train) {
    with_quotes += ex.text.find('"') != std::string::npos;
    with_newline += ex.text.find('\n') != std::string::npos;
  }
  CHECK(with_quotes == 21);
  // Ten texts hold line breaks; trimming leaves one inside: "...to my account here.\n."
  CHECK(with_newline == 1);
  const auto it = std::find_if(train.begin(), train.end(), [](const TextExample& ex) {
    return ex.text.rfind("I'm pretty frustrated about a pound charge", 0) == 0;
  });
  REQUIRE(it != train.end());
  CHECK(it->text.find("as \"pending\", it never changes, and") != std::string::npos);
  CHECK(categories[static_cast<std::size_t>(it->label)] == "extra_charge_on_statement");

  const auto test = read_banking77_csv(data_file("banking77/test.csv"), categories);
  CHECK(test.size() == 3080);
  std::set<std::int32_t> labels;
  for (const auto& ex : test) labels.insert(ex.label);
  CHECK(labels.size() == 77);
  CHECK(*labels.begin() == 0);
  CHECK(*labels.rbegin() == 76);
}

TEST_CASE("read_banking77_csv: RFC 4180 quoting") {
  TempFile f("quoting.csv",
             "text,category\r\n"
             "\"a, b\",x\r\n"
             "\"say \"\"hi\"\"\",y\r\n"
             "\"two\nlines\",x\r\n"
             "plain,\"y\"\r\n");
  std::vector<std::string> names;
  const auto rows = read_banking77_csv(f.path(), &names);
  REQUIRE(rows.size() == 4);
  CHECK(rows[0].text == "a, b");
  CHECK(rows[1].text == "say \"hi\"");
  CHECK(rows[2].text == "two\nlines");
  CHECK(rows[3].text == "plain");
  CHECK(rows[3].label == 1);
  CHECK(names == std::vector<std::string>{"x", "y"});
  // The names overload fixes the ids.
  const auto fixed = read_banking77_csv(f.path(), std::vector<std::string>{"y", "x"});
  CHECK(fixed[0].label == 1);
  CHECK(fixed[1].label == 0);
}

TEST_CASE("bad input: read_banking77_csv and categories.json") {
  {
    TempFile f("bad input header.csv", "sentence,label\na,b\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 1, "header");
  }
  {
    TempFile f("bad input fields.csv", "text,category\na,x\n\"multi\nline\",x\nb,c,d\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 5, "expected 2 fields");
  }
  {
    TempFile f("bad input one field.csv", "text,category\na,x\nlonely\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 3, "found 1");
  }
  {
    TempFile f("bad input quote.csv", "text,category\na,x\n\"never closed,x\nb,y\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 3, "unterminated quoted field");
  }
  {
    TempFile f("bad input after quote.csv", "text,category\n\"a\"b,x\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 2, "after a closing quote");
  }
  {
    TempFile f("bad input bare quote.csv", "text,category\na,x\nsay \"hi\",x\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path()), f.path(), 3, "quote inside an unquoted field");
  }
  {
    TempFile f("bad input unknown category.csv", "text,category\na,x\nb,zzz\n");
    CHECK_ERROR_AT(read_banking77_csv(f.path(), std::vector<std::string>{"x"}), f.path(), 3,
                   "category 'zzz' is not among the 1 category names given");
  }
  {
    TempFile f("bad input categories.json", "[\n  \"a\",\n  \"b\"\n  \"c\"\n]\n");
    CHECK_ERROR_AT(read_banking77_categories(f.path()), f.path(), 4, "syntax error while parsing array");
  }
  {
    TempFile f("bad input categories string.json", "[\"a\", \"b]\n");
    CHECK_ERROR_AT(read_banking77_categories(f.path()), f.path(), 1, "invalid string");
  }
  {
    TempFile f("bad input categories number.json", "[\"a\", 3]");
    CHECK_ERROR_AT(read_banking77_categories(f.path()), f.path(), 1,
                   "element 1 is number, expected a string");
  }
  {
    TempFile f("bad input categories object.json", "{\"a\": 1}");
    CHECK_ERROR_AT(read_banking77_categories(f.path()), f.path(), 1,
                   "expected a JSON array of strings, found object");
  }
  TempFile ok("escapes.json", "[\"a\\\"b\", \"caf\\u00e9\", \"\\n\"]");
  CHECK(read_banking77_categories(ok.path()) ==
        std::vector<std::string>{"a\"b", "caf\xc3\xa9", "\n"});
}

// ---- WordTokenizer ------------------------------------------------------------------------------

TEST_CASE("WordTokenizer: WikiText-2 valid, 217,646 tokens counting end-of-line") {
  const std::string path = data_file("wikitext-2/wiki.valid.tokens");
  const WordTokenizer tok = WordTokenizer::build(path);
  CHECK(tok.size() == 13777);  // 13,776 distinct words (with <unk>) + <eos>
  CHECK(tok.decode(0) == "<unk>");
  CHECK(tok.decode(1) == "<eos>");
  CHECK(tok.decode(2) == "the");  // most frequent word, then "," and "."
  CHECK(tok.decode(3) == ",");
  CHECK(tok.decode(4) == ".");
  const std::vector<std::int32_t> ids = tok.encode_file(path);
  CHECK(ids.size() == 217646);
  CHECK(std::count(ids.begin(), ids.end(), tok.eos()) == 3760);
  CHECK(std::count(ids.begin(), ids.end(), tok.unk()) == 11718);
  CHECK(*std::max_element(ids.begin(), ids.end()) == static_cast<std::int32_t>(tok.size()) - 1);
  // The file starts " \n = Homarus gammarus = \n".
  REQUIRE(ids.size() > 6);
  CHECK(ids[0] == tok.eos());
  CHECK(tok.decode(std::vector<std::int32_t>(ids.begin(), ids.begin() + 6)) ==
        "\n= Homarus gammarus =\n");

  // max_size keeps the most frequent words; the rest, and words of other files, become <unk>.
  const WordTokenizer small = WordTokenizer::build(path, 100);
  CHECK(small.size() == 100);
  CHECK(small.decode(2) == "the");
  const auto test_ids = small.encode_file(data_file("wikitext-2/wiki.test.tokens"));
  CHECK(test_ids.size() == 245569);
  CHECK(*std::max_element(test_ids.begin(), test_ids.end()) == 99);
  // min_count drops the rare words: what is left is a prefix of the full vocabulary.
  const WordTokenizer frequent = WordTokenizer::build(path, 0, 50);
  CHECK(frequent.size() > 2);
  CHECK(frequent.size() < tok.size());
  CHECK(std::equal(frequent.words().begin(), frequent.words().end(), tok.words().begin()));
}

TEST_CASE("WordTokenizer: order by count then first occurrence, round trip, save/load") {
  TempFile f("words.txt", "b a c\n\na  b\td\nunseen? no: <unk> <eos>\n");
  const WordTokenizer tok = WordTokenizer::build(f.path());
  // counts: b 2, a 2, c 1, d 1, unseen? 1, no: 1 (<unk>, <eos> are reserved)
  CHECK(tok.words() == std::vector<std::string>{"<unk>", "<eos>", "b", "a", "c", "d", "unseen?", "no:"});
  CHECK(tok.id("a") == 3);
  CHECK(tok.id("zzz") == tok.unk());
  CHECK(tok.encode_line("a b zzz") == std::vector<std::int32_t>{3, 2, 0});
  CHECK(tok.encode_file(f.path()) ==
        std::vector<std::int32_t>{2, 3, 4, 1, 1, 3, 2, 5, 1, 6, 7, 0, 1, 1});
  CHECK(tok.decode(tok.encode_line(" c  a\tb ")) == "c a b");
  CHECK(WordTokenizer::build(f.path(), 4).words() == std::vector<std::string>{"<unk>", "<eos>", "b", "a"});
  CHECK(WordTokenizer::build(f.path(), 0, 2).size() == 4);

  TempFile saved("vocab.txt", "");
  tok.save(saved.path());
  const WordTokenizer back = WordTokenizer::load(saved.path());
  CHECK(back.words() == tok.words());
  CHECK(back.encode_file(f.path()) == tok.encode_file(f.path()));
  CHECK_THROWS_AS(tok.decode(static_cast<std::int32_t>(tok.size())), Error);
  CHECK_THROWS_AS(WordTokenizer::build(f.path(), 1), Error);
}

TEST_CASE("bad input: WordTokenizer::load") {
  {
    TempFile f("bad input header.vocab", "vocab 3\n<unk>\n<eos>\nx\n");
    CHECK_ERROR_AT(WordTokenizer::load(f.path()), f.path(), 1, "expected the header");
  }
  {
    TempFile f("bad input dup.vocab", "graphmoe::WordTokenizer v1 4\n<unk>\n<eos>\nx\nx\n");
    CHECK_ERROR_AT(WordTokenizer::load(f.path()), f.path(), 5, "appears twice");
  }
  {
    TempFile f("bad input short.vocab", "graphmoe::WordTokenizer v1 5\n<unk>\n<eos>\nx\n");
    CHECK_ERROR_AT(WordTokenizer::load(f.path()), f.path(), 4, "announces 5 words");
  }
  {
    TempFile f("bad input specials.vocab", "graphmoe::WordTokenizer v1 3\n<eos>\n<unk>\nx\n");
    CHECK_ERROR_AT(WordTokenizer::load(f.path()), f.path(), 2, "id 0 must be <unk>");
  }
  {
    TempFile f("bad input space.vocab", "graphmoe::WordTokenizer v1 3\n<unk>\n<eos>\na b\n");
    CHECK_ERROR_AT(WordTokenizer::load(f.path()), f.path(), 4, "holds whitespace");
  }
}

// ---- CharTokenizer ------------------------------------------------------------------------------

TEST_CASE("CharTokenizer: Tiny Shakespeare, 65 characters, round trip, save/load") {
  const std::string path = data_file("tinyshakespeare/input.txt");
  const CharTokenizer tok = CharTokenizer::build(path);
  CHECK(tok.size() == 66);  // <unk> + 65 distinct characters
  CHECK(tok.decode(1) == "\n");
  CHECK(tok.decode(2) == " ");
  const auto ids = tok.encode_file(path);
  CHECK(ids.size() == 1115394);
  CHECK(std::count(ids.begin(), ids.end(), tok.unk()) == 0);
  CHECK(tok.decode(std::vector<std::int32_t>(ids.begin(), ids.begin() + 14)) == "First Citizen:");
  CHECK(tok.decode(ids) == read_file(path));
  CHECK(tok.encode("~") == std::vector<std::int32_t>{0});
  CHECK(tok.decode(0) == "<unk>");

  TempFile saved("chars.txt", "");
  tok.save(saved.path());
  const CharTokenizer back = CharTokenizer::load(saved.path());
  CHECK(back.size() == tok.size());
  CHECK(back.encode("Hello, world!\n~") == tok.encode("Hello, world!\n~"));
  CHECK_THROWS_AS(tok.decode(66), Error);
}

TEST_CASE("bad input: CharTokenizer::load") {
  {
    TempFile f("bad input byte.chars", "graphmoe::CharTokenizer v1 3\n10\n300\n");
    CHECK_ERROR_AT(CharTokenizer::load(f.path()), f.path(), 3, "expected a byte value 0-255");
  }
  {
    TempFile f("bad input order.chars", "graphmoe::CharTokenizer v1 3\n65\n32\n");
    CHECK_ERROR_AT(CharTokenizer::load(f.path()), f.path(), 3, "must increase");
  }
  {
    TempFile f("bad input count.chars", "graphmoe::CharTokenizer v1 2\n65\n66\n");
    CHECK_ERROR_AT(CharTokenizer::load(f.path()), f.path(), 3, "more entries");
  }
}

// ---- LMBatcher ----------------------------------------------------------------------------------

TEST_CASE("LMBatcher: shapes, targets shifted by one, batches tile every lane") {
  const index_t batch = 3, seq = 4;
  std::vector<std::int32_t> stream(50);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<std::int32_t>(1000 + i);
  const LMBatcher b(stream, batch, seq);
  // lanes of 50 / 3 = 16 tokens; (16 - 1) / 4 = 3 batches
  CHECK(b.lane_length() == 16);
  REQUIRE(b.num_batches() == 3);
  for (index_t lane = 0; lane < batch; ++lane) {
    std::vector<std::int32_t> walked;
    for (index_t i = 0; i < b.num_batches(); ++i) {
      const LMBatch mb = b.batch(i);
      CHECK(mb.inputs.shape() == Shape{batch, seq});
      CHECK(mb.targets.shape() == Shape{batch, seq});
      for (index_t t = 0; t < seq; ++t) {
        CHECK(mb.inputs(lane, t) == stream[static_cast<std::size_t>(lane * 16 + i * seq + t)]);
        if (t + 1 < seq) CHECK(mb.targets(lane, t) == mb.inputs(lane, t + 1));
        walked.push_back(mb.inputs(lane, t));
      }
      if (i + 1 < b.num_batches()) CHECK(mb.targets(lane, seq - 1) == b.batch(i + 1).inputs(lane, 0));
    }
    walked.push_back(b.batch(b.num_batches() - 1).targets(lane, seq - 1));
    // inputs of batches 0..n-1 plus the last target = the lane's first n*seq + 1 tokens
    const std::vector<std::int32_t> expected(stream.begin() + lane * 16,
                                             stream.begin() + lane * 16 + 3 * seq + 1);
    CHECK(walked == expected);
  }
}

TEST_CASE("LMBatcher: exact fit, deterministic shuffled order, bad arguments") {
  std::vector<std::int32_t> stream(2 * 9);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<std::int32_t>(i);
  const LMBatcher b(stream, 2, 4);  // lanes of 9 = 2 * 4 + 1: two batches, nothing dropped
  REQUIRE(b.num_batches() == 2);
  CHECK(b.batch(1).targets.to_vector() == std::vector<std::int32_t>{5, 6, 7, 8, 14, 15, 16, 17});

  std::vector<std::int32_t> big(10001);
  const LMBatcher many(big, 1, 10);
  Rng r1(7), r2(7), r3(8);
  const auto o1 = many.order(r1), o2 = many.order(r2), o3 = many.order(r3);
  CHECK(o1 == o2);
  CHECK(o1 != o3);
  auto sorted = o1;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) CHECK(sorted[i] == static_cast<index_t>(i));
  CHECK(sorted.size() == 1000);

  CHECK(LMBatcher(stream, 2, 8).num_batches() == 1);  // one window of 8 + 1 fills a lane
  CHECK_THROWS_AS(LMBatcher(stream, 2, 9), Error);     // a lane of 9 cannot hold 9 + 1
  CHECK_THROWS_AS(LMBatcher(stream, 0, 4), Error);
  CHECK_THROWS_AS(LMBatcher(stream, 2, 0), Error);
  CHECK_THROWS_AS(b.batch(2), Error);
}

// ---- images -------------------------------------------------------------------------------------

TEST_CASE("read_digits_csv: 1,797 8x8 digits, pixels / 16") {
  const ImageDataset d = read_digits_csv(data_file("digits/digits.csv.gz"));
  CHECK(d.count == 1797);
  CHECK(d.rows == 8);
  CHECK(d.cols == 8);
  REQUIRE(d.pixels.size() == 1797u * 64u);
  REQUIRE(d.labels.size() == 1797u);
  CHECK(d.pixels[2] == 5.0f / 16.0f);
  CHECK(d.pixels[3] == 13.0f / 16.0f);
  CHECK(d.labels[0] == 0);
  CHECK(d.labels[1] == 1);
  CHECK(d.labels[2] == 2);
  CHECK(*std::max_element(d.pixels.begin(), d.pixels.end()) == 1.0f);
  std::vector<std::size_t> per_class(10);
  for (auto l : d.labels) ++per_class[static_cast<std::size_t>(l)];
  CHECK(*std::min_element(per_class.begin(), per_class.end()) == 174);
  CHECK(*std::max_element(per_class.begin(), per_class.end()) == 183);
}

TEST_CASE("bad input: read_digits_csv") {
  std::string row;
  for (int i = 0; i < 64; ++i) row += std::to_string(i % 17) + ",";
  {
    TempFile f("bad input fields.csv", row + "3\n" + row + "\n");
    CHECK_ERROR_AT(read_digits_csv(f.path()), f.path(), 2, "label '' is not an integer");
  }
  {
    TempFile f("bad input count.csv", row + "3\n" + row + "3,4\n");
    CHECK_ERROR_AT(read_digits_csv(f.path()), f.path(), 2, "found 66");
  }
  {
    TempFile f("bad input pixel.csv", row + "3\n" + row + "3\n17" + row.substr(row.find(',')) + "1\n");
    CHECK_ERROR_AT(read_digits_csv(f.path()), f.path(), 3, "pixel 1 '17' is not an integer in 0-16");
  }
  {
    TempFile f("bad input label.csv", row + "10\n");
    CHECK_ERROR_AT(read_digits_csv(f.path()), f.path(), 1, "label '10'");
  }
  TempFile ok("digit.csv", row + "7");  // plain (not gzip) and no final newline
  const ImageDataset d = read_digits_csv(ok.path());
  CHECK(d.count == 1);
  CHECK(d.labels == std::vector<std::int32_t>{7});
  CHECK(d.pixels[16] == 16.0f / 16.0f);
}

namespace {
std::string be32(std::uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}
}  // namespace

TEST_CASE("read_idx_images: a small plain idx pair") {
  TempFile img("two.idx3", be32(2051) + be32(2) + be32(2) + be32(3) +
                               std::string("\x00\xff\x33\x00\x00\x00\x01\x02\x03\x04\x05\x06", 12));
  TempFile lab("two.idx1", be32(2049) + be32(2) + std::string("\x07\x02", 2));
  const ImageDataset d = read_idx_images(img.path(), lab.path());
  CHECK(d.count == 2);
  CHECK(d.rows == 2);
  CHECK(d.cols == 3);
  CHECK(d.pixels.size() == 12);
  CHECK(d.pixels[1] == 1.0f);
  CHECK(d.pixels[2] == doctest::Approx(0x33 / 255.0));
  CHECK(d.labels == std::vector<std::int32_t>{7, 2});
}

TEST_CASE("bad input: read_idx_images") {
  const std::string pixels(12, '\x01');
  TempFile lab("labels.idx1", be32(2049) + be32(2) + std::string("\x01\x02", 2));
  {
    TempFile img("bad input magic.idx3", be32(2049) + be32(2) + be32(2) + be32(3) + pixels);
    const std::string m = error_of([&] { read_idx_images(img.path(), lab.path()); });
    CHECK(m.find("'" + img.path() + "': bad idx magic 2049, expected 2051") != std::string::npos);
  }
  {
    TempFile img("bad input truncated.idx3", be32(2051) + be32(2) + be32(2) + be32(3) + pixels.substr(1));
    const std::string m = error_of([&] { read_idx_images(img.path(), lab.path()); });
    CHECK(m.find("'" + img.path() + "': truncated idx data") != std::string::npos);
  }
  {
    TempFile img("bad input header.idx3", be32(2051) + be32(2));
    const std::string m = error_of([&] { read_idx_images(img.path(), lab.path()); });
    CHECK(m.find("'" + img.path() + "': truncated idx header") != std::string::npos);
  }
  {
    TempFile img("bad input huge.idx3", be32(2051) + be32(0xFFFFFFFFu) + be32(0xFFFFFFFFu) + be32(0xFFFFFFFFu));
    const std::string m = error_of([&] { read_idx_images(img.path(), lab.path()); });
    CHECK(m.find("'" + img.path() + "': truncated idx data") != std::string::npos);
  }
  {
    TempFile img("ok.idx3", be32(2051) + be32(2) + be32(2) + be32(3) + pixels);
    TempFile lab3("bad input count.idx1", be32(2049) + be32(3) + std::string("\x01\x02\x03", 3));
    const std::string m = error_of([&] { read_idx_images(img.path(), lab3.path()); });
    CHECK(m.find("holds 2 images but '" + lab3.path() + "' holds 3 labels") != std::string::npos);
  }
  {
    TempFile img("bad input gzip.idx3.gz", std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x01\x02", 12));
    const std::string m = error_of([&] { read_idx_images(img.path(), lab.path()); });
    CHECK(m.find("'" + img.path() + "': corrupt") != std::string::npos);
  }
}

TEST_CASE("read_idx_images: Fashion-MNIST from Debian's dataset-fashion-mnist") {
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    REQUIRE_MESSAGE(std::filesystem::exists(kFashionDir + f), "missing ", kFashionDir, f,
                    ": install the Debian package dataset-fashion-mnist (scripts/install-deps.sh)");
  }
  const ImageDataset test = read_idx_images(kFashionDir + "t10k-images-idx3-ubyte.gz",
                                            kFashionDir + "t10k-labels-idx1-ubyte.gz");
  CHECK(test.count == 10000);
  CHECK(test.rows == 28);
  CHECK(test.cols == 28);
  CHECK(test.pixels.size() == 10000u * 28u * 28u);
  std::vector<std::size_t> per_class(10);
  for (auto l : test.labels) {
    REQUIRE((l >= 0 && l < 10));
    ++per_class[static_cast<std::size_t>(l)];
  }
  CHECK(per_class == std::vector<std::size_t>(10, 1000));
  CHECK(test.labels[0] == 9);  // the first test image is an ankle boot
  CHECK(*std::max_element(test.pixels.begin(), test.pixels.end()) == 1.0f);

  const ImageDataset train = read_idx_images(kFashionDir + "train-images-idx3-ubyte.gz",
                                             kFashionDir + "train-labels-idx1-ubyte.gz");
  CHECK(train.count == 60000);
  CHECK(train.rows == 28);
  CHECK(train.cols == 28);
  CHECK(train.labels.size() == 60000u);
  CHECK(std::count(train.labels.begin(), train.labels.end(), 0) == 6000);
}
