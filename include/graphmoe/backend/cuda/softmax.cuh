// graphmoe/backend/cuda/softmax.cuh: the CUDA system's softmax and log-softmax over the last
// dimension (contract and argument checks: ops/softmax.hpp, which calls these through the backend
// tag), on Tensor<T, cuda>:
//
//   softmax:      y_j = exp(x_j - m) / sum_k exp(x_k - m),        m = max_k x_k
//                 dx_j = y_j * (dy_j - sum_k dy_k y_k)
//   log_softmax:  y_j = x_j - m - log(sum_k exp(x_k - m))
//                 dx_j = dy_j - exp(y_j) * sum_k dy_k
//
// One thread block per row (up to 256 threads, fewer for short rows), block-wide reductions with
// warp shuffles. Sums are accumulated in acc_t<T> (fp32 for float, where the CPU op uses double):
// the two backends agree to about 1e-6 relative for float (tests/cuda/test_cuda_ops.cu). -inf
// entries (masked positions) give exactly 0 probability, as exp(-inf) = 0.
//
// T = __nv_bfloat16 or __half: storage only. Every entry is widened to fp32, the max, the sums,
// exp and log run in fp32, and each output entry is rounded once (softmax recomputes exp(x - m)
// in its last pass instead of re-reading a rounded intermediate from y).
//
// The forward functions return the first row whose maximum is not finite (all -inf, a +inf, or a
// NaN) with its NaN and +inf counts (core/bad_row.hpp), for the op layer to throw; the check reads
// one flag back from the device (and that row, if any), so they synchronise the stream. Such rows
// are left untouched in y. Outputs may alias their inputs (y may be x, dx may be dy): each thread
// reads and writes the same entries, after the row's reductions.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/bad_row.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T, bool Log>
__global__ void softmax_forward_kernel(const T* x, T* y, index_t rows, index_t cols,
                                       unsigned long long* bad_row) {
  using A = acc_t<T>;  // T for float and double, fp32 for bf16 and half
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A m = -std::numeric_limits<A>::infinity();
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) m = MaxNanOp{}(m, to_acc(xr[j]));
    m = block_reduce(m, MaxNanOp{}, -std::numeric_limits<A>::infinity());
    if (!isfinite(m)) {  // the same for every thread of the block: no barrier is skipped by some
      if (threadIdx.x == 0) flag_index(bad_row, r);
      continue;
    }
    A s = A(0);
    if (Log) {
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x) s += exp_t(to_acc(xr[j]) - m);
      s = block_reduce(s, SumOp{}, A(0));
      const A lse = log_t(s);
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = from_acc<T>((to_acc(xr[j]) - m) - lse);
    } else if constexpr (is_half_precision_v<T>) {
      // y is not written before the last pass (it may alias x): one rounding per entry
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x) s += exp_t(to_acc(xr[j]) - m);
      s = block_reduce(s, SumOp{}, A(0));
      const A inv = A(1) / s;
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = from_acc<T>(exp_t(to_acc(xr[j]) - m) * inv);
    } else {
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const T e = exp_t(xr[j] - m);
        yr[j] = e;
        s += static_cast<A>(e);
      }
      s = block_reduce(s, SumOp{}, A(0));
      const T inv = static_cast<T>(A(1) / s);
      for (index_t j = threadIdx.x; j < cols; j += blockDim.x) yr[j] *= inv;
    }
  }
}

template <class T, bool Log>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, index_t rows,
                                        index_t cols) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    A s = A(0);
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x)
      s += Log ? to_acc(dyr[j]) : to_acc(dyr[j]) * to_acc(yr[j]);
    const A d = block_reduce(s, SumOp{}, A(0));
    for (index_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const A yj = to_acc(yr[j]), dyj = to_acc(dyr[j]);
      dxr[j] = from_acc<T>(Log ? dyj - exp_t(yj) * d : yj * (dyj - d));
    }
  }
}

// Row `row` of x (no finite maximum) with its NaN and +inf counts, read back from the device.
template <class T>
BadRow softmax_bad_row(const Tensor<T, cuda>& x, index_t row) {
  const index_t cols = x.cols();
  std::vector<T> h(static_cast<std::size_t>(cols));
  GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(h.data(), x.data() + row * cols, sizeof(T) * h.size(),
                                      cudaMemcpyDeviceToHost, cuda_stream()));
  cuda_stream_synchronize();
  using A = acc_t<T>;
  index_t pos_inf = 0, nan = 0;
  for (const T t : h) {
    const A v = to_acc(t);
    if (std::isnan(v)) ++nan;
    if (v == std::numeric_limits<A>::infinity()) ++pos_inf;
  }
  return {row, nan, pos_inf};
}


template <class T, bool Log>
BadRow softmax_forward_impl(const Tensor<T, cuda>& x, Tensor<T, cuda>& y) {
  static_assert(cuda_float_type<T>,
                "graphmoe::softmax: T must be float, double, __nv_bfloat16 or __half");
  const index_t rows = x.rows(), cols = x.cols();
  if (x.numel() == 0) return {};
  FirstIndexFlag bad{FirstIndexFlag::Deferrable{}};
  launch_kernel<softmax_forward_kernel<T, Log>>(grid_for_rows(rows), threads_for_row(cols),
                                                x.data(), y.data(), rows, cols, bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<BadRow>(Log ? "log_softmax_forward" : "softmax_forward",
                            [x](index_t r) { return softmax_bad_row(x, r); });
}

template <class T, bool Log>
void softmax_backward_impl(const Tensor<T, cuda>& y, const Tensor<T, cuda>& dy,
                           Tensor<T, cuda>& dx) {
  const index_t rows = y.rows(), cols = y.cols();
  if (y.numel() == 0) return;
  launch_kernel<softmax_backward_kernel<T, Log>>(grid_for_rows(rows), threads_for_row(cols),
                                                 y.data(), dy.data(), dx.data(), rows, cols);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace detail

// y (x's shape, prepared by ops/softmax.hpp) = softmax(x); returns the first bad row of x.
template <class T>
BadRow softmax_forward(cuda, const Tensor<T, cuda>& x, Tensor<T, cuda>& y) {
  return detail::softmax_forward_impl<T, false>(x, y);
}

// dx = y * (dy - sum(dy * y)) per row; dx prepared by ops/softmax.hpp.
template <class T>
void softmax_backward(cuda, const Tensor<T, cuda>& y, const Tensor<T, cuda>& dy,
                      Tensor<T, cuda>& dx) {
  detail::softmax_backward_impl<T, false>(y, dy, dx);
}

// y (x's shape, prepared by ops/softmax.hpp) = log_softmax(x); returns the first bad row of x.
template <class T>
BadRow log_softmax_forward(cuda, const Tensor<T, cuda>& x, Tensor<T, cuda>& y) {
  return detail::softmax_forward_impl<T, true>(x, y);
}

// dx = dy - exp(y) * sum(dy) per row; dx prepared by ops/softmax.hpp.
template <class T>
void log_softmax_backward(cuda, const Tensor<T, cuda>& y, const Tensor<T, cuda>& dy,
                          Tensor<T, cuda>& dx) {
  detail::softmax_backward_impl<T, true>(y, dy, dx);
}

}  // namespace graphmoe
