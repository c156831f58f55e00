// graphmoe/backend/cuda/graph_blend.cuh: the CUDA system's ops of the Blended token graph
// (routing/graphs/blended.hpp; contract and argument checks: ops/token_graph.hpp, which calls
// these through the backend tag). The mixing weight a stays on the device: every kernel reads
// a[0] itself, and uses w = clamp(a[0], 0, 1).
//
//   graph_blend            p = r + w (q - r)              one thread per element
//   graph_blend_backward   dq = w dp                      one thread per element
//                          da += sum dp (q - r)           one block, double partial sums in a
//                                                         fixed order (as accumulate_dot); 0 where
//                                                         a step would take a out of [0, 1]
//   graph_blend_residual   dr += (1 - w) dp               one thread per element
//
// T = __nv_bfloat16 or __half: widened to fp32, computed there and rounded once when stored.
#pragma once

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__device__ acc_t<T> blend_weight(const T* a) {
  const acc_t<T> x = to_acc(a[0]);
  return x < acc_t<T>(0) ? acc_t<T>(0) : (x > acc_t<T>(1) ? acc_t<T>(1) : x);
}

template <class T>
__global__ void graph_blend_kernel(const T* r, const T* q, const T* a, T* p, index_t n) {
  const acc_t<T> w = blend_weight(a);
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const acc_t<T> ri = to_acc(r[i]);
    p[i] = from_acc<T>(ri + w * (to_acc(q[i]) - ri));
  }
}

template <class T>
__global__ void graph_blend_dq_kernel(const T* a, const T* dp, T* dq, index_t n) {
  const acc_t<T> w = blend_weight(a);
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { dq[i] = from_acc<T>(w * to_acc(dp[i])); }
}

template <class T>
__global__ void graph_blend_da_kernel(const T* r, const T* q, const T* dp, const T* a, index_t n,
                                      T* da) {
  double s = 0;
  for (index_t i = threadIdx.x; i < n; i += blockDim.x)
    s += static_cast<double>(to_acc(dp[i])) *
         (static_cast<double>(to_acc(q[i])) - static_cast<double>(to_acc(r[i])));
  s = block_reduce(s, SumOp{}, 0.0);
  const acc_t<T> raw = to_acc(a[0]);
  if ((raw <= acc_t<T>(0) && s > 0) || (raw >= acc_t<T>(1) && s < 0)) s = 0;  // would leave [0, 1]
  if (threadIdx.x == 0)
    da[0] = from_acc<T>(static_cast<acc_t<T>>(static_cast<double>(to_acc(da[0])) + s));
}

template <class T>
__global__ void graph_blend_residual_kernel(const T* a, const T* dp, T* dr, index_t n) {
  const acc_t<T> c = acc_t<T>(1) - blend_weight(a);
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { dr[i] = from_acc<T>(to_acc(dr[i]) + c * to_acc(dp[i])); }
}

}  // namespace detail

template <class T>
void graph_blend(cuda, const Tensor<T, cuda>& r, const Tensor<T, cuda>& q,
                 const Tensor<T, cuda>& a, Tensor<T, cuda>& p) {
  const index_t n = r.numel();
  detail::launch_kernel<detail::graph_blend_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                       r.data(), q.data(), a.data(), p.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void graph_blend_backward(cuda, const Tensor<T, cuda>& r, const Tensor<T, cuda>& q,
                          const Tensor<T, cuda>& a, const Tensor<T, cuda>& dp,
                          Tensor<T, cuda>& dq, const Tensor<T, cuda>& da) {
  const index_t n = r.numel();
  detail::launch_kernel<detail::graph_blend_dq_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                          a.data(), dp.data(), dq.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::graph_blend_da_kernel<T>>(1, detail::kThreads, r.data(), q.data(),
                                                          dp.data(), a.data(), n, da.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void graph_blend_residual(cuda, const Tensor<T, cuda>& a, const Tensor<T, cuda>& dp,
                          const Tensor<T, cuda>& dr) {
  const index_t n = dp.numel();
  detail::launch_kernel<detail::graph_blend_residual_kernel<T>>(
      detail::grid_for(n), detail::kThreads, a.data(), dp.data(), dr.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
