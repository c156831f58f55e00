// graphmoe/backend/cuda/device.cuh: the CUDA device the backend runs on.
//
// The backend uses the calling thread's current device (cudaSetDevice) and ONE stream per device,
// cuda_stream(): every kernel, copy, Thrust algorithm and cuBLAS call is ordered after the
// previous one, so no op needs an explicit synchronisation and a tensor freed while a kernel still
// reads it can be handed to the next allocation safely (see allocator.cuh). Functions that return
// data to the host (to_host, make_dispatch_plan's expert offsets, the NaN checks of softmax and
// topk) synchronise that stream. More streams (overlapping copies, all-to-all) will need
// stream-aware reuse in the allocator.
//
// The stream is created on first use (cudaStreamCreateWithFlags with cudaStreamDefault: a
// blocking stream, so work a program queues on the legacy default stream, e.g. a plain
// cudaMemcpy, is still ordered with the backend's) and lives as long as the process. It is not
// the legacy default stream itself because CUDA cannot capture that one into a graph
// (backend/cuda/graph.cuh). Should creating it fail, the backend runs on the legacy default stream
// (and graph capture reports that it is unavailable).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <sstream>
#include <string>

#include "graphmoe/backend/cuda/detail/error.cuh"

namespace graphmoe {

// The stream every op of the backend runs on, for the calling thread's current device (created on
// the first call for that device; process-wide, never destroyed).
inline cudaStream_t cuda_stream() noexcept {
  constexpr int kMaxDevices = 64;
  struct Streams {
    std::mutex mu;  // creation only; the lookup is one atomic load
    std::atomic<cudaStream_t> by_device[kMaxDevices] = {};
    bool tried[kMaxDevices] = {};
  };
  static Streams* streams = new Streams();  // never destroyed: tensors in statics free late
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    (void)cudaGetLastError();
    return cudaStreamLegacy;
  }
  if (cudaStream_t s = streams->by_device[device].load(std::memory_order_acquire)) return s;
  std::lock_guard<std::mutex> lock(streams->mu);
  if (!streams->tried[device]) {
    streams->tried[device] = true;
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithFlags(&s, cudaStreamDefault) == cudaSuccess)
      streams->by_device[device].store(s, std::memory_order_release);
    else
      (void)cudaGetLastError();
  }
  cudaStream_t s = streams->by_device[device].load(std::memory_order_acquire);
  return s != nullptr ? s : cudaStreamLegacy;
}

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

// Whether the backend's stream is being captured into a CUDA graph (graph.cuh) right now.
inline bool cuda_stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GRAPHMOE_CUDA_CHECK(cudaStreamIsCapturing(cuda_stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

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
