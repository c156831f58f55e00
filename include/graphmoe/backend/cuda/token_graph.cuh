// graphmoe/backend/cuda/token_graph.cuh: the CUDA system's token graphs, one file per graph:
// similarity_graph.cuh (with similarity_blocks.cuh, its block path) and attention_graph.cuh;
// here what they share (contract, options and argument checks: ops/token_graph.hpp, which calls
// the entry points through the backend tag). Their products go through gemm.cuh's batched_gemm,
// their shared pieces are in detail/graph_products.cuh and their element math in
// detail/token_graph_math.hpp (shared with the host test).
//
// Differences from the CPU graphs (backend/cpu/token_graph.hpp), none of them in the results
// beyond rounding:
//   - Similarity has two paths. The block path (similarity_blocks.cuh: cuBLAS products, on
//     TF32 / bf16 tensor cores under a reduced precision, and fused masked-softmax row kernels)
//     runs for GraphPrecision::TF32 / BF16 and for any of a learned temperature, exclude_self
//     and projection; it keeps what the CPU keeps. The fused kernels (GraphPrecision::Exact
//     without those options, the fp32 reference) never store S: one online-softmax kernel
//     keeps the row log-sum-exp and entropy (O(N)), and the backward recomputes S tile by tile.
//     So there args.store is ignored (state.stores stays false; it costs one more U U^T product
//     in backward, as GraphMemory::Recompute does on the CPU) and there are no self weights
//     (state.self stays empty).
//   - Attention always keeps A^p (args.store is ignored, state.stores is true); its row entropies
//     stay on the device (state.backend.entropy; state.row_entropy and state.self stay empty);
//     h* stays on the device (state.backend.head_dev; attention_graph_heads reads it back):
//     every head's work runs at once with each row's queries masked to its head
//     (attention_graph.cuh), so the forward has no read back to the host: its all-zero-row flag
//     is a deferrable check (core/deferred_check.hpp).
//   - The mean entropies read the N row entropies back to the host (synchronises) and average
//     them in double (detail::device_mean).
//   - Sums run in other orders (tiles, warp reductions, cuBLAS) and the float kernels use fused
//     multiply-adds: float results agree with the CPU to about 1e-6 relative.
#pragma once

#include "graphmoe/backend/cuda/attention_graph.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/graph_products.cuh"
#include "graphmoe/backend/cuda/similarity_graph.cuh"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

// The CUDA graphs implement every option: the Similarity block path (similarity_blocks.cuh)
// covers a learned temperature, exclude_self, projection and the tensor-core precisions.
constexpr TokenGraphSupport token_graph_support(cuda) {
  return TokenGraphSupport{true, true, true, true};
}

// The value of a one-entry parameter (copied to the host).
template <class T>
double token_graph_scalar(cuda, const Tensor<T, cuda>& t) {
  return static_cast<double>(to_host(t).data()[0]);
}

// The mean of the self weights, in double (the CUDA graphs leave them empty: never called there
// by the graph classes, which answer 1 for an empty tensor).
template <class T>
double token_graph_mean_self_weight(cuda, const Tensor<T, cuda>& self) {
  return detail::device_mean(self);
}

}  // namespace graphmoe
