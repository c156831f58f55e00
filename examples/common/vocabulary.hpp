// The vocabulary a train_lm checkpoint was trained with: its metadata field "vocabulary", a JSON
// object {"kind": "word" | "char", "size": N, "normalisation": "none" | "lower" | "punct" |
// "lower,punct", "fingerprint": "fnv1a64:...", "file": the vocab.txt train_lm wrote}
// (graphmoe/train/tokenizers.hpp: TextNormalisation, fingerprint()). generate checks the --vocab
// it is given against it and reads prompts with its normalisation; checkpoints written before
// the field have none, and load with a warning.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "graphmoe/config.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/tokenizers.hpp"

namespace examples {

struct VocabularyRecord {
  bool char_level = false;
  std::size_t size = 0;
  graphmoe::TextNormalisation normalisation;
  std::string fingerprint;
  std::string file;

  std::string json() const {
    return nlohmann::json{{"kind", char_level ? "char" : "word"},
                          {"size", size},
                          {"normalisation", normalisation.name()},
                          {"fingerprint", fingerprint},
                          {"file", file}}
        .dump();
  }
};

// The record of checkpoint `f` (named `where` in errors), or none when it has no "vocabulary"
// field (a checkpoint written before train_lm recorded one). A field that is there but malformed
// throws naming what is wrong.
inline std::optional<VocabularyRecord> vocabulary_record(const graphmoe::SafetensorsFile& f,
                                                         const std::string& where) {
  const auto it = f.metadata.find("vocabulary");
  if (it == f.metadata.end()) return std::nullopt;
  const char* op = "vocabulary";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception&) {
    graphmoe::detail::throw_error(op, where, ": metadata field 'vocabulary' is not JSON");
  }
  GRAPHMOE_CHECK(j.is_object(), op, where, ": metadata field 'vocabulary' is not a JSON object");
  auto text = [&](const char* key) {
    GRAPHMOE_CHECK(j.contains(key) && j[key].is_string(), op, where,
                   ": metadata field 'vocabulary' has no text field '", key, "'");
    return j[key].get<std::string>();
  };
  VocabularyRecord r;
  const std::string kind = text("kind");
  GRAPHMOE_CHECK(kind == "word" || kind == "char", op, where, ": the vocabulary's kind is '", kind,
                 "', not word or char");
  r.char_level = kind == "char";
  GRAPHMOE_CHECK(j.contains("size") && j["size"].is_number_unsigned(), op, where,
                 ": metadata field 'vocabulary' has no size (a non-negative integer)");
  r.size = j["size"].get<std::size_t>();
  r.normalisation = graphmoe::TextNormalisation::parse(text("normalisation"));
  r.fingerprint = text("fingerprint");
  r.file = j.contains("file") && j["file"].is_string() ? j["file"].get<std::string>() : "";
  return r;
}

}  // namespace examples
