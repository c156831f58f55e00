// graphmoe/backend/cuda/dispatch.cuh: grouping tokens by expert (dispatch) and gathering the
// experts' outputs back per token (combine), on the GPU (contract and argument checks:
// ops/dispatch.hpp, which calls these through the backend tag), on Tensor<T, cuda> and a
// DispatchPlan<cuda> (core/dispatch_plan.hpp; alias CudaDispatchPlan):
//
//   dispatch:  xs[s] = x[slot_token[s]]                                  x (N, D) -> xs (N k, D)
//   combine:   y[t]  = sum_j gates[t, j] * ys[source_slot[t k + j]]      ys (N k, D) -> y (N, D)
//
// Backwards (all gradients assigned):
//   dispatch:  dx[t] = sum_j dxs[source_slot[t k + j]]
//   combine:   dys[source_slot[t k + j]] = gates[t, j] * dy[t]
//              dgates[t, j] = <dy[t], ys[source_slot[t k + j]]>
//
// make_dispatch_plan sorts the N k assignments by expert with Thrust (a stable radix sort, then
// a scatter for the inverse permutation and a vectorised lower_bound for the expert offsets):
// detail/dispatch_plan_thrust.hpp, which g++ also compiles against Thrust's CPU backends so that
// the plan is tested without a GPU. The plan equals the CPU plan entry for entry. It copies the
// E + 1 expert offsets to the host (host_offsets, one synchronising copy): the expert FFN bank
// launches its GEMMs from the host, and the copy doubles as the check of the expert ids. It also
// fills slot_expert (the sorted ids), which the grouped expert bias reads (grouped.cuh).
//
// The gathers run one thread per output element (coalesced over D); dgates runs one warp per
// (token, choice) dot product. Sums over j run in the CPU's order; the dgates dot product is a
// tree sum, so combine_backward agrees with the CPU to rounding.
//
// T = __nv_bfloat16 or __half: the gathers copy; every sum and product (dispatch_backward's sum
// over j, combine's weighted sum, gates * dy, the dgates dot products) runs in fp32 on widened
// entries and is rounded once per stored entry. For float and double nothing changes.
#pragma once

#include <thrust/system_error.h>

#include <concepts>
#include <cstdint>
#include <limits>

#include "graphmoe/backend/cuda/detail/dispatch_plan_thrust.hpp"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void dispatch_forward_kernel(const std::int32_t* slot_token, const T* x, T* xs,
                                        index_t slots, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, slots * d) {
    const index_t s = i / d, c = i - s * d;
    xs[i] = x[static_cast<index_t>(slot_token[s]) * d + c];
  }
}

template <class T>
__global__ void dispatch_backward_kernel(const std::int32_t* source_slot, const T* dxs, T* dx,
                                         index_t n, index_t k, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n * d) {
    const index_t t = i / d, c = i - t * d;
    acc_t<T> out = to_acc(dxs[static_cast<index_t>(source_slot[t * k]) * d + c]);
    for (index_t j = 1; j < k; ++j)
      out += to_acc(dxs[static_cast<index_t>(source_slot[t * k + j]) * d + c]);
    dx[i] = from_acc<T>(out);
  }
}

template <class T>
__global__ void combine_forward_kernel(const std::int32_t* source_slot, const T* ys,
                                       const T* gates, T* y, index_t n, index_t k, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n * d) {
    const index_t t = i / d, c = i - t * d;
    acc_t<T> out =
        to_acc(gates[t * k]) * to_acc(ys[static_cast<index_t>(source_slot[t * k]) * d + c]);
    for (index_t j = 1; j < k; ++j)
      out += to_acc(gates[t * k + j]) *
             to_acc(ys[static_cast<index_t>(source_slot[t * k + j]) * d + c]);
    y[i] = from_acc<T>(out);
  }
}

template <class T>
__global__ void combine_backward_dys_kernel(const std::int32_t* source_slot, const T* gates,
                                            const T* dy, T* dys, index_t n, index_t k, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n * k * d) {
    const index_t a = i / d, c = i - a * d, t = a / k;
    dys[static_cast<index_t>(source_slot[a]) * d + c] =
        from_acc<T>(to_acc(gates[a]) * to_acc(dy[t * d + c]));
  }
}

// One warp per assignment a = t k + j: dgates[a] = <dy[t], ys[source_slot[a]]>.
template <class T>
__global__ void combine_backward_dgates_kernel(const std::int32_t* source_slot, const T* ys,
                                               const T* dy, T* dgates, index_t n, index_t k,
                                               index_t d) {
  using A = acc_t<T>;
  const index_t lane = threadIdx.x & 31;
  const index_t warps = static_cast<index_t>(gridDim.x) * (blockDim.x / 32);
  for (index_t a = (static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; a < n * k;
       a += warps) {
    const T* g = dy + (a / k) * d;
    const T* v = ys + static_cast<index_t>(source_slot[a]) * d;
    A dot = A(0);
    for (index_t c = lane; c < d; c += 32) dot += to_acc(g[c]) * to_acc(v[c]);
    dot = warp_reduce(dot, SumOp{});
    if (lane == 0) dgates[a] = from_acc<T>(dot);
  }
}

}  // namespace detail

