// graphmoe/backend/cuda/gates.cuh: backend/cpu/gates.hpp on Tensor<T, cuda>.
//
//   renormalized_gates            one thread per token (k <= E is small: 1 to 8 choices); a token
//                                 whose selected scores do not sum to > 0 throws the CPU message
//                                 (one flag read back, which synchronises the stream)
//   renormalized_gates_backward   one thread per token: zeroes its row of dp, then writes its k
//                                 entries (the top-k ids of a token are distinct), sums in the
//                                 CPU's order
//   route_dropped_to              one thread per assignment
//   capacity_mask                 token order is inherently sequential per expert: the ids
//                                 (N k int32, 16 KB at the paper's medium shape) are copied to
//                                 the host, the CPU op runs there and keep is copied back. Only
//                                 taken when RouterConfig::capacity_factor > 0 (off by default);
//                                 without a capacity the mask is filled on the device.
#pragma once

#include <cstdint>
#include <vector>

#include "graphmoe/backend/cpu/gates.hpp"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"

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

inline index_t capacity_mask(const Tensor<std::int32_t, cuda>& indices, index_t num_experts,
                             index_t capacity, Tensor<std::uint8_t, cuda>& keep) {
  prepare_output("capacity_mask", "keep", keep, indices.shape());
  if (capacity <= 0) {
    if (keep.numel() > 0)
      GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(keep.data(), 1, keep.bytes(), cuda_stream()));
    return 0;
  }
  Tensor<std::uint8_t, cpu> host_keep;
  const index_t dropped = capacity_mask(to_host(indices), num_experts, capacity, host_keep);
  to_device(host_keep, keep);
  return dropped;
}

template <class T>
void renormalized_gates(const Tensor<T, cuda>& values, const Tensor<std::uint8_t, cuda>& keep,
                        Tensor<T, cuda>& gates) {
  detail::check_gate_inputs("renormalized_gates", values, keep);
  prepare_output("renormalized_gates", "gates", gates, values.shape());
  const index_t n = values.rows(), k = values.cols();
  detail::FirstIndexFlag bad;
  detail::launch_kernel<detail::renormalized_gates_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                              values.data(), keep.data(),
                                                              gates.data(), n, k, bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  const index_t i = bad.read();
  if (i >= 0) {
    const Tensor<T, cpu> row = to_host(values[i]);
    T s = 0;
    for (index_t j = 0; j < k; ++j) s += row.data()[j];
    GRAPHMOE_CHECK(false, "TopK", "the selected scores of token ", i, " sum to ", s,
                   " (p must be a probability vector)");
  }
}

template <class T>
void renormalized_gates_backward(const Tensor<T, cuda>& values,
                                 const Tensor<std::int32_t, cuda>& indices,
                                 const Tensor<std::uint8_t, cuda>& keep,
                                 const Tensor<T, cuda>& gates, const Tensor<T, cuda>& dgates,
                                 index_t num_experts, Tensor<T, cuda>& dp) {
  detail::check_gate_inputs("renormalized_gates_backward", values, keep);
  check_shape("TopK::backward", "dgates", dgates, gates.shape());
  const index_t n = values.rows(), k = values.cols();
  prepare_output("TopK::backward", "dp", dp, Shape{n, num_experts});
  detail::launch_kernel<detail::renormalized_gates_backward_kernel<T>>(
      detail::grid_for(n), detail::kThreads, values.data(), indices.data(), keep.data(),
      gates.data(), dgates.data(), dp.data(), n, k, num_experts);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

inline void route_dropped_to(const Tensor<std::int32_t, cuda>& indices,
                             const Tensor<std::uint8_t, cuda>& keep, std::int32_t bucket,
                             Tensor<std::int32_t, cuda>& ids) {
  check_shape("route_dropped_to", "keep", keep, indices.shape());
  prepare_output("route_dropped_to", "ids", ids, indices.shape());
  const index_t n = indices.numel();
  if (n == 0) return;
  detail::launch_kernel<detail::route_dropped_to_kernel<std::int32_t>>(
      detail::grid_for(n), detail::kThreads, indices.data(), keep.data(), bucket, ids.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
