// graphmoe/backend/cuda/device.cuh: the CUDA device the backend runs on.
//
// The backend uses the calling thread's current device (cudaSetDevice) and ONE stream,
// cuda_stream() (the legacy default stream, also under `--default-stream per-thread`): every
// kernel, copy, Thrust algorithm and cuBLAS call is ordered after the previous one, so no op needs
// an explicit synchronisation and a tensor freed while a kernel still reads it can be handed to
// the next allocation safely (see allocator.cuh). Functions that return data to the host (to_host,
// make_dispatch_plan's expert offsets, the NaN checks of softmax and topk) synchronise that stream.
// More streams (overlapping copies, all-to-all) will need stream-aware reuse in the allocator.
#pragma once

#include <cuda_runtime_api.h>

#include <sstream>
#include <string>

#include "graphmoe/backend/cuda/detail/error.cuh"

namespace graphmoe {

// The stream every op of the backend runs on.
inline cudaStream_t cuda_stream() noexcept { return cudaStreamLegacy; }

// Number of visible CUDA devices; 0 when there is none or no driver (never throws), so that
// tests and programs can fall back to the CPU.
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not report it
    return 0;
  }
  return n;
}

// The calling thread's current device.
inline int cuda_current_device() {
  int dev = 0;
  GRAPHMOE_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

// Waits for all work on the current device; reports errors of kernels that already ran.
inline void cuda_synchronize() { GRAPHMOE_CUDA_CHECK(cudaDeviceSynchronize()); }

// Waits for the backend's stream only.
inline void cuda_stream_synchronize() { GRAPHMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream())); }

// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)": the current device, for logs and reports.
inline std::string cuda_device_name() {
  cudaDeviceProp prop{};
  GRAPHMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, cuda_current_device()));
  std::ostringstream os;
  os << prop.name << " (sm_" << prop.major << prop.minor << ", "
     << static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0) << " GiB)";
  return os.str();
}

}  // namespace graphmoe
