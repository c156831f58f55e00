// generate: what main.cpp hands to the per-router generation (one function template, instantiated
// per router in its own translation unit, examples/CMakeLists.txt, from run_impl.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "graphmoe/inference/generate.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace graphmoe::hf {
class Checkpoint;  // graphmoe/hf/reader.hpp
}  // namespace graphmoe::hf

namespace generate_cli {

// The text printed for the generated ids of one output: step(id) for each id as it is drawn,
// finish() once at the end (what step held back: a character whose bytes never completed).
struct Printer {
  std::function<std::string(std::int32_t)> step;
  std::function<std::string()> finish;  // empty: nothing held back
};

struct Input {
  const graphmoe::SafetensorsFile* file = nullptr;  // a train_lm checkpoint ("model.<name>")
  // or a Hugging Face model directory (--hf; CPU, SoftmaxRouter, read with hf::Checkpoint::load)
  const graphmoe::hf::Checkpoint* hf = nullptr;
  std::string model_name;                           // --hf: what the first stderr line names
  graphmoe::TransformerLMConfig config;             // from its metadata (--hf: config.json)
  std::string router;                               // its router's name
  std::int64_t step = 0;                            // its training step (SMoE-Dropout's k)
  std::vector<std::vector<std::int32_t>> prompts;   // one per output (a prompt per sample)
  bool batch = false;                               // several outputs: printed when done
  graphmoe::GenerateOptions options;                // max_new_tokens, sampling, stop_ids (--hf: eos)
  std::vector<std::string> stop;                    // stop texts, matched against the printed text
  // the printer of the output that follows `prompt` (stateful: a word's leading space depends on
  // the token before; a Hugging Face tokenizer's stream decoder holds incomplete characters back)
  std::function<Printer(const std::vector<std::int32_t>& prompt)> printer;
  // the text of any id in an --explain line (a word, "<eos>", a character or a token, quoted)
  std::function<std::string(std::int32_t)> label;
};

// Loads the model of `in.file` (or `in.hf`) with router Policy (float, on backend B), generates,
// streams the text of each token to stdout (a batch: one line per output when done; with
// options.explain: one line per token with its routing instead) and the timings to stderr.
// Returns the exit status. Defined in run_impl.hpp.
template <class Policy, class B>
int run(const Input& in);

}  // namespace generate_cli
