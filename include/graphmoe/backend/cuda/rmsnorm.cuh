// graphmoe/backend/cuda/rmsnorm.cuh: RMS normalisation over the last dimension, on the GPU.
//
// The CUDA system's rmsnorm (contract and argument checks: ops/rmsnorm.hpp, which calls these
// through the backend tag), on Tensor<T, cuda>; the formulas:
//
//   inv_rms_i = 1 / sqrt((1/D) sum_j x_ij^2 + eps)          y_ij = T(x_ij inv_rms_i) w_j
//   dx_ij  = inv_rms_i (g_ij - xhat_ij (1/D) sum_k g_ik xhat_ik)      (assigned)
//   dw_j  += sum_i dy_ij xhat_ij                                      (accumulated)
//   with g_ij = dy_ij w_j, xhat_ij = x_ij inv_rms_i; x read as (N, D), w (D), inv_rms (N).
//
// Forward and dx: one thread block per row (up to 256 threads, fewer for short rows), block-wide
// reductions in acc_t<T> (fp32 for float, where the CPU op uses double: the backends agree to
// about 1e-6 relative for float).
//
// dweight without atomics, deterministic: the rows are cut into fixed chunks of 64 (the CPU op's
// blocks); one thread per (chunk, column) sums its chunk's rows in order into a (chunks, D)
// partial array in acc_t<T>, then one thread per column adds the partials in chunk order. The
// partials are read from x and dy before dx is written, so dx may alias dy; y may alias x.
// Nothing is read back: both functions are asynchronous.
//
// T = __nv_bfloat16 or __half: every element is widened to fp32 and the math runs in fp32, with
// one rounding per stored entry; xhat is rounded to T before it is multiplied by w (as
// LlamaRMSNorm does), and the cache inv_rms is stored in T (backward reads the rounded value).
// eps is given in double and converted to acc_t<T>.
#pragma once

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// Rows per chunk of the weight-gradient partial sums: the CPU op's kRmsnormBlockRows.
inline constexpr index_t kRmsnormChunkRows = 64;

template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, acc_t<T> eps, index_t n, index_t d,
                                       T* y, T* inv_rms) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    A s = A(0);
    for (index_t j = threadIdx.x; j < d; j += blockDim.x) {
      const A v = to_acc(xr[j]);
      s += v * v;
    }
    const A ms = block_reduce(s, SumOp{}, A(0)) / static_cast<A>(d);
    const A rs = A(1) / nn_sqrt(ms + eps);
    if (threadIdx.x == 0) inv_rms[r] = from_acc<T>(rs);
    // every read of the row for the sum is behind the reduction's barriers: y may alias x
    for (index_t j = threadIdx.x; j < d; j += blockDim.x)
      yr[j] = from_acc<T>(to_acc(from_acc<T>(to_acc(xr[j]) * rs)) * to_acc(w[j]));
  }
}

template <class T>
__global__ void rmsnorm_backward_dx_kernel(const T* x, const T* w, const T* inv_rms, const T* dy,
                                           index_t n, index_t d, T* dx) {
  using A = acc_t<T>;
  const A inv_d = A(1) / static_cast<A>(d);
  for (index_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const A rs = to_acc(inv_rms[r]);
    A sgx = A(0);
    for (index_t j = threadIdx.x; j < d; j += blockDim.x)
      sgx += (to_acc(dyr[j]) * to_acc(w[j])) * (to_acc(xr[j]) * rs);
    const A mean_gx = block_reduce(sgx, SumOp{}, A(0)) * inv_d;
    // every read of the row for the sum is behind the reduction's barriers: dx may alias dy
    for (index_t j = threadIdx.x; j < d; j += blockDim.x) {
      const A xv = to_acc(xr[j]);
      dxr[j] = from_acc<T>(rs * (to_acc(dyr[j]) * to_acc(w[j]) - xv * rs * mean_gx));
    }
  }
}

// partial[g * d + j] = sum over chunk g's rows i, in order, of dy_ij x_ij inv_rms_i.
template <class T>
__global__ void rmsnorm_dweight_partial_kernel(const T* x, const T* dy, const T* inv_rms,
                                               index_t n, index_t d, index_t chunks,
                                               acc_t<T>* partial) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(e, chunks * d) {
    const index_t g = e / d, j = e % d;
    const index_t end = (g + 1) * kRmsnormChunkRows < n ? (g + 1) * kRmsnormChunkRows : n;
    A s = A(0);
    for (index_t i = g * kRmsnormChunkRows; i < end; ++i)
      s += to_acc(dy[i * d + j]) * (to_acc(x[i * d + j]) * to_acc(inv_rms[i]));
    partial[e] = s;
  }
}

// dw_j += the partials of column j, added in chunk order (the sum rounded once).
template <class T>
__global__ void rmsnorm_dweight_reduce_kernel(const acc_t<T>* partial, index_t chunks, index_t d,
                                              T* dw) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(j, d) {
    A total = A(0);
    for (index_t g = 0; g < chunks; ++g) total += partial[g * d + j];
    dw[j] = from_acc<T>(to_acc(dw[j]) + total);
  }
}

}  // namespace detail

// y (x's shape) and inv_rms (N) prepared by ops/rmsnorm.hpp.
template <class T>
void rmsnorm_forward(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& weight, double eps,
                     Tensor<T, cuda>& y, Tensor<T, cuda>& inv_rms) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::rmsnorm_forward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  const index_t n = x.rows(), d = x.cols();
  if (n == 0) return;
  detail::launch_kernel<detail::rmsnorm_forward_kernel<T>>(
      detail::grid_for_rows(n), detail::threads_for_row(d), x.data(), weight.data(),
      static_cast<detail::acc_t<T>>(eps), n, d, y.data(), inv_rms.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dx (x's shape) and dweight (D) prepared by ops/rmsnorm.hpp.
template <class T>
void rmsnorm_backward(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& weight,
                      const Tensor<T, cuda>& inv_rms, const Tensor<T, cuda>& dy,
                      Tensor<T, cuda>& dx, Tensor<T, cuda>& dweight) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::rmsnorm_backward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  using A = detail::acc_t<T>;
  const index_t n = x.rows(), d = x.cols();
  if (n == 0) return;
  const index_t chunks = (n + detail::kRmsnormChunkRows - 1) / detail::kRmsnormChunkRows;
  auto partial = Tensor<A, cuda>::uninitialized(Shape{chunks, d});  // written in full
  // 1. the partials, reading x and dy before dx (which may alias dy) is written
  detail::launch_kernel<detail::rmsnorm_dweight_partial_kernel<T>>(
      detail::grid_for(chunks * d), detail::kThreads, x.data(), dy.data(), inv_rms.data(), n, d,
      chunks, partial.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // 2. dweight += the partials, in chunk order
  detail::launch_kernel<detail::rmsnorm_dweight_reduce_kernel<T>>(
      detail::grid_for(d), detail::kThreads, partial.data(), chunks, d, dweight.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // 3. dx
  detail::launch_kernel<detail::rmsnorm_backward_dx_kernel<T>>(
      detail::grid_for_rows(n), detail::threads_for_row(d), x.data(), weight.data(),
      inv_rms.data(), dy.data(), n, d, dx.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
