// The CUDA side of common/device.hpp: included (after graphmoe/cuda.cuh) by the examples' .cu
// instantiations of their training loops on graphmoe::cuda.
#pragma once

#include "common/device.hpp"
#include "graphmoe/cuda.cuh"

namespace examples {

template <>
inline void require_device<graphmoe::cuda>(const char* program) {
  GRAPHMOE_CHECK(graphmoe::cuda_device_count() > 0, program,
                 "--device cuda: no CUDA device is visible to this process");
  std::fprintf(stderr, "%s: device %s\n", program, graphmoe::cuda_device_name().c_str());
}

template <>
struct Bf16Compute<graphmoe::cuda> {
  using type = __nv_bfloat16;
};

}  // namespace examples
