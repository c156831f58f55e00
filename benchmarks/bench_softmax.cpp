// Softmax benchmarks: graphmoe::softmax_forward / softmax_backward (float) over the last
// dimension.
//
// Arguments: rows, cols, threads. Shapes:
//   2048 x 16     router scores: 2048 tokens over 16 experts
//   4096 x 512    attention probabilities: 8 heads x 512 queries over 512 keys
// bytes_per_second counts each tensor read or written once: forward reads x and writes y
// (2 tensors), backward reads y and dy and writes dx (3 tensors).
#include <benchmark/benchmark.h>

#include <cstdint>

#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/ops/softmax.hpp"

namespace {

using graphmoe::index_t;
using graphmoe::Shape;
using graphmoe::Tensor;

Tensor<float> random_tensor(index_t rows, index_t cols, std::uint64_t seed) {
  Tensor<float> t(Shape{rows, cols});
  graphmoe::Rng rng(seed);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(rng.normal());
  return t;
}

void softmax_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "cols", "threads"});
  for (int threads : {1, 2}) {
    b->Args({2048, 16, threads});
    b->Args({8 * 512, 512, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

void set_bytes(benchmark::State& state, const Tensor<float>& t, int tensors) {
  state.SetBytesProcessed(static_cast<std::int64_t>(t.bytes()) * tensors * state.iterations());
}

void BM_softmax_forward(benchmark::State& state) {
  const auto x = random_tensor(state.range(0), state.range(1), 1);
  Tensor<float> y(x.shape());
  graphmoe::set_num_threads(static_cast<int>(state.range(2)));
  for (auto _ : state) {
    graphmoe::softmax_forward(x, y);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, x, 2);
  graphmoe::set_num_threads(1);
}
BENCHMARK(BM_softmax_forward)->Apply(softmax_shapes);

void BM_softmax_backward(benchmark::State& state) {
  const auto x = random_tensor(state.range(0), state.range(1), 1);
  const auto dy = random_tensor(state.range(0), state.range(1), 2);
  Tensor<float> y, dx(x.shape());
  graphmoe::softmax_forward(x, y);
  graphmoe::set_num_threads(static_cast<int>(state.range(2)));
  for (auto _ : state) {
    graphmoe::softmax_backward(y, dy, dx);
    benchmark::DoNotOptimize(dx.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, x, 3);
  graphmoe::set_num_threads(1);
}
BENCHMARK(BM_softmax_backward)->Apply(softmax_shapes);

}  // namespace

BENCHMARK_MAIN();
