// graphmoe/backend/cuda/optim.cuh: the optimizer updates and the gradient norm on the GPU
// (contract and argument checks: ops/optim.hpp, which calls these through the backend tag), so
// that AdamW, SGD (train/optim.hpp) and clip_grad_norm run on a ParameterArena<T, cuda>:
//
//   ParameterArena<float, cuda> arena;  ...  arena.allocate();
//   AdamW<float, cuda> opt(arena, AdamWConfig{});
//   clip_grad_norm(arena, 1.0);
//   opt.step(arena, lr);
//
// The per-element arithmetic is the functor of core/optim_math.hpp, the CPU loop's, with rounded
// device intrinsics that are never fused: the parameters and the state after a step are bitwise
// the CPU's (tests/cuda/test_cuda_attention_optim.cu).
//
// Kernels. The optimizer's chunks (ranges of at most kOptimChunk elements inside one trainable
// parameter, with its decay flag) live in device memory, uploaded when the optimizer is built
// and when set_no_decay changes the flags. One thread block per chunk: the decay decision is
// uniform over a block, the threads stride over the chunk (coalesced).
//
// Gradient norm, deterministic and equal to the CPU's bit for bit: a fixed-order two-level
// reduction, no atomics. Level 1: eight threads per chunk, thread k summing the squares of
// entries k, k + 8, k + 16, ... in double, then one of them combining the eight pairwise and
// adding the tail (accumulate_double's order, via optim_math.hpp). Level 2: one thread adds the
// chunk sums in chunk order. The host reads the sum back (one 8-byte copy, which synchronises the
// stream), takes the square root and checks it as the CPU does.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// One chunk's AdamW update; with a mirror (M not void) also pc[j] = the updated p[j] as M
// (value_cast: convert's rounding), in the same pass.
template <bool Decay, class T, class M>
__device__ void adamw_chunk(const AdamWUpdate<T>& u, const OptimChunk& c, T* p, const T* g, T* m,
                            T* v, M* pc) {
  for (index_t j = c.begin + threadIdx.x; j < c.end; j += blockDim.x) {
    u.template apply<Decay>(p[j], g[j], m[j], v[j]);
    if constexpr (!std::is_void_v<M>) pc[j] = value_cast<M>(p[j]);
  }
}

// M = void: no mirror (pc unused).
template <class T, class M>
__global__ void adamw_kernel(const OptimChunk* chunks, index_t num_chunks, AdamWUpdate<T> u, T* p,
                             const T* g, T* m, T* v, M* pc) {
  for (index_t ci = blockIdx.x; ci < num_chunks; ci += gridDim.x) {
    const OptimChunk c = chunks[ci];
    if (u.decays(c.decay != 0))
      adamw_chunk<true>(u, c, p, g, m, v, pc);
    else
      adamw_chunk<false>(u, c, p, g, m, v, pc);
  }
}

template <class T, bool Momentum, bool Nesterov>
__global__ void sgd_kernel(const OptimChunk* chunks, index_t num_chunks, SGDUpdate<T> u, T* p,
                           const T* g, T* buf) {
  for (index_t ci = blockIdx.x; ci < num_chunks; ci += gridDim.x) {
    const OptimChunk c = chunks[ci];
    const bool decay = u.decays(c.decay != 0);
    for (index_t j = c.begin + threadIdx.x; j < c.end; j += blockDim.x) {
      T unused = T(0);  // buf is null without momentum
      T& b = Momentum ? buf[j] : unused;
      if (decay)
        u.template apply<true, Momentum, Nesterov>(p[j], g[j], b);
      else
        u.template apply<false, Momentum, Nesterov>(p[j], g[j], b);
    }
  }
}

// Level 1 of the gradient norm: partial[c] = the sum of squares of chunk c, in the CPU's order.
// Eight threads per chunk; blockDim.x is a multiple of 8.
constexpr int kSumsqLanes = 8;

template <class T>
__global__ void chunk_sumsq_kernel(const OptimChunk* chunks, index_t num_chunks, const T* g,
                                   double* partial) {
  __shared__ double lanes[kThreads];
  const int lane = static_cast<int>(threadIdx.x) % kSumsqLanes;
  const int group = static_cast<int>(threadIdx.x) / kSumsqLanes;
  const index_t per_block = blockDim.x / kSumsqLanes;
  for (index_t first = blockIdx.x * per_block; first < num_chunks;
       first += static_cast<index_t>(gridDim.x) * per_block) {
    const index_t ci = first + group;
    OptimChunk c{};
    if (ci < num_chunks) {
      c = chunks[ci];
      lanes[threadIdx.x] = sumsq_lane(g + c.begin, c.end - c.begin, lane);
    }
    __syncthreads();
    if (ci < num_chunks && lane == 0)
      partial[ci] = combine_sumsq_lanes(&lanes[threadIdx.x], g + c.begin, c.end - c.begin);
    __syncthreads();  // lanes is reused by the next round
  }
}

