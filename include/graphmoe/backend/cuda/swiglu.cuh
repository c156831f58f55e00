// graphmoe/backend/cuda/swiglu.cuh: the SwiGLU activation on a fused gate|up tensor, on the GPU.
//
// The CUDA system's swiglu (contract, formulas and argument checks: ops/swiglu.hpp, which calls
// these through the backend tag), on Tensor<T, cuda>, gu read as (N, 2F) rows [gate | up]:
//
//   forward:   h = silu(gate) * up
//   backward:  dgate = dh * up * silu'(gate),   dup = dh * silu(gate)       (assigned)
//
// One thread per (row, column j < F), in acc_t<T> with exp_t (expf for float; fp32 for bf16 and
// half, rounded once per stored entry); sigmoid takes exp of a non-positive argument only. The
// CPU op's expressions in the same order: the backends agree to a few ulp. A thread reads gate_j
// and up_j before it writes dgate_j and dup_j: dgu may alias gu. Asynchronous.
#pragma once

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class A>
__device__ inline A swiglu_sigmoid_of(A x) {
  if (x >= A(0)) return A(1) / (A(1) + exp_t(-x));
  const A e = exp_t(x);
  return e / (A(1) + e);
}

template <class T>
__global__ void swiglu_forward_kernel(const T* gu, index_t n, index_t f, T* h) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(e, n * f) {
    const index_t i = e / f, j = e % f;
    const A a = to_acc(gu[i * 2 * f + j]), u = to_acc(gu[i * 2 * f + f + j]);
    h[e] = from_acc<T>(a * swiglu_sigmoid_of(a) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* gu, const T* dh, index_t n, index_t f, T* dgu) {
  using A = acc_t<T>;
  GRAPHMOE_CUDA_GRID_STRIDE(e, n * f) {
    const index_t i = e / f, j = e % f;
    const A a = to_acc(gu[i * 2 * f + j]), u = to_acc(gu[i * 2 * f + f + j]), dv = to_acc(dh[e]);
    const A s = swiglu_sigmoid_of(a);
    dgu[i * 2 * f + j] = from_acc<T>(dv * u * (s * (A(1) + a * (A(1) - s))));
    dgu[i * 2 * f + f + j] = from_acc<T>(dv * (a * s));
  }
}

}  // namespace detail

// h (gu's shape with F last) prepared by ops/swiglu.hpp.
template <class T>
void swiglu_forward(cuda, const Tensor<T, cuda>& gu, Tensor<T, cuda>& h) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::swiglu_forward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  const index_t n = gu.rows(), f = gu.cols() / 2;
  if (n * f == 0) return;
  detail::launch_kernel<detail::swiglu_forward_kernel<T>>(detail::grid_for(n * f),
                                                          detail::kThreads, gu.data(), n, f,
                                                          h.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dgu (gu's shape) prepared by ops/swiglu.hpp; may alias gu.
template <class T>
void swiglu_backward(cuda, const Tensor<T, cuda>& gu, const Tensor<T, cuda>& dh,
                     Tensor<T, cuda>& dgu) {
  static_assert(detail::cuda_float_type<T>,
                "graphmoe::swiglu_backward on cuda: T must be float, double, __nv_bfloat16 or "
                "__half");
  const index_t n = gu.rows(), f = gu.cols() / 2;
  if (n * f == 0) return;
  detail::launch_kernel<detail::swiglu_backward_kernel<T>>(detail::grid_for(n * f),
                                                           detail::kThreads, gu.data(), dh.data(),
                                                           n, f, dgu.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
