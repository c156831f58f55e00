// graphmoe/hf/sentencepiece.hpp: SentencePiece tokenizer.model files (libsentencepiece), behind
// graphmoe/hf/tokenizer.hpp's Tokenizer interface.
//
//   auto tok = hf::SentencePieceTokenizer::from_file("dir/tokenizer.model");
//   auto tok = hf::load_tokenizer("dir");  // picks tokenizer.model when there is no tokenizer.json
//
// Including this header makes load_tokenizer read tokenizer.model files (in every translation unit
// of the program). encode is sentencepiece's EncodeAsIds, with the model's bos id in front when
// add_special_tokens is true and the model has one (as Llama's and Mistral's tokenizers add it);
// decode is sentencepiece's DecodeIds, which drops control tokens (<s>, </s>) whatever
// skip_special_tokens says. bos / eos / pad start as the model's own ids (absent when < 0).
// Link: libsentencepiece (the CMake target graphmoe::hf_sentencepiece).
// Errors: graphmoe::Error "graphmoe::hf::load_tokenizer: '<path>': sentencepiece: ...".
#pragma once

#include <sentencepiece_processor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/hf/tokenizer.hpp"

namespace graphmoe::hf {

class SentencePieceTokenizer : public Tokenizer {
 public:
  static std::unique_ptr<SentencePieceTokenizer> from_file(const std::string& path) {
    const std::string bytes = detail::read_tokenizer_file(path);
    std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
    t->path_ = path;
    const auto status = t->sp_.LoadFromSerializedProto(bytes);
    GRAPHMOE_CHECK(status.ok(), detail::kLoadOp, "'", path, "': sentencepiece: ", status.ToString());
    const int n = t->sp_.GetPieceSize();
    GRAPHMOE_CHECK(n > 0 && n <= TokenizerLimits::vocab_size, detail::kLoadOp, "'", path,
                   "': sentencepiece: ", n, " pieces");
    auto id = [&](int v) { return v >= 0 && v < n ? std::optional<std::int32_t>(v) : std::nullopt; };
    t->special_.bos = id(t->sp_.bos_id());
    t->special_.eos = id(t->sp_.eos_id());
    t->special_.pad = id(t->sp_.pad_id());
    return t;
  }

  std::vector<std::int32_t> encode(std::string_view text,
                                   bool add_special_tokens = true) const override {
    const std::size_t bad = detail::utf8_invalid_at(text);
    GRAPHMOE_CHECK(bad == std::string_view::npos, "hf::Tokenizer::encode",
                   "the text is not valid UTF-8 (byte ", bad, ")");
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    GRAPHMOE_CHECK(status.ok(), "hf::Tokenizer::encode", "sentencepiece: ", status.ToString());
    std::vector<std::int32_t> out;
    out.reserve(ids.size() + 1);
    if (add_special_tokens && special_.bos) out.push_back(*special_.bos);
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }

  std::string decode(std::span<const std::int32_t> ids, bool = false) const override {
    std::vector<int> v(ids.begin(), ids.end());
    for (std::size_t i = 0; i < v.size(); ++i)
      GRAPHMOE_CHECK(v[i] >= 0 && v[i] < vocab_size(), "hf::Tokenizer::decode", "ids[", i, "] = ",
                     v[i], " is out of range for '", path_, "' (vocabulary size ", vocab_size(), ")");
    std::string text;
    const auto status = sp_.Decode(v, &text);
    GRAPHMOE_CHECK(status.ok(), "hf::Tokenizer::decode", "sentencepiece: ", status.ToString());
    return text;
  }

  std::int32_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    if (id == sp_.unk_id() && sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  std::string id_to_token(std::int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return std::string();
    return sp_.IdToPiece(id);
  }
  bool is_special(std::int32_t id) const override {
    return id >= 0 && id < vocab_size() && (sp_.IsControl(id) || sp_.IsUnknown(id));
  }
  const sentencepiece::SentencePieceProcessor& processor() const { return sp_; }

 private:
  SentencePieceTokenizer() = default;
  sentencepiece::SentencePieceProcessor sp_;
};

namespace detail {
inline std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return SentencePieceTokenizer::from_file(path);
}
// Registers the loader with load_tokenizer when the program starts.
inline const bool sentencepiece_registered = (sentencepiece_loader() = &load_sentencepiece, true);
}  // namespace detail

}  // namespace graphmoe::hf
