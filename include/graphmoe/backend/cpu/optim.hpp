// graphmoe/backend/cpu/optim.hpp: the CPU system's optimizer updates and gradient norm (contract
// and argument checks: ops/optim.hpp, which calls these through the backend tag; the optimizers:
// train/optim.hpp).
//
// Chunks are updated in parallel (parallel_for), each by one loop of the element functor of
// core/optim_math.hpp with the decay decision hoisted out of it. The chunks depend on the arena's
// layout only, never on the thread count, and the update is elementwise, so the result is bitwise
// the same for any number of threads. The gradient norm sums per-chunk partial sums (in double)
// in chunk order: also thread-independent.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/config.hpp"
#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {
namespace detail {

// x = sqrt(x) for n values, correctly rounded (as std::sqrt and CUDA's sqrt), with SIMD
// instructions. std::sqrt alone would not vectorise (GCC keeps its errno handling, -fmath-errno),
// and Eigen's float sqrt is an rsqrt approximation under EIGEN_FAST_MATH, off by 1-2 bits.
inline void sqrt_in_place(float* x, index_t n) {
  index_t j = 0;
#if defined(__AVX__)
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_sqrt_ps(_mm256_loadu_ps(x + j)));
#elif defined(__SSE2__)
  for (; j + 4 <= n; j += 4) _mm_storeu_ps(x + j, _mm_sqrt_ps(_mm_loadu_ps(x + j)));
#endif
  for (; j < n; ++j) x[j] = std::sqrt(x[j]);
}
inline void sqrt_in_place(double* x, index_t n) {
  index_t j = 0;
#if defined(__AVX__)
  for (; j + 4 <= n; j += 4) _mm256_storeu_pd(x + j, _mm256_sqrt_pd(_mm256_loadu_pd(x + j)));
#elif defined(__SSE2__)
  for (; j + 2 <= n; j += 2) _mm_storeu_pd(x + j, _mm_sqrt_pd(_mm_loadu_pd(x + j)));
#endif
  for (; j < n; ++j) x[j] = std::sqrt(x[j]);
}

// AdamWUpdate::apply over n elements, in blocks: moments() for the block, the square roots, then
// update(): each stage is one vectorised loop, and the result is apply()'s bit for bit.
template <bool Decay, class T>
void adamw_range(const AdamWUpdate<T>& u, T* __restrict p, const T* __restrict g,
                 T* __restrict m, T* __restrict v, index_t n) {
  constexpr index_t kBlock = 512;
  alignas(64) T root[kBlock];
  for (index_t b = 0; b < n; b += kBlock) {
    const index_t len = std::min(kBlock, n - b);
    T* __restrict r = root;
    for (index_t j = 0; j < len; ++j) r[j] = u.moments(g[b + j], m[b + j], v[b + j]);
    sqrt_in_place(r, len);
    for (index_t j = 0; j < len; ++j) u.template update<Decay>(p[b + j], m[b + j], r[j]);
  }
}

template <bool Decay, bool Momentum, bool Nesterov, class T>
void sgd_range(const SGDUpdate<T>& u, T* __restrict p, const T* __restrict g, T* __restrict buf,
               index_t n) {
  for (index_t j = 0; j < n; ++j) {
    if constexpr (Momentum) {
      u.template apply<Decay, true, Nesterov>(p[j], g[j], buf[j]);
    } else {
      T unused = T(0);  // not read without momentum (buf is null then)
      u.template apply<Decay, false, false>(p[j], g[j], unused);
    }
  }
}

}  // namespace detail

// The host list needs no copy on the CPU.
inline void upload_optim_chunks(cpu, detail::OptimChunks<cpu>&) {}

// Chunks in parallel; inside a chunk, one loop with the decay decision hoisted out of it.
template <class T>
void adamw_update(cpu, const detail::OptimChunks<cpu>& chunks, const detail::AdamWUpdate<T>& u,
                  T* p, const T* g, T* m, T* v) {
  parallel_for(0, chunks.size(), [&](index_t ci) {
    const detail::OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
    const index_t b = c.begin, n = c.end - c.begin;
    if (u.decays(c.decay != 0))
      detail::adamw_range<true>(u, p + b, g + b, m + b, v + b, n);
    else
      detail::adamw_range<false>(u, p + b, g + b, m + b, v + b, n);
  });
}

template <class T>
void sgd_update(cpu, const detail::OptimChunks<cpu>& chunks, const detail::SGDUpdate<T>& u, T* p,
                const T* g, T* buf) {
  using detail::sgd_range;
  parallel_for(0, chunks.size(), [&](index_t ci) {
    const detail::OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
    const index_t b = c.begin, n = c.end - c.begin;
    T* const bb = u.use_momentum ? buf + b : nullptr;
    if (u.decays(c.decay != 0)) {
      if (!u.use_momentum)
        sgd_range<true, false, false>(u, p + b, g + b, bb, n);
      else if (u.nesterov)
        sgd_range<true, true, true>(u, p + b, g + b, bb, n);
      else
        sgd_range<true, true, false>(u, p + b, g + b, bb, n);
    } else {
      if (!u.use_momentum)
        sgd_range<false, false, false>(u, p + b, g + b, bb, n);
      else if (u.nesterov)
        sgd_range<false, true, true>(u, p + b, g + b, bb, n);
      else
        sgd_range<false, true, false>(u, p + b, g + b, bb, n);
    }
  });
}

// The sum of the squares of the chunks of g: per-chunk partial sums in parallel
// (accumulate_double), then added in chunk order.
template <class T>
double grad_sumsq(cpu, const detail::OptimChunks<cpu>& chunks, const T* gv) {
  const index_t n = chunks.size();
  std::vector<double> partial(chunks.host.size(), 0.0);
  parallel_for(0, n, [&](index_t ci) {
    const detail::OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
    const T* g = gv + c.begin;
    partial[static_cast<std::size_t>(ci)] = detail::accumulate_double(
        c.end - c.begin, [g](index_t j) { return static_cast<double>(g[j]) * g[j]; });
  });
  double sumsq = 0;
  for (double s : partial) sumsq += s;
  return sumsq;
}

// g *= scale over the chunks.
template <class T>
void scale_grads(cpu, const detail::OptimChunks<cpu>& chunks, T* gv, T scale) {
  parallel_for(0, chunks.size(), [&](index_t ci) {
    const detail::OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
    for (index_t j = c.begin; j < c.end; ++j) gv[j] = detail::fp::mul(gv[j], scale);
  });
}

}  // namespace graphmoe
