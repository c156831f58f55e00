// tests/cuda/emulation/cuda_emulation.hpp: runs the CUDA backend's kernels on the CPU, so that the
// cross-backend tests execute every kernel in CI, on machines without a GPU (test infrastructure,
// not part of the library).
//
// A CUDA test translation unit (tests/cuda/test_cuda_*.cu) is compiled a second time by the C++
// compiler with this header force-included (-include) and GRAPHMOE_CUDA_EMULATION defined, and
// linked against runtime.cpp instead of libcudart and libcublas:
//
//   kernels         __global__ functions are plain functions; detail::launch_kernel runs every
//                   block of the grid, one after the other, each block's threads as fibers
//                   (ucontext) on the calling thread: a thread runs until it reaches
//                   __syncthreads() or a warp shuffle, then the next one runs. Barriers are
//                   checked: a __syncthreads() that some threads of the block never reach, or a
//                   shuffle naming a lane that has exited or does not exist, throws (real GPUs
//                   hang or return garbage there).
//   __shared__      a static variable: shared by the threads of the one block that runs at a time.
//   shuffles        __shfl_xor_sync exchanges values through the warp's slots (one warp barrier).
//   atomics         plain read-modify-write (only one fiber runs at a time).
//   runtime         cudaMalloc / cudaMemcpyAsync / ... on host memory (runtime.cpp), one device;
//                   copies and cuBLAS operands must lie inside one live allocation (a tensor's
//                   own bytes for the caching allocator's blocks).
//   memory          tensors start as NaN bytes, the bytes past their end are a canary checked when
//                   they are freed, freed blocks read as NaN (on_tensor_allocate / on_tensor_free).
//   cuBLAS          cublasSgemm / Dgemm / GemmEx / *StridedBatched(Ex) evaluated naively on the host,
//                   accumulating in double (runtime.cpp).
//   Thrust          the CPP device system (THRUST_DEVICE_SYSTEM_CPP).
//
// What it cannot find: data races the fiber order happens to serialise correctly, performance
// problems, host code that dereferences device pointers (host and device memory are one here),
// and differences of the GPU's math library (expf, logf: the host's libm runs instead).
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.hpp is for the C++ compiler, not nvcc"
#endif

#ifndef GRAPHMOE_CUDA_EMULATION
#define GRAPHMOE_CUDA_EMULATION 1
#endif

// CUDA's keywords, before any CUDA header defines them (host_defines.h keeps these).
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(...)
// threadIdx, blockIdx, blockDim, gridDim: mutable globals that the scheduler sets before it
// resumes a thread (defined in runtime.cpp).
#define __STORAGE__ extern

#include <cuda_runtime.h>
#include <device_launch_parameters.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>

#undef __STORAGE__

namespace graphmoe_cuda_emulation {

// Runs body() once per thread of every block of the grid (see above). Throws std::runtime_error
// naming the kernel (read from `signature`, launch_kernel's __PRETTY_FUNCTION__) for an invalid
// launch configuration, a barrier some threads cannot reach, or an exception escaping a thread.
void launch(const char* signature, dim3 grid, dim3 block, const std::function<void()>& body);

// Runs the blocks of every later launch in descending order (the last block of the grid first)
// while on, ascending (the default) otherwise. A GPU runs a grid's blocks in any order, and
// concurrently: a kernel whose block reads what another block of the same launch writes is wrong
// there, but may pass here when the writer happens to run first; a test turns this on to run
// such a kernel the other way round (tests/cuda/test_cuda_decode.cu: the chunks of a decode step).
void set_blocks_descending(bool on);

// The current thread waits until every thread of its block has called it.
void block_barrier();

// The current thread publishes `size` bytes at `value` in its warp's exchange slot, waits for the
// lanes in `mask`, and copies lane `src_lane`'s value into `out`.
void warp_exchange(unsigned mask, const void* value, std::size_t size, int src_lane, void* out);

// What the program has asked of the "device" so far: kernel launches and cuBLAS GEMM calls (a
// grouped GEMM counts once), copies by direction (a copy to pageable host memory waits for the
// device: a synchronisation point on a GPU, and what a CUDA graph cannot hold; an asynchronous
// copy to page-locked memory does not, and is counted apart), memsets, device allocations
// (cudaMalloc: the caching allocator's misses) and explicit synchronisations. Tests use them as a
// proxy for launch overhead, which the emulation cannot time. Thrust's algorithms run on the
// host's backends here, so their kernels (the dispatch plan's sort) are not counted.
struct Counters {
  unsigned long long kernel_launches = 0;
  unsigned long long cublas_calls = 0;
  unsigned long long copies_to_host = 0;        // cudaMemcpy(Async) to pageable host memory
  unsigned long long async_copies_to_host = 0;  // cudaMemcpyAsync to page-locked host memory
                                                // (cudaMallocHost): no wait on a GPU
  unsigned long long copies_to_device = 0;
  unsigned long long copies_on_device = 0;
  unsigned long long memsets = 0;
  unsigned long long device_allocations = 0;
  unsigned long long synchronizations = 0;
  unsigned long long graph_launches = 0;  // cudaGraphLaunch (its operations are counted as they run)
};
Counters counters();
// Kernel launches so far by kernel ("graphmoe::detail::softmax_forward_kernel<float, false>").
std::map<std::string, unsigned long long> launches_by_kernel();

// Called by the caching allocator (backend/cuda/allocator.cuh) when it hands out `block` bytes at
// p for a tensor of `requested` bytes, and when it takes them back. Allocation fills the whole
// block with 0xFF bytes (NaN as float or double, -1 as an integer), so that a kernel reading
// uninitialised memory or past a tensor's end gets NaN; freeing checks that the bytes past the
// end are still 0xFF (else a kernel wrote out of bounds: the next launch throws, and the program
// fails at exit if none follows) and fills the block again, so that reading freed memory gives NaN
// too. Copies and cuBLAS calls are checked against `requested` bytes, not the whole block.
void on_tensor_allocate(void* p, std::size_t requested, std::size_t block) noexcept;
void on_tensor_free(void* p, std::size_t requested, std::size_t block) noexcept;
// A block of a CUDA graph's private pool (allocator.cuh): owned = true makes all `block` bytes
// usable by copies and cuBLAS whatever tensor holds it (a replay writes the buffers of the whole
// capture), and leaves its bytes as they are when a tensor holding it is freed; owned = false
// (the graph is gone) returns it to the cached state, poisoned.
void on_graph_block(void* p, std::size_t block, bool owned) noexcept;

}  // namespace graphmoe_cuda_emulation

// CUDA's floating-point max / min (fmax / fmin: a NaN argument loses to a number).
inline float max(float a, float b) { return std::fmax(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }

inline void __syncthreads() { graphmoe_cuda_emulation::block_barrier(); }

template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16);
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int src = ((lane ^ lane_mask) & (width - 1)) | (lane & ~(width - 1));
  T out;
  graphmoe_cuda_emulation::warp_exchange(mask, &var, sizeof(T), src, &out);
  return out;
}

template <class T>
inline T atomicMin(T* address, T value) {
  const T old = *address;
  if (value < old) *address = value;
  return old;
}

template <class T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
