// graphmoe/routing/token_graphs_cuda.cuh: the token graphs on the GPU, GraphImpl<Policy, T, cuda>.
//
// Same members, contract, options and error messages as the CPU graphs (token_graphs.hpp):
//   configure(d_model, cfg)
//   forward(u, r, ctx, p)                       p assigned (N, E)
//   backward(u, r, p, dp, ctx, dr, du)          dr assigned, du accumulated (+=)
//   mean_entropy()                              mean row entropy of G in the last forward
// on Tensor<T, cuda> (T = float or double), with GraphContext<T, cuda> and AttentionCache<T, cuda>.
// The kernels are in backend/cuda/token_graph.cuh.
//
// Differences from the CPU graphs, none of them in the results beyond rounding:
//   - Similarity never stores S: the forward is one fused online-softmax kernel that keeps the
//     row log-sum-exp and entropy (O(N)), and the backward recomputes S tile by tile. So
//     Similarity::Options::memory is ignored: the GPU path always recomputes (it costs one
//     more U U^T product in backward, as GraphMemory::Recompute does on the CPU).
//   - Attention::Options::memory is ignored: the GPU graph keeps A^p (posterior()).
//   - row_entropy() (Similarity) and posterior() (Attention) are device tensors; heads() is a
//     host vector, copied back during forward (the forward synchronises the stream there, and
//     once more to read the all-zero-row flag, as the softmax op does).
//   - mean_entropy() reads the N row entropies back to the host (synchronises) and averages them
//     in double.
//   - Sums run in other orders (tiles, warp reductions, cuBLAS) and the float kernels use fused
//     multiply-adds: float results agree with the CPU to about 1e-6 relative.
//
// This header includes both CUDA graphs; each also has its own header:
//   routing/graphs/similarity_cuda.cuh  GraphImpl<Similarity, T, cuda>
//   routing/graphs/attention_cuda.cuh   GraphImpl<Attention, T, cuda>
// GraphImpl<Independent, T, B> (p = r) is the backend-generic one of graphs/independent.hpp.
#pragma once

#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include "graphmoe/routing/graphs/attention_cuda.cuh"
#include "graphmoe/routing/graphs/similarity_cuda.cuh"
#include "graphmoe/routing/token_graphs.hpp"
