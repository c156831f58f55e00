// graphmoe/backend/cuda/layernorm.cuh: layer normalisation over the last dimension, on the GPU.
//
// The CUDA system's layer normalisation (contract and argument checks: ops/layernorm.hpp, which
// calls these through the backend tag), on Tensor<T, cuda>; the formulas:
//
//   mean_i = (1/D) sum_j x_ij        rstd_i = 1 / sqrt((1/D) sum_j (x_ij - mean_i)^2 + eps)
//   xhat_ij = (x_ij - mean_i) rstd_i          y_ij = xhat_ij gamma_j + beta_j
//   dx_ij     = rstd_i (g_ij - (1/D) sum_k g_ik - xhat_ij (1/D) sum_k g_ik xhat_ik)   (assigned)
//   dgamma_j += sum_i dy_ij xhat_ij,   dbeta_j += sum_i dy_ij                       (accumulated)
//   with g_ij = dy_ij gamma_j; x read as (N, D), gamma and beta (D), mean and rstd (N).
//
// Forward and dx: one thread block per row (up to 256 threads, fewer for short rows), block-wide
// reductions; the mean and the variance in two passes (no E[x^2] - E[x]^2 cancellation), row sums
// in acc_t<T> (fp32 for float, where the CPU op uses double: the backends agree to about 1e-6
// relative for float).
//
// dgamma and dbeta without atomics, deterministic: the rows are cut into fixed chunks of 64 (the
// CPU op's blocks); one thread per (chunk, column) sums its chunk's rows in order into a partial
// (chunks, 2 D) array in acc_t<T>, then one thread per column adds the partials in chunk order
// (detail::LayernormParam{Partial,Reduce}Op in detail/nn_functors.hpp, tested against the CPU op
// on the host). The partials are read from x and dy before dx is written, so dx may alias dy or
// x; y may alias x. Nothing is read back: both functions are asynchronous.
//
// T = __nv_bfloat16 or __half: x, gamma, beta, y, dy, dx, dgamma, dbeta are stored in T; every
// element is widened to fp32 and all the math above (means, variances, the row and column sums,
// xhat, dx) runs in fp32, with one rounding per stored entry (dgamma_j + sum is rounded once).
// The cache mean and rstd may be stored in fp32 (Tensor<float, cuda>, recommended: no rounding
// between forward and backward) or in T (the forward's y still uses the fp32 statistics; backward
// then reads the rounded ones, a relative error of 2^-9 (bf16) or 2^-12 (half) in rstd and
// |mean| * 2^-9 (bf16) in the centring). eps is given as T and widened to fp32 (ops/layernorm.hpp
// checks it as a float).
#pragma once

#include <concepts>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// The cache mean and rstd are stored in T, or in acc_t<T> (fp32 for bf16 and half).
template <class S, class T>
concept layernorm_stats_type =
    cuda_float_type<T> && (std::same_as<S, T> || std::same_as<S, acc_t<T>>);

// For float and double (A = T, S = T) every to_acc / value_cast below is the identity: the
// kernels compute exactly the T-precision expressions of the CPU-matching formulas.
template <class T, class S>
__global__ void layernorm_forward_kernel(const T* x, const T* gamma, const T* beta, acc_t<T> eps,
                                         index_t n, index_t d, T* y, S* mean, S* rstd) {
  using A = acc_t<T>;
  for (index_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    A s = A(0);
    for (index_t j = threadIdx.x; j < d; j += blockDim.x) s += to_acc(xr[j]);
    const A mu = block_reduce(s, SumOp{}, A(0)) / static_cast<A>(d);
    A v = A(0);
    for (index_t j = threadIdx.x; j < d; j += blockDim.x) {
      const A c = to_acc(xr[j]) - mu;
      v += c * c;
    }
    const A var = block_reduce(v, SumOp{}, A(0)) / static_cast<A>(d);
    const A rs = A(1) / nn_sqrt(var + eps);
    if (threadIdx.x == 0) {
      mean[r] = value_cast<S>(mu);
      rstd[r] = value_cast<S>(rs);
    }
    // every read of the row is behind the reductions' barriers: y may alias x
    for (index_t j = threadIdx.x; j < d; j += blockDim.x)
      yr[j] = from_acc<T>(
          layernorm_y(to_acc(xr[j]), mu, rs, to_acc(gamma[j]), to_acc(beta[j])));
  }
}

template <class T, class S>
__global__ void layernorm_backward_dx_kernel(const T* x, const T* gamma, const S* mean,
                                             const S* rstd, const T* dy, index_t n, index_t d,
                                             T* dx) {
  using A = acc_t<T>;
  const A inv_d = A(1) / static_cast<A>(d);
  for (index_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const A m = value_cast<A>(mean[r]), rs = value_cast<A>(rstd[r]);
    A sg = A(0), sgx = A(0);
    for (index_t j = threadIdx.x; j < d; j += blockDim.x) {
      const A g = mul_rn(to_acc(dyr[j]), to_acc(gamma[j]));  // rounded, as in layernorm_dx
      sg += g;
      sgx += g * ((to_acc(xr[j]) - m) * rs);
    }
    const A mean_g = block_reduce(sg, SumOp{}, A(0)) * inv_d;
    const A mean_gx = block_reduce(sgx, SumOp{}, A(0)) * inv_d;
    // every read of the row is behind the reductions' barriers: dx may alias dy or x
    for (index_t j = threadIdx.x; j < d; j += blockDim.x)
      dxr[j] = from_acc<T>(layernorm_dx(to_acc(xr[j]), to_acc(dyr[j]), to_acc(gamma[j]), m, rs,
                                        mean_g, mean_gx));
  }
}

