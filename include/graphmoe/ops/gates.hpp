// graphmoe/ops/gates.hpp: the selector's ops after top-k (routing/selectors.hpp, layers/moe.hpp).
//
//   capacity_mask(indices, E, capacity, keep)
//       keep[a] = 0 for every assignment a = t k + j (token order, then choice order) beyond the
//       first `capacity` assignments of its expert; 1 otherwise. capacity <= 0: keep everything.
//       With a capacity, an expert id outside [0, E) throws (a deferrable content check,
//       core/deferred_check.hpp). The number of drops is not returned: count_dropped asks for it
//       (on a GPU that is a read back to the host, which a training step does not need).
//   count_dropped(keep) -> the number of entries of keep that are 0
//   renormalized_gates(values, keep, gates)
//       gates[t, j] = keep[t, j] values[t, j] / s_t,   s_t = sum_j values[t, j]
//       (Renormalize(TopK^0(p)) of the paper's Appendix C.3; s_t counts dropped choices too).
//       A token whose s_t is not > 0 throws.
//   renormalized_gates_backward(values, indices, keep, gates, dgates, dp)
//       dp (N, E) assigned: zero except at the selected experts, where
//       dp[t, indices[t, j]] = keep[t, j] dgates[t, j] / s_t - sum_l gates[t, l] dgates[t, l] / s_t
//   route_dropped_to(indices, keep, bucket, ids)
//       ids[a] = keep[a] ? indices[a] : bucket   (the MoE layer sends dropped assignments to an
//       extra expert `bucket` = E that the expert bank skips)
//
// Outputs follow prepare_output (empty: allocated; otherwise the shape must match).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// X(B{}, ...) runs the backend's system (backend/cpu/gates.hpp, backend/cuda/gates.cuh, or a user
// backend's overload found by argument-dependent lookup), which returns the first offending entry
// of the data it scanned (core/offender.hpp).
#pragma once

#include <cstdint>

#include "graphmoe/backend/cpu/gates.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
template <class T, class B>
void check_gate_inputs(const char* op, const Tensor<T, B>& values,
                       const Tensor<std::uint8_t, B>& keep) {
  GRAPHMOE_CHECK(values.rank() == 2 && !values.empty(), op,
                 "values must be a non-empty (N, k) matrix, got shape ", values.shape());
  check_shape(op, "keep", keep, values.shape());
}
}  // namespace detail

template <Backend B>
void capacity_mask(const Tensor<std::int32_t, B>& indices, index_t num_experts, index_t capacity,
                   Tensor<std::uint8_t, B>& keep) {
  GRAPHMOE_CHECK(num_experts >= 1, "capacity_mask", "num_experts = ", num_experts,
                 " must be >= 1");
  prepare_output("capacity_mask", "keep", keep, indices.shape());
  report_check(capacity_mask(B{}, indices, num_experts, capacity, keep),
               [num_experts](const Offender& bad) {
                 detail::throw_error("capacity_mask", "expert id ",
                                     static_cast<std::int32_t>(bad.value), " at assignment ",
                                     bad.index, " is outside [0, ", num_experts, ")");
               });
}

template <Backend B>
index_t count_dropped(const Tensor<std::uint8_t, B>& keep) {
  return count_dropped(B{}, keep);
}

template <class T, Backend B>
void renormalized_gates(const Tensor<T, B>& values, const Tensor<std::uint8_t, B>& keep,
                        Tensor<T, B>& gates) {
  detail::check_gate_inputs("renormalized_gates", values, keep);
  prepare_output("renormalized_gates", "gates", gates, values.shape());
  report_check(renormalized_gates(B{}, values, keep, gates), [](const Offender& bad) {
    detail::throw_error("TopK", "the selected scores of token ", bad.index, " sum to ", bad.value,
                        " (p must be a probability vector)");
  });
}

template <class T, Backend B>
void renormalized_gates_backward(const Tensor<T, B>& values, const Tensor<std::int32_t, B>& indices,
                                 const Tensor<std::uint8_t, B>& keep, const Tensor<T, B>& gates,
                                 const Tensor<T, B>& dgates, index_t num_experts,
                                 Tensor<T, B>& dp) {
  detail::check_gate_inputs("renormalized_gates_backward", values, keep);
  check_shape("TopK::backward", "dgates", dgates, gates.shape());
  prepare_output("TopK::backward", "dp", dp, Shape{values.rows(), num_experts});
  renormalized_gates_backward(B{}, values, indices, keep, gates, dgates, num_experts, dp);
}

template <Backend B>
void route_dropped_to(const Tensor<std::int32_t, B>& indices, const Tensor<std::uint8_t, B>& keep,
                      std::int32_t bucket, Tensor<std::int32_t, B>& ids) {
  check_shape("route_dropped_to", "keep", keep, indices.shape());
  prepare_output("route_dropped_to", "ids", ids, indices.shape());
  route_dropped_to(B{}, indices, keep, bucket, ids);
}

}  // namespace graphmoe
