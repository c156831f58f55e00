// graphmoe/backend/cpu/gates.hpp: the selector's ops after top-k (routing/selectors.hpp).
//
//   capacity_mask(indices, E, capacity, keep) -> dropped
//       keep[a] = 0 for every assignment a = t k + j (token order, then choice order) beyond the
//       first `capacity` assignments of its expert; 1 otherwise. capacity <= 0: keep everything.
//   renormalized_gates(values, keep, gates)
//       gates[t, j] = keep[t, j] values[t, j] / s_t,   s_t = sum_j values[t, j]
//       (Renormalize(TopK^0(p)) of the paper's Appendix C.3; s_t counts dropped choices too)
//   renormalized_gates_backward(values, indices, keep, gates, dgates, dp)
//       dp (N, E) assigned: zero except at the selected experts, where
//       dp[t, indices[t, j]] = keep[t, j] dgates[t, j] / s_t - sum_l gates[t, l] dgates[t, l] / s_t
//   route_dropped_to(indices, keep, bucket, ids)
//       ids[a] = keep[a] ? indices[a] : bucket   (the MoE layer sends dropped assignments to an
//       extra expert `bucket` = E that the expert bank skips)
//
// backend/cuda/gates.cuh has the same functions on Tensor<T, cuda>.
#pragma once

#include <cstdint>
#include <vector>

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

inline index_t capacity_mask(const Tensor<std::int32_t, cpu>& indices, index_t num_experts,
                             index_t capacity, Tensor<std::uint8_t, cpu>& keep) {
  prepare_output("capacity_mask", "keep", keep, indices.shape());
  std::fill(keep.data(), keep.data() + keep.numel(), std::uint8_t{1});
  if (capacity <= 0) return 0;
  std::vector<index_t> load(static_cast<std::size_t>(num_experts), 0);
  index_t dropped = 0;
  for (index_t a = 0; a < indices.numel(); ++a) {
    const std::int32_t e = indices.data()[a];
    GRAPHMOE_CHECK(e >= 0 && e < num_experts, "capacity_mask", "expert id ", e,
                   " at assignment ", a, " is outside [0, ", num_experts, ")");
    auto& l = load[static_cast<std::size_t>(e)];
    if (l >= capacity) {
      keep.data()[a] = 0;
      ++dropped;
    } else {
      ++l;
    }
  }
  return dropped;
}

template <class T>
void renormalized_gates(const Tensor<T, cpu>& values, const Tensor<std::uint8_t, cpu>& keep,
                        Tensor<T, cpu>& gates) {
  detail::check_gate_inputs("renormalized_gates", values, keep);
  prepare_output("renormalized_gates", "gates", gates, values.shape());
  const index_t n = values.rows(), k = values.cols();
  for (index_t i = 0; i < n; ++i) {
    const T* v = values.data() + i * k;
    T s = 0;
    for (index_t j = 0; j < k; ++j) s += v[j];
    GRAPHMOE_CHECK(s > T(0), "TopK", "the selected scores of token ", i, " sum to ", s,
                   " (p must be a probability vector)");
    for (index_t j = 0; j < k; ++j) gates.data()[i * k + j] = keep.data()[i * k + j] ? v[j] / s : T(0);
  }
}

template <class T>
void renormalized_gates_backward(const Tensor<T, cpu>& values,
                                 const Tensor<std::int32_t, cpu>& indices,
                                 const Tensor<std::uint8_t, cpu>& keep, const Tensor<T, cpu>& gates,
                                 const Tensor<T, cpu>& dgates, index_t num_experts,
                                 Tensor<T, cpu>& dp) {
  detail::check_gate_inputs("renormalized_gates_backward", values, keep);
  check_shape("TopK::backward", "dgates", dgates, gates.shape());
  const index_t n = values.rows(), k = values.cols();
  prepare_output("TopK::backward", "dp", dp, Shape{n, num_experts});
  dp.zero();
  for (index_t i = 0; i < n; ++i) {
    T s = 0, gdg = 0;
    for (index_t j = 0; j < k; ++j) {
      s += values.data()[i * k + j];
      gdg += gates.data()[i * k + j] * dgates.data()[i * k + j];
    }
    for (index_t j = 0; j < k; ++j) {
      const index_t a = i * k + j;
      const T d = (keep.data()[a] ? dgates.data()[a] : T(0)) / s - gdg / s;
      dp.data()[i * num_experts + indices.data()[a]] += d;
    }
  }
}

inline void route_dropped_to(const Tensor<std::int32_t, cpu>& indices,
                             const Tensor<std::uint8_t, cpu>& keep, std::int32_t bucket,
                             Tensor<std::int32_t, cpu>& ids) {
  check_shape("route_dropped_to", "keep", keep, indices.shape());
  prepare_output("route_dropped_to", "ids", ids, indices.shape());
  for (index_t a = 0; a < indices.numel(); ++a)
    ids.data()[a] = keep.data()[a] ? indices.data()[a] : bucket;
}

}  // namespace graphmoe
