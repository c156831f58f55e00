// graphmoe/train/tokenizers.hpp: the word-level tokenizer of the WikiText language-modelling
// setup, and a byte-level character tokenizer.
//
// WordTokenizer (WikiText-103 / WikiText-2 "wiki.*.tokens", as in Merity et al. 2016 and the
// AWD-LSTM / Transformer-XL data loaders): a line is split at ASCII whitespace and every line,
// empty ones included, ends with the end-of-line token "<eos>".
//   ids 0 and 1      "<unk>" and "<eos>", always present (the corpus's own "<unk>" tokens map to 0)
//   ids 2, 3, ...    the other words of the training file by descending count, ties by first
//                    occurrence; words seen fewer than min_count times, and those beyond max_size
//                    entries in all (max_size 0: no limit), are left out and encode as <unk>
// Saved as text: the line "graphmoe::WordTokenizer v1 <size>", then one word per line in id order.
//
// CharTokenizer: id 0 is "<unk>", ids 1, 2, ... the distinct bytes of the training file in
// increasing byte order. Bytes not in the vocabulary encode as 0. Saved as text: the line
// "graphmoe::CharTokenizer v1 <size>", then the byte value (decimal) of ids 1.. one per line.
//
// TextNormalisation: how a line is read before it is split (both tokenizers apply it to what they
// build from and encode, so that a prompt typed as plain text reads as the training text did):
//   lowercase    ASCII A-Z become a-z
//   split_punct  (word level) each of . , ; : ! ? ( ) becomes a word of its own, and "'s" at the
//                end of a word is split off as the word "'s" (as scripts/prepare-kjv.sh prepared
//                the King James Bible: text already split that way reads the same)
// Its name() is "none", "lower", "punct" or "lower,punct"; parse() reads those back.
//
// fingerprint() (either tokenizer): "fnv1a64:" and 16 hex digits of the FNV-1a hash of its kind,
// its normalisation's name and its entries in id order: two vocabularies of the same size but other
// words, or another normalisation, have different fingerprints (train_lm records it in every
// checkpoint, generate checks it against the --vocab it is given).
//
// Files are read as bytes; "word" and "character" mean byte strings and bytes (UTF-8 text keeps
// its multi-byte characters as several byte ids in CharTokenizer). Every error is a
// graphmoe::Error naming the file, and the line (1-based) for malformed vocabulary files.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/train/files.hpp"

namespace graphmoe {

namespace detail {

// Transparent hashing, so that lookups by string_view do not allocate.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Calls f(std::string_view line) for every line of a file read in chunks (as for_each_line, but
// without holding the whole file: WikiText-103's training split is 540 MB).
template <class F>
void for_each_file_line(const char* op, const std::string& path, F&& f) {
  require_regular_file(op, path);
  std::ifstream in(path, std::ios::binary);
  GRAPHMOE_CHECK(in.is_open(), op, "cannot open '", path, "'");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    f(std::string_view(line));
  }
  GRAPHMOE_CHECK(!in.bad(), op, "error while reading '", path, "'");
}

// FNV-1a, 64 bits (the vocabularies' fingerprints).
class Fnv1a64 {
 public:
  void add(std::string_view s) {
    for (char c : s) {
      h_ ^= static_cast<unsigned char>(c);
      h_ *= 0x100000001b3ull;
    }
  }
  std::string hex() const {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out = "fnv1a64:";
    for (int shift = 60; shift >= 0; shift -= 4) out += digits[(h_ >> shift) & 0xf];
    return out;
  }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

inline bool is_word_byte(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// The header line of a saved vocabulary: "<magic> v1 <size>"; returns size.
inline std::size_t parse_vocab_header(const char* op, const std::string& path,
                                      std::string_view line, std::string_view magic) {
  std::vector<std::string_view> parts;
  for_each_word(line, [&](std::string_view w) { parts.push_back(w); });
  long long n = 0;
  if (parts.size() != 3 || parts[0] != magic || parts[1] != "v1" ||
      !parse_int(parts[2], 1, (1ll << 31) - 1, n))
    parse_error(op, path, 1, "expected the header '", magic, " v1 <size>', found ", quoted(line));
  return static_cast<std::size_t>(n);
}

}  // namespace detail

struct TextNormalisation {
  bool lowercase = false;
  bool split_punct = false;

