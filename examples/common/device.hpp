// Moving host data (batches) to the training loop's backend and results back, for the examples'
// loops written once for graphmoe::cpu and graphmoe::cuda. The CUDA overloads of to_device /
// to_host come from graphmoe/cuda.cuh, which the .cu instantiations include first.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "graphmoe/train/training_state.hpp"

namespace examples {

// t on backend B: t itself for the CPU, a device copy for CUDA.
template <class B, class T>
graphmoe::Tensor<T, B> on_backend(const graphmoe::Tensor<T, graphmoe::cpu>& t) {
  if constexpr (std::is_same_v<B, graphmoe::cpu>) {
    return t;
  } else {
    return to_device(t);
  }
}

// t's values on the host (t itself for the CPU).
using graphmoe::detail::host_values;

// Throws when backend B cannot run here (no CUDA device); nothing for the CPU. The CUDA
// specialisation is in common/device_cuda.cuh.
template <class B>
void require_device(const char*) {}

// The GEMM compute type of --precision bf16 on backend B (the models' mixed precision, C in
// TransformerLM<Policy, float, B, C>): void where B has none (the CPU); __nv_bfloat16 for CUDA,
// specialised in common/device_cuda.cuh.
template <class B>
struct Bf16Compute {
  using type = void;
};

// A training step's forward and backward, replayed from a CUDA graph when asked (train_lm
// --cuda-graph): the CPU runs the step as it is (the CUDA specialisation, common/device_cuda.cuh,
// runs it eagerly once, captures it the next time into a graphmoe::CudaGraph and replays it from
// then on). The step must read its inputs from tensors that stay the same between calls.
template <class B>
class StepGraph {
 public:
  explicit StepGraph(bool = false) {}
  bool enabled() const { return false; }
  template <class F>
  void run(F&& step) {
    std::forward<F>(step)();
  }
  // Drops the graph (before the model runs eagerly at other shapes: an evaluation).
  void reset() {}
  std::size_t captures() const { return 0; }
};

}  // namespace examples
