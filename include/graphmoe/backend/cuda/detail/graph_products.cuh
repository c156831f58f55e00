// graphmoe/backend/cuda/detail/graph_products.cuh: what the CUDA token graphs share (internal;
// similarity_graph.cuh, similarity_blocks.cuh, attention_graph.cuh): their per-sequence operands
// as batched_gemm views (gemm.cuh), a GraphPrecision's GemmMath, the bf16 copies of the operands,
// the row dot and the mean of a device vector.
#pragma once

#include <cuda_bf16.h>

#include <deque>
#include <type_traits>

#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe::detail {

// ---- operands -----------------------------------------------------------------------------------

// The (len, cols) matrices of the sequences stacked in one (nb len, cols) tensor: one problem per
// sequence of a batched_gemm.
template <class T>
MatrixBatch<T> per_sequence(T* x, index_t cols, index_t len) {
  return {x, cols, len * cols};
}

// One (rows, cols) matrix: the same for every problem (or the one problem of a batch of 1).
template <class T>
MatrixBatch<T> whole(T* x, index_t cols) {
  return {x, cols, 0};
}

// How a graph at precision p computes a product of In operands: Exact in In's own type; float
// operands under TF32, and under BF16 the float operands the graphs do not convert (their
// (N, D, dm)-sized products), on TF32 tensor cores; bf16 operands (BF16's copies, GraphOperands)
// with fp32 accumulation. (A double graph is only ever Exact: Options refuse the others.)
template <class In>
GemmMath graph_gemm_math(GraphPrecision p) {
  return p != GraphPrecision::Exact && !std::is_same_v<In, __nv_bfloat16> ? GemmMath::TF32
                                                                           : GemmMath::Default;
}

// The (T, T) products' operands in their input type In: the tensors themselves (In = T: Exact,
// TF32) or bf16 copies made once per call and kept until it returns (BF16). Both token graphs'
// block products read their operands through one of these per call.
template <class T, class In>
class GraphOperands {
 public:
  const In* operator()(const Tensor<T, cuda>& x) {
    if constexpr (std::is_same_v<In, T>) {
      return x.data();
    } else {
      copies_.emplace_back();
      convert(x, copies_.back());
      return copies_.back().data();
    }
  }

 private:
  std::deque<Tensor<In, cuda>> copies_;  // a deque: the copies never move
};

// ---- row work -----------------------------------------------------------------------------------

// Blocks of kThreads for one warp per row.
inline unsigned graph_warp_rows_blocks(index_t rows) {
  return grid_for(rows, kThreads / 32);
}

// out[row] = x_row . y_row, one warp per row.
template <class T>
__global__ void graph_row_dot_kernel(const T* x, const T* y, T* out, index_t rows, index_t cols) {
  const index_t warps_per_block = blockDim.x / 32;
  const index_t total = static_cast<index_t>(gridDim.x) * warps_per_block;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (index_t row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < rows; row += total) {
    T s = T(0);
    for (index_t j = lane; j < cols; j += 32) s += x[row * cols + j] * y[row * cols + j];
    s = warp_reduce(s, SumOp{});
    if (lane == 0) out[row] = s;
  }
}

// out (rows) = row-wise x . y of two (rows, cols) tensors.
template <class T>
void graph_row_dot_cuda(const Tensor<T, cuda>& x, const Tensor<T, cuda>& y, Tensor<T, cuda>& out) {
  if (x.rows() == 0) return;
  launch_kernel<graph_row_dot_kernel<T>>(graph_warp_rows_blocks(x.rows()), kThreads, x.data(),
                                         y.data(), out.data(), x.rows(), x.cols());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// The mean of the n values of a device vector, in double (synchronises).
template <class T>
double device_mean(const Tensor<T, cuda>& x) {
  if (x.empty() || x.numel() == 0) return 0.0;
  const Tensor<T, cpu> h = to_host(x);
  double s = 0;
  for (index_t i = 0; i < h.numel(); ++i) s += static_cast<double>(h.data()[i]);
  return s / static_cast<double>(h.numel());
}

}  // namespace graphmoe::detail
