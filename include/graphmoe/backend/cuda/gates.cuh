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
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
__global__ void renormalized_gates_kernel(const T* values, const std::uint8_t* keep, T* gates,
                                          index_t n, index_t k, unsigned long long* bad_token) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const T* v = values + i * k;
    T s = T(0);
    for (index_t j = 0; j < k; ++j) s += v[j];
    if (!(s > T(0))) {
      flag_index(bad_token, i);
      continue;
    }
    for (index_t j = 0; j < k; ++j) gates[i * k + j] = keep[i * k + j] ? v[j] / s : T(0);
  }
}

template <class T>
__global__ void renormalized_gates_backward_kernel(const T* values, const std::int32_t* indices,
                                                   const std::uint8_t* keep, const T* gates,
                                                   const T* dgates, T* dp, index_t n, index_t k,
                                                   index_t e) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    T s = T(0), gdg = T(0);
    for (index_t j = 0; j < k; ++j) {
      s += values[i * k + j];
      gdg += gates[i * k + j] * dgates[i * k + j];
    }
    T* row = dp + i * e;
    for (index_t c = 0; c < e; ++c) row[c] = T(0);
    for (index_t j = 0; j < k; ++j) {
      const index_t a = i * k + j;
      row[indices[a]] += (keep[a] ? dgates[a] : T(0)) / s - gdg / s;
    }
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
                            const Tensor<std::uint8_t, cuda>& keep, Tensor<T, cuda>& gates) {
  const index_t n = values.rows(), k = values.cols();
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::renormalized_gates_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                              values.data(), keep.data(),
                                                              gates.data(), n, k, bad.get());
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
                                 index_t num_experts, Tensor<T, cuda>& dp) {
  const index_t n = values.rows(), k = values.cols();
  detail::launch_kernel<detail::renormalized_gates_backward_kernel<T>>(
      detail::grid_for(n), detail::kThreads, values.data(), indices.data(), keep.data(),
      gates.data(), dgates.data(), dp.data(), n, k, num_experts);
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
