// graphmoe/backend/cuda/detail/kernel.cuh: launch shapes, reductions, device-side error flags and
// the storage/accumulation types shared by the kernels of the CUDA backend (internal).
//
// Element types. The floating-point ops take T = float, double, __nv_bfloat16 or __half
// (cuda_float_type). A kernel loads every element into acc_t<T> with to_acc, does all its
// arithmetic there, and rounds once per stored element with from_acc<T>:
//
//   T               acc_t<T>   to_acc / from_acc
//   float, double   T          identity (the kernels compute exactly what they did before)
//   __nv_bfloat16   float      exact widening / round to nearest even
//   __half          float      exact widening / round to nearest even
//
// value_cast<D>(v) converts between any two of the four types with one rounding to nearest even
// (double to bf16 or half directly, never through float), on the host and on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/deferred_check.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

// GRAPHMOE_CUDA_EMULATION: the tests' CPU emulation of CUDA (tests/cuda/emulation), which
// compiles these headers with the C++ compiler and runs the kernels on the host.
#if !defined(__CUDACC__) && !defined(GRAPHMOE_CUDA_EMULATION)
#error "graphmoe/backend/cuda/*.cuh kernels must be compiled by nvcc (a .cu translation unit)"
#endif

namespace graphmoe::detail {

// The 16-bit floating-point storage types: math on them runs in fp32.
template <class T>
inline constexpr bool is_half_precision_v =
    std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// The element types of the CUDA backend's floating-point ops.
template <class T>
concept cuda_float_type = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                          is_half_precision_v<T>;

// The type every kernel computes and accumulates in: T itself for float and double (so float
// rows accumulate in fp32, as cuBLAS does), fp32 for bf16 and half.
template <class T>
struct accumulate_type {
  using type = T;
};
template <>
struct accumulate_type<__nv_bfloat16> {
  using type = float;
};
template <>
struct accumulate_type<__half> {
  using type = float;
};
template <class T>
using acc_t = typename accumulate_type<T>::type;

// v as a D: exact when D is at least as wide, otherwise rounded to nearest even (one rounding:
// double to bf16 / half directly; bf16 <-> half through float, which holds both exactly). NaN
// stays NaN, overflow gives +-inf. D and S are float, double, __nv_bfloat16 or __half.
template <class D, class S>
GRAPHMOE_HOST_DEVICE inline D value_cast(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    return value_cast<D>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<S, __half>) {
    return value_cast<D>(__half2float(v));
  } else if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    if constexpr (std::is_same_v<S, double>)
      return __double2bfloat16(v);
    else
      return __float2bfloat16_rn(v);
  } else if constexpr (std::is_same_v<D, __half>) {
    if constexpr (std::is_same_v<S, double>)
      return __double2half(v);
    else
      return __float2half_rn(v);
  } else {
    return static_cast<D>(v);
  }
}

// Loads a stored element into the accumulation type (exact).
template <class T>
GRAPHMOE_HOST_DEVICE inline acc_t<T> to_acc(T v) {
  return value_cast<acc_t<T>>(v);
}

// Stores an accumulated value as T (round to nearest even for bf16 / half; identity otherwise).
template <class T>
GRAPHMOE_HOST_DEVICE inline T from_acc(acc_t<T> v) {
  return value_cast<T>(v);
}

constexpr int kThreads = 256;  // threads per block of the element-wise and row kernels

// Blocks for a grid-stride loop over n items, kThreads per block (at least 1 block).
inline unsigned grid_for(index_t n, int threads = kThreads) {
  const index_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<index_t>(blocks, 1, index_t(1) << 20));
}

// Threads for a kernel with one block per row of `cols` entries: a multiple of the warp size,
// at most kThreads, so that short rows (a router's E = 8 to 64 experts) do not idle 256 threads.
inline int threads_for_row(index_t cols) {
  return static_cast<int>(std::clamp<index_t>((cols + 31) / 32 * 32, 32, kThreads));
}

// Blocks for one block per row, grid-striding beyond 2^20 rows.
inline unsigned grid_for_rows(index_t rows) {
  return static_cast<unsigned>(std::clamp<index_t>(rows, 1, index_t(1) << 20));
}

// Launches Kernel on cuda_stream(): `grid` blocks of `block` threads, no dynamic shared memory,
// asynchronous (check with GRAPHMOE_CUDA_CHECK_LAUNCH() after it). Every kernel of the backend is
// launched here, so that the tests' CPU emulation can run it instead (it reads the kernel's name
// from this function's signature for its messages).
template <auto Kernel, class... Args>
void launch_kernel(dim3 grid, dim3 block, const Args&... args) {
#if defined(GRAPHMOE_CUDA_EMULATION)
  graphmoe_cuda_emulation::launch(__PRETTY_FUNCTION__, grid, block, [=] { Kernel(args...); });  // by value: a captured launch runs later
#else
  Kernel<<<grid, block, 0, cuda_stream()>>>(args...);
#endif
}

// exp and log in T's precision (expf / logf for float), never a silent promotion to double.
__device__ inline float exp_t(float x) { return expf(x); }
__device__ inline double exp_t(double x) { return ::exp(x); }
__device__ inline float log_t(float x) { return logf(x); }
__device__ inline double log_t(double x) { return ::log(x); }

// for (index_t i = first thread's index; i < n; i += all threads of the grid)
#define GRAPHMOE_CUDA_GRID_STRIDE(i, n)                                                      \
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<index_t>(gridDim.x) * blockDim.x)

struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// max that propagates NaN: the result is NaN if either argument is.
struct MaxNanOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    if (a != a) return a;
    if (b != b) return b;
    return a < b ? b : a;
  }
};

template <class T, class Op>
__device__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces v over the block (blockDim.x a multiple of 32) and returns the result to every thread.
// Every thread of the block must call it (it synchronises); `identity` fills the unused lanes.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T partial[32];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // a previous call may still be reading partial
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : identity;
  return warp_reduce(v, op);  // every warp reduces the partials: no third barrier needed
}

// One block ranks, in index order, the entries a in [0, n) that picked(a) selects: thread t owns
// the contiguous share [begin, end) and its first pick has rank `first` (the picks before its
// share); `total` is the block's count. Thread 0 adds the shares' counts in order, so the ranks
// are the sequential loop's. Every thread must call it (it synchronises); blockDim.x <= kThreads.
struct BlockShare {
  index_t begin, end, first, total;
};
template <class Picked>
__device__ BlockShare block_rank_shares(index_t n, Picked picked) {
  __shared__ index_t before[kThreads + 1];
  const index_t threads = blockDim.x, tid = threadIdx.x;
  const index_t per = (n + threads - 1) / threads;
  BlockShare s{};
  s.begin = tid * per < n ? tid * per : n;
  s.end = s.begin + per < n ? s.begin + per : n;
  index_t count = 0;
  for (index_t a = s.begin; a < s.end; ++a) count += picked(a) ? 1 : 0;
  before[tid] = count;
  __syncthreads();
  if (tid == 0) {
    index_t run = 0;
    for (index_t i = 0; i < threads; ++i) {
      const index_t c = before[i];
      before[i] = run;
      run += c;
    }
    before[threads] = run;
  }
  __syncthreads();
  s.first = before[tid];
  s.total = before[threads];
  __syncthreads();  // before may be written by a later call
  return s;
}

// A device-side "first bad index" for kernels that must report bad input (NaN, out-of-range ids)
// the way the CPU ops throw: a kernel records the smallest offending index with flag(), the host
// reads it back after the launch (one 8-byte copy, which synchronises the stream).
//
// A check whose op reports through report_check (core/deferred_check.hpp) constructs its flag
// with Deferrable{} and asks for result<R>(op, resolve) instead of read(): inside
// with_deferred_checks the flag is then a slot of the open batch (deferred_check.cuh) and the
// result comes back pending, to be read with the next synchronising read; outside, or with the
// batch full, it reads at once. resolve(i) turns a flagged index into the op's result (it may
// read the offending data back; it runs later when deferred, so it must hold the tensors it
// reads by value).
class FirstIndexFlag {
 public:
  static constexpr unsigned long long kNone = ~0ull;
  struct Deferrable {};

  FirstIndexFlag() { allocate(); }
  explicit FirstIndexFlag(Deferrable) {
    if (DeviceCheckBatch* b = active_device_checks(); b != nullptr) {
      ptr_ = b->take_slot(slot_);
      if (ptr_ != nullptr) {
        batch_ = b;
        return;
      }
    }
    allocate();
  }
  unsigned long long* get() const { return ptr_; }
  // The smallest flagged index, or -1 when no thread flagged one (synchronises).
  index_t read() const {
    const unsigned long long v = read_device_value(ptr_);
    return v == kNone ? index_t(-1) : static_cast<index_t>(v);
  }
  // The op's result: pending in a batch, else resolve(read()) when an index was flagged.
  template <class R, class Resolve>
  R result(const char* op, Resolve&& resolve) {
    if (batch_ != nullptr) {
      R r{};
      r.deferred = batch_->add<R>(op, slot_, std::function<R(index_t)>(std::forward<Resolve>(resolve)));
      return r;
    }
    const index_t i = read();
    return i < 0 ? R{} : resolve(i);
  }

 private:
  void allocate() {
    value_ = Tensor<unsigned long long, cuda>::uninitialized(Shape{1});
    ptr_ = value_.data();
    GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(ptr_, 0xFF, sizeof(unsigned long long), cuda_stream()));
  }

  Tensor<unsigned long long, cuda> value_;
  unsigned long long* ptr_ = nullptr;
  DeviceCheckBatch* batch_ = nullptr;
  index_t slot_ = -1;
};

// A flagged position of an integer tensor and the value there (read back): the Offender a
// check's resolve returns for an id, a target or an expert index out of range.
template <class I>
Offender offender_at(const Tensor<I, cuda>& t, index_t i) {
  return Offender{i, static_cast<double>(read_device_value(t.data() + i))};
}

// A double a kernel writes for the host (a loss's value): inside with_deferred_checks the open
// batch's deferred slot (delivered to `target` with the batch's next read: `target` must outlive
// the scope), else a scratch word that finish() reads at once. Launch the kernel writing get(),
// then call finish().
class DeferredDouble {
 public:
  explicit DeferredDouble(double& target) : target_(&target) {
    if (DeviceCheckBatch* b = active_device_checks(); b != nullptr) ptr_ = b->take_value(&target);
    if (ptr_ == nullptr) {
      own_ = Tensor<double, cuda>::uninitialized(Shape{1});
      ptr_ = own_.data();
    }
  }
  double* get() const { return ptr_; }
  void finish() {
    if (!own_.empty()) *target_ = read_device_value(ptr_);
  }

 private:
  double* target_;
  double* ptr_ = nullptr;
  Tensor<double, cuda> own_;
};

__device__ inline void flag_index(unsigned long long* flag, index_t i) {
  atomicMin(flag, static_cast<unsigned long long>(i));
}

}  // namespace graphmoe::detail
