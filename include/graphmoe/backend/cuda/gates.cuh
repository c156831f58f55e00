// graphmoe/backend/cuda/gates.cuh: the CUDA system's selector ops after top-k on Tensor<T, cuda>
// (contract and argument checks: ops/gates.hpp, which calls these through the backend tag).
//
//   renormalized_gates            one thread per token (k <= E is small: 1 to 8 choices); the
//                                 first token whose selected scores do not sum to > 0 is returned
//                                 (one flag read back, which synchronises the stream)
//   renormalized_gates_backward   one thread per token: zeroes its row of dp, then writes its k
//                                 entries (the top-k ids of a token are distinct), sums in the
//                                 CPU's order
//   route_dropped_to              one thread per assignment
//   capacity_mask                 one block per expert: each thread counts the expert's
//                                 assignments in its contiguous share of the N k ids, the block
//                                 turns the counts into prefix sums (thread 0, in order) and
//                                 each thread ranks its assignments in token order, keep = rank <
//                                 capacity: the CPU loop's mask, with no copy to the host. The
//                                 id range check is a deferrable flag (block 0 scans for ids
//                                 outside [0, E)). Without a capacity: one memset to 1.
//   count_dropped                 keep copied to the host and counted (a read: only on request)
//   expert_bias_update            one block: the counts summed in double (integers: exact in any
//                                 order, so the CPU loop's total), then each thread updates its
//                                 experts in double from the stored values; nothing read back
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/gate_scaling.hpp"
#include "graphmoe/core/group_routing.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void renormalized_gates_kernel(const T* values, const std::uint8_t* keep, T* gates,
                                          index_t n, index_t k, bool normalize, T scale,
                                          unsigned long long* bad_token) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const T* v = values + i * k;
    if (!normalize) {
      for (index_t j = 0; j < k; ++j) gates[i * k + j] = keep[i * k + j] ? v[j] * scale : T(0);
      continue;
    }
    T s = T(0);
    for (index_t j = 0; j < k; ++j) s += v[j];
    if (!(s > T(0))) {
      flag_index(bad_token, i);
      continue;
    }
    for (index_t j = 0; j < k; ++j) gates[i * k + j] = keep[i * k + j] ? v[j] / s * scale : T(0);
  }
}

template <class T>
__global__ void renormalized_gates_backward_kernel(const T* values, const std::int32_t* indices,
                                                   const std::uint8_t* keep, const T* gates,
                                                   const T* dgates, T* dp, index_t n, index_t k,
                                                   index_t e, bool normalize, T scale) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    T* row = dp + i * e;
    for (index_t c = 0; c < e; ++c) row[c] = T(0);
    if (!normalize) {
      for (index_t j = 0; j < k; ++j) {
        const index_t a = i * k + j;
        row[indices[a]] += keep[a] ? dgates[a] * scale : T(0);
      }
      continue;
    }
    T s = T(0), gdg = T(0);
    for (index_t j = 0; j < k; ++j) {
      s += values[i * k + j];
      gdg += gates[i * k + j] * dgates[i * k + j];
    }
    for (index_t j = 0; j < k; ++j) {
      const index_t a = i * k + j;
      row[indices[a]] += (keep[a] ? dgates[a] * scale : T(0)) / s - gdg / s;
    }
  }
}

// One thread per row; the group scores and choices in per-thread arrays (n_group <= kMaxGroups,
// checked by the host function).
inline constexpr index_t kMaxGroups = 64;
template <class T>
__global__ void group_limited_mask_kernel(const T* x, T* masked, index_t n, index_t e,
                                          index_t n_group, index_t topk_group) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    T score[kMaxGroups];
    std::uint8_t chosen[kMaxGroups];
    const index_t size = e / n_group;
    const T* xr = x + i * e;
    group_scores(xr, n_group, size, score);
    choose_groups(score, n_group, topk_group, chosen);
    constexpr T ninf = -std::numeric_limits<T>::infinity();
    for (index_t c = 0; c < e; ++c)
      masked[i * e + c] = chosen[c / size] || xr[c] != xr[c] ? xr[c] : ninf;
  }
}

template <class T>
__global__ void gather_columns_kernel(const T* x, const std::int32_t* indices, T* out, index_t n,
                                      index_t k, index_t e, unsigned long long* bad_id) {
  GRAPHMOE_CUDA_GRID_STRIDE(a, n * k) {
    const std::int32_t id = indices[a];
    if (!(id >= 0 && id < e)) {
      flag_index(bad_id, a);
      out[a] = T(0);
      continue;
    }
    out[a] = x[(a / k) * e + id];
  }
}

