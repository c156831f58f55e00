// train_lm: options and data shared by main.cpp and the per-router training loops.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/data_parallel.hpp"
#include "common/divergence.hpp"
#include "common/vocabulary.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/tokenizers.hpp"

namespace train_lm {

struct Options {
  // data
  std::string train_path, valid_path, test_path;
  double valid_fraction = 0.05;  // held out from the end of the training stream when no --valid
  bool char_level = false;
  std::size_t max_vocab = 0;     // word level: keep the most frequent words (0 = all)
  // model
  std::string router = "softmax";
  graphmoe::TransformerLMConfig model;
  // training
  std::int64_t steps = 1000;
  graphmoe::index_t batch = 8;
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.01, clip = 1.0;
  std::int64_t warmup = 100;
  std::int64_t eval_every = 200;
  graphmoe::index_t eval_batches = 0;  // 0 = the whole validation stream
  std::int64_t checkpoint_every = 0;   // 0 = only at the end
  std::uint64_t seed = 1;
  int threads = 2;
  examples::DataParallel dp;  // --dp N (ranks; the communicator main() set up when N > 1)
  std::string device = "cpu";  // cpu, or cuda when built with GRAPHMOE_ENABLE_CUDA
  // fp32, or bf16 (--device cuda only): every GEMM of the model on bf16 operands with fp32
  // accumulation, fp32 master weights and optimizer state (TransformerLM's compute type C)
  std::string precision = "fp32";
  // --cuda-graph: each step's forward, zero_grad and backward replayed from a CUDA graph
  // (graphmoe::CudaGraph; --device cuda, --expert-layout padded, a router with a fixed k)
  bool cuda_graph = false;
  std::string out_dir = "runs/lm";
  bool resume = false;
  // start from another train_lm checkpoint's weights (graphmoe/models/upcycling.hpp): the same
  // model, its dense blocks made MoE, or its softmax router made graph-aware ("" = none)
  std::string upcycle_from;
  // --hf DIR: a Hugging Face model directory's model, weights and tokenizer (train_lm/hf_data.hpp;
  // "" = none); --save-hf OUT: the trained model saved there in the same layout at the end, in
  // save_hf_dtype (input: config.json's dtype, F32 when it names none or float64; f32, bf16, f16),
  // with the tokenizer files; a graph router only with save_hf_drop_graph (its linear router's
  // weights written, the graph dropped: the saved model routes as the softmax router)
  std::string hf_dir, save_hf, save_hf_dtype = "input";
  bool save_hf_drop_graph = false;
  examples::DivergenceOptions divergence;  // --divergence-factor, --max-grad-norm, --max-loss
  bool keep_checkpoints = false;  // also keep checkpoint-step<N>.safetensors at every checkpoint
  // robustness: the test set again with attack_rate of its words replaced by attack_word (the
  // seed paper's attacked WikiText; graphmoe/train/text_attack.hpp). 0 = no attacked evaluation.
  double attack_rate = 0.0;
  std::uint64_t attack_seed = 1;
  std::string attack_word = "AAA";
  // a short sample at the end: the first sample_prompt tokens of the validation text continued by
  // sample_tokens generated ones (temperature 0.8, top-k 40, the run's seed); 0: no sample
  graphmoe::index_t sample_tokens = 24;
  graphmoe::index_t sample_prompt = 8;
};

struct Data {
  std::vector<std::int32_t> train, valid, test;
  std::vector<std::int32_t> attacked_test;  // test with attacked inputs (empty: no attack)
  std::size_t vocab_size = 0;
  examples::VocabularyRecord vocabulary;  // recorded in every checkpoint (metadata "vocabulary")
  // ids -> text (words joined by spaces, <eos> a line break; or the characters), for the sample
  std::function<std::string(const std::vector<std::int32_t>&)> detokenize;
  // --hf: the directory (config.json and the shards' headers, read; the weights are loaded by the
  // training loop) and what checkpoints record of it (metadata field "hf": the directory, the
  // tokenizer file and its fingerprint, the line separator), which --resume checks
  std::shared_ptr<const graphmoe::hf::Checkpoint> hf;
  std::string hf_record;
  // ids the sample never draws (--hf: the model's ids past the tokenizer's, which name no token)
  std::vector<std::int32_t> sample_banned;
};

// The tokenizer files --save-hf copies from the --hf directory next to the model (those it has).
inline const std::vector<std::string>& hf_tokenizer_files() {
  static const std::vector<std::string> names = {"tokenizer.json", "tokenizer.model",
                                                 "tokenizer_config.json",
                                                 "special_tokens_map.json",
                                                 "generation_config.json"};
  return names;
}

// The training loop for one router policy on backend B (graphmoe::cpu or graphmoe::cuda),
// instantiated per router in its own translation unit (examples/CMakeLists.txt).
template <class Policy, class B>
int run(const Options& opt, const Data& data);

}  // namespace train_lm
