// custom_router/train: trains a small TransformerLM routed by the user policies,
// Router<NoisyScorer, KnnGraph<4>, TopP>, on WikiText-2 and checks that it learns.
//
//   train [DATA_DIR] [STEPS]
//
// DATA_DIR is the folder holding wikitext-2/ (default: $GRAPHMOE_DATA_DIR, else ../shared/data).
// Only the validation and test splits of WikiText-2 are there, so the model trains on
// wiki.valid.tokens (vocabulary: its 4,096 most frequent words, the rest <unk>) and is evaluated on
// the first 16 batches of wiki.test.tokens, before and after training, with the scorer's noise
// off. Model: 2 layers, D = 64, 4 heads, d_ff = 128, E = 8 experts, k = 2, sequences of 64 tokens,
// batches of 8; AdamW, warmup + cosine learning rate, gradient clipping at 1, one thread.
// Exit status 0 when the final held-out loss is finite and at least 0.5 nats below the initial one.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <graphmoe/graphmoe.hpp>

#include "knn_graph.hpp"
#include "noisy_scorer.hpp"
#include "top_p_selector.hpp"

using namespace graphmoe;
using Policy = Router<custom_router::NoisyScorer, custom_router::KnnGraph<4>, custom_router::TopP>;
using Model = TransformerLM<Policy, float>;

namespace {

// Mean cross-entropy over the first `max_batches` batches, without router noise (Mode::Eval: the
// scorer's set_mode hook turns its noise off).
double evaluate(Model& lm, const LMBatcher& batches, index_t max_batches) {
  lm.set_mode(Mode::Eval);
  const index_t nb = std::min(max_batches, batches.num_batches());
  double sum = 0;
  for (index_t i = 0; i < nb; ++i) {
    const LMBatch b = batches.batch(i);
    sum += lm.forward(b.inputs, b.targets).task;
  }
  lm.set_mode(Mode::Train);
  return sum / static_cast<double>(nb);
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::string data_dir = "../shared/data";
  if (const char* env = std::getenv("GRAPHMOE_DATA_DIR"); env && *env) data_dir = env;
  if (argc > 1) data_dir = argv[1];
  const std::int64_t steps = argc > 2 ? std::atoll(argv[2]) : 300;
  const fs::path train_path = fs::path(data_dir) / "wikitext-2" / "wiki.valid.tokens";
  const fs::path test_path = fs::path(data_dir) / "wikitext-2" / "wiki.test.tokens";
  for (const fs::path& f : {train_path, test_path}) {
    if (!fs::is_regular_file(f)) {
      std::fprintf(stderr,
                   "train: error: %s not found. Pass the data folder (the one holding "
                   "wikitext-2/) as the first argument or set GRAPHMOE_DATA_DIR; the default is "
                   "../shared/data (see its README.md).\n",
                   f.string().c_str());
      return 2;
    }
  }
  if (steps < 1) {
    std::fprintf(stderr, "train: error: STEPS must be >= 1, got %s\n", argv[2]);
    return 2;
  }
  try {
    set_num_threads(1);
    const auto t0 = std::chrono::steady_clock::now();
    const WordTokenizer tok = WordTokenizer::build(train_path.string(), 4096);
    const index_t batch = 8, seq = 64;
    LMBatcher train(tok.encode_file(train_path.string()), batch, seq);
    LMBatcher test(tok.encode_file(test_path.string()), batch, seq);

    TransformerLMConfig mc;
    mc.vocab_size = static_cast<index_t>(tok.size());
    mc.max_seq_len = seq;
    mc.d_model = 64;
    mc.num_layers = 2;
    mc.num_heads = 4;
    mc.d_ff = 128;
    mc.router.num_experts = 8;
    mc.router.k = 2;
    mc.router.options<custom_router::NoisyScorer>().init_std = 0.02;
    mc.router.load_balance_coef = 0.01;
    Model lm(mc, 1);
    std::printf("train: router %s, vocabulary %zu, %zu train / %zu test tokens, %lld parameters\n",
                Policy::name().c_str(), tok.size(), train.stream().size(), test.stream().size(),
                static_cast<long long>(lm.arena().numel()));

    const index_t eval_batches = 16;
    const double initial = evaluate(lm, test, eval_batches);
    std::printf("train: held-out loss before training %.4f (ppl %.1f)\n", initial, std::exp(initial));

    AdamWConfig acfg;
    acfg.lr = 3e-3;
    acfg.weight_decay = 0.01;
    AdamW<float, cpu> adam(lm.arena(), acfg);
    const LRSchedule sched{3e-3, 3e-4, std::min<std::int64_t>(30, steps), steps};
    sched.validate();
    Rng order_rng(2);
    std::vector<index_t> order = train.order(order_rng);
    const index_t nb = train.num_batches();
    const auto t1 = std::chrono::steady_clock::now();
    double ema = 0;
    for (std::int64_t step = 0; step < steps; ++step) {
      if (step > 0 && step % nb == 0) order = train.order(order_rng);
      const LMBatch b = train.batch(order[static_cast<std::size_t>(step % nb)]);
      const double loss = lm.forward(b.inputs, b.targets).total();
      GRAPHMOE_USER_CHECK(std::isfinite(loss), "train", "loss is ", loss, " at step ", step);
      lm.arena().zero_grad();
      lm.backward();
      clip_grad_norm(lm.arena(), 1.0);
      adam.step(lm.arena(), sched.at(step));
      lm.after_optimizer_step();  // stateful router policies (none here; a bias-balanced one would update)
      ema = step == 0 ? loss : 0.95 * ema + 0.05 * loss;
      if ((step + 1) % 50 == 0 || step + 1 == steps)
        std::printf("train: step %4lld  train loss (ema) %.4f\n", static_cast<long long>(step + 1), ema);
    }
    const auto t2 = std::chrono::steady_clock::now();
    const double final_loss = evaluate(lm, test, eval_batches);
    const auto t3 = std::chrono::steady_clock::now();
    const double train_s = std::chrono::duration<double>(t2 - t1).count();
    const double total_s = std::chrono::duration<double>(t3 - t0).count();
    std::printf("train: held-out loss after %lld steps %.4f (ppl %.1f); training %.1f s "
                "(%.0f ms/step), total %.1f s\n",
                static_cast<long long>(steps), final_loss, std::exp(final_loss), train_s,
                1000.0 * train_s / static_cast<double>(steps), total_s);
    const bool ok = std::isfinite(final_loss) && final_loss < initial - 0.5;
    std::printf("train: %s (final %.4f vs initial %.4f, required: at least 0.5 below)\n",
                ok ? "ok" : "FAILED", final_loss, initial);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: error: %s\n", e.what());
    return 1;
  }
}