// Level 2: *out = partial[0] + partial[1] + ... in order (one thread).
template <class A>
__global__ void ordered_sum_kernel(const A* partial, index_t n, A* out) {
  A s = 0;
  for (index_t i = 0; i < n; ++i) s = fp::add(s, partial[i]);
  *out = s;
}

template <class T>
__global__ void scale_chunks_kernel(const OptimChunk* chunks, index_t num_chunks, T* g, T scale) {
  for (index_t ci = blockIdx.x; ci < num_chunks; ci += gridDim.x) {
    const OptimChunk c = chunks[ci];
    for (index_t j = c.begin + threadIdx.x; j < c.end; j += blockDim.x) g[j] = fp::mul(g[j], scale);
  }
}

// The chunk list in device memory (empty for no chunks).
inline Tensor<OptimChunk, cuda> chunk_table(const std::vector<OptimChunk>& host) {
  Tensor<OptimChunk, cuda> table;
  if (host.empty()) return table;
  Tensor<OptimChunk, cpu> h(Shape{static_cast<index_t>(host.size())});
  std::copy(host.begin(), host.end(), h.data());
  to_device(h, table);
  return table;
}

inline unsigned grid_for_chunks(index_t chunks) {
  return static_cast<unsigned>(std::min<index_t>(chunks, index_t(1) << 20));
}

}  // namespace detail

inline void upload_optim_chunks(cuda, detail::OptimChunks<cuda>& chunks) {
  chunks.table = detail::chunk_table(chunks.host);
}

// One thread block per chunk (the table uploaded by upload_optim_chunks); with a mirror pc, the
// mirror written from the updated values in the same pass.
template <class T, class M>
void adamw_update(cuda, const detail::OptimChunks<cuda>& chunks, const detail::AdamWUpdate<T>& u,
                  T* p, const T* g, T* m, T* v, M* pc) {
  using namespace detail;
  const index_t n = chunks.size();
  if (n == 0) return;
  launch_kernel<adamw_kernel<T, M>>(grid_for_chunks(n), kThreads, chunks.table.data(), n, u, p, g,
                                    m, v, pc);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

template <class T>
void adamw_update(cuda, const detail::OptimChunks<cuda>& chunks, const detail::AdamWUpdate<T>& u,
                  T* p, const T* g, T* m, T* v) {
  adamw_update(cuda{}, chunks, u, p, g, m, v, static_cast<void*>(nullptr));
}

template <class T>
void sgd_update(cuda, const detail::OptimChunks<cuda>& chunks, const detail::SGDUpdate<T>& u, T* p,
                const T* g, T* buf) {
  using namespace detail;
  const index_t n = chunks.size();
  if (n == 0) return;
  const OptimChunk* table = chunks.table.data();
  const unsigned grid = grid_for_chunks(n);
  if (!u.use_momentum)
    launch_kernel<sgd_kernel<T, false, false>>(grid, kThreads, table, n, u, p, g, buf);
  else if (u.nesterov)
    launch_kernel<sgd_kernel<T, true, true>>(grid, kThreads, table, n, u, p, g, buf);
  else
    launch_kernel<sgd_kernel<T, true, false>>(grid, kThreads, table, n, u, p, g, buf);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// The two-level reduction above; reads the sum back (synchronises the stream).
template <class T>
double grad_sumsq(cuda, const detail::OptimChunks<cuda>& chunks, const T* gv) {
  const index_t n = chunks.size();
  auto partial = Tensor<double, cuda>::uninitialized(Shape{n});  // one per chunk
  auto sumsq = Tensor<double, cuda>::uninitialized(Shape{1});
  constexpr index_t per_block = detail::kThreads / detail::kSumsqLanes;
  const unsigned grid = detail::grid_for_chunks((n + per_block - 1) / per_block);
  detail::launch_kernel<detail::chunk_sumsq_kernel<T>>(grid, detail::kThreads, chunks.table.data(),
                                                       n, gv, partial.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::ordered_sum_kernel<double>>(1, 1, partial.data(), n, sumsq.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  return detail::read_device_value(sumsq.data());
}

// g *= scale over the chunks.
template <class T>
void scale_grads(cuda, const detail::OptimChunks<cuda>& chunks, T* gv, T scale) {
  const index_t n = chunks.size();
  detail::launch_kernel<detail::scale_chunks_kernel<T>>(
      detail::grid_for_chunks(n), detail::kThreads, chunks.table.data(), n, gv, scale);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace graphmoe
