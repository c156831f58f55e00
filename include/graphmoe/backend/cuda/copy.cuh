// graphmoe/backend/cuda/copy.cuh: copies between host tensors (cpu) and device tensors (cuda).
//
//   to_device(h)      -> a new Tensor<T, cuda> of h's shape holding h's values
//   to_device(h, d)   d = h; an empty d is allocated, otherwise its shape must be h's
//   to_host(d)        -> a new Tensor<T, cpu>
//   to_host(d, h)     h = d (same output convention)
//
// Both directions wait for the copy: to_host returns when the values are on the host, after every
// kernel queued before it (so it also reports errors of those kernels), and to_device returns
// when the host memory may be changed again. An empty tensor copies to an empty tensor. Inside
// with_deferred_checks, a read to the host also brings the pending check flags
// (deferred_check.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/deferred_check.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
void to_device(const Tensor<T, cpu>& h, Tensor<T, cuda>& d) {
  if (h.empty()) {
    GRAPHMOE_CHECK(d.empty(), "to_device", "source is empty but the destination has shape ",
                   d.shape());
    return;
  }
  prepare_output("to_device", "d", d, h.shape());
  if (h.bytes() == 0) return;
  GRAPHMOE_CUDA_CHECK(
      cudaMemcpyAsync(d.data(), h.data(), h.bytes(), cudaMemcpyHostToDevice, cuda_stream()));
  // Pageable host memory: the call returns once the source has been staged, but wait anyway so
  // that the contract does not depend on how the host memory was allocated.
  cuda_stream_synchronize();
}

template <class T>
Tensor<T, cuda> to_device(const Tensor<T, cpu>& h) {
  Tensor<T, cuda> d;
  to_device(h, d);
  return d;
}

template <class T>
void to_host(const Tensor<T, cuda>& d, Tensor<T, cpu>& h) {
  if (d.empty()) {
    GRAPHMOE_CHECK(h.empty(), "to_host", "source is empty but the destination has shape ",
                   h.shape());
    return;
  }
  prepare_output("to_host", "h", h, d.shape());
  if (d.bytes() == 0) return;
  detail::deferred_checks_before_host_read();  // pending check flags travel with this read
  GRAPHMOE_CUDA_CHECK(
      cudaMemcpyAsync(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost, cuda_stream()));
  cuda_stream_synchronize();
  detail::deferred_checks_after_synchronize();
}

template <class T>
Tensor<T, cpu> to_host(const Tensor<T, cuda>& d) {
  Tensor<T, cpu> h;
  to_host(d, h);
  return h;
}

namespace detail {
// N consecutive elements of device memory in one copy (one synchronisation for several flags or
// counters that a kernel wrote side by side).
template <class T, std::size_t N>
std::array<T, N> read_device_values(const T* p) {
  std::array<T, N> v{};
  deferred_checks_before_host_read();
  GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(v.data(), p, sizeof(T) * N, cudaMemcpyDeviceToHost, cuda_stream()));
  cuda_stream_synchronize();
  deferred_checks_after_synchronize();
  return v;
}

// One element of device memory, read on the host (synchronises). For error messages and flags.
template <class T>
T read_device_value(const T* p) {
  return read_device_values<T, 1>(p)[0];
}
}  // namespace detail

}  // namespace graphmoe
