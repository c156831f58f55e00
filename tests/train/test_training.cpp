// Training end to end on real text: the loss falls; same seed and threads give bitwise identical
// losses; a checkpoint (model + AdamW state) resumes bit for bit; SGD also trains.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <unistd.h>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/training_state.hpp"
#include "graphmoe/train/files.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/schedule.hpp"
#include "graphmoe/train/tokenizers.hpp"

using namespace graphmoe;

namespace {

struct Corpus {
  std::vector<std::int32_t> stream;
  index_t vocab = 0;
};

// The first ~20k tokens of WikiText-2's validation split, vocabulary capped at 600 words.
const Corpus& corpus() {
  static const Corpus c = [] {
    const std::string path = data_dir() + "/wikitext-2/wiki.valid.tokens";
    const std::string slice_path = (std::filesystem::temp_directory_path() /
                                    ("graphmoe_wt2_slice_" + std::to_string(getpid()) + ".txt")).string();
    {
      const std::string text = read_file(path);
      std::ofstream(slice_path) << text.substr(0, 120000);
    }
    const WordTokenizer tok = WordTokenizer::build(slice_path, 600);
    Corpus out;
    out.stream = tok.encode_file(slice_path);
    out.vocab = static_cast<index_t>(tok.size());
    std::filesystem::remove(slice_path);
    return out;
  }();
  return c;
}

TransformerLMConfig small_lm(index_t vocab) {
  TransformerLMConfig c;
  c.vocab_size = vocab;
  c.max_seq_len = 32;
  c.d_model = 32;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 48;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.load_balance_coef = 0.01;
  return c;
}

// Runs steps [from, to) of AdamW training and returns the losses.
template <class Policy>
std::vector<float> train_steps(TransformerLM<Policy, float>& lm, AdamW<float>& opt,
                               const LMBatcher& data, std::int64_t from, std::int64_t to,
                               const LRSchedule& sched) {
  std::vector<float> losses;
  for (std::int64_t s = from; s < to; ++s) {
    const LMBatch b = data.batch(s % data.num_batches());
    losses.push_back(static_cast<float>(lm.forward(b.inputs, b.targets).task));
    lm.arena().zero_grad();
    lm.backward();
    clip_grad_norm(lm.arena(), 1.0);
    opt.step(lm.arena(), sched.at(s));
    lm.after_optimizer_step();  // bias balancing's update (nothing for the other routers)
  }
  return losses;
}

}  // namespace

TEST_CASE_TEMPLATE("training: the LM's loss falls on real text (WikiText-2 slice, 300 steps)", Policy,
                   SoftmaxRouter, SimilarityRouter) {
  const Corpus& c = corpus();
  REQUIRE(c.stream.size() > 15000);
  TransformerLM<Policy, float> lm(small_lm(c.vocab), 7);
  LMBatcher data(c.stream, 8, 32);
  AdamWConfig ac;
  ac.lr = 3e-3;
  AdamW<float> opt(lm.arena(), ac);
  LRSchedule sched{3e-3, 3e-4, 20, 300};
  const auto losses = train_steps(lm, opt, data, 0, 300, sched);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    first += losses[static_cast<std::size_t>(i)] / 20.0;
    last += losses[losses.size() - 20 + static_cast<std::size_t>(i)] / 20.0;
  }
  CAPTURE(first);
  CAPTURE(last);
  CHECK(first > std::log(static_cast<double>(c.vocab)) - 0.5);  // starts near uniform
  CHECK(last < first - 1.5);                                     // and learns
}

TEST_CASE("training: same seed and thread count give bitwise identical losses") {
  const Corpus& c = corpus();
  LMBatcher data(c.stream, 4, 32);
  LRSchedule sched{2e-3, 2e-4, 5, 30};
  for (int threads : {1, 2}) {
    set_num_threads(threads);
    std::vector<float> runs[2];
    for (auto& r : runs) {
      TransformerLM<SimilarityRouter, float> lm(small_lm(c.vocab), 11);
      AdamW<float> opt(lm.arena(), AdamWConfig{});
      r = train_steps(lm, opt, data, 0, 30, sched);
    }
    CHECK(runs[0] == runs[1]);
  }
  set_num_threads(1);
}

TEST_CASE_TEMPLATE("training: a checkpoint with the AdamW state resumes bit for bit", Policy,
                   AttentionRouter, SimilaritySigmoidBiasRouter) {
  const Corpus& c = corpus();
  LMBatcher data(c.stream, 4, 32);
  LRSchedule sched{2e-3, 2e-4, 5, 40};
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("graphmoe_resume_" + std::to_string(getpid()) + ".safetensors")).string();
  // uninterrupted
  TransformerLM<Policy, float> a(small_lm(c.vocab), 5);
  AdamW<float> oa(a.arena(), AdamWConfig{});
  const auto full = train_steps(a, oa, data, 0, 40, sched);
  // interrupted at step 25: save, then continue in a fresh model and optimizer
  std::vector<float> resumed;
  {
    TransformerLM<Policy, float> b(small_lm(c.vocab), 5);
    AdamW<float> ob(b.arena(), AdamWConfig{});
    train_steps(b, ob, data, 0, 25, sched);
    save_training_state(path, b.arena(), ob, {});
  }
  Tensor<float> resumed_bias;
  {
    TransformerLM<Policy, float> c2(small_lm(c.vocab), 999);  // different init, overwritten
    AdamW<float> oc(c2.arena(), AdamWConfig{});
    load_training_state(load_safetensors(path), c2.arena(), oc);
    resumed = train_steps(c2, oc, data, 25, 40, sched);
    if constexpr (std::is_same_v<typename Policy::selector, BiasBalancedTopK>)
      resumed_bias = c2.arena().value("blocks.1.moe.router.selector.expert_bias").clone();
  }
  std::filesystem::remove(path);
  REQUIRE(resumed.size() == 15);
  for (std::size_t i = 0; i < resumed.size(); ++i) CHECK(resumed[i] == full[25 + i]);
  if constexpr (std::is_same_v<typename Policy::selector, BiasBalancedTopK>) {
    // the expert bias (a buffer, not trained) moved, and resumed to the same values
    const Tensor<float> bias = a.arena().value("blocks.1.moe.router.selector.expert_bias");
    double moved = 0;
    for (index_t e = 0; e < bias.numel(); ++e) {
      moved += std::abs(bias.data()[e]);
      CHECK(bias.data()[e] == resumed_bias.data()[e]);
    }
    CHECK(moved > 0);
  }
}

TEST_CASE("training: SGD with momentum also lowers the loss") {
  const Corpus& c = corpus();
  LMBatcher data(c.stream, 8, 32);
  TransformerLM<SoftmaxRouter, float> lm(small_lm(c.vocab), 3);
  SGDConfig sc;
  sc.lr = 0.3;
  sc.momentum = 0.9;
  SGD<float> opt(lm.arena(), sc);
  std::vector<float> losses;
  for (std::int64_t s = 0; s < 150; ++s) {
    const LMBatch b = data.batch(s % data.num_batches());
    losses.push_back(static_cast<float>(lm.forward(b.inputs, b.targets).task));
    lm.arena().zero_grad();
    lm.backward();
    clip_grad_norm(lm.arena(), 1.0);
    opt.step(lm.arena(), sc.lr);
  }
  CHECK(losses.back() < losses.front() - 1.0);
}
