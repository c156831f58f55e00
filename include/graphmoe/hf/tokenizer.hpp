// graphmoe/hf/tokenizer.hpp: the tokenizer of a Hugging Face model directory (tokenizer.json, the
// format of the `tokenizers` library), encoding and decoding as that library does.
//
//   auto tok = hf::load_tokenizer("dir");              // tokenizer.json, else tokenizer.model
//   std::vector<std::int32_t> ids = tok->encode("In the beginning");  // with the bos it adds
//   std::string text = tok->decode(ids, /*skip_special_tokens=*/true);
//   hf::StreamDecoder stream(*tok);                    // generation: one id at a time
//   std::cout << stream.step(id);                      // only whole UTF-8 characters
//
// What tokenizer.json may hold (anything else is refused, naming the file and the JSON path):
//   normalizer      null, NFC / NFD / NFKC / NFKD (utf8proc), Prepend, Replace (String or Regex
//                   pattern), Sequence of these
//   pre_tokenizer   null, ByteLevel (add_prefix_space, use_regex: GPT-2's regex), Split (Regex or
//                   String pattern; behavior Removed, Isolated, MergedWithPrevious,
//                   MergedWithNext, Contiguous; invert), Metaspace (replacement, prepend_scheme
//                   first / always / never or the older add_prefix_space, split), Sequence
//   model           BPE: vocab, merges ("a b" strings or ["a", "b"] pairs), unk_token, fuse_unk,
//                   byte_fallback (<0xNN> tokens), ignore_merges; dropout null or 0, no
//                   continuing_subword_prefix / end_of_word_suffix
//   added_tokens    split off first, leftmost-longest, the non-normalized ones on the raw text,
//                   the normalized ones on each normalized piece; lstrip, rstrip, single_word
//   post_processor  null, ByteLevel (no effect on ids), TemplateProcessing (its "single"
//                   template), Sequence of these
//   decoder         null (tokens joined by spaces), ByteLevel, Metaspace, Replace, ByteFallback,
//                   Fuse, Strip, Sequence of these
//   truncation and padding must be null (they would change encode's output).
// Regular expressions run in PCRE2 (UTF and UCP mode) where the `tokenizers` library uses
// Oniguruma: GPT-2's, Qwen2's and Llama-3's patterns behave the same in both. single_word's
// "word character" is a letter or a number (Unicode categories L and N) or '_'.
//
// Ids: encode returns ids in [0, vocab_size()); decode refuses an id outside it, or one that
// names no token (a gap in the vocabulary). encode refuses text that is not valid UTF-8.
// Special ids (bos_id, eos_id, pad_id): load_tokenizer reads tokenizer_config.json's bos_token /
// eos_token / pad_token (strings or {"content": ...} objects), else special_tokens_map.json's,
// else config.json's bos_token_id / eos_token_id (the first of a list) / pad_token_id; for a
// tokenizer.model without them, sentencepiece's own bos / eos / pad ids.
//
// StreamDecoder: the text that is complete after each id, as the library's DecodeStream: it
// decodes a window of the last ids and returns what is new once it does not end in U+FFFD (an
// incomplete UTF-8 sequence); finish() returns what is left (with U+FFFD for bytes that never
// completed a character).
//
// graphmoe/hf/sentencepiece.hpp adds tokenizer.model files (libsentencepiece); without it,
// load_tokenizer refuses a directory that has only tokenizer.model, saying so.
// Errors: graphmoe::Error "graphmoe::hf::load_tokenizer: '<file>': <json path>: ..." and
// "graphmoe::hf::Tokenizer::encode / decode: ...". Link: libpcre2-8 and libutf8proc (the CMake
// target graphmoe::hf_tokenizer).
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>
#include <sys/stat.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/hf/json.hpp"
#include "graphmoe/train/files.hpp"

namespace graphmoe::hf {

// The ids of the special tokens a model directory names (absent when it names none).
struct SpecialTokenIds {
  std::optional<std::int32_t> bos, eos, pad;
};

// The limits of what a tokenizer file may ask for (refused above them, before any allocation).
struct TokenizerLimits {
  static constexpr std::int64_t file_bytes = std::int64_t(1) << 30;  // tokenizer.json: 1 GiB
  static constexpr std::int64_t vocab_size = std::int64_t(1) << 22;  // 4,194,304 ids
  static constexpr std::size_t token_bytes = 1 << 16;                // one token's text
  static constexpr int nesting = 16;                                 // Sequence in Sequence
};

// The common interface of the tokenizers load_tokenizer returns.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of text (valid UTF-8); add_special_tokens: what the post-processor adds (a bos).
  virtual std::vector<std::int32_t> encode(std::string_view text,
                                           bool add_special_tokens = true) const = 0;
  // The text of ids; skip_special_tokens leaves out the special tokens' text.
  virtual std::string decode(std::span<const std::int32_t> ids,
                             bool skip_special_tokens = false) const = 0;
  // One more than the largest id.
  virtual std::int32_t vocab_size() const = 0;
  virtual std::optional<std::int32_t> token_to_id(std::string_view token) const = 0;
  // The token's text as the file spells it ("" for an id that names no token).
  virtual std::string id_to_token(std::int32_t id) const = 0;
  virtual bool is_special(std::int32_t id) const = 0;

  std::optional<std::int32_t> bos_id() const { return special_.bos; }
  std::optional<std::int32_t> eos_id() const { return special_.eos; }
  std::optional<std::int32_t> pad_id() const { return special_.pad; }
  const SpecialTokenIds& special_ids() const { return special_; }
  void set_special_ids(const SpecialTokenIds& s) { special_ = s; }
  // The file read.
  const std::string& path() const { return path_; }

 protected:
  SpecialTokenIds special_;
  std::string path_;
};

