// The MoE layer's forward + backward on one long sequence, per router and token-graph memory mode
// (GraphMemory, routing/policies.hpp): D = 352, E = 16, d_ff = 352, top-2, float, causal graphs,
// 1 thread, T = 256 .. 8,192 tokens (bench_moe's medium shape, one sequence instead of 4 x 512).
// The attention router's cache has 4 heads (probs and dprobs (1, 4, T, T): 2 GiB at T = 8,192).
//
// Counters (besides the time per forward + backward):
//   layer_peak_MiB  the layer's own peak memory: the process's peak resident set (VmHWM, reset
//                   through /proc/self/clear_refs) during the layer's first forward + backward in
//                   the process, minus the resident set (VmRSS) just before it. Memory freed by
//                   an earlier benchmark stays mapped and would be reused unseen, so this counter
//                   needs one benchmark per process (compare/moe_long.py runs them so; the
//                   library's own later calls of the same benchmark report the first call's
//                   figure). Resident before, so not
//                   counted: the parameters and their gradients, u, dy and the attention cache
//                   (probs, v, out and the gradient sinks dprobs, dv, dout, all written before).
//                   Counted: every buffer the layer, its router and its graph allocate in their
//                   first forward + backward (activations, caches kept for backward, scratch),
//                   and du. 0 where /proc is missing.
//   peak_rss_MiB    the process's VmHWM at the end (the inputs included).
//   inputs_MiB      the bytes of u, dy and the attention cache, for reference.
//
//   ./benchmarks/bench_moe_long --benchmark_filter='/8192/'
//   /usr/bin/python3 benchmarks/compare/moe_long.py --build-dir build    (ratios to softmax)
#include <benchmark/benchmark.h>

#include <cmath>
#include <fstream>
#include <string>

#include "bench_support.hpp"
#include "graphmoe/layers/moe.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kD = 352, kE = 16, kFF = 352, kK = 2, kHeads = 4;

// A field of /proc/self/status in MiB (0 where /proc is missing).
double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == field) {
      double kib = 0;
      in >> kib;
      return kib / 1024.0;
    }
    std::getline(in, key);
  }
  return 0.0;
}

// Resets VmHWM to the current resident set (Linux >= 4.0); false where that is not possible.
bool reset_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

template <class T>
double mib(const Tensor<T>& t) {
  return static_cast<double>(t.numel()) * sizeof(T) / (1024.0 * 1024.0);
}

// Arguments: {T, memory (0 Auto, 1 Store, 2 Recompute)}.
template <class Policy>
void BM_moe_long(benchmark::State& state) {
  using T = float;
  set_num_threads(1);
  const index_t len = state.range(0);
  const auto memory = static_cast<GraphMemory>(state.range(1));
  MoEConfig cfg;
  cfg.d_model = kD;
  cfg.d_ff = kFF;
  cfg.router.num_experts = kE;
  cfg.router.k = kK;
  cfg.router.causal = true;
  cfg.router.allow_unused_options = true;  // one config for every router benchmarked
  cfg.router.options<Similarity>().memory = memory;
  cfg.router.options<Attention>().memory = memory;
  ParameterArena<T> arena;
  MoELayer<Policy, T> layer;
  layer.declare(arena, "moe.", cfg);
  arena.allocate();
  layer.bind(arena);
  Rng rng(1);
  layer.init(rng);
  auto u = bench::normal<T>({len, kD}, rng, 1.0);
  auto dy = bench::normal<T>({len, kD}, rng, 1.0);
  AttentionCache<T> cache;
  if constexpr (Policy::needs_attention) {
    // the attention layer's cache for one causal sequence, sinks resident before the measurement
    cache = bench::attention_cache<T>(u, 1, len, kD, kHeads, /*causal=*/true, rng);
    for (auto* t : {&cache.dprobs, &cache.dv, &cache.dw_o, &cache.db_o, &cache.dout}) t->zero();
  }
  GraphContext<T> ctx{len, Policy::needs_attention ? &cache : nullptr};
  Tensor<T> y, du;
  arena.zero_grad();
  // the first forward + backward, measured for memory in the process's first call (untimed)
  static double layer_peak = -1;
  const bool first = layer_peak < 0;
  const bool can_reset = first && reset_peak();
  const double rss0 = status_mib("VmRSS:");
  layer.forward(u, ctx, y);
  layer.backward(dy, du);
  if (first) layer_peak = can_reset ? status_mib("VmHWM:") - rss0 : 0.0;
  for (auto _ : state) {
    layer.forward(u, ctx, y);
    arena.zero_grad();
    layer.backward(dy, du);
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(du.data());
  }
  double inputs = mib(u) + mib(dy);
  for (const auto* t : {&cache.probs, &cache.v, &cache.out, &cache.dprobs, &cache.dv, &cache.dout})
    inputs += mib(*t);
  state.counters["layer_peak_MiB"] = layer_peak;
  state.counters["peak_rss_MiB"] = status_mib("VmHWM:");
  state.counters["inputs_MiB"] = inputs;
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(len),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

void lengths(benchmark::internal::Benchmark* b, bool graph) {
  for (index_t len : {256, 512, 1024, 2048, 4096, 8192}) {
    if (!graph) {
      b->Args({len, 0});
      continue;
    }
    for (int memory : {1, 2}) b->Args({len, memory});
  }
  b->ArgNames({"T", "memory"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
}

}  // namespace

BENCHMARK(BM_moe_long<SoftmaxRouter>)->Name("moe_long/softmax")->Apply([](auto* b) { lengths(b, false); });
BENCHMARK(BM_moe_long<SimilarityRouter>)->Name("moe_long/similarity")->Apply([](auto* b) { lengths(b, true); });
BENCHMARK(BM_moe_long<AttentionRouter>)->Name("moe_long/attention")->Apply([](auto* b) { lengths(b, true); });

BENCHMARK_MAIN();
