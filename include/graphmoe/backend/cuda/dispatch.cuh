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
// make_padded_dispatch_plan runs one kernel, one block per expert (the capacity mask's scheme,
// gates.cuh): each thread counts the expert's kept assignments in its contiguous share of the
// N k ids, thread 0 turns the counts into prefix sums, each thread places its assignments at
// e C + rank; then the block marks its empty slots. Block 0 also writes source_slot = -1 for the
// assignments no expert owns (keep = 0 with any id). Nothing is copied to the host: the offsets
// e C are filled there, and the checks (an id out of range, an expert over capacity) are a
// deferrable flag.
//
// Slot -1 (padded layout) reads as a zero row and is never written. combine's dys is written
// slot by slot (zero for an empty slot), its dgates is 0 for a dropped assignment.
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

// What the CUDA system keeps in a dispatch plan (core/dispatch_plan.hpp) besides the arrays every
// backend fills.
template <>
struct DispatchPlanBackendState<cuda> {
  Tensor<std::int32_t, cpu> host_offsets;  // (E + 1): expert_offsets on the host (count, offset)
  Tensor<std::int32_t, cuda> slot_expert;  // (S): the expert of slot s (the grouped expert bias)
};

namespace detail {

// blockDim.x == kThreads, one block per expert (see the header). keep: 1 = place.
template <class I>
__global__ void padded_plan_kernel(const I* ids, const std::uint8_t* keep, index_t n, index_t k,
                                   index_t num_experts, index_t capacity, I* offsets,
                                   I* slot_token, I* slot_source, I* source_slot, I* slot_expert,
                                   unsigned long long* bad) {
  const auto e = static_cast<I>(blockIdx.x);
  const index_t threads = blockDim.x, tid = threadIdx.x;
  const BlockShare share =
      block_rank_shares(n, [&](index_t a) { return keep[a] != 0 && ids[a] == e; });
  index_t rank = share.first;
  for (index_t a = share.begin; a < share.end; ++a) {
    const I id = ids[a];
    const bool kept = keep[a] != 0;
    if (kept && id == e) {
      if (rank < capacity) {
        const index_t s = e * capacity + rank;
        slot_token[s] = static_cast<I>(a / k);
        slot_source[s] = static_cast<I>(a);
        source_slot[a] = static_cast<I>(s);
      } else {
        source_slot[a] = -1;
        flag_index(bad, a);
      }
      ++rank;
    } else if (e == 0 && !(kept && id >= 0 && id < num_experts)) {
      source_slot[a] = -1;  // dropped, or an id no block owns
      if (kept) flag_index(bad, a);
    }
  }
  const index_t filled = share.total < capacity ? share.total : capacity;
  for (index_t r = tid; r < capacity; r += threads) {
    const index_t s = e * capacity + r;
    slot_expert[s] = e;
    if (r >= filled) {
      slot_token[s] = -1;
      slot_source[s] = -1;
    }
  }
  if (tid == 0) {
    offsets[e] = static_cast<I>(e * capacity);
    if (e == 0) offsets[num_experts] = static_cast<I>(num_experts * capacity);
  }
}

template <class T>
__global__ void dispatch_forward_kernel(const std::int32_t* slot_token, const T* x, T* xs,
                                        index_t slots, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, slots * d) {
    const index_t s = i / d, c = i - s * d;
    const index_t t = slot_token[s];
    xs[i] = t < 0 ? T(0) : x[t * d + c];
  }
}

template <class T>
__global__ void dispatch_backward_kernel(const std::int32_t* source_slot, const T* dxs, T* dx,
                                         index_t n, index_t k, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n * d) {
    const index_t t = i / d, c = i - t * d;
    acc_t<T> out = 0;
    bool first = true;
    for (index_t j = 0; j < k; ++j) {
      const index_t s = source_slot[t * k + j];
      if (s < 0) continue;
      if (first) {
        out = to_acc(dxs[s * d + c]);
        first = false;
      } else {
        out += to_acc(dxs[s * d + c]);
      }
    }
    dx[i] = from_acc<T>(out);
  }
}

template <class T>
__global__ void combine_forward_kernel(const std::int32_t* source_slot, const T* ys,
                                       const T* gates, T* y, index_t n, index_t k, index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n * d) {
    const index_t t = i / d, c = i - t * d;
    acc_t<T> out = 0;
    bool first = true;
    for (index_t j = 0; j < k; ++j) {
      const index_t s = source_slot[t * k + j];
      if (s < 0) continue;
      const acc_t<T> term = to_acc(gates[t * k + j]) * to_acc(ys[s * d + c]);
      if (first) {
        out = term;
        first = false;
      } else {
        out += term;
      }
    }
    y[i] = from_acc<T>(out);
  }
}

