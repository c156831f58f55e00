// graphmoe/train/text_datasets.hpp: the sentence-classification sets of the paper's fine-tuning
// experiments, read from their standard files (see ../shared/data/README.md).
//
//   read_sst2_tsv(path)          GLUE SST-2 train.tsv / dev.tsv: header "sentence<TAB>label",
//                                then one "sentence<TAB>label" row per line, label 0 or 1
//   read_sst5_trees(path)        SST fine-grained PTB trees, one per line: "(3 (2 The) (2 Rock) ...)";
//                                label = the root's label (0-4), text = the leaves joined by
//                                single spaces (words as in the file: "-LRB-", "'s", ...)
//   read_banking77_csv(path [, names])
//                                Banking77 train.csv / test.csv: header "text,category",
//                                RFC 4180 CSV (quoted fields may hold commas, newlines and doubled
//                                quotes; LF or CRLF line ends). Category ids follow the order of
//                                first appearance, or the order of `names` when given (e.g. from
//                                read_banking77_categories("categories.json")).
//   read_banking77_categories(path)
//                                categories.json: a JSON array of strings (nlohmann_json)
//
// Texts are trimmed of leading and trailing whitespace. Malformed input throws graphmoe::Error
// "graphmoe::<reader>: <path>:<line>: <what>" with the 1-based line (for a CSV record, the line
// it starts on; for an unterminated quote, the line the quote opens on). A file that cannot be
// opened throws "graphmoe::<reader>: cannot open '<path>'".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/train/files.hpp"

