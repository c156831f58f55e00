// graphmoe/backend/cpu/gates.hpp: the CPU system's selector ops after top-k (contract and
// argument checks: ops/gates.hpp, which calls these through the backend tag).
//
// One pass over the tokens in order, single-threaded (N k assignments with k = 1 to 8 choices).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphmoe/core/capacity.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// keep (indices' shape) prepared by ops/gates.hpp; returns the first expert id outside
// [0, num_experts) (checked only with a capacity; keep is then partly written).
inline Offender capacity_mask(cpu, const Tensor<std::int32_t, cpu>& indices, index_t num_experts,
                              index_t capacity, Tensor<std::uint8_t, cpu>& keep) {
  std::fill(keep.data(), keep.data() + keep.numel(), std::uint8_t{1});
  if (capacity <= 0) return {};
  return detail::capacity_mask_host(indices.data(), indices.numel(), num_experts, capacity,
                                    keep.data());
}

inline index_t count_dropped(cpu, const Tensor<std::uint8_t, cpu>& keep) {
  return static_cast<index_t>(
      std::count(keep.data(), keep.data() + keep.numel(), std::uint8_t{0}));
}

// gates (values' shape) prepared by ops/gates.hpp; returns the first token whose selected scores
// do not sum to > 0, with that sum (the gates of earlier tokens are written).
template <class T>
Offender renormalized_gates(cpu, const Tensor<T, cpu>& values,
                            const Tensor<std::uint8_t, cpu>& keep, Tensor<T, cpu>& gates) {
  const index_t n = values.rows(), k = values.cols();
  for (index_t i = 0; i < n; ++i) {
    const T* v = values.data() + i * k;
    T s = 0;
    for (index_t j = 0; j < k; ++j) s += v[j];
    if (!(s > T(0))) return {i, static_cast<double>(s)};
    for (index_t j = 0; j < k; ++j) gates.data()[i * k + j] = keep.data()[i * k + j] ? v[j] / s : T(0);
  }
  return {};
}

// dp (N, E) prepared by ops/gates.hpp; assigned.
template <class T>
void renormalized_gates_backward(cpu, const Tensor<T, cpu>& values,
                                 const Tensor<std::int32_t, cpu>& indices,
                                 const Tensor<std::uint8_t, cpu>& keep, const Tensor<T, cpu>& gates,
                                 const Tensor<T, cpu>& dgates, index_t num_experts,
                                 Tensor<T, cpu>& dp) {
  const index_t n = values.rows(), k = values.cols();
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

// ids (indices' shape) prepared by ops/gates.hpp.
inline void route_dropped_to(cpu, const Tensor<std::int32_t, cpu>& indices,
                             const Tensor<std::uint8_t, cpu>& keep, std::int32_t bucket,
                             Tensor<std::int32_t, cpu>& ids) {
  for (index_t a = 0; a < indices.numel(); ++a)
    ids.data()[a] = keep.data()[a] ? indices.data()[a] : bucket;
}

}  // namespace graphmoe
