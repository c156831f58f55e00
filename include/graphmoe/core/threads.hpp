// graphmoe/core/threads.hpp: the thread-count setting every CPU op honours.
//
// set_num_threads(n) sets the count used by graphmoe's own parallel loops (OpenMP when the
// library is built with it), by Eigen's GEMM, and by OpenBLAS when GRAPHMOE_USE_BLAS is on.
// The default is 1 thread: results are then independent of the machine, and the caller opts in
// to parallelism.
#pragma once

#include <atomic>

#include <Eigen/Core>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(GRAPHMOE_USE_BLAS)
extern "C" void openblas_set_num_threads(int);
#endif

namespace graphmoe {

namespace detail {
inline std::atomic<int>& thread_count() {
  static std::atomic<int> n{1};
  return n;
}
}  // namespace detail

inline int num_threads() { return detail::thread_count().load(std::memory_order_relaxed); }

inline void set_num_threads(int n) {
  GRAPHMOE_CHECK(n >= 1, "set_num_threads", "thread count must be >= 1, got ", n);
  detail::thread_count().store(n, std::memory_order_relaxed);
  Eigen::setNbThreads(n);
#if defined(GRAPHMOE_USE_BLAS)
  openblas_set_num_threads(n);
#endif
}

// Calls fn(i) for i in [begin, end), split statically over num_threads() threads. Work below
// `grain` iterations per thread runs serially. fn must not throw.
template <class Fn>
void parallel_for(index_t begin, index_t end, Fn&& fn, index_t grain = 1) {
  const index_t n = end - begin;
  if (n <= 0) return;
#if defined(_OPENMP)
  const int threads = num_threads();
  if (threads > 1 && n >= 2 * grain) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t i = begin; i < end; ++i) fn(i);
    return;
  }
#endif
  for (index_t i = begin; i < end; ++i) fn(i);
}

}  // namespace graphmoe
