// Moving host data (batches) to the training loop's backend and results back, for the examples'
// loops written once for graphmoe::cpu and graphmoe::cuda. The CUDA overloads of to_device /
// to_host come from graphmoe/cuda.cuh, which the .cu instantiations include first.
#pragma once

#include <type_traits>

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

}  // namespace examples