  bool none() const { return !lowercase && !split_punct; }
  std::string name() const {
    if (none()) return "none";
    if (lowercase && split_punct) return "lower,punct";
    return lowercase ? "lower" : "punct";
  }
  // "none", "lower", "punct", "lower,punct" (or "punct,lower"); anything else throws naming it.
  static TextNormalisation parse(std::string_view name) {
    TextNormalisation n;
    if (name == "none") return n;
    n.lowercase = name == "lower" || name == "lower,punct" || name == "punct,lower";
    n.split_punct = name == "punct" || name == "lower,punct" || name == "punct,lower";
    GRAPHMOE_CHECK(!n.none(), "TextNormalisation", "unknown normalisation '", name,
                   "': expected none, lower, punct or lower,punct");
    return n;
  }
  // The line as the tokenizer reads it (see the header comment).
  std::string apply(std::string_view line) const {
    std::string out;
    out.reserve(line.size() + line.size() / 4);
    for (std::size_t i = 0; i < line.size(); ++i) {
      char c = line[i];
      if (lowercase && c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      if (split_punct) {
        if (std::string_view(".,;:!?()").find(c) != std::string_view::npos) {
          out += ' ';
          out += c;
          out += ' ';
          continue;
        }
        // "'s" ending a word: split off (followed by a byte that is not a letter, digit or _)
        if (c == '\'' && i + 1 < line.size() && (line[i + 1] == 's' || (lowercase && line[i + 1] == 'S')) &&
            (i + 2 == line.size() || !detail::is_word_byte(line[i + 2]))) {
          out += " 's";
          ++i;
          continue;
        }
      }
      out += c;
    }
    return out;
  }
  bool operator==(const TextNormalisation&) const = default;
};

class WordTokenizer {
 public:
  static constexpr std::string_view kUnk = "<unk>";
  static constexpr std::string_view kEos = "<eos>";

  WordTokenizer() { add("<unk>"); add("<eos>"); }

  // The vocabulary of the training file at `train_path` (see the header comment).
  static WordTokenizer build(const std::string& train_path, std::size_t max_size = 0,
                             std::size_t min_count = 1, TextNormalisation norm = {}) {
    GRAPHMOE_CHECK(max_size == 0 || max_size >= 2, "WordTokenizer::build", "max_size ", max_size,
                   " leaves no room for <unk> and <eos> (use 0 for no limit)");
    GRAPHMOE_CHECK(min_count >= 1, "WordTokenizer::build", "min_count must be at least 1");
    std::unordered_map<std::string, std::size_t, detail::StringHash, std::equal_to<>> counts;
    std::vector<const std::string*> order;  // words by first occurrence
    std::string normalised;
    detail::for_each_file_line("WordTokenizer::build", train_path, [&](std::string_view line) {
      if (!norm.none()) line = normalised = norm.apply(line);
      detail::for_each_word(line, [&](std::string_view w) {
        if (w == kUnk || w == kEos) return;
        auto it = counts.find(w);
        if (it == counts.end()) {
          it = counts.emplace(std::string(w), 0).first;
          order.push_back(&it->first);
        }
        ++it->second;
      });
    });
    std::vector<std::pair<const std::string*, std::size_t>> words;  // (word, count)
    words.reserve(order.size());
    for (const std::string* w : order) {
      const std::size_t c = counts.find(*w)->second;
      if (c >= min_count) words.emplace_back(w, c);
    }
    // Stable sort by descending count keeps the first-occurrence order among ties.
    std::stable_sort(words.begin(), words.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
    WordTokenizer tok;
    tok.norm_ = norm;
    for (const auto& entry : words) {
      if (max_size != 0 && tok.size() >= max_size) break;
      tok.add(*entry.first);
    }
    return tok;
  }

  // Every line of the file, each followed by eos().
  std::vector<std::int32_t> encode_file(const std::string& path) const {
    std::vector<std::int32_t> ids;
    detail::for_each_file_line("WordTokenizer::encode_file", path, [&](std::string_view line) {
      append(line, ids);
      ids.push_back(eos());
    });
    return ids;
  }
  // The words of one line, without eos().
  std::vector<std::int32_t> encode_line(std::string_view line) const {
    std::vector<std::int32_t> ids;
    append(line, ids);
    return ids;
  }
  std::string decode(std::int32_t id) const {
    GRAPHMOE_CHECK(id >= 0 && static_cast<std::size_t>(id) < words_.size(),
                   "WordTokenizer::decode", "id ", id, " out of range [0, ", words_.size(), ")");
    return words_[static_cast<std::size_t>(id)];
  }
  // Words joined by single spaces; eos() becomes a newline.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string s;
    bool line_start = true;
    for (std::int32_t id : ids) {
      if (id == eos()) {
        s += '\n';
        line_start = true;
        continue;
      }
      if (!line_start) s += ' ';
      s += decode(id);
      line_start = false;
    }
    return s;
  }
  // The id of w, unk() for a word outside the vocabulary.
  std::int32_t id(std::string_view w) const {
    const auto it = ids_.find(w);
    return it == ids_.end() ? unk() : it->second;
  }
  bool contains(std::string_view w) const { return ids_.find(w) != ids_.end(); }
  std::size_t size() const { return words_.size(); }
  std::int32_t unk() const { return 0; }
  std::int32_t eos() const { return 1; }
  const std::vector<std::string>& words() const { return words_; }
  // The normalisation encode_file and encode_line apply (a loaded vocabulary file does not hold
  // it: train_lm records it in the checkpoint, and generate sets it from there).
  const TextNormalisation& normalisation() const { return norm_; }
  void set_normalisation(TextNormalisation n) { norm_ = n; }
  std::string fingerprint() const {
    detail::Fnv1a64 h;
    h.add("graphmoe::WordTokenizer\n");
    h.add(norm_.name());
    for (const std::string& w : words_) {
      h.add("\n");
      h.add(w);
    }
    return h.hex();
  }

