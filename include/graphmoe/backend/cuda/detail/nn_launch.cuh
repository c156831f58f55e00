// graphmoe/backend/cuda/detail/nn_launch.cuh: how the CUDA neural-network ops run the functors
// of detail/nn_functors.hpp (internal).
//
//   for_each_index(n, op)        op(i) for every i in [0, n): a grid-stride kernel on
//                                cuda_stream(), asynchronous, launch errors as graphmoe::Error
//   run_thrust(op_name, f)       f(policy) with policy = thrust_policy(alloc): par_nosync on
//                                cuda_stream() and the caching allocator for Thrust's scratch;
//                                a thrust::system_error becomes graphmoe::Error naming op_name
//
// test_host_nn_ops.cpp runs the same functors with thrust::for_each on the host.
#pragma once

#if defined(GRAPHMOE_CUDA_EMULATION)
#include <thrust/system/cpp/execution_policy.h>
#else
#include <thrust/system/cuda/execution_policy.h>
#endif
#include <thrust/system_error.h>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe::detail {

template <class Op>
__global__ void for_each_index_kernel(index_t n, Op op) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) { op(i); }
}

template <class Op>
void for_each_index(index_t n, const Op& op) {
  if (n <= 0) return;
  launch_kernel<for_each_index_kernel<Op>>(grid_for(n), kThreads, n, op);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// The backend's Thrust execution policies: on cuda_stream(), scratch memory from the caching
// allocator; thrust_policy does not synchronise after an algorithm, thrust_policy_sync does (for
// algorithms whose result the host reads at once). The tests' CPU emulation runs Thrust's CPP
// system instead.
inline auto thrust_policy(CudaThrustAllocator& alloc) {
#if defined(GRAPHMOE_CUDA_EMULATION)
  return thrust::cpp::par(alloc);
#else
  return thrust::cuda::par_nosync(alloc).on(cuda_stream());
#endif
}
inline auto thrust_policy_sync(CudaThrustAllocator& alloc) {
#if defined(GRAPHMOE_CUDA_EMULATION)
  return thrust::cpp::par(alloc);
#else
  return thrust::cuda::par(alloc).on(cuda_stream());
#endif
}

template <class F>
void run_thrust(const char* op, F&& f) {
  GRAPHMOE_CHECK(!cuda_stream_capturing(), op,
                 "a Thrust algorithm inside a CUDA graph capture (not supported: the compact "
                 "expert layout sorts with Thrust and reads its offsets back; capture with "
                 "ExpertLayout::Padded)");
  CudaThrustAllocator alloc;
  try {
    f(thrust_policy(alloc));
  } catch (const thrust::system_error& e) {  // Thrust reports CUDA errors its own way
    throw_error(op, "Thrust: ", e.what());
  }
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe::detail
