// finetune_classifier: options and data shared by main.cpp and the per-router loops.
#pragma once

#include <string>
#include <vector>

#include "common/data_parallel.hpp"
#include "common/divergence.hpp"
#include "graphmoe/models/sequence_classifier.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace finetune_classifier {

struct Encoded {
  std::vector<std::vector<std::int32_t>> ids;  // token ids per example (truncated to max_len)
  std::vector<std::int32_t> labels;
};

struct Options {
  std::string router;  // from the checkpoint
  graphmoe::TransformerLMConfig model;
  graphmoe::index_t num_classes = 2;
  std::string checkpoint;
  std::string hf_dir;  // --hf: a Hugging Face model directory instead of the checkpoint
  int epochs = 1;
  graphmoe::index_t batch = 16;
  double lr = 1e-3, weight_decay = 0.01, clip = 1.0;
  std::int64_t warmup = 0;
  std::uint64_t seed = 1;
  int threads = 2;
  std::string device = "cpu";  // cpu, or cuda when built with CUDA (see examples/CMakeLists.txt)
  std::string out_dir = "runs/finetune";
  bool from_scratch = false;  // skip loading the LM checkpoint (a baseline)
  examples::DataParallel dp;  // --dp: data parallel over the ranks of an MPI job
  examples::DivergenceOptions divergence;  // --divergence-factor, --max-grad-norm, --max-loss
};

struct Data {
  Encoded train, test;
};

// The fine-tuning loop for one router on backend B (graphmoe::cpu or graphmoe::cuda).
template <class Policy, class B>
int run(const Options& opt, const Data& data);

}  // namespace finetune_classifier
