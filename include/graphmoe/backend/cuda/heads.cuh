// graphmoe/backend/cuda/heads.cuh: the CUDA system's key/value head sharing on Tensor<T, cuda>
// (contract and argument checks: ops/heads.hpp). One thread per output entry; the backward sums a
// group's heads in head order, as the CPU.
#pragma once

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void repeat_heads_kernel(const T* x, T* y, index_t n, index_t kv_heads, index_t heads,
                                    index_t dh) {
  const index_t g = heads / kv_heads, width = heads * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(o, n * width) {
    const index_t i = o / width, c = o % width, h = c / dh, j = c % dh;
    y[o] = x[i * kv_heads * dh + (h / g) * dh + j];
  }
}

template <class T>
__global__ void repeat_heads_backward_kernel(const T* dy, T* dx, index_t n, index_t kv_heads,
                                             index_t heads, index_t dh) {
  const index_t g = heads / kv_heads, width = kv_heads * dh;
  GRAPHMOE_CUDA_GRID_STRIDE(o, n * width) {
    const index_t i = o / width, c = (o % width) / dh, j = o % dh;
    const T* row = dy + i * heads * dh;
    T s = row[(c * g) * dh + j];
    for (index_t r = 1; r < g; ++r) s += row[(c * g + r) * dh + j];
    dx[o] = s;
  }
}

}  // namespace detail

template <class T>
void repeat_heads(cuda, const Tensor<T, cuda>& x, index_t kv_heads, index_t heads,
                  Tensor<T, cuda>& y) {
  const index_t n = x.rows(), dh = x.cols() / kv_heads;
  if (n == 0) return;
  detail::launch_kernel<detail::repeat_heads_kernel<T>>(detail::grid_for(n * heads * dh),
                                                        detail::kThreads, x.data(), y.data(), n,
                                                        kv_heads, heads, dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void repeat_heads_backward(cuda, const Tensor<T, cuda>& dy, index_t kv_heads, index_t heads,
                           Tensor<T, cuda>& dx) {
  const index_t n = dy.rows(), dh = dy.cols() / heads;
  if (n == 0) return;
  detail::launch_kernel<detail::repeat_heads_backward_kernel<T>>(
      detail::grid_for(n * kv_heads * dh), detail::kThreads, dy.data(), dx.data(), n, kv_heads,
      heads, dh);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
