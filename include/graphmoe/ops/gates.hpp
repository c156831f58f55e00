// graphmoe/ops/gates.hpp: the selector's ops after top-k (routing/selectors.hpp, layers/moe.hpp).
//
//   capacity_mask(indices, E, capacity, keep)
//       keep[a] = 0 for every assignment a = t k + j (token order, then choice order) beyond the
//       first `capacity` assignments of its expert; 1 otherwise. capacity <= 0: keep everything.
//       With a capacity, an expert id outside [0, E) throws (a deferrable content check,
//       core/deferred_check.hpp). The number of drops is not returned: count_dropped asks for it
//       (on a GPU that is a read back to the host, which a training step does not need).
//   count_dropped(keep) -> the number of entries of keep that are 0
//   renormalized_gates(values, keep, gates, scaling = {})
//       gates[t, j] = c keep[t, j] values[t, j] / s_t,   s_t = sum_j values[t, j]
//       (Renormalize(TopK^0(p)) of the paper's Appendix C.3; s_t counts dropped choices too),
//       c = scaling.scale; without scaling.normalize (core/gate_scaling.hpp) the division is left
//       out. With it, a token whose s_t is not > 0 throws.
//   renormalized_gates_backward(values, indices, keep, gates, dgates, dp, scaling = {})
//       dp (N, E) assigned: zero except at the selected experts, where
//       dp[t, indices[t, j]] = c keep[t, j] dgates[t, j] / s_t - sum_l gates[t, l] dgates[t, l] / s_t
//       (without normalize: c keep[t, j] dgates[t, j])
//   group_limited_mask(x, n_group, topk_group, masked)
//       x (N, E) with E a multiple of n_group: each row keeps the entries of its topk_group groups
//       of E / n_group experts with the largest scores (a group's score: the sum of its two
//       largest entries; core/group_routing.hpp), the other entries become -inf (DeepSeek-V3's
//       group-limited routing before top-k). A NaN entry stays NaN, for top-k to name.
//   gather_columns(x, indices, out)
//       out[t, j] = x[t, indices[t, j]]   (a selector's unbiased values at the experts it chose
//       by biased scores). An id outside [0, E) throws.
//   accumulate_expert_counts(indices, keep, counts)
//       counts[e] += the number of kept slots routed to e (counts: (E) int32, the step's load for
//       auxiliary-loss-free balancing). An id outside [0, E) throws.
//   expert_bias_update(bias, loads, rate)
//       auxiliary-loss-free balancing's bias update (BiasBalancedTopK::after_step): bias (E) of T,
//       loads (E) int32 (the step's kept assignments per expert, summed over the data-parallel
//       ranks), on the same backend. With total = sum_e loads[e] and mean = total / E, every
//       expert gets bias[e] += rate * sign(mean - loads[e]) (sign 0 at the mean); nothing changes
//       when total is not > 0 (a step that routed no token). In double from the stored T values,
//       rounded once to T: the counts sum exactly in any order, so every backend and every rank
//       writes the same bits (and a resumed run continues bit for bit).
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

#include <cmath>
#include <cstdint>
#include <string>

#include "graphmoe/backend/cpu/gates.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/gate_scaling.hpp"
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
inline void check_gate_scaling(const char* op, const GateScaling& scaling) {
  GRAPHMOE_CHECK(scaling.scale > 0 && scaling.scale < 1e300, op,
                 "the gate scale (routed_scaling_factor) must be > 0 and finite, got ",
                 scaling.scale);
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
                        Tensor<T, B>& gates, GateScaling scaling = {}) {
  detail::check_gate_inputs("renormalized_gates", values, keep);
  detail::check_gate_scaling("renormalized_gates", scaling);
  prepare_output("renormalized_gates", "gates", gates, values.shape());
  report_check(renormalized_gates(B{}, values, keep, gates, scaling), [](const Offender& bad) {
    detail::throw_error("renormalized_gates", "the selected scores of token ", bad.index,
                        " sum to ", bad.value, " (p must be a probability vector)");
  });
}