// The plan of indices (N, k), checked by ops/dispatch.hpp, built on the device. A template only
// so that Thrust's sort kernels are compiled in the translation units that build plans; indices
// are std::int32_t as on the CPU. Returns the first expert id outside [0, num_experts) (the plan
// is then invalid, and ops/dispatch.hpp marks it so).
template <class I>
  requires std::same_as<I, std::int32_t>
Offender make_dispatch_plan(cuda, const Tensor<I, cuda>& indices, index_t num_experts,
                            DispatchPlan<cuda>& plan) {
  constexpr const char* op = "make_dispatch_plan";
  const index_t n = indices.dim(0), k = indices.dim(1), slots = n * k;
  plan.num_tokens = n;
  plan.k = k;
  plan.num_experts = num_experts;
  detail::plan_tensor(plan.expert_offsets, Shape{num_experts + 1});
  detail::plan_tensor(plan.slot_token, Shape{slots});
  detail::plan_tensor(plan.slot_source, Shape{slots});
  detail::plan_tensor(plan.source_slot, Shape{slots});
  detail::plan_tensor(plan.slot_expert, Shape{slots});
  detail::plan_tensor(plan.host_offsets, Shape{num_experts + 1});

  detail::CudaThrustAllocator alloc;
  std::int64_t bad = -1;
  try {
    // slot_expert doubles as the sort's unsigned keys (the same values for ids in range)
    detail::build_dispatch_plan(detail::thrust_policy(alloc), indices.data(),
                                slots, static_cast<std::int32_t>(k),
                                static_cast<std::int32_t>(num_experts),
                                reinterpret_cast<std::uint32_t*>(plan.slot_expert.data()),
                                plan.expert_offsets.data(), plan.slot_token.data(),
                                plan.slot_source.data(), plan.source_slot.data());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    to_host(plan.expert_offsets, plan.host_offsets);  // synchronises
    if (plan.host_offsets.data()[num_experts] != slots)
      bad = detail::first_invalid_expert_id(detail::thrust_policy_sync(alloc),
                                            indices.data(), slots,
                                            static_cast<std::int32_t>(num_experts));
  } catch (const thrust::system_error& e) {  // Thrust reports CUDA errors its own way
    plan.k = 0;
    detail::throw_error(op, "Thrust: ", e.what());
  }
  if (bad < 0) return {};
  return {bad, static_cast<double>(detail::read_device_value(indices.data() + bad))};
}

// xs[s] = x[slot_token[s]] (xs prepared by ops/dispatch.hpp).
template <class T>
void dispatch_forward(cuda, const DispatchPlan<cuda>& plan, const Tensor<T, cuda>& x,
                      Tensor<T, cuda>& xs) {
  const index_t d = x.cols();
  const index_t total = plan.num_slots() * d;
  if (total == 0) return;
  detail::launch_kernel<detail::dispatch_forward_kernel<T>>(
      detail::grid_for(total), detail::kThreads, plan.slot_token.data(), x.data(), xs.data(),
      plan.num_slots(), d);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// dx[t] = sum_j dxs[source_slot[t k + j]]: dxs (N k, D) -> dx (N, D), assigned.
template <class T>
void dispatch_backward(cuda, const DispatchPlan<cuda>& plan, const Tensor<T, cuda>& dxs,
                       Tensor<T, cuda>& dx) {
  const index_t d = dxs.cols();
  const index_t total = plan.num_tokens * d;
  if (total == 0) return;
  detail::launch_kernel<detail::dispatch_backward_kernel<T>>(
      detail::grid_for(total), detail::kThreads, plan.source_slot.data(), dxs.data(), dx.data(),
      plan.num_tokens, plan.k, d);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// y[t] = sum_j gates[t, j] * ys[source_slot[t k + j]]: ys (N k, D), gates (N, k) -> y (N, D).
template <class T>
void combine_forward(cuda, const DispatchPlan<cuda>& plan, const Tensor<T, cuda>& ys,
                     const Tensor<T, cuda>& gates, Tensor<T, cuda>& y) {
  const index_t d = ys.cols(), k = plan.k;
  const index_t total = plan.num_tokens * d;
  if (total == 0) return;
  detail::launch_kernel<detail::combine_forward_kernel<T>>(
      detail::grid_for(total), detail::kThreads, plan.source_slot.data(), ys.data(), gates.data(),
      y.data(), plan.num_tokens, k, d);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// Backward of combine_forward: dys (N k, D) and dgates (N, k), both assigned.
template <class T>
void combine_backward(cuda, const DispatchPlan<cuda>& plan, const Tensor<T, cuda>& ys,
                      const Tensor<T, cuda>& gates, const Tensor<T, cuda>& dy,
                      Tensor<T, cuda>& dys, Tensor<T, cuda>& dgates) {
  const index_t d = ys.cols(), k = plan.k, n = plan.num_tokens;
  if (n == 0) return;
  if (d > 0) {
    detail::launch_kernel<detail::combine_backward_dys_kernel<T>>(
        detail::grid_for(n * k * d), detail::kThreads, plan.source_slot.data(), gates.data(),
        dy.data(), dys.data(), n, k, d);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  detail::launch_kernel<detail::combine_backward_dgates_kernel<T>>(
      detail::grid_for(n * k * 32), detail::kThreads, plan.source_slot.data(), ys.data(), dy.data(),
      dgates.data(), n, k, d);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
