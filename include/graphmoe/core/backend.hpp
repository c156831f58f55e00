// graphmoe/core/backend.hpp: execution backend tags.
//
// A backend is an empty tag type passed as a template parameter (as thrust::host / thrust::device
// are). Tensor<T, Backend> carries its backend in its type, so an op called on a CPU tensor resolves
// to backend/cpu/<op>.hpp and the same call on a CUDA tensor to backend/cuda/<op>.cuh: callers do
// not change when the backend does.
#pragma once

#include <concepts>

namespace graphmoe {

struct cpu {
  static constexpr const char* name = "cpu";
};

struct cuda {
  static constexpr const char* name = "cuda";
};

// Whether B's tensors live in host memory (what a host-memory communicator can move). A user
// backend whose tensors are host memory specialises it.
template <class B>
inline constexpr bool host_memory_v = false;
template <>
inline constexpr bool host_memory_v<cpu> = true;

template <class B>
concept Backend = std::same_as<B, cpu> || std::same_as<B, cuda>;

}  // namespace graphmoe
