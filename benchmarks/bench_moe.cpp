// MoE layer forward and forward+backward for each router at the paper's medium shape:
// batch 4 x 512 tokens, D = 352, E = 16, d_ff = 352, top-2, float, at 1 and 2 threads.
//
//   ./benchmarks/bench_moe --benchmark_filter='BM_moe'            (all)
//   python3 benchmarks/compare/moe_layer_torch.py --build-dir build   (beside PyTorch)
//
// Arguments: {threads, parallelism (0 = within GEMMs, 1 = across experts)}.
#include <benchmark/benchmark.h>

#include <cmath>

#include "bench_support.hpp"
#include "graphmoe/layers/moe.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kBatch = 4, kSeq = 512, kD = 352, kE = 16, kFF = 352, kK = 2, kHeads = 8;

template <class Policy>
void BM_moe(benchmark::State& state, bool backward) {
  using T = float;
  const int threads = static_cast<int>(state.range(0));
  set_num_threads(threads);
  MoEConfig cfg;
  cfg.d_model = kD;
  cfg.d_ff = kFF;
  cfg.router.num_experts = kE;
  cfg.router.k = kK;
  cfg.router.allow_unused_options = true;  // one config for every router benchmarked
  cfg.router.options<ScheduledTopK>().k_min = kK;
  cfg.router.options<ScheduledTopK>().k_max = kK;
  cfg.router.causal = true;
  cfg.parallelism = state.range(1) ? ExpertParallelism::AcrossExperts : ExpertParallelism::WithinGemm;
  ParameterArena<T> arena;
  MoELayer<Policy, T> layer;
  layer.declare(arena, "moe.", cfg);
  arena.allocate();
  layer.bind(arena);
  Rng rng(1);
  layer.init(rng);
  auto u = bench::normal<T>({kBatch * kSeq, kD}, rng, 1.0);
  auto dy = bench::normal<T>({kBatch * kSeq, kD}, rng, 1.0);
  AttentionCache<T> cache = bench::attention_cache<T>(u, kBatch, kSeq, kD, kHeads, /*causal=*/true, rng);
  GraphContext<T> ctx{kSeq, Policy::needs_attention ? &cache : nullptr};
  Tensor<T> y, du;
  for (auto _ : state) {
    layer.forward(u, ctx, y);
    if (backward) {
      arena.zero_grad();
      layer.backward(dy, du);
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(du.data());
  }
  // Expert FLOPs only (2 GEMMs per routed slot, x3 with backward): a yardstick, not the total.
  const double flops = 2.0 * 2.0 * kBatch * kSeq * kK * kD * kFF * (backward ? 3.0 : 1.0);
  state.counters["expert_GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(kBatch * kSeq), benchmark::Counter::kIsIterationInvariantRate);
  set_num_threads(1);
}

void args(benchmark::internal::Benchmark* b) {
  for (int t : {1, 2}) b->Args({t, 0});
  b->Args({2, 1});
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

}  // namespace

#define GRAPHMOE_BENCH_ROUTER(Policy, name)                                              \
  void BM_moe_##name##_fwd(benchmark::State& s) { BM_moe<Policy>(s, false); }        \
  void BM_moe_##name##_fwdbwd(benchmark::State& s) { BM_moe<Policy>(s, true); }      \
  BENCHMARK(BM_moe_##name##_fwd)->Apply(args);                                       \
  BENCHMARK(BM_moe_##name##_fwdbwd)->Apply(args)

GRAPHMOE_BENCH_ROUTER(SoftmaxRouter, softmax);
GRAPHMOE_BENCH_ROUTER(SimilarityRouter, similarity);
GRAPHMOE_BENCH_ROUTER(AttentionRouter, attention);
GRAPHMOE_BENCH_ROUTER(XMoERouter, xmoe);
GRAPHMOE_BENCH_ROUTER(SMoEDropoutRouter, smoe_dropout);
// Expert choice (each expert takes ceil(512 * 2 / 16) = 64 tokens per sequence: the same expert
// FLOPs as top-2). The graph stays causal as in the rows above (a layer alone does not refuse it).
GRAPHMOE_BENCH_ROUTER(ExpertChoiceRouter, expert_choice);
GRAPHMOE_BENCH_ROUTER(SimilarityExpertChoiceRouter, similarity_expert_choice);

BENCHMARK_MAIN();