namespace graphmoe {

struct TextExample {
  std::string text;
  std::int32_t label = 0;
};

inline std::vector<TextExample> read_sst2_tsv(const std::string& path) {
  constexpr const char* op = "read_sst2_tsv";
  const std::string bytes = detail::read_file(op, path);
  std::vector<TextExample> out;
  bool header = false;
  for_each_line(bytes, [&](std::string_view line, std::size_t n) {
    if (n == 1) {
      if (line != "sentence\tlabel")
        detail::parse_error(op, path, n, "expected the header 'sentence<TAB>label', found ",
                            detail::quoted(line));
      header = true;
      return;
    }
    const std::size_t tab = line.find('\t');
    std::size_t fields = 1;
    for (char c : line) fields += c == '\t';
    if (fields != 2)
      detail::parse_error(op, path, n, "expected 2 tab-separated fields (sentence, label), found ",
                          fields);
    long long label = 0;
    const std::string_view label_text = detail::trim(line.substr(tab + 1));
    if (!detail::parse_int(label_text, 0, 1, label))
      detail::parse_error(op, path, n, "label ", detail::quoted(label_text), " is not 0 or 1");
    const std::string_view text = detail::trim(line.substr(0, tab));
    if (text.empty()) detail::parse_error(op, path, n, "empty sentence");
    out.push_back({std::string(text), static_cast<std::int32_t>(label)});
  });
  if (!header) detail::parse_error(op, path, 1, "empty file, expected the header 'sentence<TAB>label'");
  return out;
}

namespace detail {

// One SST tree on one line: returns the root label and appends the leaves to `text`.
inline std::int32_t parse_sst_tree(const char* op, const std::string& path, std::size_t n,
                                   std::string_view line, std::string& text) {
  auto is_delim = [](char c) { return is_space(c) || c == '(' || c == ')'; };
  struct Node {
    bool has_leaf = false, has_child = false;
  };
  std::vector<Node> stack;
  std::int32_t root_label = -1;
  bool root_closed = false;
  std::size_t i = 0;
  while (i < line.size()) {
    const char c = line[i];
    if (is_space(c)) {
      ++i;
      continue;
    }
    const std::size_t column = i + 1;
    if (c == ')' && stack.empty())
      parse_error(op, path, n, "unbalanced parentheses: ')' at column ", column,
                  " closes nothing");
    if (root_closed)
      parse_error(op, path, n, "text after the root tree ends, at column ", column);
    if (c == '(') {
      if (!stack.empty()) {
        if (stack.back().has_leaf)
          parse_error(op, path, n, "a node holds both a word and subtrees, at column ", column);
        stack.back().has_child = true;
      }
      std::size_t j = ++i;
      while (j < line.size() && !is_delim(line[j])) ++j;
      const std::string_view label = line.substr(i, j - i);
      long long v = 0;
      if (label.empty()) parse_error(op, path, n, "missing label after '(' at column ", column);
      if (!parse_int(label, 0, 4, v))
        parse_error(op, path, n, "label ", quoted(label), " at column ", column + 1,
                    " is not an integer in 0-4");
      if (stack.empty()) root_label = static_cast<std::int32_t>(v);
      stack.push_back({});
      i = j;
    } else if (c == ')') {
      if (!stack.back().has_leaf && !stack.back().has_child)
        parse_error(op, path, n, "empty node closed at column ", column);
      stack.pop_back();
      root_closed = stack.empty();
      ++i;
    } else {
      if (stack.empty())
        parse_error(op, path, n, "expected '(' at column ", column, ", found ", quoted(line.substr(i, 1)));
      if (stack.back().has_leaf || stack.back().has_child)
        parse_error(op, path, n, "a node holds more than one word or a word after subtrees, at column ",
                    column);
      std::size_t j = i;
      while (j < line.size() && !is_delim(line[j])) ++j;
      if (!text.empty()) text += ' ';
      text.append(line.substr(i, j - i));
      stack.back().has_leaf = true;
      i = j;
    }
  }
  if (root_label < 0) parse_error(op, path, n, "empty line, expected a tree");
  if (!stack.empty())
    parse_error(op, path, n, "unbalanced parentheses: ", stack.size(), " '(' left unclosed");
  return root_label;
}

}  // namespace detail

inline std::vector<TextExample> read_sst5_trees(const std::string& path) {
  constexpr const char* op = "read_sst5_trees";
  const std::string bytes = detail::read_file(op, path);
  std::vector<TextExample> out;
  for_each_line(bytes, [&](std::string_view line, std::size_t n) {
    TextExample ex;
    ex.label = detail::parse_sst_tree(op, path, n, line, ex.text);
    out.push_back(std::move(ex));
  });
  return out;
}

namespace detail {

struct CsvRecord {
  std::vector<std::string> fields;
  std::size_t line = 0;  // 1-based line the record starts on
};

// RFC 4180 records of `text`. A quoted field may hold commas, line breaks and doubled quotes;
// records end at LF or CRLF; a final line break does not start another record.
inline std::vector<CsvRecord> parse_csv(const char* op, const std::string& path,
                                        std::string_view text) {
  std::vector<CsvRecord> records;
  std::size_t pos = 0, line = 1;
  const std::size_t size = text.size();
  auto at_record_end = [&](std::size_t p) {
    return p == size || text[p] == '\n' || (text[p] == '\r' && p + 1 < size && text[p + 1] == '\n') ||
           (text[p] == '\r' && p + 1 == size);
  };
  while (pos < size) {
    CsvRecord rec;
    rec.line = line;
    for (;;) {
      std::string field;
      if (pos < size && text[pos] == '"') {
        const std::size_t quote_line = line;
        ++pos;
        for (;;) {
          if (pos == size)
            parse_error(op, path, quote_line, "unterminated quoted field (the quote opens on line ",
                        quote_line, " and is never closed)");
          const char c = text[pos];
          if (c == '"') {
            if (pos + 1 < size && text[pos + 1] == '"') {
              field += '"';
              pos += 2;
              continue;
            }
            ++pos;
            break;
          }
          if (c == '\n') ++line;
          field += c;
          ++pos;
        }
        if (pos < size && text[pos] != ',' && !at_record_end(pos))
          parse_error(op, path, line, "unexpected ", quoted(text.substr(pos, 1)),
                      " after a closing quote (a quote inside a field must be doubled)");
      } else {
        while (pos < size && text[pos] != ',' && !at_record_end(pos)) {
          if (text[pos] == '"')
            parse_error(op, path, line, "quote inside an unquoted field (quote the field and "
                        "double the quote)");
          field += text[pos++];
        }
      }
      rec.fields.push_back(std::move(field));
      if (pos < size && text[pos] == ',') {
        ++pos;
        continue;
      }
      // End of record: skip "\r\n", "\n" or a final "\r".
      if (pos < size && text[pos] == '\r') ++pos;
      if (pos < size && text[pos] == '\n') ++pos;
      ++line;
      break;
    }
    records.push_back(std::move(rec));
  }
  return records;
}

// names_given: ids come from `names`; otherwise they are assigned in order of first appearance
// and appended to `names`.
inline std::vector<TextExample> read_banking77(const std::string& path,
                                               std::vector<std::string>& names, bool names_given) {
  constexpr const char* op = "read_banking77_csv";
  const std::string bytes = read_file(op, path);
  const std::vector<CsvRecord> records = parse_csv(op, path, bytes);
  if (records.empty()) parse_error(op, path, 1, "empty file, expected the header 'text,category'");
  const CsvRecord& head = records.front();
  if (head.fields.size() != 2 || head.fields[0] != "text" || head.fields[1] != "category")
    parse_error(op, path, head.line, "expected the header 'text,category'");
  std::unordered_map<std::string, std::int32_t> ids;
  for (std::size_t k = 0; k < names.size(); ++k) {
    GRAPHMOE_CHECK(ids.emplace(names[k], static_cast<std::int32_t>(k)).second, op,
                   "category name '", names[k], "' is given twice");
  }
  std::vector<TextExample> out;
  out.reserve(records.size() - 1);
  for (std::size_t r = 1; r < records.size(); ++r) {
    const CsvRecord& rec = records[r];
    if (rec.fields.size() != 2)
      parse_error(op, path, rec.line, "expected 2 fields (text, category), found ",
                  rec.fields.size());
    const std::string_view text = trim(rec.fields[0]);
    const std::string_view category = trim(rec.fields[1]);
    if (text.empty()) parse_error(op, path, rec.line, "empty text");
    if (category.empty()) parse_error(op, path, rec.line, "empty category");
    auto it = ids.find(std::string(category));
    if (it == ids.end()) {
      if (names_given)
        parse_error(op, path, rec.line, "category ", quoted(category), " is not among the ",
                    names.size(), " category names given");
      it = ids.emplace(std::string(category), static_cast<std::int32_t>(names.size())).first;
      names.emplace_back(category);
    }
    out.push_back({std::string(text), it->second});
  }
  return out;
}

}  // namespace detail

// Category ids in order of first appearance; their names, in id order, go to *label_names when
// it is not null.
inline std::vector<TextExample> read_banking77_csv(const std::string& path,
                                                   std::vector<std::string>* label_names = nullptr) {
  std::vector<std::string> names;
  std::vector<TextExample> out = detail::read_banking77(path, names, false);
  if (label_names != nullptr) *label_names = std::move(names);
  return out;
}

// Category ids are positions in label_names; a category outside it is an error.
inline std::vector<TextExample> read_banking77_csv(const std::string& path,
                                                   const std::vector<std::string>& label_names) {
  std::vector<std::string> names = label_names;
  return detail::read_banking77(path, names, true);
}

// A JSON array of strings, such as Banking77's categories.json, parsed by nlohmann_json. A
// malformed file names the line of the parser's error; an element that is not a string names its
// index.
inline std::vector<std::string> read_banking77_categories(const std::string& path) {
  constexpr const char* op = "read_banking77_categories";
  const std::string text = detail::read_file(op, path);
  detail::check_json_depth(op, "'" + path + "'", text);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    const std::size_t at = std::min<std::size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    std::size_t line = 1;
    for (std::size_t k = 0; k < at; ++k) line += text[k] == '\n';
    // the parser's own description, without its "[json.exception.parse_error.101] " prefix
    std::string what = e.what();
    if (const std::size_t b = what.find("] "); what.rfind("[json.exception", 0) == 0 && b != std::string::npos)
      what = what.substr(b + 2);
    detail::parse_error(op, path, line, "not valid JSON: ", what);
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range: a number beyond double
    std::string what = e.what();
    if (const std::size_t b = what.find("] "); what.rfind("[json.exception", 0) == 0 && b != std::string::npos)
      what = what.substr(b + 2);
    detail::parse_error(op, path, 1, "not valid JSON: ", what);
  }
  if (!j.is_array()) detail::parse_error(op, path, 1, "expected a JSON array of strings, found ", j.type_name());
  std::vector<std::string> names;
  names.reserve(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_string())
      detail::parse_error(op, path, 1, "element ", i, " is ", j[i].type_name(), ", expected a string");
    names.push_back(j[i].get<std::string>());
  }
  return names;
}

}  // namespace graphmoe
