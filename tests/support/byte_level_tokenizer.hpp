// tests/support/byte_level_tokenizer.hpp: a byte-level BPE tokenizer.json written by hand, for
// the tests that build a Hugging Face model directory of their own (generate --hf, train_lm --hf):
// <s> 0 and </s> 1 (special), the 256 bytes as GPT-2's byte characters (ids 2..257), then the
// merges that make each given word one token, merged left to right in the order given.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace graphmoe::test {

// The UTF-8 bytes of a code point below 0x10000.
inline std::string utf8(std::uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: the character that stands for each byte in a byte-level vocabulary.
inline std::vector<std::string> byte_chars() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cs = bs;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + n++);
    }
  std::vector<std::string> out(256);
  for (std::size_t i = 0; i < bs.size(); ++i)
    out[static_cast<std::size_t>(bs[i])] = utf8(static_cast<std::uint32_t>(cs[i]));
  return out;
}

// bos_first: a TemplateProcessing post-processor that puts <s> before every sequence (as Llama's);
// otherwise none (GPT-2's).
inline nlohmann::json byte_level_tokenizer_json(const std::vector<std::string>& words,
                                                bool bos_first) {
  const std::vector<std::string> chars = byte_chars();
  nlohmann::json vocab = nlohmann::json::object();
  vocab["<s>"] = 0;
  vocab["</s>"] = 1;
  for (int b = 0; b < 256; ++b) vocab[chars[static_cast<std::size_t>(b)]] = 2 + b;
  nlohmann::json merges = nlohmann::json::array();
  for (const std::string& word : words) {
    std::string token;  // the word in byte characters, merged left to right
    for (unsigned char c : word) {
      const std::string ch = chars[c];
      if (!token.empty() && !vocab.contains(token + ch)) {
        merges.push_back(token + " " + ch);
        const int id = static_cast<int>(vocab.size());
        vocab[token + ch] = id;
      }
      token += ch;
    }
  }
  auto special = [](int id, const std::string& content) {
    return nlohmann::json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                          {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false},
                                     {"trim_offsets", true}, {"use_regex", true}};
  nlohmann::json post = nullptr;
  if (bos_first)
    post = {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair", nullptr},
            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {0}}, {"tokens", {"<s>"}}}}}}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", {special(0, "<s>"), special(1, "</s>")}},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", post},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
            {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
            {"vocab", vocab}, {"merges", merges}}}};
}

}  // namespace graphmoe::test
