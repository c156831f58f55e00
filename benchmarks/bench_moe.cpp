// MoE layer forward and forward+backward, float, at 1 and 2 threads, causal token graphs:
//   BM_moe_<router>_*       each router at the paper's medium shape: batch 4 x 512 tokens,
//                           D = 352, E = 16 GELU experts of d_ff = 352 with biases, top-2
//                           (TopK's gates renormalised).
//   BM_moe_fine_<router>_*  fine-grained experts, the olmoe preset's MoE layer
//                           (TransformerLMConfig::olmoe): batch 4 x 512 tokens, D = 256, E = 64
//                           SwiGLU experts of width 128 without biases, top-8, gates not
//                           renormalised (norm_topk_prob = false); routers softmax, similarity and
//                           sigmoid_bias (SigmoidBiasRouter).
//
//   ./benchmarks/bench_moe --benchmark_filter='BM_moe'            (all)
//   ./benchmarks/bench_moe --benchmark_filter='BM_moe_fine'       (the fine-grained rows)
//   python3 benchmarks/compare/moe_layer_torch.py --build-dir build [--shape fine]  (PyTorch)
//
// Arguments: {threads, parallelism (0 = within GEMMs, 1 = across experts)}.
#include <benchmark/benchmark.h>

#include <cmath>

#include "bench_support.hpp"
#include "graphmoe/layers/moe.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kBatch = 4, kSeq = 512, kHeads = 8;

// The layer's shape past the batch: width, experts, expert width, top-k, the experts'
// activation and biases, and whether the gates are renormalised over the k chosen (TopK's
// norm_topk_prob; also BiasBalancedTopK's).
struct LayerShape {
  index_t d, e, ff, k;
  FfnActivation activation;
  bool bias, norm_topk_prob;
};
// The paper's medium shape (MoEConfig's defaults: GELU experts with biases, renormalised gates).
constexpr LayerShape kMedium{352, 16, 352, 2, FfnActivation::Gelu, true, true};
// The olmoe preset's MoE layer: 64 fine-grained SwiGLU experts of width 128 (expert_d_ff), no
// biases (ffn_bias = false), top-8, unnormalised gates.
constexpr LayerShape kFine{256, 64, 128, 8, FfnActivation::SwiGLU, false, false};

template <class Policy>
void BM_moe(benchmark::State& state, bool backward, const LayerShape& s = kMedium) {
  using T = float;
  const index_t d = s.d, k = s.k;
  const int threads = static_cast<int>(state.range(0));
  set_num_threads(threads);
  MoEConfig cfg;
  cfg.d_model = d;
  cfg.d_ff = s.ff;
  cfg.activation = s.activation;
  cfg.bias = s.bias;
  cfg.router.num_experts = s.e;
  cfg.router.k = k;
  cfg.router.allow_unused_options = true;  // one config for every router benchmarked
  cfg.router.options<ScheduledTopK>().k_min = k;
  cfg.router.options<ScheduledTopK>().k_max = k;
  cfg.router.options<TopK>().norm_topk_prob = s.norm_topk_prob;
  cfg.router.causal = true;
  cfg.parallelism = state.range(1) ? ExpertParallelism::AcrossExperts : ExpertParallelism::WithinGemm;
  ParameterArena<T> arena;
  MoELayer<Policy, T> layer;
  layer.declare(arena, "moe.", cfg);
  arena.allocate();
  layer.bind(arena);
  Rng rng(1);
  layer.init(rng);
  auto u = bench::normal<T>({kBatch * kSeq, d}, rng, 1.0);
  auto dy = bench::normal<T>({kBatch * kSeq, d}, rng, 1.0);
  AttentionCache<T> cache = bench::attention_cache<T>(u, kBatch, kSeq, d, kHeads, /*causal=*/true, rng);
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
  // Expert FLOPs only, a yardstick, not the total: per routed slot the first projection (F rows,
  // SwiGLU's fused gate | up 2F) and the second (F), 2 D FLOPs per row; x3 with backward.
  const double flops = 2.0 * (ffn_first_width(s.activation) + 1) * kBatch * kSeq * k * d * s.ff *
                       (backward ? 3.0 : 1.0);
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

#define GRAPHMOE_BENCH_FINE_ROUTER(Policy, name)                                            \
  void BM_moe_fine_##name##_fwd(benchmark::State& s) { BM_moe<Policy>(s, false, kFine); }   \
  void BM_moe_fine_##name##_fwdbwd(benchmark::State& s) { BM_moe<Policy>(s, true, kFine); } \
  BENCHMARK(BM_moe_fine_##name##_fwd)->Apply(args);                                         \
  BENCHMARK(BM_moe_fine_##name##_fwdbwd)->Apply(args)

// The fine-grained rows (the olmoe preset's layer). The sigmoid-bias router's selection bias stays
// at its initial zero (it moves only in after_step, which a layer benchmark does not call).
GRAPHMOE_BENCH_FINE_ROUTER(SoftmaxRouter, softmax);
GRAPHMOE_BENCH_FINE_ROUTER(SimilarityRouter, similarity);
GRAPHMOE_BENCH_FINE_ROUTER(SigmoidBiasRouter, sigmoid_bias);

BENCHMARK_MAIN();
