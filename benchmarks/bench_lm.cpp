// One full training step of the Switch LM: forward (mean cross-entropy), zero_grad, backward,
// clip_grad_norm(1.0), AdamW step. TransformerLM<Router, float> with the default config: 6 pre-norm
// blocks, D = 128, 4 heads, every FFN an MoE with E = 8 experts, top-2, d_ff = 512, GELU (tanh),
// learned positions, tied embeddings, causal; vocabulary 10000, batch 8 x 128 tokens. Token ids
// are random with a fixed seed (inputs and next-token targets from one (B, T + 1) stream).
//
//   ./benchmarks/bench_lm --benchmark_filter='BM_lm_train'            (all)
//   /usr/bin/python3 benchmarks/compare/lm_torch.py --build-dir build   (beside PyTorch)
//
// Arguments: {threads}. Counter tokens/s = batch * seq per step.
//
// BM_lm_train_paper_medium_<router>: the model of bench_cuda's lm_train rows on the CPU backend
// (TransformerLMConfig::paper_medium with a vocabulary of 1024, batch 4 x 512, the same random
// tokens), 2 threads, 3 timed steps: the GPU's tokens/s against the CPU's for the same model.
//
// BM_lm_train_olmoe_<router>: the olmoe preset (TransformerLMConfig::olmoe(10000): 4 blocks,
// D = 256, 8 heads, RMSNorm, RoPE, QK-norm, SwiGLU, E = 64 experts of width 128, top-8, untied
// head, the load-balancing and z-losses), batch 8 x 128 as above, threads 1 and 2;
// `lm_torch.py --arch olmoe` trains the same model in PyTorch. Counter params = the parameters.
#include <benchmark/benchmark.h>

#include <cstdint>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/optim.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kBatch = 8, kSeq = 128, kVocab = 10000, kD = 128, kLayers = 6, kHeads = 4;
constexpr index_t kFF = 512, kE = 8, kK = 2;
constexpr int kWarmupSteps = 2;

TransformerLMConfig lm_config() {
  TransformerLMConfig c;
  c.vocab_size = kVocab;
  c.max_seq_len = kSeq;
  c.d_model = kD;
  c.num_layers = kLayers;
  c.num_heads = kHeads;
  c.d_ff = kFF;
  c.layout = MoELayout::Switch;
  c.tie_embeddings = true;
  c.gelu = GeluForm::Tanh;
  c.router.num_experts = kE;
  c.router.k = kK;
  return c;
}

template <class Policy>
void BM_lm_train(benchmark::State& state, const TransformerLMConfig& cfg, index_t batch,
                 index_t seq) {
  using T = float;
  const index_t vocab = cfg.vocab_size;
  const int threads = static_cast<int>(state.range(0));
  set_num_threads(threads);
  TransformerLM<Policy, T> lm(cfg, /*seed=*/1);
  AdamWConfig acfg;
  acfg.lr = 1e-3;
  acfg.weight_decay = 0.01;
  AdamW<T> opt(lm.arena(), acfg);

  Rng rng(1234);
  Tensor<std::int32_t> ids(Shape{batch, seq}), targets(Shape{batch, seq});
  for (index_t b = 0; b < batch; ++b) {
    std::int32_t prev = static_cast<std::int32_t>(rng.next_u32() % vocab);
    for (index_t t = 0; t < seq; ++t) {
      const std::int32_t next = static_cast<std::int32_t>(rng.next_u32() % vocab);
      ids.data()[b * seq + t] = prev;
      targets.data()[b * seq + t] = next;
      prev = next;
    }
  }

  std::int64_t step = 0;
  auto train_step = [&] {
    lm.set_step(step++);
    const double loss = lm.forward(ids, targets).total();
    lm.arena().zero_grad();
    lm.backward();
    const double norm = clip_grad_norm(lm.arena(), 1.0);
    opt.step(lm.arena());
    benchmark::DoNotOptimize(loss);
    benchmark::DoNotOptimize(norm);
    return loss;
  };
  for (int i = 0; i < kWarmupSteps; ++i) train_step();  // first-touch allocations, caches
  double loss = 0;
  for (auto _ : state) loss = train_step();
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(batch * seq),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["loss"] = static_cast<double>(loss);
  state.counters["params"] = static_cast<double>(lm.arena().numel());
  set_num_threads(1);
}

void args(benchmark::internal::Benchmark* b) {
  for (int t : {1, 2}) b->Args({t});
  b->ArgNames({"threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}

void BM_lm_train_softmax(benchmark::State& s) {
  BM_lm_train<SoftmaxRouter>(s, lm_config(), kBatch, kSeq);
}
void BM_lm_train_similarity(benchmark::State& s) {
  BM_lm_train<SimilarityRouter>(s, lm_config(), kBatch, kSeq);
}

void BM_lm_train_olmoe_softmax(benchmark::State& s) {
  BM_lm_train<SoftmaxRouter>(s, TransformerLMConfig::olmoe(kVocab), kBatch, kSeq);
}
void BM_lm_train_olmoe_similarity(benchmark::State& s) {
  BM_lm_train<SimilarityRouter>(s, TransformerLMConfig::olmoe(kVocab), kBatch, kSeq);
}

void medium_args(benchmark::internal::Benchmark* b) {
  b->Args({2})->ArgNames({"threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);
}
void BM_lm_train_paper_medium_softmax(benchmark::State& s) {
  BM_lm_train<SoftmaxRouter>(s, TransformerLMConfig::paper_medium(1024), 4, 512);
}
void BM_lm_train_paper_medium_similarity(benchmark::State& s) {
  BM_lm_train<SimilarityRouter>(s, TransformerLMConfig::paper_medium(1024), 4, 512);
}

}  // namespace

BENCHMARK(BM_lm_train_softmax)->Apply(args);
BENCHMARK(BM_lm_train_similarity)->Apply(args);
BENCHMARK(BM_lm_train_olmoe_softmax)->Apply(args);
BENCHMARK(BM_lm_train_olmoe_similarity)->Apply(args);
BENCHMARK(BM_lm_train_paper_medium_softmax)->Apply(medium_args);
BENCHMARK(BM_lm_train_paper_medium_similarity)->Apply(medium_args);

BENCHMARK_MAIN();
