// graphmoe/ops/rmsnorm.hpp: root-mean-square normalisation over the last dimension (the
// LlamaRMSNorm of Hugging Face transformers: no centring, no bias).
//
//   inv_rms_i = 1 / sqrt((1/D) sum_j x_ij^2 + eps)          y_ij = x_ij inv_rms_i w_j
//
// Backward, with g_ij = dy_ij w_j and xhat_ij = x_ij inv_rms_i:
//   dx_ij = inv_rms_i (g_ij - xhat_ij (1/D) sum_k g_ik xhat_ik)      (assigned)
//   dw_j += sum_i dy_ij xhat_ij                                      (accumulated)
//
// x is read as (N, D): all dimensions but the last are the N rows; weight is (D); the cached
// inv_rms is (N) (flat, whatever x's rank), stored in T. The row statistics are computed in the
// backend's accumulation type (double on the CPU) and xhat is rounded to T before the weight is
// applied, as in LlamaRMSNorm (weight * hidden_states.to(input_dtype)).
//
// Outputs follow prepare_output (empty: allocated; otherwise the shape must match); an empty
// dweight is allocated as zeros, since it accumulates. y may alias x and dx may alias dy. The
// dweight sum over rows runs in a fixed order (blocks of 64 rows, added in block order): the
// result does not depend on the thread count.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend (eps
// > 0 and finite); then rmsnorm_forward(B{}, ...) / rmsnorm_backward(B{}, ...) runs the backend's
// system (backend/cpu/rmsnorm.hpp, backend/cuda/rmsnorm.cuh, or a user backend's overload found
// by argument-dependent lookup).
#pragma once

#include <cmath>

#include "graphmoe/backend/cpu/rmsnorm.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/layernorm.hpp"

namespace graphmoe {

namespace detail {

inline void rmsnorm_check_eps(const char* op, double eps) {
  GRAPHMOE_CHECK(eps > 0.0 && std::isfinite(eps), op, "eps must be positive and finite, got ",
                 eps);
}

}  // namespace detail

// y = x / rms(x) * weight, row by row; fills the cache inv_rms (N) for backward. eps > 0.
template <class T, Backend B>
void rmsnorm_forward(const Tensor<T, B>& x, const Tensor<T, B>& weight, double eps,
                     Tensor<T, B>& y, Tensor<T, B>& inv_rms) {
  constexpr const char* op = "rmsnorm_forward";
  const detail::LayernormDims s = detail::layernorm_check_x(op, x);
  check_shape(op, "weight", weight, Shape{s.d});
  detail::rmsnorm_check_eps(op, eps);
  prepare_output(op, "y", y, x.shape());
  prepare_output(op, "inv_rms", inv_rms, Shape{s.n});
  rmsnorm_forward(B{}, x, weight, eps, y, inv_rms);
}

// From the forward's input, weight and cache and the output gradient dy: assigns dx, adds to
// dweight (allocated as zeros when empty).
template <class T, Backend B>
void rmsnorm_backward(const Tensor<T, B>& x, const Tensor<T, B>& weight,
                      const Tensor<T, B>& inv_rms, const Tensor<T, B>& dy, Tensor<T, B>& dx,
                      Tensor<T, B>& dweight) {
  constexpr const char* op = "rmsnorm_backward";
  const detail::LayernormDims s = detail::layernorm_check_x(op, x);
  check_shape(op, "weight", weight, Shape{s.d});
  check_shape(op, "inv_rms", inv_rms, Shape{s.n});
  check_shape(op, "dy", dy, x.shape());
  prepare_output(op, "dx", dx, x.shape());
  prepare_accumulator(op, "dweight", dweight, Shape{s.d});
  rmsnorm_backward(B{}, x, weight, inv_rms, dy, dx, dweight);
}

}  // namespace graphmoe
