// The routers' whole-model cost (the seed paper's Table 8): forward time and one training step
// (forward, backward, clip, AdamW) of TransformerLM<Router, float> at the paper's medium shape:
// 6 pre-norm blocks, D = 352, 8 heads, d_ff = 352, every FFN an MoE with E = 16 experts, top-2,
// sequences of 512 tokens (one sequence a step), tied embeddings, causal graphs (the LM's).
// Vocabulary 8,000 (WikiText-103's 267,735 would make the LM head most of the time and hide the
// routers' cost; a small vocabulary makes the ratios harder to meet, not easier).
// GRAPHMOE_BENCH_VOCAB=N sets another vocabulary (2 to 10,000,000; e.g. 267735, the paper's
// WikiText-103 models, where the tied LM head is ~96 GFLOP of a forward's ~100).
// Counter peak_rss_MiB = the process's peak resident set (VmHWM) after the benchmark: run one
// router per process to compare memory (benchmarks/compare/model_cost.py does).
//
//   ./benchmarks/bench_model_cost --benchmark_filter='similarity'
//   /usr/bin/python3 benchmarks/compare/model_cost.py --build-dir build     (ratios to softmax)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/optim.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kBatch = 1, kSeq = 512, kDefaultVocab = 8000;

// The vocabulary: GRAPHMOE_BENCH_VOCAB when set (a whole number in [2, 1e7]), else 8,000.
index_t vocab() {
  const char* v = std::getenv("GRAPHMOE_BENCH_VOCAB");
  if (v == nullptr || *v == '\0') return kDefaultVocab;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || n < 2 || n > 10'000'000)
    throw std::invalid_argument(std::string("bench_model_cost: GRAPHMOE_BENCH_VOCAB must be a whole "
                                            "number from 2 to 10000000, got '") + v + "'");
  return static_cast<index_t>(n);
}

// VmHWM of /proc/self/status in MiB (0 where /proc is missing).
double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      in >> kib;
      return kib / 1024.0;
    }
    std::getline(in, key);
  }
  return 0.0;
}

template <class Policy>
struct Fixture {
  const index_t kVocab = vocab();
  TransformerLM<Policy, float> lm{TransformerLMConfig::paper_medium(kVocab), /*seed=*/1};
  AdamW<float> opt{lm.arena(), AdamWConfig{}};
  Tensor<std::int32_t> ids{Shape{kBatch, kSeq}}, targets{Shape{kBatch, kSeq}};
  std::int64_t step = 0;

  Fixture() {
    Rng rng(1234);
    for (index_t i = 0; i < kBatch * kSeq; ++i) {
      ids.data()[i] = static_cast<std::int32_t>(rng.next_u32() % kVocab);
      targets.data()[i] = static_cast<std::int32_t>(rng.next_u32() % kVocab);
    }
  }
  double train_step() {
    lm.set_step(step++);
    const double loss = lm.forward(ids, targets).total();
    lm.arena().zero_grad();
    lm.backward();
    benchmark::DoNotOptimize(clip_grad_norm(lm.arena(), 1.0));
    opt.step(lm.arena());
    return loss;
  }
};

template <class Policy>
void BM_forward(benchmark::State& state) {
  set_num_threads(static_cast<int>(state.range(0)));
  Fixture<Policy> f;
  benchmark::DoNotOptimize(f.lm.forward(f.ids, f.targets).total());  // first-touch allocations
  for (auto _ : state) benchmark::DoNotOptimize(f.lm.forward(f.ids, f.targets).total());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kBatch * kSeq),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  state.counters["vocabulary"] = static_cast<double>(f.kVocab);
  set_num_threads(1);
}

template <class Policy>
void BM_train_step(benchmark::State& state) {
  set_num_threads(static_cast<int>(state.range(0)));
  Fixture<Policy> f;
  f.train_step();
  for (auto _ : state) benchmark::DoNotOptimize(f.train_step());
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kBatch * kSeq),
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  set_num_threads(1);
}

void args(benchmark::internal::Benchmark* b) {
  b->Args({1})->ArgNames({"threads"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
}

}  // namespace

BENCHMARK(BM_forward<SoftmaxRouter>)->Name("forward/softmax")->Apply(args);
BENCHMARK(BM_forward<SimilarityRouter>)->Name("forward/similarity")->Apply(args);
BENCHMARK(BM_forward<AttentionRouter>)->Name("forward/attention")->Apply(args);
BENCHMARK(BM_train_step<SoftmaxRouter>)->Name("train_step/softmax")->Apply(args);
BENCHMARK(BM_train_step<SimilarityRouter>)->Name("train_step/similarity")->Apply(args);
BENCHMARK(BM_train_step<AttentionRouter>)->Name("train_step/attention")->Apply(args);

int main(int argc, char** argv) {
  try {
    vocab();  // a bad GRAPHMOE_BENCH_VOCAB is reported before any benchmark runs
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