// LayernormParamPartialOp (detail/nn_functors.hpp) for 16-bit T and a cache in S: xhat, the
// products and the sums in fp32.
template <class T, class S>
struct LayernormParamPartialAccOp {
  const T* x;     // (n, d)
  const T* dy;    // (n, d)
  const S* mean;  // (n)
  const S* rstd;  // (n)
  index_t n;
  index_t d;
  acc_t<T>* partial;  // (chunks, 2 d)
  __device__ void operator()(index_t e) const {
    using A = acc_t<T>;
    const index_t g = e / d, j = e % d;
    const index_t end = (g + 1) * kLayernormChunkRows < n ? (g + 1) * kLayernormChunkRows : n;
    A sg = A(0), sb = A(0);
    for (index_t i = g * kLayernormChunkRows; i < end; ++i) {
      const A xhat = (to_acc(x[i * d + j]) - value_cast<A>(mean[i])) * value_cast<A>(rstd[i]);
      const A g_ij = to_acc(dy[i * d + j]);
      sg += g_ij * xhat;
      sb += g_ij;
    }
    partial[g * 2 * d + j] = sg;
    partial[g * 2 * d + d + j] = sb;
  }
};

// LayernormParamReduceOp for 16-bit T: the old value plus the fp32 total, rounded once.
template <class T>
struct LayernormParamReduceAccOp {
  const acc_t<T>* partial;
  index_t chunks;
  index_t d;
  T* dgamma;
  T* dbeta;
  __device__ void operator()(index_t j) const {
    acc_t<T> total = acc_t<T>(0);
    for (index_t g = 0; g < chunks; ++g) total += partial[g * 2 * d + j];
    T* out = j < d ? dgamma + j : dbeta + (j - d);
    *out = from_acc<T>(to_acc(*out) + total);
  }
};

}  // namespace detail

// y (x's shape), mean and rstd (N) prepared by ops/layernorm.hpp. mean and rstd are
// Tensor<T, cuda>, or Tensor<float, cuda> when T is __nv_bfloat16 or __half.
template <class T, class S>
  requires detail::layernorm_stats_type<S, T>
void layernorm_forward(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& gamma,
                       const Tensor<T, cuda>& beta, T eps, Tensor<T, cuda>& y,
                       Tensor<S, cuda>& mean, Tensor<S, cuda>& rstd) {
  const index_t n = x.rows(), d = x.cols();
  if (n == 0) return;
  detail::launch_kernel<detail::layernorm_forward_kernel<T, S>>(
      detail::grid_for_rows(n), detail::threads_for_row(d), x.data(), gamma.data(), beta.data(),
      detail::to_acc(eps), n, d, y.data(), mean.data(), rstd.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dx (x's shape), dgamma and dbeta (D) prepared by ops/layernorm.hpp.
template <class T, class S>
  requires detail::layernorm_stats_type<S, T>
void layernorm_backward(cuda, const Tensor<T, cuda>& x, const Tensor<T, cuda>& gamma,
                        const Tensor<S, cuda>& mean, const Tensor<S, cuda>& rstd,
                        const Tensor<T, cuda>& dy, Tensor<T, cuda>& dx, Tensor<T, cuda>& dgamma,
                        Tensor<T, cuda>& dbeta) {
  using A = detail::acc_t<T>;
  const index_t n = x.rows(), d = x.cols();
  const index_t chunks = detail::layernorm_chunks(n);
  auto partial = Tensor<A, cuda>::uninitialized(Shape{chunks, 2 * d});  // (chunks, 2 D), written in full
  // 1. the parameter gradients' partials, reading x and dy before dx (which may alias them)
  // 2. dgamma, dbeta += the partials, in chunk order
  if constexpr (detail::is_half_precision_v<T>) {
    detail::for_each_index(chunks * d, detail::LayernormParamPartialAccOp<T, S>{
                                           x.data(), dy.data(), mean.data(), rstd.data(), n, d,
                                           partial.data()});
    detail::for_each_index(2 * d, detail::LayernormParamReduceAccOp<T>{
                                      partial.data(), chunks, d, dgamma.data(), dbeta.data()});
  } else {
    detail::for_each_index(chunks * d,
                           detail::LayernormParamPartialOp<T, A>{x.data(), dy.data(), mean.data(),
                                                                 rstd.data(), n, d,
                                                                 partial.data()});
    detail::for_each_index(
        2 * d, detail::LayernormParamReduceOp<T, A>{partial.data(), chunks, d, dgamma.data(),
                                                   dbeta.data()});
  }
  // 3. dx
  if (n == 0) return;
  detail::launch_kernel<detail::layernorm_backward_dx_kernel<T, S>>(
      detail::grid_for_rows(n), detail::threads_for_row(d), x.data(), gamma.data(), mean.data(),
      rstd.data(), dy.data(), n, d, dx.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