  void save(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    GRAPHMOE_CHECK(out.is_open(), "WordTokenizer::save", "cannot open '", path, "' for writing");
    out << "graphmoe::WordTokenizer v1 " << words_.size() << '\n';
    for (const std::string& w : words_) out << w << '\n';
    out.flush();
    GRAPHMOE_CHECK(out.good(), "WordTokenizer::save", "error while writing '", path, "'");
  }
  static WordTokenizer load(const std::string& path) {
    constexpr const char* op = "WordTokenizer::load";
    const std::string text = detail::read_file(op, path);
    WordTokenizer tok;
    tok.words_.clear();
    tok.ids_.clear();
    std::size_t expected = 0, last_line = 0;
    for_each_line(text, [&](std::string_view line, std::size_t n) {
      last_line = n;
      if (n == 1) {
        expected = detail::parse_vocab_header(op, path, line, "graphmoe::WordTokenizer");
        return;
      }
      if (tok.words_.size() == expected)
        detail::parse_error(op, path, n, "more words than the ", expected, " in the header");
      if (line.empty()) detail::parse_error(op, path, n, "empty word");
      for (char c : line)
        if (detail::is_space(c))
          detail::parse_error(op, path, n, "word ", detail::quoted(line), " holds whitespace");
      if (tok.contains(line))
        detail::parse_error(op, path, n, "word ", detail::quoted(line), " appears twice");
      const std::size_t id = tok.words_.size();
      if ((id == 0 && line != kUnk) || (id == 1 && line != kEos))
        detail::parse_error(op, path, n, "id ", id, " must be ", id == 0 ? kUnk : kEos,
                            ", found ", detail::quoted(line));
      tok.add(std::string(line));
    });
    if (last_line == 0) detail::parse_error(op, path, 1, "empty file");
    if (tok.words_.size() != expected || expected < 2)
      detail::parse_error(op, path, last_line, "the header announces ", expected,
                          " words, the file holds ", tok.words_.size());
    return tok;
  }

 private:
  void add(std::string w) {
    const auto id = static_cast<std::int32_t>(words_.size());
    ids_.emplace(w, id);
    words_.push_back(std::move(w));
  }
  void append(std::string_view line, std::vector<std::int32_t>& ids) const {
    if (!norm_.none()) {
      const std::string n = norm_.apply(line);
      detail::for_each_word(n, [&](std::string_view w) { ids.push_back(id(w)); });
      return;
    }
    detail::for_each_word(line, [&](std::string_view w) { ids.push_back(id(w)); });
  }

  TextNormalisation norm_;
  std::vector<std::string> words_;
  std::unordered_map<std::string, std::int32_t, detail::StringHash, std::equal_to<>> ids_;
};

class CharTokenizer {
 public:
  CharTokenizer() { table_.fill(0); }

