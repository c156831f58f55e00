// graphmoe/train/files.hpp: where the data sets live, reading whole files, and the file:line
// errors that every data reader throws.
//
//   data_dir()                 $GRAPHMOE_DATA_DIR if set, else "../shared/data" (relative to the
//                              current directory: the project root's sibling shared/data)
//   read_file(path)            the file's bytes; throws "graphmoe::read_file: cannot open '<path>'",
//                              "... is a broken symbolic link (to '<target>')" (or "a symbolic
//                              link loop"), "... is not a regular file (a FIFO)" for FIFOs,
//                              devices, folders
//   for_each_line(text, f)     calls f(line, line_number) for every line of text, without its
//                              '\n' (or "\r\n"); a final '\n' does not start another line
//   detail::check_json_depth(op, what, text)
//                              refuses JSON nested deeper than kMaxJsonDepth (256) levels, before
//                              nlohmann_json's recursive copies could overflow the stack
//
// For the readers (namespace detail): detail::read_file(op, path) names `op` in its error, and
// detail::parse_error(op, path, line, parts...) throws "graphmoe::op: <path>:<line>: parts...".
//
// The data itself is never part of the project: see ../shared/data/README.md.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"

namespace graphmoe {

// The data directory: $GRAPHMOE_DATA_DIR when set and non-empty, else "../shared/data".
inline std::string data_dir() {
  const char* env = std::getenv("GRAPHMOE_DATA_DIR");
  if (env != nullptr && env[0] != '\0') return std::string(env);
  return std::string("../shared/data");
}

// Calls f(std::string_view line, std::size_t line_number) for every line of `text`. Lines end at
// '\n'; a '\r' right before it is dropped (CRLF files). The text after the last '\n' is a line
// only if it is non-empty (as Python's file iteration counts lines).
template <class F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t start = 0, number = 1;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    const std::size_t next = end == std::string_view::npos ? text.size() : end + 1;
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(line, number);
    ++number;
    start = next;
  }
}

namespace detail {

// Throws graphmoe::Error("graphmoe::op: path:line: parts...").
template <class... Args>
[[noreturn]] inline void parse_error(const char* op, const std::string& path, std::size_t line,
                                     Args&&... parts) {
  throw_error(op, path, ':', line, ": ", std::forward<Args>(parts)...);
}

// What a non-regular file is, for error messages.
inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// What a path that stat() cannot follow is, for a message: "a symbolic link loop", "a broken
// symbolic link (to 'target')", or "" when it is no link (missing, or not readable).
inline std::string broken_link(const std::string& path) {
  struct stat link {};
  if (::lstat(path.c_str(), &link) != 0 || !S_ISLNK(link.st_mode)) return "";
  struct stat target {};
  if (::stat(path.c_str(), &target) == 0) return "";
  if (errno == ELOOP) return "a symbolic link loop";
  char to[4096];
  const ssize_t n = ::readlink(path.c_str(), to, sizeof to);
  if (n <= 0 || static_cast<std::size_t>(n) >= sizeof to) return "a broken symbolic link";
  return "a broken symbolic link (to '" + std::string(to, static_cast<std::size_t>(n)) + "')";
}

// Throws, naming what path is, when it is a broken symbolic link or a link loop.
inline void require_no_broken_link(const char* op, const std::string& path) {
  const std::string link = broken_link(path);
  GRAPHMOE_CHECK(link.empty(), op, "'", path, "' is ", link);
}

// The whole file as bytes (binary mode: no newline translation). Only a regular file (or a link
// to one): a FIFO would block the open, /dev/zero would never end, a directory reads as nothing.
// Throws unless path names a regular file (or a link to one): every reader calls it before
// opening the file.
inline void require_regular_file(const char* op, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    require_no_broken_link(op, path);
    detail::throw_error(op, "cannot open '", path, "'");
  }
  GRAPHMOE_CHECK(S_ISREG(st.st_mode), op, "'", path, "' is not a regular file (",
                 file_kind(st.st_mode), ")");
}

inline std::string read_file(const char* op, const std::string& path) {
  require_regular_file(op, path);
  std::ifstream in(path, std::ios::binary);
  GRAPHMOE_CHECK(in.is_open(), op, "cannot open '", path, "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  GRAPHMOE_CHECK(!in.bad(), op, "error while reading '", path, "'");
  return bytes;
}

inline bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Calls f(std::string_view token) for every maximal run of non-whitespace bytes of s.
template <class F>
void for_each_word(std::string_view s, F&& f) {
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && is_space(s[i])) ++i;
    const std::size_t start = i;
    while (i < s.size() && !is_space(s[i])) ++i;
    if (i > start) f(s.substr(start, i - start));
  }
}

// Parses all of s as a decimal integer in [lo, hi]; false when s is anything else.
inline bool parse_int(std::string_view s, long long lo, long long hi, long long& out) {
  if (s.empty()) return false;
  long long v = 0;
  const char* first = s.data();
  if (*first == '+') ++first;  // from_chars rejects a leading '+'
  const auto [ptr, ec] = std::from_chars(first, s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || first == s.data() + s.size()) return false;
  if (v < lo || v > hi) return false;
  out = v;
  return true;
}

// The JSON readers' nesting limit. nlohmann_json parses iteratively but copies, compares and
// prints values recursively, so a file nested tens of thousands of levels deep (a few hundred
// kilobytes of '[') would overflow the stack at the first copy of the parsed value. No file
// graphmoe reads nests deeper than about ten levels.
inline constexpr std::size_t kMaxJsonDepth = 256;

// Throws "op: <what> nests JSON arrays and objects <n> levels deep (at byte <b>); at most 256
// are read" when `text` opens more than kMaxJsonDepth arrays or objects at once (outside
// strings). Run before nlohmann::json::parse: what it accepts is then safe to copy.
inline void check_json_depth(const char* op, const std::string& what, std::string_view text) {
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character, '"' included
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      GRAPHMOE_CHECK(++depth <= kMaxJsonDepth, op, what, " nests JSON arrays and objects more than ",
                     kMaxJsonDepth, " levels deep (at byte ", i, "): not a file graphmoe reads");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

// "'s'" quoted for messages, shortened to 40 bytes.
inline std::string quoted(std::string_view s) {
  std::string q = "'";
  q += s.size() > 40 ? std::string(s.substr(0, 37)) + "..." : std::string(s);
  q += "'";
  return q;
}

}  // namespace detail

// The whole file as bytes; throws "graphmoe::read_file: cannot open '<path>'".
inline std::string read_file(const std::string& path) { return detail::read_file("read_file", path); }

}  // namespace graphmoe
