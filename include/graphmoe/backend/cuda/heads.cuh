// graphmoe/backend/cuda/heads.cuh: the CUDA system's key/value head sharing, head joins and
// splits on Tensor<T, cuda> (contract and argument checks: ops/heads.hpp). One thread per output
// entry; repeat_heads' backward sums a group's heads in head order, as the CPU.
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

// One thread per entry of the joined (N, heads (wa + wb)) matrix.
template <class T>
__global__ void concat_heads_kernel(const T* a, const T* b, T* y, index_t n, index_t heads,
                                    index_t wa, index_t wb) {
  const index_t w = wa + wb, width = heads * w;
  GRAPHMOE_CUDA_GRID_STRIDE(o, n * width) {
    const index_t i = o / width, c = o % width, h = c / w, j = c % w;
    y[o] = j < wa ? a[i * heads * wa + h * wa + j] : b[i * heads * wb + h * wb + (j - wa)];
  }
}

template <class T>
__global__ void split_heads_kernel(const T* x, T* a, T* b, index_t n, index_t heads, index_t wa,
                                   index_t wb) {
  const index_t w = wa + wb, width = heads * w;
  GRAPHMOE_CUDA_GRID_STRIDE(o, n * width) {
    const index_t i = o / width, c = o % width, h = c / w, j = c % w;
    if (j < wa)
      a[i * heads * wa + h * wa + j] = x[o];
    else
      b[i * heads * wb + h * wb + (j - wa)] = x[o];
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

template <class T>
void concat_heads(cuda, const Tensor<T, cuda>& a, const Tensor<T, cuda>& b, index_t heads,
                  Tensor<T, cuda>& y) {
  const index_t n = a.rows(), wa = a.cols() / heads, wb = b.cols() / heads;
  if (n == 0) return;
  detail::launch_kernel<detail::concat_heads_kernel<T>>(detail::grid_for(n * heads * (wa + wb)),
                                                        detail::kThreads, a.data(), b.data(),
                                                        y.data(), n, heads, wa, wb);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void split_heads(cuda, const Tensor<T, cuda>& x, index_t heads, index_t width_a,
                 Tensor<T, cuda>& a, Tensor<T, cuda>& b) {
  const index_t n = x.rows(), wa = width_a, wb = x.cols() / heads - width_a;
  if (n == 0) return;
  detail::launch_kernel<detail::split_heads_kernel<T>>(detail::grid_for(n * heads * (wa + wb)),
                                                       detail::kThreads, x.data(), a.data(),
                                                       b.data(), n, heads, wa, wb);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