template <class T, Backend B>
void renormalized_gates_backward(const Tensor<T, B>& values, const Tensor<std::int32_t, B>& indices,
                                 const Tensor<std::uint8_t, B>& keep, const Tensor<T, B>& gates,
                                 const Tensor<T, B>& dgates, index_t num_experts,
                                 Tensor<T, B>& dp, GateScaling scaling = {}) {
  constexpr const char* op = "renormalized_gates_backward";
  detail::check_gate_inputs(op, values, keep);
  detail::check_gate_scaling(op, scaling);
  check_shape(op, "indices", indices, values.shape());
  check_shape(op, "dgates", dgates, gates.shape());
  prepare_output(op, "dp", dp, Shape{values.rows(), num_experts});
  renormalized_gates_backward(B{}, values, indices, keep, gates, dgates, num_experts, dp, scaling);
}

template <class T, Backend B>
void group_limited_mask(const Tensor<T, B>& x, index_t n_group, index_t topk_group,
                        Tensor<T, B>& masked) {
  constexpr const char* op = "group_limited_mask";
  GRAPHMOE_CHECK(!x.empty() && x.rank() == 2, op, "x must be a non-empty (N, E) matrix, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  GRAPHMOE_CHECK(n_group >= 1 && x.cols() % n_group == 0, op, "n_group = ", n_group,
                 " must be >= 1 and divide E = ", x.cols());
  GRAPHMOE_CHECK(topk_group >= 1 && topk_group <= n_group, op, "topk_group = ", topk_group,
                 " must be in [1, n_group = ", n_group, "]");
  prepare_output(op, "masked", masked, x.shape());
  group_limited_mask(B{}, x, n_group, topk_group, masked);
}

template <class T, Backend B>
void gather_columns(const Tensor<T, B>& x, const Tensor<std::int32_t, B>& indices,
                    Tensor<T, B>& out) {
  constexpr const char* op = "gather_columns";
  GRAPHMOE_CHECK(x.rank() == 2 && indices.rank() == 2 && indices.rows() == x.rows() &&
                     !indices.empty(),
                 op, "x ", x.shape(), " and indices ", indices.shape(),
                 " must be (N, E) and (N, k) matrices");
  prepare_output(op, "out", out, indices.shape());
  report_check(gather_columns(B{}, x, indices, out), [e = x.cols()](const Offender& bad) {
    detail::throw_error("gather_columns", "expert id ", static_cast<std::int64_t>(bad.value),
                        " at slot ", bad.index, " is outside [0, ", e, ")");
  });
}

template <Backend B>
void accumulate_expert_counts(const Tensor<std::int32_t, B>& indices,
                              const Tensor<std::uint8_t, B>& keep,
                              Tensor<std::int32_t, B>& counts) {
  constexpr const char* op = "accumulate_expert_counts";
  check_shape(op, "keep", keep, indices.shape());
  GRAPHMOE_CHECK(counts.rank() == 1 && counts.numel() >= 1, op,
                 "counts must be an allocated (E) vector, got ",
                 (counts.empty() ? "an empty tensor" : counts.shape().str()));
  report_check(accumulate_expert_counts(B{}, indices, keep, counts),
               [e = counts.numel()](const Offender& bad) {
                 detail::throw_error("accumulate_expert_counts", "expert id ",
                                     static_cast<std::int64_t>(bad.value), " at slot ", bad.index,
                                     " is outside [0, ", e, ")");
               });
}

template <class T, Backend B>
void expert_bias_update(const Tensor<T, B>& bias, const Tensor<std::int32_t, B>& loads,
                        double rate) {
  constexpr const char* op = "expert_bias_update";
  GRAPHMOE_CHECK(bias.rank() == 1 && bias.numel() >= 1, op,
                 "bias must be an allocated (E) vector, got ",
                 (bias.empty() ? std::string("an empty tensor") : bias.shape().str()));
  GRAPHMOE_CHECK(loads.rank() == 1 && loads.numel() == bias.numel(), op, "loads must be a (",
                 bias.numel(), ") vector, one count per expert of the bias, got ",
                 (loads.empty() ? std::string("an empty tensor") : loads.shape().str()));
  GRAPHMOE_CHECK(std::isfinite(rate), op, "rate must be finite, got ", rate);
  expert_bias_update(B{}, bias, loads, rate);
}

template <Backend B>
void route_dropped_to(const Tensor<std::int32_t, B>& indices, const Tensor<std::uint8_t, B>& keep,
                      std::int32_t bucket, Tensor<std::int32_t, B>& ids) {
  check_shape("route_dropped_to", "keep", keep, indices.shape());
  prepare_output("route_dropped_to", "ids", ids, indices.shape());
  route_dropped_to(B{}, indices, keep, bucket, ids);
}

}  // namespace graphmoe
