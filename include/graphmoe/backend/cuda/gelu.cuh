// graphmoe/backend/cuda/gelu.cuh: the GELU activation, elementwise, on the GPU.
//
// The CUDA system's gelu (contract and argument checks: ops/gelu.hpp, which calls these through
// the backend tag), on Tensor<T, cuda>:
//
//   Erf  (exact):  y = x Phi(x) = 0.5 x erfc(-x / sqrt(2))
//   Tanh (GPT-2):  y = x sigmoid(2u),   u = sqrt(2 / pi) (x + 0.044715 x^3)
//   backward:      dx = dy * gelu'(x)                                     (assigned)
//
// The formulas are the CPU op's (detail::gelu_value_of / gelu_derivative_of in
// detail/nn_functors.hpp, tested against the CPU op on the host by test_host_nn_ops), in T's
// precision with CUDA's expf / erfcf: the backends agree to a few ulp. One thread per element,
// a grid-stride kernel on cuda_stream(); nothing is read back (asynchronous). Outputs may alias
// the inputs (y may be x, dx may be dy).
//
// T = __nv_bfloat16 or __half: each element is widened to fp32, the float formula above is
// evaluated, and the result is rounded once (detail::Gelu{Forward,Backward}AccOp).
#pragma once

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/gelu.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// GeluForwardOp for 16-bit storage: y[i] = gelu(x[i]) in acc_t<T>, rounded once.
template <class T>
struct GeluForwardAccOp {
  GeluForm form;
  const T* x;
  T* y;
  __device__ void operator()(index_t i) const {
    y[i] = from_acc<T>(gelu_value_of(form, to_acc(x[i])));
  }
};

// GeluBackwardOp for 16-bit storage: dx[i] = dy[i] * gelu'(x[i]) in acc_t<T>, rounded once.
template <class T>
struct GeluBackwardAccOp {
  GeluForm form;
  const T* x;
  const T* dy;
  T* dx;
  __device__ void operator()(index_t i) const {
    dx[i] = from_acc<T>(to_acc(dy[i]) * gelu_derivative_of(form, to_acc(x[i])));
  }
};

}  // namespace detail

// y = gelu(x), elementwise; y prepared by ops/gelu.hpp.
template <class T>
void gelu_forward(cuda, GeluForm form, const Tensor<T, cuda>& x, Tensor<T, cuda>& y) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::gelu_forward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  if constexpr (detail::is_half_precision_v<T>)
    detail::for_each_index(x.numel(), detail::GeluForwardAccOp<T>{form, x.data(), y.data()});
  else
    detail::for_each_index(x.numel(), detail::GeluForwardOp<T>{form, x.data(), y.data()});
}

// dx = dy * gelu'(x), elementwise; dx prepared by ops/gelu.hpp.
template <class T>
void gelu_backward(cuda, GeluForm form, const Tensor<T, cuda>& x, const Tensor<T, cuda>& dy,
                   Tensor<T, cuda>& dx) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::gelu_backward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  if constexpr (detail::is_half_precision_v<T>)
    detail::for_each_index(x.numel(),
                           detail::GeluBackwardAccOp<T>{form, x.data(), dy.data(), dx.data()});
  else
    detail::for_each_index(x.numel(),
                           detail::GeluBackwardOp<T>{form, x.data(), dy.data(), dx.data()});
}

}  // namespace graphmoe