template <class I>
__global__ void accumulate_expert_counts_kernel(const I* indices, const std::uint8_t* keep,
                                                I* counts, index_t n, index_t e,
                                                unsigned long long* bad_id) {
  GRAPHMOE_CUDA_GRID_STRIDE(a, n) {
    if (!keep[a]) continue;
    const I id = indices[a];
    if (!(id >= 0 && id < e)) {
      flag_index(bad_id, a);
      continue;
    }
    atomicAdd(counts + id, I(1));
  }
}

// blockDim.x == kThreads, one block per expert (see the header).
// (A template only so that the kernel is defined in each translation unit that launches it.)
template <class I>
__global__ void capacity_mask_kernel(const I* ids, index_t n, index_t num_experts,
                                     index_t capacity, std::uint8_t* keep,
                                     unsigned long long* bad_id) {
  const auto e = static_cast<I>(blockIdx.x);
  const BlockShare share = block_rank_shares(n, [&](index_t a) { return ids[a] == e; });
  index_t rank = share.first;
  for (index_t a = share.begin; a < share.end; ++a) {
    const I id = ids[a];
    if (id == e) {
      keep[a] = rank < capacity ? 1 : 0;
      ++rank;
    } else if (e == 0 && !(id >= 0 && id < num_experts)) {
      keep[a] = 0;  // no block owns it
      flag_index(bad_id, a);
    }
  }
}

// One block (blockDim.x a multiple of 32): bias[x] += rate * sign(mean - loads[x]) when the loads
// sum to > 0. rate * sign is exact (sign is -1, 0 or 1), so a contraction into an FMA rounds the
// same single addition as the CPU.
template <class T>
__global__ void expert_bias_update_kernel(T* bias, const std::int32_t* loads, index_t e,
                                          double rate) {
  double part = 0;
  for (index_t x = threadIdx.x; x < e; x += blockDim.x) part += static_cast<double>(loads[x]);
  const double total = block_reduce(part, SumOp{}, 0.0);
  if (!(total > 0)) return;  // the same total in every thread: all return
  const double mean = total / static_cast<double>(e);
  for (index_t x = threadIdx.x; x < e; x += blockDim.x) {
    const double load = static_cast<double>(loads[x]);
    const double sign = load < mean ? 1.0 : (load > mean ? -1.0 : 0.0);
    bias[x] = value_cast<T>(value_cast<double>(bias[x]) + rate * sign);
  }
}

template <class I>
__global__ void route_dropped_to_kernel(const I* indices, const std::uint8_t* keep, I bucket,
                                        I* ids, index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(a, n) { ids[a] = keep[a] ? indices[a] : bucket; }
}

}  // namespace detail

