// GEMM benchmarks: graphmoe::gemm (float, row-major C = A B) and, when built with OpenBLAS,
// cblas_sgemm on the same row-major buffers.
//
// Arguments: M, K, N, threads. The shapes are those of an MoE transformer block at width 352
// (FFN 4x = 1408) over 2048 tokens, and a small per-expert GEMM:
//   2048 x 352 x 1408   FFN up-projection        (tokens, d_model) x (d_model, d_ff)
//   2048 x 1408 x 352   FFN down-projection      (tokens, d_ff) x (d_ff, d_model)
//    256 x 352 x 352    one expert's share of the tokens through a square projection
// Threads: graphmoe::set_num_threads(t) for graphmoe::gemm, which splits C into t panels over
// OpenMP with a single-threaded OpenBLAS (or Eigen) product each; openblas_set_num_threads(t)
// for cblas_sgemm, i.e. OpenBLAS's own pthreads.
// Counters: FLOPS = 2 M N K per iteration as a rate; bytes_per_second counts reading A and B
// and writing C once ((M K + K N + M N) * 4 bytes), a lower bound on the memory traffic.
// Wall-clock time (UseRealTime), because both libraries run worker threads.
#include <benchmark/benchmark.h>

#include <cstdint>

#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/ops/gemm.hpp"

#if defined(GRAPHMOE_BENCH_HAVE_CBLAS)
#include <cblas.h>
#endif

// Which GEMM kernel graphmoe::gemm ends up in, shown beside each result.
#if !defined(GRAPHMOE_BENCH_LABEL)
#if defined(EIGEN_USE_BLAS)
#define GRAPHMOE_BENCH_LABEL "Eigen->OpenBLAS"
#else
#define GRAPHMOE_BENCH_LABEL "Eigen kernel"
#endif
#endif

namespace {

using graphmoe::index_t;
using graphmoe::Shape;
using graphmoe::Tensor;

Tensor<float> random_matrix(index_t rows, index_t cols, std::uint64_t seed) {
  Tensor<float> t(Shape{rows, cols});
  graphmoe::Rng rng(seed);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(rng.uniform(-1, 1));
  return t;
}

struct GemmCase {
  index_t m, k, n;
  int threads;
  Tensor<float> a, b, c;  // (M, K), (K, N), (M, N)

  explicit GemmCase(const benchmark::State& state)
      : m(state.range(0)), k(state.range(1)), n(state.range(2)),
        threads(static_cast<int>(state.range(3))),
        a(random_matrix(m, k, 1)), b(random_matrix(k, n, 2)), c(Shape{m, n}) {}

  void set_counters(benchmark::State& state) const {
    const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) *
                         static_cast<double>(k);
    state.counters["FLOPS"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
    const double bytes = static_cast<double>(m * k + k * n + m * n) * sizeof(float);
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  }
};

void gemm_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"M", "K", "N", "threads"});
  for (int threads : {1, 2}) {
    b->Args({2048, 352, 1408, threads});
    b->Args({2048, 1408, 352, threads});
    b->Args({256, 352, 352, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void BM_graphmoe_gemm(benchmark::State& state) {
  GemmCase g(state);
  graphmoe::set_num_threads(g.threads);
  for (auto _ : state) {
    graphmoe::gemm(graphmoe::Trans::N, graphmoe::Trans::N, 1.0f, g.a, g.b, 0.0f, g.c);
    benchmark::DoNotOptimize(g.c.data());
    benchmark::ClobberMemory();
  }
  g.set_counters(state);
  state.SetLabel(GRAPHMOE_BENCH_LABEL);
  graphmoe::set_num_threads(1);
}
BENCHMARK(BM_graphmoe_gemm)->Apply(gemm_shapes);

#if defined(GRAPHMOE_BENCH_HAVE_CBLAS)
void BM_cblas_sgemm(benchmark::State& state) {
  GemmCase g(state);
  openblas_set_num_threads(g.threads);  // graphmoe::set_num_threads keeps OpenBLAS at 1 thread
  const int m = static_cast<int>(g.m), k = static_cast<int>(g.k), n = static_cast<int>(g.n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, g.a.data(), k,
                g.b.data(), n, 0.0f, g.c.data(), n);
    benchmark::DoNotOptimize(g.c.data());
    benchmark::ClobberMemory();
  }
  g.set_counters(state);
  state.SetLabel("OpenBLAS");
  openblas_set_num_threads(1);
}
BENCHMARK(BM_cblas_sgemm)->Apply(gemm_shapes);
#endif

}  // namespace

BENCHMARK_MAIN();
