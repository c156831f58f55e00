// Compiled by nvcc in every build with GRAPHMOE_ENABLE_CUDA (tests/CMakeLists.txt): the headers
// meant for device code and every backend/cuda header compile as CUDA, each included twice
// (include guards), and the Philox stream (core/rng.hpp) and GRAPHMOE_HOST_DEVICE functions
// compile into a kernel. The g++ counterpart is tests/packaging.cmake ("headers: self-contained"),
// which skips backend/cuda/.
#include "graphmoe/config.hpp"
#include "graphmoe/config.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/tensor.hpp"

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/attention.cuh"
#include "graphmoe/backend/cuda/attention.cuh"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/grouped.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/grouped.cuh"
#include "graphmoe/backend/cuda/optim.cuh"
#include "graphmoe/backend/cuda/optim.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/backend/cuda/topk.cuh"
#include "graphmoe/backend/cuda/topk.cuh"
#include "graphmoe/backend/cuda/layernorm.cuh"
#include "graphmoe/backend/cuda/layernorm.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/cross_entropy.cuh"
#include "graphmoe/backend/cuda/cross_entropy.cuh"
#include "graphmoe/backend/cuda/embedding.cuh"
#include "graphmoe/backend/cuda/embedding.cuh"
#include "graphmoe/backend/cuda/dropout.cuh"
#include "graphmoe/backend/cuda/dropout.cuh"
#include "graphmoe/backend/cuda/graph.cuh"
#include "graphmoe/backend/cuda/graph.cuh"
#include "graphmoe/backend/cuda/graph_blend.cuh"
#include "graphmoe/backend/cuda/graph_blend.cuh"
#include "graphmoe/backend/cuda/heads.cuh"
#include "graphmoe/backend/cuda/heads.cuh"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/similarity_graph.cuh"
#include "graphmoe/backend/cuda/similarity_graph.cuh"
#include "graphmoe/backend/cuda/attention_graph.cuh"
#include "graphmoe/backend/cuda/attention_graph.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/backend/cuda/detail/token_graph_math.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/routing/token_graphs.hpp"
#include "graphmoe/routing/token_graphs.hpp"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/gates.cuh"
#include "graphmoe/backend/cuda/gates.cuh"
#include "graphmoe/backend/cuda/aux_losses.cuh"
#include "graphmoe/backend/cuda/aux_losses.cuh"
#include "graphmoe/backend/cuda/decode.cuh"
#include "graphmoe/backend/cuda/decode.cuh"
#include "graphmoe/backend/cuda/rmsnorm.cuh"
#include "graphmoe/backend/cuda/rmsnorm.cuh"
#include "graphmoe/backend/cuda/rope.cuh"
#include "graphmoe/backend/cuda/rope.cuh"
#include "graphmoe/backend/cuda/swiglu.cuh"
#include "graphmoe/backend/cuda/swiglu.cuh"
#include "graphmoe/cuda.cuh"
#include "graphmoe/cuda.cuh"

#if !GRAPHMOE_DEVICE_PASS && defined(__CUDA_ARCH__)
#error "GRAPHMOE_DEVICE_PASS must be 1 in nvcc's device pass"
#endif

namespace {

GRAPHMOE_HOST_DEVICE inline float twice(float x) { return 2.0f * x; }

// word n of the stream for `seed`, and its uniform float, on the device
__global__ void philox_kernel(std::uint64_t seed, std::uint32_t* words, float* uniforms, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  words[i] = graphmoe::philox_word(seed, static_cast<std::uint64_t>(i));
  uniforms[i] = twice(graphmoe::uniform_float(words[i])) / 2.0f;
}

}  // namespace

// Host code that names the device tensor type and launches the kernel, so both are instantiated.
void graphmoe_cuda_header_check(std::uint64_t seed, int n) {
  graphmoe::Tensor<std::uint32_t, graphmoe::cuda> words(graphmoe::Shape{n});
  graphmoe::Tensor<float, graphmoe::cuda> uniforms(graphmoe::Shape{n});
  philox_kernel<<<(n + 255) / 256, 256, 0, graphmoe::cuda_stream()>>>(seed, words.data(),
                                                                       uniforms.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}