// Slot by slot: dys[s] = gates[a] dy[a / k] for the assignment a in slot s, 0 in an empty slot.
template <class T>
__global__ void combine_backward_dys_kernel(const std::int32_t* slot_source, const T* gates,
                                            const T* dy, T* dys, index_t slots, index_t k,
                                            index_t d) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, slots * d) {
    const index_t s = i / d, c = i - s * d;
    const index_t a = slot_source[s];
    dys[i] = a < 0 ? T(0) : from_acc<T>(to_acc(gates[a]) * to_acc(dy[(a / k) * d + c]));
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
    const index_t s = source_slot[a];
    if (s < 0) {  // a dropped assignment (padded layout): uniform over the warp
      if (lane == 0) dgates[a] = T(0);
      continue;
    }
    const T* g = dy + (a / k) * d;
    const T* v = ys + s * d;
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
  GRAPHMOE_CHECK(!cuda_stream_capturing(), op,
                 "the compact expert layout inside a CUDA graph capture (it sorts with Thrust and "
                 "reads its expert offsets back to the host); capture with ExpertLayout::Padded");
  const index_t n = indices.dim(0), k = indices.dim(1), slots = n * k;
  detail::size_dispatch_plan(plan, n, k, num_experts, 0);
  plan.k = k;
  detail::plan_tensor(plan.backend.slot_expert, Shape{slots});
  detail::plan_tensor(plan.backend.host_offsets, Shape{num_experts + 1});

  detail::CudaThrustAllocator alloc;
  std::int64_t bad = -1;
  try {
    // slot_expert doubles as the sort's unsigned keys (the same values for ids in range)
    detail::build_dispatch_plan(detail::thrust_policy(alloc), indices.data(),
                                slots, static_cast<std::int32_t>(k),
                                static_cast<std::int32_t>(num_experts),
                                reinterpret_cast<std::uint32_t*>(plan.backend.slot_expert.data()),
                                plan.expert_offsets.data(), plan.slot_token.data(),
                                plan.slot_source.data(), plan.source_slot.data());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    to_host(plan.expert_offsets, plan.backend.host_offsets);  // synchronises
    if (plan.backend.host_offsets.data()[num_experts] != slots)
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

// The padded plan (checked by ops/dispatch.hpp), built without a copy to the host; returns the
// first kept assignment with an id outside [0, num_experts) or beyond its expert's capacity
// (pending inside with_deferred_checks).
template <class I>
  requires std::same_as<I, std::int32_t>
Offender make_padded_dispatch_plan(cuda, const Tensor<I, cuda>& indices,
                                   const Tensor<std::uint8_t, cuda>& keep, index_t num_experts,
                                   index_t capacity, DispatchPlan<cuda>& plan) {
  const index_t n = indices.dim(0), k = indices.dim(1), slots = num_experts * capacity;
  detail::size_dispatch_plan(plan, n, k, num_experts, capacity);
  detail::plan_tensor(plan.backend.slot_expert, Shape{slots});
  detail::plan_tensor(plan.backend.host_offsets, Shape{num_experts + 1});
  for (index_t e = 0; e <= num_experts; ++e)
    plan.backend.host_offsets.data()[e] = static_cast<std::int32_t>(e * capacity);
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::padded_plan_kernel<I>>(
      static_cast<unsigned>(num_experts), detail::kThreads, indices.data(), keep.data(), n * k,
      k, num_experts, capacity, plan.expert_offsets.data(), plan.slot_token.data(),
      plan.slot_source.data(), plan.source_slot.data(), plan.backend.slot_expert.data(),
      bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("make_padded_dispatch_plan", [indices](index_t a) {
    return Offender{a, static_cast<double>(detail::read_device_value(indices.data() + a))};
  });
}

// xs[s] = x[slot_token[s]], zero for an empty slot (xs prepared by ops/dispatch.hpp).
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
  const index_t slots = plan.num_slots();
  if (d > 0 && slots > 0) {
    detail::launch_kernel<detail::combine_backward_dys_kernel<T>>(
        detail::grid_for(slots * d), detail::kThreads, plan.slot_source.data(), gates.data(),
        dy.data(), dys.data(), slots, k, d);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }
  detail::launch_kernel<detail::combine_backward_dgates_kernel<T>>(
      detail::grid_for(n * k * 32), detail::kThreads, plan.source_slot.data(), ys.data(), dy.data(),
      dgates.data(), n, k, d);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
