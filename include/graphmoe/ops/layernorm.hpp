// graphmoe/ops/layernorm.hpp: layer normalisation over the last dimension.
//
//   mean_i = (1/D) sum_j x_ij        rstd_i = 1 / sqrt((1/D) sum_j (x_ij - mean_i)^2 + eps)
//   xhat_ij = (x_ij - mean_i) rstd_i          y_ij = xhat_ij gamma_j + beta_j
//
// Backward, with g_ij = dy_ij gamma_j:
//   dx_ij     = rstd_i (g_ij - (1/D) sum_k g_ik - xhat_ij (1/D) sum_k g_ik xhat_ik)   (assigned)
//   dgamma_j += sum_i dy_ij xhat_ij                                                   (accumulated)
//   dbeta_j  += sum_i dy_ij                                                           (accumulated)
//
// x is read as (N, D): all dimensions but the last are the N rows; gamma and beta are (D); the
// cached mean and rstd are (N) (flat, whatever x's rank). The cache is stored in T, or (CUDA
// system, T = __nv_bfloat16 or __half) in fp32: its element type S is the backend's to accept.
//
// Outputs follow prepare_output (empty: allocated; otherwise the shape must match); an empty
// dgamma or dbeta is allocated as zeros, since they accumulate. y may alias x and dx may alias dy
// or x.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend
// (eps > 0 and finite; a 16-bit T is tested and printed as a float); then layernorm_forward(B{},
// ...) / layernorm_backward(B{}, ...) runs the backend's system (backend/cpu/layernorm.hpp,
// backend/cuda/layernorm.cuh, or a user backend's overload found by argument-dependent lookup).
#pragma once

#include <cmath>
#include <type_traits>

#include "graphmoe/backend/cpu/layernorm.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// Rows and columns (N, D) of layernorm's x, read as an (N, D) matrix.
struct LayernormDims {
  index_t n;
  index_t d;
};

template <class T, class B>
LayernormDims layernorm_check_x(const char* op, const Tensor<T, B>& x) {
  GRAPHMOE_CHECK(!x.empty() && x.rank() >= 1, op, "x must be a non-empty tensor of rank >= 1, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  const index_t n = x.rows(), d = x.cols();
  GRAPHMOE_CHECK(d >= 1, op, "x has shape ", x.shape(), ": the normalised dimension is empty");
  return {n, d};
}

// eps > 0 and finite. A T that is not a standard floating-point type (the CUDA system's 16-bit
// __nv_bfloat16 and __half, which cannot be streamed) is widened to float, tested and printed so.
template <class T>
void layernorm_check_eps(const char* op, T eps) {
  if constexpr (std::is_floating_point_v<T>) {
    GRAPHMOE_CHECK(eps > T(0) && std::isfinite(eps), op, "eps must be positive and finite, got ",
                   eps);
  } else {
    const float e = static_cast<float>(eps);
    GRAPHMOE_CHECK(e > 0.0f && std::isfinite(e), op, "eps must be positive and finite, got ", e);
  }
}

}  // namespace detail

// y = layernorm(x) * gamma + beta; fills the cache mean and rstd (N) for backward. eps > 0.
template <class T, class S, Backend B>
void layernorm_forward(const Tensor<T, B>& x, const Tensor<T, B>& gamma, const Tensor<T, B>& beta,
                       T eps, Tensor<T, B>& y, Tensor<S, B>& mean, Tensor<S, B>& rstd) {
  constexpr const char* op = "layernorm_forward";
  const detail::LayernormDims s = detail::layernorm_check_x(op, x);
  check_shape(op, "gamma", gamma, Shape{s.d});
  check_shape(op, "beta", beta, Shape{s.d});
  detail::layernorm_check_eps(op, eps);
  prepare_output(op, "y", y, x.shape());
  prepare_output(op, "mean", mean, Shape{s.n});
  prepare_output(op, "rstd", rstd, Shape{s.n});
  layernorm_forward(B{}, x, gamma, beta, eps, y, mean, rstd);
}

// From the forward's inputs and cache and the output gradient dy: assigns dx, adds to dgamma and
// dbeta (allocated as zeros when empty).
template <class T, class S, Backend B>
void layernorm_backward(const Tensor<T, B>& x, const Tensor<T, B>& gamma, const Tensor<S, B>& mean,
                        const Tensor<S, B>& rstd, const Tensor<T, B>& dy, Tensor<T, B>& dx,
                        Tensor<T, B>& dgamma, Tensor<T, B>& dbeta) {
  constexpr const char* op = "layernorm_backward";
  const detail::LayernormDims s = detail::layernorm_check_x(op, x);
  check_shape(op, "gamma", gamma, Shape{s.d});
  check_shape(op, "mean", mean, Shape{s.n});
  check_shape(op, "rstd", rstd, Shape{s.n});
  check_shape(op, "dy", dy, x.shape());
  prepare_output(op, "dx", dx, x.shape());
  prepare_accumulator(op, "dgamma", dgamma, Shape{s.d});
  prepare_accumulator(op, "dbeta", dbeta, Shape{s.d});
  layernorm_backward(B{}, x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
}

}  // namespace graphmoe
