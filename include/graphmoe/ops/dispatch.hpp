// graphmoe/ops/dispatch.hpp: grouping tokens by expert (dispatch) and gathering the experts'
// outputs back per token (combine), for a Mixture-of-Experts layer.
//
// Each of N tokens is routed to k experts: indices (N, k). Assignment a = t * k + j is "token t's
// j-th choice". make_dispatch_plan sorts the N * k assignments by expert id with a STABLE sort,
// so the rows for expert e are one contiguous block of slots [offsets[e], offsets[e + 1]), and
// within that block assignments keep (token, j) order (core/dispatch_plan.hpp). One GEMM per
// expert then reads its block of xs directly. Every backend builds the same plan entry for entry.
//
//   dispatch:  xs[s] = x[slot_token[s]]                                  x (N, D) -> xs (N k, D)
//   combine:   y[t]  = sum_j gates[t, j] * ys[source_slot[t k + j]]      ys (N k, D) -> y (N, D)
//
// Backwards (all gradients assigned):
//   dispatch:  dx[t] = sum_j dxs[source_slot[t k + j]]
//   combine:   dys[source_slot[t k + j]] = gates[t, j] * dy[t]
//              dgates[t, j] = <dy[t], ys[source_slot[t k + j]]>
//
// make_padded_dispatch_plan(indices, keep, E, C, plan) builds the padded layout instead
// (core/dispatch_plan.hpp): S = E C slots, expert e's kept assignments in [e C, e C + count_e),
// empty slots (slot_token = -1) dispatched as zero rows, dropped assignments (keep = 0, or an
// ExpertChoice pad) with source_slot = -1, skipped by combine and dispatch's backward (dgates 0,
// no dx). An expert with more than C kept assignments, or a kept id outside [0, E), throws (a
// deferrable content check, core/deferred_check.hpp: the GPU builds the plan without a read).
//
// This is the seam where expert parallelism (dist/expert_parallel.hpp) sends the rows to other
// ranks.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// make_dispatch_plan(B{}, ...), dispatch_forward(B{}, ...), ... run the backend's system
// (backend/cpu/dispatch.hpp, backend/cuda/dispatch.cuh, or a user backend's overloads found by
// argument-dependent lookup). The plan builder returns the first expert id out of range
// (core/offender.hpp); the plan is then left invalid (k = 0), to be rebuilt.
#pragma once

#include <cstdint>
#include <limits>

#include "graphmoe/backend/cpu/dispatch.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/dispatch_plan.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {
namespace detail {

// Whether `plan` is one that make_dispatch_plan built (every array present, with its size).
template <class B>
void check_plan(const char* op, const DispatchPlan<B>& plan) {
  const index_t slots = plan.num_slots();
  GRAPHMOE_CHECK(plan.k >= 1 && plan.num_experts >= 1 && plan.capacity >= 0 &&
                     !plan.expert_offsets.empty() &&
                     plan.expert_offsets.numel() == plan.num_experts + 1 &&
                     !plan.slot_token.empty() && plan.slot_token.numel() == slots &&
                     !plan.slot_source.empty() && plan.slot_source.numel() == slots &&
                     !plan.source_slot.empty() &&
                     plan.source_slot.numel() == plan.num_assignments(),
                 op, "the plan was not built by make_dispatch_plan (N = ", plan.num_tokens,
                 ", k = ", plan.k, ", E = ", plan.num_experts, ")");
}

// Checks that `m` is read as an (rows, cols) matrix: rank >= 1 with those rows and columns.
template <class T, class B>
void check_matrix(const char* op, const char* what, const Tensor<T, B>& m, index_t rows,
                  index_t cols) {
  GRAPHMOE_CHECK(!m.empty(), op, what, " is empty, expected (", rows, ", ", cols, ")");
  GRAPHMOE_CHECK(m.rank() >= 1 && m.rows() == rows && m.cols() == cols, op, what,
                 " has shape ", m.shape(), ", expected (", rows, ", ", cols, ")");
}

}  // namespace detail

// Builds the plan for indices (N, k) of expert ids in [0, num_experts). The plan's arrays keep
// their storage when their shapes do not change (plans are rebuilt every step).
template <Backend B>
void make_dispatch_plan(const Tensor<std::int32_t, B>& indices, index_t num_experts,
                        DispatchPlan<B>& plan) {
  constexpr const char* op = "make_dispatch_plan";
  GRAPHMOE_CHECK(!indices.empty() && indices.rank() == 2, op,
                 "indices must be an (N, k) matrix of expert ids, got ",
                 (indices.empty() ? "an empty tensor" : indices.shape().str()));
  GRAPHMOE_CHECK(num_experts >= 1, op, "num_experts = ", num_experts, " must be >= 1");
  const index_t n = indices.dim(0), k = indices.dim(1), slots = n * k;
  GRAPHMOE_CHECK(k >= 1, op, "indices ", indices.shape(), " select no expert per token (k = 0)");
  GRAPHMOE_CHECK(slots <= std::numeric_limits<std::int32_t>::max() &&
                     num_experts < std::numeric_limits<std::int32_t>::max(),
                 op, "N * k = ", slots, " or E = ", num_experts, " exceeds the int32 range");
  const Offender bad = make_dispatch_plan(B{}, indices, num_experts, plan);
  if (bad.found()) {
    plan.k = 0;  // invalid: check_plan rejects it
    GRAPHMOE_CHECK(false, op, "expert id ", static_cast<std::int64_t>(bad.value), " of token ",
                   bad.index / k, ", choice ", bad.index % k, " is out of range [0, ",
                   num_experts, ")");
  }
}

