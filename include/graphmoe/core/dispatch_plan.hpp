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

// The arrays live in B's memory. count() and offset() read host memory on every backend:
// host_offsets, which a backend whose memory is the host's (cpu) makes a handle of
// expert_offsets itself, and the others fill with a copy (cuda copies the E + 1 offsets back
// once per plan: the expert bank schedules its GEMMs from the host).
template <class B = cpu>
struct DispatchPlan {
  index_t num_tokens = 0, k = 0, num_experts = 0;
  index_t capacity = 0;                    // > 0: the padded layout (slots per expert), else 0
  Tensor<std::int32_t, B> expert_offsets;  // (E + 1): slots of expert e are [offsets[e], offsets[e + 1])
  Tensor<std::int32_t, B> slot_token;      // (S): the token row held by sorted slot s
  Tensor<std::int32_t, B> slot_source;     // (S): the assignment (t k + j) held by slot s
  Tensor<std::int32_t, B> source_slot;     // (N k): inverse of slot_source
  Tensor<std::int32_t, cpu> host_offsets;  // (E + 1): expert_offsets on the host
  // (S): the expert of slot s (the sorted ids). Filled by the backends whose kernels read it
  // (cuda: the grouped expert bias); empty on cpu.
  Tensor<std::int32_t, B> slot_expert;

  // S, the rows of xs and ys: N k, or E C in the padded layout.
  index_t num_slots() const { return capacity > 0 ? num_experts * capacity : num_tokens * k; }
  index_t num_assignments() const { return num_tokens * k; }
  // Number of assignments routed to expert e.
  index_t count(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e < num_experts, "DispatchPlan::count", "expert ", e,
                   " is out of range [0, ", num_experts, ")");
    return host_offsets.data()[e + 1] - host_offsets.data()[e];
  }
  // First slot of expert e (the row of xs where its block starts).
  index_t offset(index_t e) const {
    GRAPHMOE_CHECK(e >= 0 && e <= num_experts, "DispatchPlan::offset", "expert ", e,
                   " is out of range [0, ", num_experts, "]");
    return host_offsets.data()[e];
  }
};

namespace detail {
// Keeps t's storage when it already has the shape (plans are rebuilt every step).
template <class B>
void plan_tensor(Tensor<std::int32_t, B>& t, const Shape& shape) {
  if (t.empty() || t.shape() != shape) t = new_output<std::int32_t, B>(shape);  // written in full
}
}  // namespace detail

// The name the CUDA plan had before the plan became one template.
using CudaDispatchPlan = DispatchPlan<cuda>;

}  // namespace graphmoe
