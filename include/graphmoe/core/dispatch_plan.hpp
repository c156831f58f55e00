// graphmoe/core/dispatch_plan.hpp: the grouping of routed tokens by expert (the dispatch plan), one
// type for every backend. Built by make_dispatch_plan and read by dispatch / combine
// (ops/dispatch.hpp states the contract) and by the expert FFNs (ops/experts.hpp).
//
// Each of N tokens is routed to k experts: indices (N, k). Assignment a = t * k + j is "token t's
// j-th choice". The plan sorts the N * k assignments by expert id, stably, so the rows for expert
// e are one contiguous block of slots [offsets[e], offsets[e + 1]), and within that block
// assignments keep (token, j) order.
//
// The padded layout (make_padded_dispatch_plan, capacity C > 0): every expert owns C slots,
// expert e the slots [e C, (e + 1) C). Its kept assignments (keep = 1) fill the first of them in
// (token, j) order; the rest are empty (slot_token = slot_source = -1: dispatch writes zero rows
// there, combine never reads them). An assignment with keep = 0 has source_slot = -1 (combine
// skips it, its gate gradient is 0). The shapes and the offsets (e C) depend on N, k, E and C
// only, so nothing is read back from a device to build or use the plan: the layout a CUDA graph
// can capture, at the price of E C - (kept assignments) rows of expert work on empty slots.
#pragma once

#include <cstdint>

#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// What a backend keeps in its plans beyond the arrays every backend fills: nothing by default. A
// backend whose memory is not the host's specialises it with at least host_offsets, a host copy of
// expert_offsets (Tensor<std::int32_t, cpu>, E + 1 entries), which count() and offset() read: the
// expert bank schedules its GEMMs from the host (cuda: backend/cuda/dispatch.cuh, which copies the
// offsets back once per plan and also keeps the expert of every slot).
template <class B>
struct DispatchPlanBackendState {};

// The arrays live in B's memory; `backend` holds B's own (DispatchPlanBackendState).
template <class B = cpu>
struct DispatchPlan {
  index_t num_tokens = 0, k = 0, num_experts = 0;
  index_t capacity = 0;                    // > 0: the padded layout (slots per expert), else 0
  Tensor<std::int32_t, B> expert_offsets;  // (E + 1): slots of expert e are [offsets[e], offsets[e + 1])
  Tensor<std::int32_t, B> slot_token;      // (S): the token row held by sorted slot s
  Tensor<std::int32_t, B> slot_source;     // (S): the assignment (t k + j) held by slot s
  Tensor<std::int32_t, B> source_slot;     // (N k): inverse of slot_source
  DispatchPlanBackendState<B> backend;

  // S, the rows of xs and ys: N k, or E C in the padded layout.
  index_t num_slots() const { return capacity > 0 ? num_experts * capacity : num_tokens * k; }
  index_t num_assignments() const { return num_tokens * k; }
  // Number of assignments routed to expert e.
  index_t count(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e < num_experts, "DispatchPlan::count", "expert ", e,
                   " is out of range [0, ", num_experts, ")");
    return host_offsets()[e + 1] - host_offsets()[e];
  }
  // First slot of expert e (the row of xs where its block starts).
  index_t offset(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e <= num_experts, "DispatchPlan::offset", "expert ", e,
                   " is out of range [0, ", num_experts, "]");
    return host_offsets()[e];
  }

 private:
  // expert_offsets in host memory: the array itself on a backend whose memory is the host's.
  const std::int32_t* host_offsets() const {
    if constexpr (B::host_memory)
      return expert_offsets.data();
    else
      return backend.host_offsets.data();
  }
};

namespace detail {
// Keeps t's storage when it already has the shape (plans are rebuilt every step).
template <class B>
void plan_tensor(Tensor<std::int32_t, B>& t, const Shape& shape) {
  if (t.empty() || t.shape() != shape) t = new_output<std::int32_t, B>(shape);  // written in full
}

// Sets a plan's counts and sizes the arrays every backend fills, for n tokens routed to k of
// num_experts experts: N k slots, or E C in the padded layout (capacity C > 0). k is left to the
// caller (a padded plan's op keeps it 0, invalid, until the plan is built).
template <class B>
void size_dispatch_plan(DispatchPlan<B>& plan, index_t n, index_t k, index_t num_experts,
                        index_t capacity) {
  plan.num_tokens = n;
  plan.num_experts = num_experts;
  plan.capacity = capacity;
  const index_t slots = capacity > 0 ? num_experts * capacity : n * k;
  plan_tensor(plan.expert_offsets, Shape{num_experts + 1});
  plan_tensor(plan.slot_token, Shape{slots});
  plan_tensor(plan.slot_source, Shape{slots});
  plan_tensor(plan.source_slot, Shape{n * k});
}
}  // namespace detail

// The CUDA backend's plan under its own name.
using CudaDispatchPlan = DispatchPlan<cuda>;

}  // namespace graphmoe
