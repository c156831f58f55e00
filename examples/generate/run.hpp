// generate: what main.cpp hands to the per-router generation (one function template, instantiated
// per router in its own translation unit, examples/CMakeLists.txt, from run_impl.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "graphmoe/inference/generate.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace generate_cli {

struct Input {
  const graphmoe::SafetensorsFile* file = nullptr;  // a train_lm checkpoint ("model.<name>")
  graphmoe::TransformerLMConfig config;             // from its metadata
  std::string router;                               // its router's name
  std::int64_t step = 0;                            // its training step (SMoE-Dropout's k)
  std::vector<std::vector<std::int32_t>> prompts;   // one per output (a prompt per sample)
  bool batch = false;                               // several outputs: printed when done
  graphmoe::GenerateOptions options;                // max_new_tokens, sampling
  std::vector<std::string> stop;                    // stop texts, matched against the printed text
  // the text printed for each generated id of the output that follows `prompt` (stateful: a
  // word's leading space depends on the token before)
  std::function<std::function<std::string(std::int32_t)>(const std::vector<std::int32_t>& prompt)> printer;
  // the text of any id in an --explain line (a word, "<eos>", or a character, quoted)
  std::function<std::string(std::int32_t)> label;
};

// Loads the model of `in.file` with router Policy (float, on backend B), generates, streams the
// text of each token to stdout (a batch: one line per output when done; with options.explain: one
// line per token with its routing instead) and the timings to stderr. Returns the exit status.
// Defined in run_impl.hpp.
template <class Policy, class B>
int run(const Input& in);

}  // namespace generate_cli
