// graphmoe/backend/cuda/detail/error.cuh: CUDA runtime and cuBLAS errors as graphmoe::Error
// (internal).
//
//   GRAPHMOE_CUDA_CHECK(cudaMalloc(&p, n));
//     -> graphmoe::Error("graphmoe::cudaMalloc(&p, n): cudaErrorMemoryAllocation: out of memory
//        (file.cuh:42)")
//
// The message names the call as written, the error's name and cudaGetErrorString. Kernel launches
// are checked with GRAPHMOE_CUDA_CHECK_LAUNCH() right after the launch (cudaGetLastError: bad
// configuration, no kernel image for this GPU); errors inside a running kernel surface at the
// next synchronising call (a copy to the host, a check of a device flag).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "graphmoe/config.hpp"

namespace graphmoe::detail {

[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t err, const char* file,
                                          int line) {
  throw_error(call, cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (", file, ":", line,
              ")");
}

[[noreturn]] inline void throw_cublas_error(const char* call, cublasStatus_t status,
                                            const char* file, int line) {
  throw_error(call, cublasGetStatusName(status), ": ", cublasGetStatusString(status), " (", file,
              ":", line, ")");
}

}  // namespace graphmoe::detail

#define GRAPHMOE_CUDA_CHECK(call)                                                        \
  do {                                                                                   \
    const cudaError_t graphmoe_cuda_err_ = (call);                                       \
    if (graphmoe_cuda_err_ != cudaSuccess)                                               \
      ::graphmoe::detail::throw_cuda_error(#call, graphmoe_cuda_err_, __FILE__, __LINE__); \
  } while (0)

#define GRAPHMOE_CUDA_CHECK_LAUNCH() GRAPHMOE_CUDA_CHECK(cudaGetLastError())

#define GRAPHMOE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                       \
    const cublasStatus_t graphmoe_cublas_status_ = (call);                                   \
    if (graphmoe_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::graphmoe::detail::throw_cublas_error(#call, graphmoe_cublas_status_, __FILE__, __LINE__); \
  } while (0)