// The padded plan (core/dispatch_plan.hpp) of indices (N, k) and keep (N, k): expert e's kept
// assignments in slots [e C, e C + count_e), in (token, j) order. Keeps the arrays' storage when
// their shapes do not change.
template <Backend B>
void make_padded_dispatch_plan(const Tensor<std::int32_t, B>& indices,
                               const Tensor<std::uint8_t, B>& keep, index_t num_experts,
                               index_t capacity, DispatchPlan<B>& plan) {
  constexpr const char* op = "make_padded_dispatch_plan";
  GRAPHMOE_CHECK(!indices.empty() && indices.rank() == 2 && indices.dim(1) >= 1, op,
                 "indices must be an (N, k) matrix of expert ids with k >= 1, got ",
                 (indices.empty() ? "an empty tensor" : indices.shape().str()));
  check_shape(op, "keep", keep, indices.shape());
  GRAPHMOE_CHECK(num_experts >= 1 && capacity >= 1, op, "num_experts = ", num_experts,
                 " and capacity = ", capacity, " must be >= 1");
  GRAPHMOE_CHECK(indices.numel() <= std::numeric_limits<std::int32_t>::max() &&
                     num_experts <= std::numeric_limits<std::int32_t>::max() / capacity,
                 op, "N * k = ", indices.numel(), " or E * C = ", num_experts, " * ", capacity,
                 " exceeds the int32 range");
  const index_t k = indices.dim(1);
  plan.k = 0;  // invalid until built
  const Offender bad = make_padded_dispatch_plan(B{}, indices, keep, num_experts, capacity, plan);
  // Found now: the plan is invalid (check_plan rejects it). Found later (deferred): the plan left
  // the offending assignment out (source_slot -1), and the scope's end throws.
  plan.k = bad.found() ? 0 : k;
  report_check(bad, [k, num_experts, capacity](const Offender& o) {
    const auto id = static_cast<std::int64_t>(o.value);
    if (id >= 0 && id < num_experts)
      detail::throw_error("make_padded_dispatch_plan", "expert ", id, " received more than ",
                          capacity, " kept assignments (the first beyond them: token ",
                          o.index / k, ", choice ", o.index % k,
                          "); the padded layout holds `capacity` per expert");
    detail::throw_error("make_padded_dispatch_plan", "expert id ", id, " of token ", o.index / k,
                        ", choice ", o.index % k, " is out of range [0, ", num_experts, ")");
  });
}

// xs[s] = x[slot_token[s]]: x (N, D) -> xs (N k, D). An empty xs is allocated.
template <class T, Backend B>
void dispatch_forward(const DispatchPlan<B>& plan, const Tensor<T, B>& x, Tensor<T, B>& xs) {
  constexpr const char* op = "dispatch_forward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!x.empty() && x.rank() >= 1, op, "x is empty");
  const index_t d = x.cols();
  detail::check_matrix(op, "x", x, plan.num_tokens, d);
  prepare_output(op, "xs", xs, Shape{plan.num_slots(), d});
  dispatch_forward(B{}, plan, x, xs);
}

// dx[t] = sum_j dxs[source_slot[t k + j]]: dxs (N k, D) -> dx (N, D), assigned.
template <class T, Backend B>
void dispatch_backward(const DispatchPlan<B>& plan, const Tensor<T, B>& dxs, Tensor<T, B>& dx) {
  constexpr const char* op = "dispatch_backward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!dxs.empty() && dxs.rank() >= 1, op, "dxs is empty");
  const index_t d = dxs.cols();
  detail::check_matrix(op, "dxs", dxs, plan.num_slots(), d);
  prepare_output(op, "dx", dx, Shape{plan.num_tokens, d});
  dispatch_backward(B{}, plan, dxs, dx);
}

// y[t] = sum_j gates[t, j] * ys[source_slot[t k + j]]: ys (N k, D), gates (N, k) -> y (N, D).
template <class T, Backend B>
void combine_forward(const DispatchPlan<B>& plan, const Tensor<T, B>& ys, const Tensor<T, B>& gates,
                     Tensor<T, B>& y) {
  constexpr const char* op = "combine_forward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!ys.empty() && ys.rank() >= 1, op, "ys is empty");
  const index_t d = ys.cols(), k = plan.k;
  detail::check_matrix(op, "ys", ys, plan.num_slots(), d);
  detail::check_matrix(op, "gates", gates, plan.num_tokens, k);
  prepare_output(op, "y", y, Shape{plan.num_tokens, d});
  combine_forward(B{}, plan, ys, gates, y);
}

// Backward of combine_forward: dys (N k, D) and dgates (N, k), both assigned.
template <class T, Backend B>
void combine_backward(const DispatchPlan<B>& plan, const Tensor<T, B>& ys, const Tensor<T, B>& gates,
                      const Tensor<T, B>& dy, Tensor<T, B>& dys, Tensor<T, B>& dgates) {
  constexpr const char* op = "combine_backward";
  detail::check_plan(op, plan);
  GRAPHMOE_CHECK(!ys.empty() && ys.rank() >= 1, op, "ys is empty");
  const index_t d = ys.cols(), k = plan.k;
  detail::check_matrix(op, "ys", ys, plan.num_slots(), d);
  detail::check_matrix(op, "gates", gates, plan.num_tokens, k);
  detail::check_matrix(op, "dy", dy, plan.num_tokens, d);
  prepare_output(op, "dys", dys, Shape{plan.num_slots(), d});
  prepare_output(op, "dgates", dgates, Shape{plan.num_tokens, k});
  combine_backward(B{}, plan, ys, gates, dy, dys, dgates);
}

}  // namespace graphmoe
