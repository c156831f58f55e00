// graphmoe/backend/cpu/gates.hpp: the CPU system's selector ops after top-k (contract and
// argument checks: ops/gates.hpp, which calls these through the backend tag).
//
// One pass over the tokens in order, single-threaded (N k assignments with k = 1 to 8 choices).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "graphmoe/core/capacity.hpp"
#include "graphmoe/core/gate_scaling.hpp"
#include "graphmoe/core/group_routing.hpp"
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

// gates (values' shape) prepared by ops/gates.hpp; with scaling.normalize, returns the first token
// whose selected scores do not sum to > 0, with that sum (the gates of earlier tokens are written).
template <class T>
Offender renormalized_gates(cpu, const Tensor<T, cpu>& values,
                            const Tensor<std::uint8_t, cpu>& keep, Tensor<T, cpu>& gates,
                            GateScaling scaling = {}) {
  const index_t n = values.rows(), k = values.cols();
  const T scale = static_cast<T>(scaling.scale);
  for (index_t i = 0; i < n; ++i) {
    const T* v = values.data() + i * k;
    T* g = gates.data() + i * k;
    const std::uint8_t* kp = keep.data() + i * k;
    if (!scaling.normalize) {
      for (index_t j = 0; j < k; ++j) g[j] = kp[j] ? v[j] * scale : T(0);
      continue;
    }
    T s = 0;
    for (index_t j = 0; j < k; ++j) s += v[j];
    if (!(s > T(0))) return {i, static_cast<double>(s)};
    for (index_t j = 0; j < k; ++j) g[j] = kp[j] ? v[j] / s * scale : T(0);
  }
  return {};
}

// dp (N, E) prepared by ops/gates.hpp; assigned. With normalize (s = sum_j v_j):
//   dp[t, idx_j] = scale keep_j dg_j / s - sum_l g_l dg_l / s;  without: scale keep_j dg_j.
template <class T>
void renormalized_gates_backward(cpu, const Tensor<T, cpu>& values,
                                 const Tensor<std::int32_t, cpu>& indices,
                                 const Tensor<std::uint8_t, cpu>& keep, const Tensor<T, cpu>& gates,
                                 const Tensor<T, cpu>& dgates, index_t num_experts,
                                 Tensor<T, cpu>& dp, GateScaling scaling = {}) {
  const index_t n = values.rows(), k = values.cols();
  const T scale = static_cast<T>(scaling.scale);
  dp.zero();
  for (index_t i = 0; i < n; ++i) {
    if (!scaling.normalize) {
      for (index_t j = 0; j < k; ++j) {
        const index_t a = i * k + j;
        dp.data()[i * num_experts + indices.data()[a]] +=
            keep.data()[a] ? dgates.data()[a] * scale : T(0);
      }
      continue;
    }
    T s = 0, gdg = 0;
    for (index_t j = 0; j < k; ++j) {
      s += values.data()[i * k + j];
      gdg += gates.data()[i * k + j] * dgates.data()[i * k + j];
    }
    for (index_t j = 0; j < k; ++j) {
      const index_t a = i * k + j;
      const T d = (keep.data()[a] ? dgates.data()[a] * scale : T(0)) / s - gdg / s;
      dp.data()[i * num_experts + indices.data()[a]] += d;
    }
  }
}

// masked (x's shape) prepared by ops/gates.hpp: row i keeps the entries of its topk_group groups
// of largest score (a group's score: the sum of its two largest entries, or its one entry; ties:
// the lower group), the others become -inf; a NaN stays NaN (top-k then names it).
template <class T>
void group_limited_mask(cpu, const Tensor<T, cpu>& x, index_t n_group, index_t topk_group,
                        Tensor<T, cpu>& masked) {
  const index_t n = x.rows(), e = x.cols(), size = e / n_group;
  std::vector<T> score(static_cast<std::size_t>(n_group));
  std::vector<std::uint8_t> chosen(static_cast<std::size_t>(n_group));
  for (index_t i = 0; i < n; ++i) {
    const T* xr = x.data() + i * e;
    T* mr = masked.data() + i * e;
    detail::group_scores(xr, n_group, size, score.data());
    detail::choose_groups(score.data(), n_group, topk_group, chosen.data());
    for (index_t c = 0; c < e; ++c)
      mr[c] = chosen[static_cast<std::size_t>(c / size)] || xr[c] != xr[c]
                  ? xr[c]
                  : -std::numeric_limits<T>::infinity();
  }
}

// out (indices' shape) prepared by ops/gates.hpp: out[i, j] = x[i, indices[i, j]]; returns the
// first id outside [0, E).
template <class T>
Offender gather_columns(cpu, const Tensor<T, cpu>& x, const Tensor<std::int32_t, cpu>& indices,
                        Tensor<T, cpu>& out) {
  const index_t n = indices.rows(), k = indices.cols(), e = x.cols();
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t id = indices.data()[i * k + j];
      if (!(id >= 0 && id < e)) return {i * k + j, static_cast<double>(id)};
      out.data()[i * k + j] = x.data()[i * e + id];
    }
  return {};
}

// counts (E) += the kept assignments of each expert; returns the first id outside [0, E).
inline Offender accumulate_expert_counts(cpu, const Tensor<std::int32_t, cpu>& indices,
                                         const Tensor<std::uint8_t, cpu>& keep,
                                         Tensor<std::int32_t, cpu>& counts) {
  const index_t e = counts.numel();
  for (index_t a = 0; a < indices.numel(); ++a) {
    if (!keep.data()[a]) continue;
    const std::int32_t id = indices.data()[a];
    if (!(id >= 0 && id < e)) return {a, static_cast<double>(id)};
    ++counts.data()[id];
  }
  return {};
}

// bias (E) += rate * sign(mean - loads) in double from the stored values, nothing when the loads
// sum to no more than 0 (shapes checked by ops/gates.hpp). The total in double in index order (the
// integer counts sum exactly, so the CUDA kernel's block sum equals it).
template <class T>
void expert_bias_update(cpu, const Tensor<T, cpu>& bias, const Tensor<std::int32_t, cpu>& loads,
                        double rate) {
  const index_t e = bias.numel();
  const std::int32_t* l = loads.data();
  double total = 0;
  for (index_t i = 0; i < e; ++i) total += static_cast<double>(l[i]);
  if (!(total > 0)) return;
  const double mean = total / static_cast<double>(e);
  T* b = bias.data();
  for (index_t i = 0; i < e; ++i) {
    const double load = static_cast<double>(l[i]);
    const double sign = load < mean ? 1.0 : (load > mean ? -1.0 : 0.0);
    b[i] = static_cast<T>(static_cast<double>(b[i]) + rate * sign);
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
