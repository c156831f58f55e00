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
//   capacity_mask                 token order is inherently sequential per expert: the ids
//                                 (N k int32, 16 KB at the paper's medium shape) are copied to
//                                 the host, the CPU system's loop runs there and keep is copied
//                                 back (not when an id is out of range: keep is untouched). Only
//                                 taken when RouterConfig::capacity_factor > 0 (off by default);
//                                 without a capacity the mask is filled on the device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/capacity.hpp"
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

template <class I>
__global__ void route_dropped_to_kernel(const I* indices, const std::uint8_t* keep, I bucket,
                                        I* ids, index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(a, n) { ids[a] = keep[a] ? indices[a] : bucket; }
}

}  // namespace detail

// keep (indices' shape) prepared by ops/gates.hpp; sets `dropped` and returns the first expert id
// outside [0, num_experts) (checked only with a capacity).
inline Offender capacity_mask(cuda, const Tensor<std::int32_t, cuda>& indices,
                              index_t num_experts, index_t capacity,
                              Tensor<std::uint8_t, cuda>& keep, index_t& dropped) {
  dropped = 0;
  if (capacity <= 0) {
    if (keep.numel() > 0)
      GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(keep.data(), 1, keep.bytes(), cuda_stream()));
    return {};
  }
  // The CPU system's loop (core/capacity.hpp) on host copies.
  const Tensor<std::int32_t, cpu> host_ids = to_host(indices);
  Tensor<std::uint8_t, cpu> host_keep(indices.shape());
  std::fill(host_keep.data(), host_keep.data() + host_keep.numel(), std::uint8_t{1});
  const Offender bad = detail::capacity_mask_host(host_ids.data(), host_ids.numel(), num_experts,
                                                  capacity, host_keep.data(), dropped);
  if (bad.found()) return bad;
  to_device(host_keep, keep);
  return {};
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