  // Vocabulary: <unk> and the distinct bytes of the file at `train_path`.
  // norm: lowercase only (splitting punctuation is word level).
  static CharTokenizer build(const std::string& train_path, TextNormalisation norm = {}) {
    GRAPHMOE_CHECK(!norm.split_punct, "CharTokenizer::build",
                   "the normalisation '", norm.name(), "' splits punctuation into words: a "
                   "character-level vocabulary takes none or lower");
    const std::string text = detail::read_file("CharTokenizer::build", train_path);
    std::array<bool, 256> seen{};
    for (char c : text) seen[static_cast<unsigned char>(lower(norm, c))] = true;
    CharTokenizer tok;
    tok.norm_ = norm;
    for (int b = 0; b < 256; ++b)
      if (seen[static_cast<std::size_t>(b)]) tok.add(static_cast<unsigned char>(b));
    return tok;
  }

  // Every byte of the file (newlines included).
  std::vector<std::int32_t> encode_file(const std::string& path) const {
    return encode(detail::read_file("CharTokenizer::encode_file", path));
  }
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = id(lower(norm_, text[i]));
    return ids;
  }
  const TextNormalisation& normalisation() const { return norm_; }
  void set_normalisation(TextNormalisation n) {
    GRAPHMOE_CHECK(!n.split_punct, "CharTokenizer", "the normalisation '", n.name(),
                   "' splits punctuation into words: a character-level vocabulary takes none or lower");
    norm_ = n;
  }
  std::string fingerprint() const {
    detail::Fnv1a64 h;
    h.add("graphmoe::CharTokenizer\n");
    h.add(norm_.name());
    h.add("\n");
    for (unsigned char b : bytes_) h.add(std::string_view(reinterpret_cast<const char*>(&b), 1));
    return h.hex();
  }
  // The byte of `id` as a one-byte string; "<unk>" for unk().
  std::string decode(std::int32_t id) const {
    GRAPHMOE_CHECK(id >= 0 && static_cast<std::size_t>(id) < size(), "CharTokenizer::decode",
                   "id ", id, " out of range [0, ", size(), ")");
    if (id == unk()) return "<unk>";
    return std::string(1, static_cast<char>(bytes_[static_cast<std::size_t>(id) - 1]));
  }
  // The bytes of ids concatenated (unk() as "<unk>").
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string s;
    s.reserve(ids.size());
    for (std::int32_t i : ids) s += decode(i);
    return s;
  }
  std::int32_t id(char c) const { return table_[static_cast<unsigned char>(c)]; }
  std::size_t size() const { return bytes_.size() + 1; }
  std::int32_t unk() const { return 0; }

  void save(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    GRAPHMOE_CHECK(out.is_open(), "CharTokenizer::save", "cannot open '", path, "' for writing");
    out << "graphmoe::CharTokenizer v1 " << size() << '\n';
    for (unsigned char b : bytes_) out << static_cast<int>(b) << '\n';
    out.flush();
    GRAPHMOE_CHECK(out.good(), "CharTokenizer::save", "error while writing '", path, "'");
  }
  static CharTokenizer load(const std::string& path) {
    constexpr const char* op = "CharTokenizer::load";
    const std::string text = detail::read_file(op, path);
    CharTokenizer tok;
    std::size_t expected = 0, last_line = 0;
    for_each_line(text, [&](std::string_view line, std::size_t n) {
      last_line = n;
      if (n == 1) {
        expected = detail::parse_vocab_header(op, path, line, "graphmoe::CharTokenizer");
        return;
      }
      if (tok.size() == expected)
        detail::parse_error(op, path, n, "more entries than the ", expected, " in the header");
      long long b = 0;
      if (!detail::parse_int(line, 0, 255, b))
        detail::parse_error(op, path, n, "expected a byte value 0-255, found ", detail::quoted(line));
      if (!tok.bytes_.empty() && static_cast<long long>(tok.bytes_.back()) >= b)
        detail::parse_error(op, path, n, "byte values must increase, ", b, " follows ",
                            static_cast<int>(tok.bytes_.back()));
      tok.add(static_cast<unsigned char>(b));
    });
    if (last_line == 0) detail::parse_error(op, path, 1, "empty file");
    if (tok.size() != expected)
      detail::parse_error(op, path, last_line, "the header announces ", expected,
                          " entries, the file holds ", tok.size());
    return tok;
  }

 private:
  void add(unsigned char b) {
    bytes_.push_back(b);
    table_[b] = static_cast<std::int32_t>(bytes_.size());
  }

  static char lower(const TextNormalisation& n, char c) {
    return n.lowercase && c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
  }

  TextNormalisation norm_;
  std::vector<unsigned char> bytes_;           // bytes_[id - 1]
  std::array<std::int32_t, 256> table_{};      // byte -> id, 0 when absent
};

}  // namespace graphmoe
