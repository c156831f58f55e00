// graphmoe/backend/cuda/detail/graph_blas.cuh: the cuBLAS products and the row dot of the CUDA
// token graphs (internal; token_graph.cuh, similarity_blocks.cuh).
#pragma once

#include <cublas_v2.h>

#include <climits>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/trans.hpp"

namespace graphmoe::detail {

// ---- cuBLAS, row-major, strided-batched ---------------------------------------------------------

inline void cublas_gemm_strided(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                int n, int k, float alpha, const float* a, int lda, long long sa,
                                const float* b, int ldb, long long sb, float beta, float* c,
                                int ldc, long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasSgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}
inline void cublas_gemm_strided(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                int n, int k, double alpha, const double* a, int lda, long long sa,
                                const double* b, int ldb, long long sb, double beta, double* c,
                                int ldc, long long sc, int batch) {
  GRAPHMOE_CUBLAS_CHECK(cublasDgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb,
                                                  sb, &beta, c, ldc, sc, batch));
}

// For each of `batch` matrices (pointers advanced by sa, sb, sc elements), row-major
//   C (m, n; row stride ldc) = alpha op(A) op(B) + beta C,
// A (row stride lda) and B (ldb) possibly column slices of wider matrices. As gemm.cuh, computed
// as the column-major C^T = op(B)^T op(A)^T.
template <class T>
void graph_gemm(Trans ta, Trans tb, index_t m, index_t n, index_t k, T alpha, const T* A,
                index_t lda, index_t sa, const T* B, index_t ldb, index_t sb, T beta, T* C,
                index_t ldc, index_t sc, index_t batch) {
  GRAPHMOE_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX &&
                     ldb <= INT_MAX && ldc <= INT_MAX && batch <= INT_MAX,
                 "token graph gemm", "dimensions (", m, ", ", n, ", ", k, ") x ", batch,
                 " exceed cuBLAS's int range");
  if (m == 0 || n == 0 || batch == 0) return;
  cublas_gemm_strided(cublas_handle(), cublas_op(tb), cublas_op(ta), static_cast<int>(n),
                      static_cast<int>(m), static_cast<int>(k), alpha, B, static_cast<int>(ldb),
                      static_cast<long long>(sb), A, static_cast<int>(lda),
                      static_cast<long long>(sa), beta, C, static_cast<int>(ldc),
                      static_cast<long long>(sc), static_cast<int>(batch));
}

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

}  // namespace graphmoe::detail