namespace detail {

// ---- UTF-8 -------------------------------------------------------------------------------------

// The length of the valid UTF-8 character at s[i], or 0 when s[i..] does not start with one.
inline std::size_t utf8_char_len(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
  else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
  else return 0;
  if (i + n > s.size()) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

// The byte offset of the first invalid UTF-8 byte, or npos.
inline std::size_t utf8_invalid_at(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_char_len(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

inline std::uint32_t utf8_decode_at(std::string_view s, std::size_t i, std::size_t n) {
  const auto b = [&](std::size_t k) { return static_cast<std::uint32_t>(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (n == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

inline void utf8_append(std::string& out, std::uint32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Bytes as UTF-8 text, each maximal invalid subpart replaced by U+FFFD (Rust's from_utf8_lossy).
inline std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_char_len(s, i);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    // The maximal prefix of a valid sequence: the lead byte and the continuation bytes that fit.
    const unsigned char c = static_cast<unsigned char>(s[i]);
    std::size_t want = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) want = 2;
    else if (c >= 0xE0 && c <= 0xEF) { want = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { want = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    std::size_t k = 1;
    while (want > 0 && k < want && i + k < s.size()) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      const bool ok = k == 1 ? (d >= lo && d <= hi) : (d >= 0x80 && d <= 0xBF);
      if (!ok) break;
      ++k;
    }
    out += kReplacementChar;
    i += k;
  }
  return out;
}

// Calls f(code_point, byte_offset, byte_length) for each character of valid UTF-8 text.
template <class F>
void for_each_char(std::string_view s, F&& f) {
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n = utf8_char_len(s, i);
    if (n == 0) n = 1;  // not reached for validated text
    f(utf8_decode_at(s, i, n), i, n);
    i += n;
  }
}

// Rust's char::is_whitespace (the White_Space property).
inline bool is_unicode_space(std::uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}
// A letter or a number (Unicode categories L*, N*), or '_'.
inline bool is_word_char(std::uint32_t c) {
  if (c == '_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO: return true;
    default: return false;
  }
}
inline std::uint32_t last_char(std::string_view s) {
  std::size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i == 0) return 0;
  --i;
  const std::size_t n = utf8_char_len(s, i);
  return n == 0 ? 0 : utf8_decode_at(s, i, n);
}

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the others for 256 + n.
struct ByteLevelMap {
  std::uint32_t to_char[256];
  std::int16_t to_byte[324];
  ByteLevelMap() {
    std::fill(std::begin(to_byte), std::end(to_byte), std::int16_t(-1));
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      to_char[b] = printable ? static_cast<std::uint32_t>(b) : static_cast<std::uint32_t>(256 + n++);
      to_byte[to_char[b]] = static_cast<std::int16_t>(b);
    }
  }
  static const ByteLevelMap& get() {
    static const ByteLevelMap m;
    return m;
  }
};

// ---- PCRE2 -------------------------------------------------------------------------------------

// A compiled pattern (UTF + UCP; literal for the String patterns); finds all its matches.
class Regex {
 public:
  Regex() = default;
  // Throws error(message) when PCRE2 refuses the pattern.
  template <class OnError>
  Regex(const std::string& pattern, bool literal, OnError&& error) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    const std::uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
    pcre2_code_8* re = pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(pattern.data()),
                                       pattern.size(), options, &code, &offset, nullptr);
    if (re == nullptr) {
      PCRE2_UCHAR8 msg[256];
      pcre2_get_error_message_8(code, msg, sizeof msg);
      error(std::string("PCRE2 refuses the pattern at offset ") + std::to_string(offset) + ": " +
            reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile_8(re, PCRE2_JIT_COMPLETE);  // best effort: the interpreter otherwise
    code_.reset(re, [](pcre2_code_8* p) { pcre2_code_free_8(p); });
  }
  bool empty() const { return !code_; }
  // The (begin, end) byte offsets of the non-overlapping matches in s, left to right; after an
  // empty match the search goes on one character later.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<std::size_t, std::size_t>> out;
    std::unique_ptr<pcre2_match_data_8, void (*)(pcre2_match_data_8*)> md(
        pcre2_match_data_create_from_pattern_8(code_.get(), nullptr),
        [](pcre2_match_data_8* p) { pcre2_match_data_free_8(p); });
    GRAPHMOE_CHECK(md != nullptr, "hf::Tokenizer::encode", "out of memory for a PCRE2 match");
    std::size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match_8(code_.get(), reinterpret_cast<PCRE2_SPTR8>(s.data()), s.size(),
                                   at, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR8 msg[256];
        pcre2_get_error_message_8(rc, msg, sizeof msg);
        graphmoe::detail::throw_error("hf::Tokenizer::encode", "PCRE2 match failed: ",
                                      reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer_8(md.get());
      const std::size_t b = ov[0], e = ov[1];
      out.emplace_back(b, e);
      if (e > b) {
        at = e;
      } else {
        if (e >= s.size()) break;
        const std::size_t n = utf8_char_len(s, e);
        at = e + (n == 0 ? 1 : n);
      }
    }
    return out;
  }

 private:
  std::shared_ptr<pcre2_code_8> code_;
};

inline const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- the pipeline's parts ----------------------------------------------------------------------

struct TransparentHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, std::int32_t, TransparentHash, std::equal_to<>>;

// One piece of the text on its way through the pipeline.
struct Piece {
  std::string text;
  bool at_start = false;    // begins at offset 0 of the original text (Metaspace "first")
  std::int32_t added = -1;  // the id of the added token it is, or -1
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct NormalizerStep {
  enum Kind { NFC, NFD, NFKC, NFKD, Prepend, Replace } kind = NFC;
  std::string text, content;  // Prepend: text; Replace: text (literal) or regex -> content
  Regex regex;
};

struct PreTokenizerStep {
  enum Kind { ByteLevel, Split, Metaspace } kind = ByteLevel;
  bool add_prefix_space = false, use_regex = true;      // ByteLevel
  Regex regex;                                          // Split, ByteLevel's GPT-2 regex
  SplitBehavior behavior = SplitBehavior::Isolated;     // Split
  bool invert = false;                                  // Split
  std::string replacement;                              // Metaspace
  enum Scheme { Always, First, Never } scheme = Always;  // Metaspace
  bool split = true;                                    // Metaspace
};

struct DecoderStep {
  enum Kind { ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip } kind = ByteLevel;
  std::string from, to;  // Replace; Metaspace: from = replacement; Strip: from = content
  bool prepend = true;   // Metaspace: prepend_scheme != never
  std::size_t start = 0, stop = 0;  // Strip
};

// One item of TemplateProcessing's "single": special ids, or the sequence itself (ids empty).
struct TemplateItem {
  bool sequence = false;
  std::vector<std::int32_t> ids;
};

// A trie of added tokens' texts: the leftmost-longest match from a position.
class AddedTrie {
 public:
  void insert(std::string_view s, std::int32_t id) {
    int node = 0;
    for (unsigned char c : s) {
      int next = child(node, c);
      if (next < 0) {
        next = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
        nodes_[static_cast<std::size_t>(node)].children.emplace_back(c, next);
      }
      node = next;
    }
    nodes_[static_cast<std::size_t>(node)].id = id;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest match starting at i: (end, id), or end = 0 when none.
  std::pair<std::size_t, std::int32_t> longest_at(std::string_view s, std::size_t i) const {
    int node = 0;
    std::pair<std::size_t, std::int32_t> best{0, -1};
    for (std::size_t k = i; k < s.size(); ++k) {
      node = child(node, static_cast<unsigned char>(s[k]));
      if (node < 0) break;
      if (nodes_[static_cast<std::size_t>(node)].id >= 0)
        best = {k + 1, nodes_[static_cast<std::size_t>(node)].id};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> children;
    std::int32_t id = -1;
  };
  int child(int node, unsigned char c) const {
    for (const auto& [k, v] : nodes_[static_cast<std::size_t>(node)].children)
      if (k == c) return v;
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
};

struct AddedToken {
  std::int32_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// ---- reading the JSON --------------------------------------------------------------------------

inline constexpr const char* kLoadOp = "hf::load_tokenizer";

// One JSON object of the file: typed reads of its keys; finish() refuses a key left unread.
class JsonObject {
 public:
  JsonObject(const nlohmann::json& j, std::string file, std::string path)
      : j_(j), file_(std::move(file)), path_(std::move(path)) {
    if (!j_.is_object()) fail("is " + std::string(json_kind(j_)) + ", not an object");
  }
  [[noreturn]] void fail(const std::string& what) const { fail_at(path_, what); }
  [[noreturn]] void fail_at(const std::string& path, const std::string& what) const {
    graphmoe::detail::throw_error(kLoadOp, "'", file_, "': ", path, ": ", what);
  }
  std::string at(const std::string& key) const { return path_ + "." + key; }
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }

  const nlohmann::json* find(const std::string& key) {
    used_.insert(key);
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  const nlohmann::json& required(const std::string& key) {
    const nlohmann::json* v = find(key);
    if (v == nullptr) fail_at(at(key), "is missing");
    return *v;
  }
  std::string string(const std::string& key) {
    const nlohmann::json& v = required(key);
    if (!v.is_string()) fail_at(at(key), "is " + std::string(json_kind(v)) + ", not a string");
    return v.get<std::string>();
  }
  std::optional<std::string> string_or_null(const std::string& key) {
    const nlohmann::json* v = find(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    if (!v->is_string()) fail_at(at(key), "is " + std::string(json_kind(*v)) + ", not a string");
    return v->get<std::string>();
  }
  bool boolean(const std::string& key, std::optional<bool> fallback = std::nullopt) {
    const nlohmann::json* v = find(key);
    if ((v == nullptr || v->is_null()) && fallback) return *fallback;
    if (v == nullptr) fail_at(at(key), "is missing");
    if (!v->is_boolean())
      fail_at(at(key), "is " + std::string(json_kind(*v)) + ", not true or false");
    return v->get<bool>();
  }
  std::int64_t integer(const std::string& key, std::int64_t lo, std::int64_t hi) {
    const nlohmann::json& v = required(key);
    return integer_value(v, at(key), lo, hi);
  }
  std::int64_t integer_value(const nlohmann::json& v, const std::string& path, std::int64_t lo,
                             std::int64_t hi) const {
    if (!v.is_number_integer() && !v.is_number_unsigned())
      fail_at(path, "is " + std::string(json_kind(v)) + ", not an integer");
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
      fail_at(path, "= " + v.dump() + " is out of range [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
    const std::int64_t x = v.is_number_unsigned() ? static_cast<std::int64_t>(v.get<std::uint64_t>())
                                                  : v.get<std::int64_t>();
    if (x < lo || x > hi)
      fail_at(path, "= " + std::to_string(x) + " is out of range [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "]");
    return x;
  }
  // Keys nobody read: refused (they could change what the tokenizer does).
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (used_.count(it.key()) == 0)
        fail_at(at(it.key()), "is not understood by graphmoe's tokenizer (it could change the ids)");
  }

 private:
  const nlohmann::json& j_;
  std::string file_, path_;
  std::unordered_set<std::string> used_;
};

// A {"String": s} or {"Regex": r} pattern as a compiled Regex; literal_out tells which.
inline Regex read_pattern(JsonObject& parent, const std::string& key, std::string* literal_out) {
  JsonObject p(parent.required(key), parent.file(), parent.at(key));
  const bool has_string = p.find("String") != nullptr;
  const bool has_regex = p.find("Regex") != nullptr;
  if (has_string == has_regex) p.fail("must hold exactly one of \"String\" and \"Regex\"");
  const std::string k = has_string ? "String" : "Regex";
  const std::string text = p.string(k);
  if (text.size() > TokenizerLimits::token_bytes) p.fail_at(p.at(k), "is too long");
  p.finish();
  if (literal_out != nullptr) *literal_out = has_string ? text : std::string();
  if (has_string && text.empty()) p.fail_at(p.at(k), "is empty");
  return Regex(text, has_string, [&](const std::string& m) { p.fail_at(p.at(k), m); });
}

inline std::string type_of(JsonObject& o) { return o.string("type"); }

// A tokenizer file's bytes: a regular file of at most TokenizerLimits::file_bytes, read whole.
inline std::string read_tokenizer_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    graphmoe::detail::require_no_broken_link(kLoadOp, path);
    graphmoe::detail::throw_error(kLoadOp, "cannot open '", path, "'");
  }
  GRAPHMOE_CHECK(S_ISREG(st.st_mode), kLoadOp, "'", path, "' is not a regular file");
  GRAPHMOE_CHECK(st.st_size <= TokenizerLimits::file_bytes, kLoadOp, "'", path, "' is ",
                 st.st_size, " bytes, more than the limit of ", TokenizerLimits::file_bytes);
  return graphmoe::detail::read_file(kLoadOp, path);
}

}  // namespace detail

// A tokenizer.json tokenizer (BPE model); see the top of this file for what it reads.
class JsonTokenizer : public Tokenizer {
 public:
  // Reads and validates the file; throws graphmoe::Error naming the file and the JSON path.
  static std::unique_ptr<JsonTokenizer> from_file(const std::string& path) {
    return from_string(detail::read_tokenizer_file(path), path);
  }
  // The same from the file's text; `path` names it in errors.
  static std::unique_ptr<JsonTokenizer> from_string(std::string_view text, const std::string& path) {
    graphmoe::detail::check_json_depth(detail::kLoadOp, "'" + path + "'", text);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text.begin(), text.end());
    } catch (const nlohmann::json::exception& e) {
      graphmoe::detail::throw_error(detail::kLoadOp, "'", path, "': not valid JSON: ", e.what());
    }
    std::unique_ptr<JsonTokenizer> t(new JsonTokenizer());
    t->path_ = path;
    t->read(j);
    return t;
  }

  std::vector<std::int32_t> encode(std::string_view text,
                                   bool add_special_tokens = true) const override {
    const std::size_t bad = detail::utf8_invalid_at(text);
    GRAPHMOE_CHECK(bad == std::string_view::npos, "hf::Tokenizer::encode",
                   "the text is not valid UTF-8 (byte ", bad, ")");
    std::vector<detail::Piece> pieces;
    {
      detail::Piece whole{std::string(text), true, -1};
      split_added(whole, raw_trie_, pieces);
    }
    // The normalizer on each piece left, then the normalized added tokens.
    std::vector<detail::Piece> normalized;
    for (auto& p : pieces) {
      if (p.added >= 0) {
        normalized.push_back(std::move(p));
        continue;
      }
      p.text = normalize(p.text);
      split_added(p, normalized_trie_, normalized);
    }
    std::vector<std::int32_t> ids;
    std::vector<detail::Piece> words;
    for (auto& p : normalized) {
      if (p.added >= 0) {
        ids.push_back(p.added);
        continue;
      }
      words.clear();
      words.push_back(std::move(p));
      pre_tokenize(words);
      for (const auto& w : words) bpe(w.text, ids);
    }
    if (add_special_tokens) {
      for (const auto& tmpl : templates_) {
        std::vector<std::int32_t> out;
        for (const auto& item : tmpl) {
          if (item.sequence) out.insert(out.end(), ids.begin(), ids.end());
          else out.insert(out.end(), item.ids.begin(), item.ids.end());
        }
        ids = std::move(out);
      }
    }
    return ids;
  }

  std::string decode(std::span<const std::int32_t> ids,
                     bool skip_special_tokens = false) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int32_t id = ids[i];
      GRAPHMOE_CHECK(id >= 0 && id < vocab_size_ && !id_to_token_[static_cast<std::size_t>(id)].empty(),
                     "hf::Tokenizer::decode", "ids[", i, "] = ", id,
                     id >= 0 && id < vocab_size_ ? " names no token in '" : " is out of range for '",
                     path_, "' (vocabulary size ", vocab_size_, ")");
      if (skip_special_tokens && is_special(id)) continue;
      tokens.push_back(id_to_token_[static_cast<std::size_t>(id)]);
    }
    if (!has_decoder_) {
      std::string out;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0) out += ' ';
        out += tokens[i];
      }
      return out;
    }
    for (const auto& step : decoders_) decode_step(step, tokens);
    std::string out;
    for (const auto& t : tokens) out += t;
    return out;
  }

  std::int32_t vocab_size() const override { return vocab_size_; }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
    if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  std::string id_to_token(std::int32_t id) const override {
    if (id < 0 || id >= vocab_size_) return std::string();
    return id_to_token_[static_cast<std::size_t>(id)];
  }
  bool is_special(std::int32_t id) const override {
    if (id < 0 || id >= vocab_size_) return false;
    return special_contents_.count(id_to_token_[static_cast<std::size_t>(id)]) > 0;
  }

 private:
  JsonTokenizer() = default;

  // ---- loading ---------------------------------------------------------------------------------

  void read(const nlohmann::json& j) {
    detail::JsonObject top(j, path_, "$");
    if (const auto* v = top.find("version"); v != nullptr && !v->is_string() && !v->is_null())
      top.fail_at(top.at("version"), "is not a string");
    for (const char* k : {"truncation", "padding"}) {
      const auto* v = top.find(k);
      if (v != nullptr && !v->is_null())
        top.fail_at(top.at(k), "is set: graphmoe's tokenizer does not truncate or pad (use null)");
    }
    read_model(top);
    read_added_tokens(top);
    // vocab_size_ and id_to_token_ are complete: the rest may refer to ids.
    if (const auto* v = top.find("normalizer"); v != nullptr && !v->is_null())
      read_normalizer(*v, top.at("normalizer"), 0);
    if (const auto* v = top.find("pre_tokenizer"); v != nullptr && !v->is_null())
      read_pre_tokenizer(*v, top.at("pre_tokenizer"), 0);
    if (const auto* v = top.find("post_processor"); v != nullptr && !v->is_null())
      read_post_processor(*v, top.at("post_processor"), 0);
    if (const auto* v = top.find("decoder"); v != nullptr && !v->is_null()) {
      has_decoder_ = true;
      read_decoder(*v, top.at("decoder"), 0);
    }
    top.finish();
    // The normalized added tokens are matched in normalized text: their normalized content.
    for (const auto& a : added_)
      if (a.normalized) {
        const std::string n = normalize(a.content);
        if (!n.empty()) normalized_trie_.insert(n, a.id);
      }
  }

  void read_model(detail::JsonObject& top) {
    detail::JsonObject m(top.required("model"), path_, "$.model");
    const auto* type = m.find("type");
    if (type != nullptr) {
      const std::string t = m.string("type");
      if (t != "BPE")
        m.fail_at(m.at("type"), "is '" + t + "': graphmoe reads BPE models only (not WordPiece, "
                                "Unigram or WordLevel)");
    } else if (m.find("merges") == nullptr) {
      m.fail("has no \"type\" (graphmoe reads BPE models only)");
    }
    if (const auto* d = m.find("dropout"); d != nullptr && !d->is_null()) {
      if (!d->is_number() || d->get<double>() != 0.0)
        m.fail_at(m.at("dropout"), "is " + d->dump() + ": BPE dropout is not supported (use null)");
    }
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const auto s = m.string_or_null(k);
      if (s && !s->empty()) m.fail_at(m.at(k), "is '" + *s + "': not supported (use null)");
    }
    fuse_unk_ = m.boolean("fuse_unk", false);
    byte_fallback_ = m.boolean("byte_fallback", false);
    ignore_merges_ = m.boolean("ignore_merges", false);
    const auto unk = m.string_or_null("unk_token");

    const nlohmann::json& vocab = m.required("vocab");
    if (!vocab.is_object())
      m.fail_at(m.at("vocab"), std::string("is ") + detail::json_kind(vocab) + ", not an object");
    if (static_cast<std::int64_t>(vocab.size()) > TokenizerLimits::vocab_size)
      m.fail_at(m.at("vocab"), "has " + std::to_string(vocab.size()) + " tokens, more than the limit of " +
                                   std::to_string(TokenizerLimits::vocab_size));
    vocab_.reserve(vocab.size());
    std::int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const std::string where = m.at("vocab") + "[\"" + detail_quote(it.key()) + "\"]";
      const std::int64_t id = m.integer_value(it.value(), where, 0, TokenizerLimits::vocab_size - 1);
      check_token_text(m, where, it.key());
      vocab_.emplace(it.key(), static_cast<std::int32_t>(id));
      max_id = std::max(max_id, id);
    }
    id_to_token_.assign(static_cast<std::size_t>(max_id + 1), std::string());
    for (const auto& [tok, id] : vocab_) {
      std::string& slot = id_to_token_[static_cast<std::size_t>(id)];
      if (!slot.empty())
        m.fail_at(m.at("vocab"), "id " + std::to_string(id) + " is given to two tokens, '" + slot +
                                     "' and '" + tok + "'");
      slot = tok;
    }
    vocab_size_ = static_cast<std::int32_t>(max_id + 1);
    if (unk) {
      auto it = vocab_.find(*unk);
      if (it == vocab_.end()) m.fail_at(m.at("unk_token"), "'" + *unk + "' is not in the vocabulary");
      unk_id_ = it->second;
    }
    if (byte_fallback_) {
      for (int b = 0; b < 256; ++b) {
        static const char* hex = "0123456789ABCDEF";
        const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
        auto it = vocab_.find(name);
        byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
      }
    }

    const nlohmann::json& merges = m.required("merges");
    if (!merges.is_array())
      m.fail_at(m.at("merges"), std::string("is ") + detail::json_kind(merges) + ", not an array");
    if (static_cast<std::int64_t>(merges.size()) > TokenizerLimits::vocab_size)
      m.fail_at(m.at("merges"), "has " + std::to_string(merges.size()) + " merges, more than the limit");
    merges_.reserve(merges.size());
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const std::string where = m.at("merges") + "[" + std::to_string(r) + "]";
      const nlohmann::json& e = merges[r];
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          m.fail_at(where, "'" + s + "' is not two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        m.fail_at(where, "is neither \"a b\" nor [\"a\", \"b\"]");
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end()) m.fail_at(where, "names '" + a + "', which is not in the vocabulary");
      if (ib == vocab_.end()) m.fail_at(where, "names '" + b + "', which is not in the vocabulary");
      if (iab == vocab_.end())
        m.fail_at(where, "makes '" + a + b + "', which is not in the vocabulary");
      merges_[merge_key(ia->second, ib->second)] = {static_cast<std::int32_t>(r), iab->second};
    }
    m.finish();
  }

  static std::string detail_quote(const std::string& s) {
    return s.size() > 40 ? s.substr(0, 37) + "..." : s;
  }
  static void check_token_text(const detail::JsonObject& o, const std::string& where,
                               const std::string& s) {
    if (s.empty()) o.fail_at(where, "is an empty token");
    if (s.size() > TokenizerLimits::token_bytes) o.fail_at(where, "is a token longer than the limit");
  }

  void read_added_tokens(detail::JsonObject& top) {
    const nlohmann::json* list = top.find("added_tokens");
    if (list == nullptr || list->is_null()) return;
    if (!list->is_array()) top.fail_at(top.at("added_tokens"), "is not an array");
    if (static_cast<std::int64_t>(list->size()) > TokenizerLimits::vocab_size)
      top.fail_at(top.at("added_tokens"), "has more entries than the limit");
    std::unordered_map<std::int32_t, std::size_t> by_id;
    std::int64_t max_added = -1;
    for (std::size_t i = 0; i < list->size(); ++i) {
      detail::JsonObject o((*list)[i], path_, "$.added_tokens[" + std::to_string(i) + "]");
      detail::AddedToken a;
      a.id = static_cast<std::int32_t>(o.integer("id", 0, TokenizerLimits::vocab_size - 1));
      a.content = o.string("content");
      check_token_text(o, o.at("content"), a.content);
      a.single_word = o.boolean("single_word", false);
      a.lstrip = o.boolean("lstrip", false);
      a.rstrip = o.boolean("rstrip", false);
      a.special = o.boolean("special", false);
      a.normalized = o.boolean("normalized", !a.special);
      o.finish();
      if (detail::utf8_invalid_at(a.content) != std::string_view::npos)
        o.fail_at(o.at("content"), "is not valid UTF-8");
      if (by_id.count(a.id) > 0)
        o.fail_at(o.at("id"), std::to_string(a.id) + " is also the id of $.added_tokens[" +
                                  std::to_string(by_id[a.id]) + "]");
      if (added_by_content_.count(a.content) > 0)
        o.fail_at(o.at("content"), "'" + a.content + "' is added twice");
      // The library numbers an added token itself (and only warns when the file says otherwise):
      // its id in the model's vocabulary, else the next after the model's and the added ones.
      std::int64_t expected = 0;
      if (auto it = vocab_.find(a.content); it != vocab_.end()) {
        expected = it->second;
      } else {
        const auto model_size = static_cast<std::int64_t>(vocab_.size());
        expected = max_added < 0 ? model_size : (max_added >= model_size ? max_added + 1 : model_size);
      }
      if (a.id != expected)
        o.fail_at(o.at("id"), std::to_string(a.id) + ", but the tokenizers library gives '" +
                                  a.content + "' the id " + std::to_string(expected));
      max_added = std::max<std::int64_t>(max_added, a.id);
      by_id[a.id] = i;
      added_index_.emplace(a.id, added_.size());
      added_by_content_.emplace(a.content, a.id);
      if (a.special) special_contents_.insert(a.content);
      if (!a.normalized) raw_trie_.insert(a.content, a.id);
      if (a.id >= vocab_size_) {
        vocab_size_ = a.id + 1;
        id_to_token_.resize(static_cast<std::size_t>(vocab_size_));
      }
      id_to_token_[static_cast<std::size_t>(a.id)] = a.content;
      added_.push_back(std::move(a));
    }
  }

  void check_depth(const detail::JsonObject& o, int depth) const {
    if (depth > TokenizerLimits::nesting) o.fail("nests Sequences deeper than the limit");
  }

  void read_normalizer(const nlohmann::json& j, const std::string& path, int depth) {
    detail::JsonObject o(j, path_, path);
    check_depth(o, depth);
    const std::string type = detail::type_of(o);
    detail::NormalizerStep s;
    if (type == "Sequence") {
      const nlohmann::json& list = o.required("normalizers");
      if (!list.is_array()) o.fail_at(o.at("normalizers"), "is not an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        read_normalizer(list[i], o.at("normalizers") + "[" + std::to_string(i) + "]", depth + 1);
      o.finish();
      return;
    } else if (type == "NFC") {
      s.kind = detail::NormalizerStep::NFC;
    } else if (type == "NFD") {
      s.kind = detail::NormalizerStep::NFD;
    } else if (type == "NFKC") {
      s.kind = detail::NormalizerStep::NFKC;
    } else if (type == "NFKD") {
      s.kind = detail::NormalizerStep::NFKD;
    } else if (type == "Prepend") {
      s.kind = detail::NormalizerStep::Prepend;
      s.text = o.string("prepend");
    } else if (type == "Replace") {
      s.kind = detail::NormalizerStep::Replace;
      s.regex = detail::read_pattern(o, "pattern", &s.text);
      s.content = o.string("content");
    } else {
      o.fail_at(o.at("type"), "is '" + type + "': graphmoe's tokenizer does not implement this "
                              "normalizer (it reads NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)");
    }
    o.finish();
    normalizers_.push_back(std::move(s));
  }

  void read_pre_tokenizer(const nlohmann::json& j, const std::string& path, int depth) {
    detail::JsonObject o(j, path_, path);
    check_depth(o, depth);
    const std::string type = detail::type_of(o);
    detail::PreTokenizerStep s;
    if (type == "Sequence") {
      const nlohmann::json& list = o.required("pretokenizers");
      if (!list.is_array()) o.fail_at(o.at("pretokenizers"), "is not an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        read_pre_tokenizer(list[i], o.at("pretokenizers") + "[" + std::to_string(i) + "]", depth + 1);
      o.finish();
      return;
    } else if (type == "ByteLevel") {
      s.kind = detail::PreTokenizerStep::ByteLevel;
      s.add_prefix_space = o.boolean("add_prefix_space", false);
      s.use_regex = o.boolean("use_regex", true);
      o.find("trim_offsets");  // offsets only
      if (s.use_regex)
        s.regex = detail::Regex(detail::kGpt2Pattern, false, [&](const std::string& m) { o.fail(m); });
    } else if (type == "Split") {
      s.kind = detail::PreTokenizerStep::Split;
      s.regex = detail::read_pattern(o, "pattern", nullptr);
      s.invert = o.boolean("invert", false);
      const std::string b = o.string("behavior");
      if (b == "Removed") s.behavior = detail::SplitBehavior::Removed;
      else if (b == "Isolated") s.behavior = detail::SplitBehavior::Isolated;
      else if (b == "MergedWithPrevious") s.behavior = detail::SplitBehavior::MergedWithPrevious;
      else if (b == "MergedWithNext") s.behavior = detail::SplitBehavior::MergedWithNext;
      else if (b == "Contiguous") s.behavior = detail::SplitBehavior::Contiguous;
      else o.fail_at(o.at("behavior"), "is '" + b + "', not a split behavior");
    } else if (type == "Metaspace") {
      s.kind = detail::PreTokenizerStep::Metaspace;
      read_metaspace(o, s.replacement, s.scheme, s.split);
    } else {
      o.fail_at(o.at("type"), "is '" + type + "': graphmoe's tokenizer does not implement this "
                              "pre-tokenizer (it reads ByteLevel, Split, Metaspace, Sequence)");
    }
    o.finish();
    pre_tokenizers_.push_back(std::move(s));
  }

  static void read_metaspace(detail::JsonObject& o, std::string& replacement,
                             detail::PreTokenizerStep::Scheme& scheme, bool& split) {
    replacement = o.string("replacement");
    std::size_t n = replacement.empty() ? 0 : detail::utf8_char_len(replacement, 0);
    if (n == 0 || n != replacement.size())
      o.fail_at(o.at("replacement"), "must be one character");
    split = o.boolean("split", true);
    o.find("str_rep");  // older files: the replacement again
    const auto* ps = o.find("prepend_scheme");
    const auto* aps = o.find("add_prefix_space");
    if (ps != nullptr && !ps->is_null()) {
      const std::string v = o.string("prepend_scheme");
      if (v == "always") scheme = detail::PreTokenizerStep::Always;
      else if (v == "first") scheme = detail::PreTokenizerStep::First;
      else if (v == "never") scheme = detail::PreTokenizerStep::Never;
      else o.fail_at(o.at("prepend_scheme"), "is '" + v + "', not first, always or never");
    } else if (aps != nullptr) {
      scheme = o.boolean("add_prefix_space") ? detail::PreTokenizerStep::Always
                                             : detail::PreTokenizerStep::Never;
    } else {
      scheme = detail::PreTokenizerStep::Always;
    }
  }

  void read_post_processor(const nlohmann::json& j, const std::string& path, int depth) {
    detail::JsonObject o(j, path_, path);
    check_depth(o, depth);
    const std::string type = detail::type_of(o);
    if (type == "Sequence") {
      const nlohmann::json& list = o.required("processors");
      if (!list.is_array()) o.fail_at(o.at("processors"), "is not an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        read_post_processor(list[i], o.at("processors") + "[" + std::to_string(i) + "]", depth + 1);
    } else if (type == "ByteLevel") {
      for (const char* k : {"add_prefix_space", "trim_offsets", "use_regex"}) o.find(k);  // offsets
    } else if (type == "TemplateProcessing") {
      read_template(o);
    } else {
      o.fail_at(o.at("type"), "is '" + type + "': graphmoe's tokenizer does not implement this "
                              "post-processor (it reads ByteLevel, TemplateProcessing, Sequence)");
    }
    o.finish();
  }

  void read_template(detail::JsonObject& o) {
    o.find("pair");  // pairs of sequences are not encoded
    // special_tokens: name -> ids.
    std::unordered_map<std::string, std::vector<std::int32_t>> specials;
    const nlohmann::json& st = o.required("special_tokens");
    if (!st.is_object()) o.fail_at(o.at("special_tokens"), "is not an object");
    for (auto it = st.begin(); it != st.end(); ++it) {
      detail::JsonObject e(it.value(), path_, o.at("special_tokens") + "[\"" + it.key() + "\"]");
      e.string("id");
      e.find("tokens");
      const nlohmann::json& ids = e.required("ids");
      if (!ids.is_array() || ids.size() > 64) e.fail_at(e.at("ids"), "is not an array of at most 64 ids");
      std::vector<std::int32_t> v;
      for (std::size_t k = 0; k < ids.size(); ++k) {
        const std::string where = e.at("ids") + "[" + std::to_string(k) + "]";
        const auto id = e.integer_value(ids[k], where, 0, std::max(0, vocab_size_ - 1));
        if (id >= vocab_size_ || id_to_token_[static_cast<std::size_t>(id)].empty())
          e.fail_at(where, "= " + std::to_string(id) + " names no token");
        v.push_back(static_cast<std::int32_t>(id));
      }
      e.finish();
      specials[it.key()] = std::move(v);
    }
    const nlohmann::json& single = o.required("single");
    if (!single.is_array()) o.fail_at(o.at("single"), "is not an array");
    std::vector<detail::TemplateItem> tmpl;
    int sequences = 0;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const std::string where = o.at("single") + "[" + std::to_string(i) + "]";
      detail::JsonObject item(single[i], path_, where);
      if (item.find("SpecialToken") != nullptr) {
        detail::JsonObject s(item.required("SpecialToken"), path_, item.at("SpecialToken"));
        const std::string id = s.string("id");
        s.find("type_id");
        s.finish();
        auto it = specials.find(id);
        if (it == specials.end()) s.fail_at(s.at("id"), "'" + id + "' is not in special_tokens");
        tmpl.push_back({false, it->second});
      } else if (item.find("Sequence") != nullptr) {
        detail::JsonObject s(item.required("Sequence"), path_, item.at("Sequence"));
        const std::string id = s.string("id");
        s.find("type_id");
        s.finish();
        if (id != "A") s.fail_at(s.at("id"), "is '" + id + "': a single sequence is A");
        tmpl.push_back({true, {}});
        ++sequences;
      } else {
        item.fail("is neither {\"SpecialToken\": ...} nor {\"Sequence\": ...}");
      }
      item.finish();
    }
    if (sequences != 1) o.fail_at(o.at("single"), "must name the sequence A exactly once");
    templates_.push_back(std::move(tmpl));
  }

  void read_decoder(const nlohmann::json& j, const std::string& path, int depth) {
    detail::JsonObject o(j, path_, path);
    check_depth(o, depth);
    const std::string type = detail::type_of(o);
    detail::DecoderStep s;
    if (type == "Sequence") {
      const nlohmann::json& list = o.required("decoders");
      if (!list.is_array()) o.fail_at(o.at("decoders"), "is not an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        read_decoder(list[i], o.at("decoders") + "[" + std::to_string(i) + "]", depth + 1);
      o.finish();
      return;
    } else if (type == "ByteLevel") {
      s.kind = detail::DecoderStep::ByteLevel;
      for (const char* k : {"add_prefix_space", "trim_offsets", "use_regex"}) o.find(k);
    } else if (type == "Metaspace") {
      s.kind = detail::DecoderStep::Metaspace;
      detail::PreTokenizerStep::Scheme scheme{};
      bool split = true;
      read_metaspace(o, s.from, scheme, split);
      s.prepend = scheme != detail::PreTokenizerStep::Never;
    } else if (type == "Replace") {
      s.kind = detail::DecoderStep::Replace;
      std::string literal;
      detail::read_pattern(o, "pattern", &literal);
      if (literal.empty()) o.fail_at(o.at("pattern"), "must be a String pattern in a decoder");
      s.from = literal;
      s.to = o.string("content");
    } else if (type == "ByteFallback") {
      s.kind = detail::DecoderStep::ByteFallback;
    } else if (type == "Fuse") {
      s.kind = detail::DecoderStep::Fuse;
    } else if (type == "Strip") {
      s.kind = detail::DecoderStep::Strip;
      s.from = o.string("content");
      const std::size_t n = s.from.empty() ? 0 : detail::utf8_char_len(s.from, 0);
      if (n == 0 || n != s.from.size()) o.fail_at(o.at("content"), "must be one character");
      s.start = static_cast<std::size_t>(o.integer("start", 0, 1 << 20));
      s.stop = static_cast<std::size_t>(o.integer("stop", 0, 1 << 20));
    } else {
      o.fail_at(o.at("type"), "is '" + type + "': graphmoe's tokenizer does not implement this "
                              "decoder (it reads ByteLevel, Metaspace, Replace, ByteFallback, Fuse, "
                              "Strip, Sequence)");
    }
    o.finish();
    decoders_.push_back(std::move(s));
  }

  // ---- encoding --------------------------------------------------------------------------------

  // Splits p (not an added token) at the added tokens of trie, as AddedVocabulary::find_matches;
  // appends the non-empty pieces to out.
  void split_added(const detail::Piece& p, const detail::AddedTrie& trie,
                   std::vector<detail::Piece>& out) const {
    const std::string& s = p.text;
    auto emit = [&](std::size_t b, std::size_t e, std::int32_t id) {
      if (e <= b) return;
      out.push_back({s.substr(b, e - b), p.at_start && b == 0, id});
    };
    if (trie.empty()) {
      emit(0, s.size(), -1);
      return;
    }
    std::size_t start_offset = 0, i = 0;
    while (i < s.size()) {
      const auto [end, id] = trie.longest_at(s, i);
      if (end == 0) {
        ++i;
        continue;
      }
      const detail::AddedToken& a = added_[added_index_.at(id)];
      std::size_t start = i, stop = end;
      i = end;
      if (a.single_word) {
        const bool start_space = start == 0 || !detail::is_word_char(detail::last_char(s.substr(0, start)));
        bool stop_space = stop == s.size();
        if (!stop_space) {
          const std::size_t n = detail::utf8_char_len(s, stop);
          stop_space = !detail::is_word_char(detail::utf8_decode_at(s, stop, n == 0 ? 1 : n));
        }
        if (!start_space || !stop_space) continue;
      }
      if (a.lstrip) {
        std::size_t k = start;
        while (k > 0) {
          std::size_t b = k - 1;
          while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
          if (!detail::is_unicode_space(detail::utf8_decode_at(s, b, k - b))) break;
          k = b;
        }
        start = std::max(k, start_offset);
      }
      if (a.rstrip) {
        while (stop < s.size()) {
          const std::size_t n = detail::utf8_char_len(s, stop);
          if (n == 0 || !detail::is_unicode_space(detail::utf8_decode_at(s, stop, n))) break;
          stop += n;
        }
        i = stop;
      }
      emit(start_offset, start, -1);
      out.push_back({s.substr(start, stop - start), p.at_start && start == 0, id});
      start_offset = stop;
    }
    emit(start_offset, s.size(), -1);
  }

  std::string normalize(std::string s) const {
    for (const auto& n : normalizers_) {
      switch (n.kind) {
        case detail::NormalizerStep::NFC:
        case detail::NormalizerStep::NFD:
        case detail::NormalizerStep::NFKC:
        case detail::NormalizerStep::NFKD: {
          int options = UTF8PROC_STABLE;
          if (n.kind == detail::NormalizerStep::NFC) options |= UTF8PROC_COMPOSE;
          if (n.kind == detail::NormalizerStep::NFD) options |= UTF8PROC_DECOMPOSE;
          if (n.kind == detail::NormalizerStep::NFKC) options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
          if (n.kind == detail::NormalizerStep::NFKD) options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
          utf8proc_uint8_t* dst = nullptr;
          const utf8proc_ssize_t len =
              utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                           static_cast<utf8proc_ssize_t>(s.size()), &dst,
                           static_cast<utf8proc_option_t>(options));
          if (len < 0) {
            std::free(dst);
            graphmoe::detail::throw_error("hf::Tokenizer::encode", "utf8proc: ",
                                          utf8proc_errmsg(len));
          }
          s.assign(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(len));
          std::free(dst);
          break;
        }
        case detail::NormalizerStep::Prepend:
          if (!s.empty()) s = n.text + s;
          break;
        case detail::NormalizerStep::Replace: {
          std::string out;
          std::size_t prev = 0;
          for (const auto& [b, e] : n.regex.find_all(s)) {
            out.append(s, prev, b - prev);
            out += n.content;
            prev = e;
          }
          out.append(s, prev, std::string::npos);
          s = std::move(out);
          break;
        }
      }
    }
    return s;
  }

  // Splits the piece at the matches of re with the given behavior (NormalizedString::split).
  static void split_regex(const detail::Piece& p, const detail::Regex& re,
                          detail::SplitBehavior behavior, bool invert,
                          std::vector<detail::Piece>& out) {
    const std::string& s = p.text;
    // (begin, end, is_match) covering s.
    struct Part { std::size_t b, e; bool match; };
    std::vector<Part> parts;
    std::size_t prev = 0;
    for (const auto& [b, e] : re.find_all(s)) {
      if (prev != b) parts.push_back({prev, b, false});
      parts.push_back({b, e, true});
      prev = e;
    }
    if (prev != s.size()) parts.push_back({prev, s.size(), false});
    if (invert)
      for (auto& q : parts) q.match = !q.match;
    std::vector<Part> kept;  // match = remove
    using B = detail::SplitBehavior;
    if (behavior == B::Isolated) {
      for (auto& q : parts) kept.push_back({q.b, q.e, false});
    } else if (behavior == B::Removed) {
      kept = parts;
    } else if (behavior == B::Contiguous) {
      bool previous = false;
      for (const auto& q : parts) {
        if (q.match == previous && !kept.empty()) kept.back().e = q.e;
        else kept.push_back({q.b, q.e, false});
        previous = q.match;
      }
    } else if (behavior == B::MergedWithPrevious) {
      bool previous = false;
      for (const auto& q : parts) {
        if (q.match && !previous && !kept.empty()) kept.back().e = q.e;
        else kept.push_back({q.b, q.e, false});
        previous = q.match;
      }
    } else {  // MergedWithNext
      bool previous = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !previous && !kept.empty()) kept.back().b = it->b;
        else kept.push_back({it->b, it->e, false});
        previous = it->match;
      }
      std::reverse(kept.begin(), kept.end());
    }
    for (const auto& q : kept)
      if (!q.match && q.e > q.b) out.push_back({s.substr(q.b, q.e - q.b), p.at_start && q.b == 0, -1});
  }

  void pre_tokenize(std::vector<detail::Piece>& words) const {
    std::vector<detail::Piece> next;
    for (const auto& step : pre_tokenizers_) {
      next.clear();
      for (auto& w : words) {
        switch (step.kind) {
          case detail::PreTokenizerStep::ByteLevel: {
            if (step.add_prefix_space && (w.text.empty() || w.text[0] != ' ')) w.text.insert(0, " ");
            const std::size_t first = next.size();
            if (step.use_regex) split_regex(w, step.regex, detail::SplitBehavior::Isolated, false, next);
            else if (!w.text.empty()) next.push_back(std::move(w));
            const auto& map = detail::ByteLevelMap::get();
            for (std::size_t k = first; k < next.size(); ++k) {
              std::string mapped;
              mapped.reserve(next[k].text.size() * 2);
              for (unsigned char c : next[k].text) detail::utf8_append(mapped, map.to_char[c]);
              next[k].text = std::move(mapped);
            }
            break;
          }
          case detail::PreTokenizerStep::Split:
            split_regex(w, step.regex, step.behavior, step.invert, next);
            break;
          case detail::PreTokenizerStep::Metaspace: {
            std::string t;
            t.reserve(w.text.size() + step.replacement.size());
            for (char c : w.text) {
              if (c == ' ') t += step.replacement;
              else t += c;
            }
            const bool starts = t.compare(0, step.replacement.size(), step.replacement) == 0;
            if (!starts && (step.scheme == detail::PreTokenizerStep::Always ||
                            (step.scheme == detail::PreTokenizerStep::First && w.at_start)))
              t.insert(0, step.replacement);
            w.text = std::move(t);
            if (!step.split) {
              if (!w.text.empty()) next.push_back(std::move(w));
              break;
            }
            // Split before each replacement character (MergedWithNext).
            const std::string& s = w.text;
            std::size_t b = 0, k = s.find(step.replacement, 1);
            while (k != std::string::npos) {
              next.push_back({s.substr(b, k - b), w.at_start && b == 0, -1});
              b = k;
              k = s.find(step.replacement, k + step.replacement.size());
            }
            if (b < s.size()) next.push_back({s.substr(b), w.at_start && b == 0, -1});
            break;
          }
        }
      }
      std::swap(words, next);
    }
  }

  static std::uint64_t merge_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }

  // The BPE model on one word (BPE::merge_word and Word::merge_all).
  void bpe(const std::string& w, std::vector<std::int32_t>& ids) const {
    if (w.empty()) return;
    if (ignore_merges_) {
      if (auto it = vocab_.find(w); it != vocab_.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    std::vector<std::int32_t> sym;
    sym.reserve(w.size());
    std::int32_t pending_unk = -1;  // a (fused) unknown not yet added
    detail::for_each_char(w, [&](std::uint32_t, std::size_t i, std::size_t n) {
      const std::string_view c(w.data() + i, n);
      if (auto it = vocab_.find(c); it != vocab_.end()) {
        if (pending_unk >= 0) sym.push_back(pending_unk), pending_unk = -1;
        sym.push_back(it->second);
        return;
      }
      if (byte_fallback_) {
        bool all = true;
        for (std::size_t k = 0; k < n; ++k)
          all = all && byte_ids_[static_cast<unsigned char>(c[k])] >= 0;
        if (all) {
          if (pending_unk >= 0) sym.push_back(pending_unk), pending_unk = -1;
          for (std::size_t k = 0; k < n; ++k) sym.push_back(byte_ids_[static_cast<unsigned char>(c[k])]);
          return;
        }
      }
      if (unk_id_ >= 0) {
        if (pending_unk >= 0 && !fuse_unk_) sym.push_back(pending_unk);
        pending_unk = unk_id_;
      }
    });
    if (pending_unk >= 0) sym.push_back(pending_unk);

    const int n = static_cast<int>(sym.size());
    std::vector<int> prev(static_cast<std::size_t>(n)), next(static_cast<std::size_t>(n));
    std::vector<char> alive(static_cast<std::size_t>(n), 1);
    for (int k = 0; k < n; ++k) {
      prev[static_cast<std::size_t>(k)] = k - 1;
      next[static_cast<std::size_t>(k)] = k + 1 < n ? k + 1 : -1;
    }
    struct Merge {
      std::int32_t rank, pos, id;
      bool operator<(const Merge& o) const {  // the heap's top: lowest rank, then lowest pos
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Merge> queue;
    auto push = [&](int pos) {
      const int nx = next[static_cast<std::size_t>(pos)];
      if (nx < 0) return;
      auto it = merges_.find(merge_key(sym[static_cast<std::size_t>(pos)], sym[static_cast<std::size_t>(nx)]));
      if (it != merges_.end()) queue.push({it->second.first, pos, it->second.second});
    };
    for (int k = 0; k + 1 < n; ++k) push(k);
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      const auto pos = static_cast<std::size_t>(top.pos);
      if (!alive[pos] || next[pos] < 0) continue;
      const auto nx = static_cast<std::size_t>(next[pos]);
      auto it = merges_.find(merge_key(sym[pos], sym[nx]));
      if (it == merges_.end() || it->second.second != top.id) continue;
      sym[pos] = top.id;
      alive[nx] = 0;
      next[pos] = next[nx];
      if (next[nx] >= 0) prev[static_cast<std::size_t>(next[nx])] = top.pos;
      if (prev[pos] >= 0) push(prev[pos]);
      push(top.pos);
    }
    for (int k = 0; k < n; ++k)
      if (alive[static_cast<std::size_t>(k)]) ids.push_back(sym[static_cast<std::size_t>(k)]);
  }

  // ---- decoding --------------------------------------------------------------------------------

  static void decode_step(const detail::DecoderStep& d, std::vector<std::string>& tokens) {
    switch (d.kind) {
      case detail::DecoderStep::ByteLevel: {
        const auto& map = detail::ByteLevelMap::get();
        std::string bytes;
        for (const auto& t : tokens) {
          std::string b;
          bool ok = true;
          detail::for_each_char(t, [&](std::uint32_t c, std::size_t, std::size_t) {
            if (c < 324 && map.to_byte[c] >= 0) b += static_cast<char>(map.to_byte[c]);
            else ok = false;
          });
          bytes += ok ? b : t;
        }
        tokens.assign(1, detail::utf8_lossy(bytes));
        break;
      }
      case detail::DecoderStep::Metaspace:
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          std::string out;
          const std::string& t = tokens[i];
          for (std::size_t k = 0; k < t.size();) {
            if (t.compare(k, d.from.size(), d.from) == 0) {
              if (!(i == 0 && d.prepend)) out += ' ';
              k += d.from.size();
            } else {
              out += t[k++];
            }
          }
          tokens[i] = std::move(out);
        }
        break;
      case detail::DecoderStep::Replace:
        for (auto& t : tokens) {
          std::string out;
          std::size_t prev = 0, k = t.find(d.from);
          while (k != std::string::npos) {
            out.append(t, prev, k - prev);
            out += d.to;
            prev = k + d.from.size();
            k = t.find(d.from, prev);
          }
          out.append(t, prev, std::string::npos);
          t = std::move(out);
        }
        break;
      case detail::DecoderStep::ByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        std::size_t pending_count = 0;
        auto flush = [&] {
          if (pending_count == 0) return;
          if (detail::utf8_invalid_at(pending) == std::string_view::npos) {
            out.push_back(pending);
          } else {
            for (std::size_t k = 0; k < pending_count; ++k) out.emplace_back(detail::kReplacementChar);
          }
          pending.clear();
          pending_count = 0;
        };
        for (auto& t : tokens) {
          int byte = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
            auto hex = [](char c) {
              if (c >= '0' && c <= '9') return c - '0';
              if (c >= 'a' && c <= 'f') return c - 'a' + 10;
              if (c >= 'A' && c <= 'F') return c - 'A' + 10;
              return -1;
            };
            const int h = hex(t[3]), l = hex(t[4]);
            if (h >= 0 && l >= 0) byte = h * 16 + l;
          }
          if (byte >= 0) {
            pending += static_cast<char>(byte);
            ++pending_count;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case detail::DecoderStep::Fuse: {
        std::string all;
        for (const auto& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case detail::DecoderStep::Strip:
        for (auto& t : tokens) {
          std::size_t b = 0, e = t.size();
          for (std::size_t k = 0; k < d.start && t.compare(b, d.from.size(), d.from) == 0; ++k)
            b += d.from.size();
          for (std::size_t k = 0; k < d.stop && e >= b + d.from.size() &&
                                  t.compare(e - d.from.size(), d.from.size(), d.from) == 0;
               ++k)
            e -= d.from.size();
          t = t.substr(b, e - b);
        }
        break;
    }
  }

 private:
  detail::TokenMap vocab_;
  std::vector<std::string> id_to_token_;  // "" where an id names no token
  std::int32_t vocab_size_ = 0;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges_;  // rank, id
  std::int32_t unk_id_ = -1;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  std::int32_t byte_ids_[256] = {};
  std::vector<detail::AddedToken> added_;
  std::unordered_map<std::int32_t, std::size_t> added_index_;  // id -> index in added_
  detail::TokenMap added_by_content_;
  std::unordered_set<std::string> special_contents_;
  detail::AddedTrie raw_trie_, normalized_trie_;
  std::vector<detail::NormalizerStep> normalizers_;
  std::vector<detail::PreTokenizerStep> pre_tokenizers_;
  std::vector<std::vector<detail::TemplateItem>> templates_;
  bool has_decoder_ = false;
  std::vector<detail::DecoderStep> decoders_;
};

// Incremental decoding for generation (the `tokenizers` library's DecodeStream): step(id) returns
// the text that the ids so far complete ("" while a character is still incomplete or the
// decoder holds text back), finish() what is left. The concatenation of every step and finish()
// is decode(all ids) for the decoders of tokenizer.json files and sentencepiece models.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false)
      : tok_(&tokenizer), skip_(skip_special_tokens) {}

  std::string step(std::int32_t id) {
    ids_.push_back(id);
    std::string text = tok_->decode(ids_, skip_);
    const bool incomplete =
        text.size() >= detail::kReplacementChar.size() &&
        text.compare(text.size() - detail::kReplacementChar.size(), std::string::npos,
                     detail::kReplacementChar) == 0;
    if (text.size() <= prefix_.size() || incomplete) return std::string();
    GRAPHMOE_CHECK(text.compare(0, prefix_.size(), prefix_) == 0, "hf::StreamDecoder::step",
                   "the decoder of '", tok_->path(), "' changed text it had already returned");
    std::string fresh = text.substr(prefix_.size());
    const std::size_t new_prefix_index = ids_.size() - prefix_index_;
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(prefix_index_));
    prefix_ = tok_->decode(ids_, skip_);
    prefix_index_ = new_prefix_index;
    return fresh;
  }
  // What the ids since the last text make (U+FFFD for bytes that never completed a character);
  // the decoder starts afresh afterwards.
  std::string finish() {
    std::string text = tok_->decode(ids_, skip_);
    std::string rest = text.size() > prefix_.size() && text.compare(0, prefix_.size(), prefix_) == 0
                           ? text.substr(prefix_.size())
                           : std::string();
    reset();
    return rest;
  }
  void reset() {
    ids_.clear();
    prefix_.clear();
    prefix_index_ = 0;
  }

 private:
  const Tokenizer* tok_;
  bool skip_;
  std::vector<std::int32_t> ids_;  // the window: the ids of the last text returned, then newer
  std::string prefix_;             // decode of ids_[0, prefix_index_)... as returned before
  std::size_t prefix_index_ = 0;
};

namespace detail {

// Set by graphmoe/hf/sentencepiece.hpp: loads a tokenizer.model.
using SentencePieceLoader = std::unique_ptr<Tokenizer> (*)(const std::string& path);
inline SentencePieceLoader& sentencepiece_loader() {
  static SentencePieceLoader loader = nullptr;
  return loader;
}

inline bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A JSON file of the directory, or null when it is absent.
inline nlohmann::json read_side_json(const std::string& path) {
  if (!is_file(path)) return nullptr;
  struct stat st {};
  ::stat(path.c_str(), &st);
  GRAPHMOE_CHECK(S_ISREG(st.st_mode) && st.st_size <= (std::int64_t(1) << 26), kLoadOp, "'", path,
                 "' is not a regular file of at most 64 MiB");
  const std::string text = graphmoe::detail::read_file(kLoadOp, path);
  graphmoe::detail::check_json_depth(kLoadOp, "'" + path + "'", text);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    graphmoe::detail::throw_error(kLoadOp, "'", path, "': not valid JSON: ", e.what());
  }
}

// The id of tokenizer_config.json's / special_tokens_map.json's key (a string or {"content": s}).
inline std::optional<std::int32_t> special_from_tokens(const Tokenizer& tok, const nlohmann::json& j,
                                                       const std::string& path, const char* key) {
  if (!j.is_object()) return std::nullopt;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  std::string content;
  if (it->is_string()) content = it->get<std::string>();
  else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    content = (*it)["content"].get<std::string>();
  else
    graphmoe::detail::throw_error(kLoadOp, "'", path, "': $.", key,
                                  " is neither a string nor {\"content\": string}");
  const auto id = tok.token_to_id(content);
  GRAPHMOE_CHECK(id.has_value(), kLoadOp, "'", path, "': $.", key, " = '", content,
                 "' is not a token of '", tok.path(), "'");
  return id;
}

// config.json's key (an id, or a list of ids: the first), checked against the vocabulary.
inline std::optional<std::int32_t> special_from_config(const Tokenizer& tok, const nlohmann::json& j,
                                                       const std::string& path, const char* key) {
  if (!j.is_object()) return std::nullopt;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  const nlohmann::json* v = &*it;
  if (v->is_array()) {
    if (v->empty()) return std::nullopt;
    v = &(*v)[0];
  }
  GRAPHMOE_CHECK(v->is_number_integer() && v->get<std::int64_t>() >= 0 &&
                     v->get<std::int64_t>() < tok.vocab_size(),
                 kLoadOp, "'", path, "': $.", key, " = ", it->dump(),
                 " is not an id of the tokenizer (vocabulary size ", tok.vocab_size(), ")");
  return static_cast<std::int32_t>(v->get<std::int64_t>());
}

}  // namespace detail

// The tokenizer of a model directory: tokenizer.json when present, else tokenizer.model (needs
// graphmoe/hf/sentencepiece.hpp in the program). bos / eos / pad: tokenizer_config.json's
// tokens, else special_tokens_map.json's, else config.json's ids, else (tokenizer.model) the
// model's own; each key on its own (a file that names only eos leaves bos to the next).
inline std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string json_path = (fs::path(dir) / "tokenizer.json").string();
  const std::string model_path = (fs::path(dir) / "tokenizer.model").string();
  std::unique_ptr<Tokenizer> tok;
  if (detail::is_file(json_path)) {
    tok = JsonTokenizer::from_file(json_path);
  } else if (detail::is_file(model_path)) {
    GRAPHMOE_CHECK(detail::sentencepiece_loader() != nullptr, detail::kLoadOp, "'", dir,
                   "' has tokenizer.model but no tokenizer.json: include "
                   "<graphmoe/hf/sentencepiece.hpp> and link graphmoe::hf_sentencepiece "
                   "(libsentencepiece) to read it");
    tok = detail::sentencepiece_loader()(model_path);
  } else {
    graphmoe::detail::throw_error(detail::kLoadOp, "'", dir,
                                  "' has neither tokenizer.json nor tokenizer.model");
  }
  SpecialTokenIds ids = tok->special_ids();
  const char* names[3] = {"bos_token", "eos_token", "pad_token"};
  const char* id_keys[3] = {"bos_token_id", "eos_token_id", "pad_token_id"};
  std::optional<std::int32_t>* slots[3] = {&ids.bos, &ids.eos, &ids.pad};
  std::optional<std::int32_t> found[3];
  for (const char* file : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const std::string p = (fs::path(dir) / file).string();
    const nlohmann::json j = detail::read_side_json(p);
    for (int k = 0; k < 3; ++k)
      if (!found[k]) found[k] = detail::special_from_tokens(*tok, j, p, names[k]);
  }
  {
    const std::string p = (fs::path(dir) / "config.json").string();
    const nlohmann::json j = detail::read_side_json(p);
    for (int k = 0; k < 3; ++k)
      if (!found[k]) found[k] = detail::special_from_config(*tok, j, p, id_keys[k]);
  }
  for (int k = 0; k < 3; ++k)
    if (found[k]) *slots[k] = found[k];
  tok->set_special_ids(ids);
  return tok;
}

}  // namespace graphmoe::hf