// keep (indices' shape) prepared by ops/gates.hpp; returns the first expert id outside
// [0, num_experts) (checked only with a capacity; pending inside with_deferred_checks).
inline Offender capacity_mask(cuda, const Tensor<std::int32_t, cuda>& indices,
                              index_t num_experts, index_t capacity,
                              Tensor<std::uint8_t, cuda>& keep) {
  const index_t n = indices.numel();
  if (n == 0) return {};
  if (capacity <= 0) {
    GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(keep.data(), 1, keep.bytes(), cuda_stream()));
    return {};
  }
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::capacity_mask_kernel<std::int32_t>>(
      static_cast<unsigned>(num_experts), detail::kThreads, indices.data(), n, num_experts,
      capacity, keep.data(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("capacity_mask", [indices](index_t a) {
    return Offender{a, static_cast<double>(detail::read_device_value(indices.data() + a))};
  });
}

// The number of zeros of keep: a copy to the host (synchronises).
inline index_t count_dropped(cuda, const Tensor<std::uint8_t, cuda>& keep) {
  const Tensor<std::uint8_t, cpu> host = to_host(keep);
  return static_cast<index_t>(
      std::count(host.data(), host.data() + host.numel(), std::uint8_t{0}));
}

// gates (values' shape) prepared by ops/gates.hpp; returns the first token whose selected scores
// do not sum to > 0, with that sum (recomputed on the host in the CPU system's order).
template <class T>
Offender renormalized_gates(cuda, const Tensor<T, cuda>& values,
                            const Tensor<std::uint8_t, cuda>& keep, Tensor<T, cuda>& gates,
                            GateScaling scaling = {}) {
  const index_t n = values.rows(), k = values.cols();
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::renormalized_gates_kernel<T>>(
      detail::grid_for(n), detail::kThreads, values.data(), keep.data(), gates.data(), n, k,
      scaling.normalize, static_cast<T>(scaling.scale), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("renormalized_gates", [values, k](index_t i) {
    const Tensor<T, cpu> row = to_host(values[i]);
    T s = 0;
    for (index_t j = 0; j < k; ++j) s += row.data()[j];
    return Offender{i, static_cast<double>(detail::to_acc(s))};
  });
}

// dp (N, E) prepared by ops/gates.hpp; assigned.
template <class T>
void renormalized_gates_backward(cuda, const Tensor<T, cuda>& values,
                                 const Tensor<std::int32_t, cuda>& indices,
                                 const Tensor<std::uint8_t, cuda>& keep,
                                 const Tensor<T, cuda>& gates, const Tensor<T, cuda>& dgates,
                                 index_t num_experts, Tensor<T, cuda>& dp,
                                 GateScaling scaling = {}) {
  const index_t n = values.rows(), k = values.cols();
  detail::launch_kernel<detail::renormalized_gates_backward_kernel<T>>(
      detail::grid_for(n), detail::kThreads, values.data(), indices.data(), keep.data(),
      gates.data(), dgates.data(), dp.data(), n, k, num_experts, scaling.normalize,
      static_cast<T>(scaling.scale));
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// masked (x's shape) prepared by ops/gates.hpp; at most detail::kMaxGroups groups.
template <class T>
void group_limited_mask(cuda, const Tensor<T, cuda>& x, index_t n_group, index_t topk_group,
                        Tensor<T, cuda>& masked) {
  GRAPHMOE_CHECK(n_group <= detail::kMaxGroups, "group_limited_mask", "n_group = ", n_group,
                 " exceeds the CUDA kernel's ", detail::kMaxGroups, " groups");
  const index_t n = x.rows(), e = x.cols();
  detail::launch_kernel<detail::group_limited_mask_kernel<T>>(detail::grid_for(n),
                                                              detail::kThreads, x.data(),
                                                              masked.data(), n, e, n_group,
                                                              topk_group);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// out (indices' shape) prepared by ops/gates.hpp; the first id outside [0, E) (deferrable).
template <class T>
Offender gather_columns(cuda, const Tensor<T, cuda>& x, const Tensor<std::int32_t, cuda>& indices,
                        Tensor<T, cuda>& out) {
  const index_t n = indices.rows(), k = indices.cols();
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::gather_columns_kernel<T>>(detail::grid_for(n * k),
                                                          detail::kThreads, x.data(),
                                                          indices.data(), out.data(), n, k,
                                                          x.cols(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("gather_columns",
                              [indices](index_t a) { return detail::offender_at(indices, a); });
}

// counts (E) += each expert's kept slots (integer atomics: the same counts in any order); the
// first id outside [0, E) (deferrable).
inline Offender accumulate_expert_counts(cuda, const Tensor<std::int32_t, cuda>& indices,
                                         const Tensor<std::uint8_t, cuda>& keep,
                                         Tensor<std::int32_t, cuda>& counts) {
  const index_t n = indices.numel();
  if (n == 0) return {};
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::accumulate_expert_counts_kernel<std::int32_t>>(
      detail::grid_for(n), detail::kThreads, indices.data(), keep.data(), counts.data(), n,
      counts.numel(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return bad.result<Offender>("accumulate_expert_counts",
                              [indices](index_t a) { return detail::offender_at(indices, a); });
}

// bias (E) += rate * sign(mean - loads) on the device (shapes checked by ops/gates.hpp); the
// CPU's bits, T = float, double, bf16 or half (value_cast: one rounding from double).
template <class T>
void expert_bias_update(cuda, const Tensor<T, cuda>& bias, const Tensor<std::int32_t, cuda>& loads,
                        double rate) {
  const index_t e = bias.numel();
  detail::launch_kernel<detail::expert_bias_update_kernel<T>>(
      1u, static_cast<unsigned>(detail::threads_for_row(e)), bias.data(), loads.data(), e, rate);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// ids (indices' shape) prepared by ops/gates.hpp.
inline void route_dropped_to(cuda, const Tensor<std::int32_t, cuda>& indices,
                             const Tensor<std::uint8_t, cuda>& keep, std::int32_t bucket,
                             Tensor<std::int32_t, cuda>& ids) {
  const index_t n = indices.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::route_dropped_to_kernel<std::int32_t>>(
      detail::grid_for(n), detail::kThreads, indices.data(), keep.data(), bucket, ids.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
