// graphmoe/core/threads.hpp: the thread-count setting every CPU op honours.
//
// set_num_threads(n) sets the count used by graphmoe's parallel loops. There is one threading
// runtime, graphmoe's own pool (core/thread_pool.hpp): Eigen's and OpenBLAS's own threads are kept
// at 1, and gemm() splits a large product over the threads itself (each part a single-threaded
// BLAS call). Two runtimes that both spin-wait on 2 cores (OpenBLAS's pthreads and OpenMP's
// workers) were measured 2-8x slower than one thread; see docs/benchmarks.md. The default is 1
// thread: the caller opts in to parallelism.
//
// The loops run on the pool when graphmoe is built with GRAPHMOE_USE_OPENMP (the build's switch
// for parallel loops; compiling with -fopenmp also links the threads library), and serially
// without it. The pool replaced OpenMP's parallel-for because OpenMP's fork-join barriers and
// long spin-waits collapse when another process shares a core (thread_pool.hpp, docs/benchmarks.md
// "Contention"); define GRAPHMOE_OPENMP_LOOPS to get the OpenMP loops back (for comparison).
//
// The count is limited to max_num_threads() = kMaxThreadsPerHardwareThread (4) x the hardware
// threads (std::thread::hardware_concurrency(), 1 when unknown): more only oversubscribes the
// cores, and OpenMP runtimes crash or stall on absurd counts (100000 threads: a SIGSEGV inside
// GOMP_parallel). set_num_threads refuses anything outside [1, max_num_threads()].
#pragma once

#include <algorithm>
#include <atomic>
#include <thread>

#include <Eigen/Core>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"

#if defined(_OPENMP)
#include <omp.h>

#include "graphmoe/core/thread_pool.hpp"
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

// Threads allowed per hardware thread (see max_num_threads).
inline constexpr int kMaxThreadsPerHardwareThread = 4;

// The hardware threads of this machine (std::thread::hardware_concurrency(); 1 when unknown).
inline int hardware_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(std::min<unsigned>(n, 1u << 20));
}

// The largest count set_num_threads accepts: 4 x the hardware threads.
inline int max_num_threads() { return kMaxThreadsPerHardwareThread * hardware_threads(); }

inline void set_num_threads(int n) {
  GRAPHMOE_CHECK(n >= 1, "set_num_threads", "thread count must be >= 1, got ", n);
  GRAPHMOE_CHECK(n <= max_num_threads(), "set_num_threads", "thread count ", n,
                 " exceeds the limit of ", max_num_threads(), " (", kMaxThreadsPerHardwareThread,
                 " x the ", hardware_threads(), " hardware threads of this machine)");
  detail::thread_count().store(n, std::memory_order_relaxed);
#if defined(_OPENMP) && !defined(GRAPHMOE_OPENMP_LOOPS)
  if (n > 1) detail::ThreadPool::instance();  // created here: a bad GRAPHMOE_SPIN_US throws now
#endif
  Eigen::setNbThreads(1);
#if defined(GRAPHMOE_USE_BLAS)
  openblas_set_num_threads(1);
#endif
}

// True inside a parallel region (where nested parallel loops run serially).
inline bool in_parallel_region() {
#if defined(_OPENMP)
  return detail::in_pool_loop() || omp_in_parallel() != 0;
#else
  return false;
#endif
}

// Calls fn(i) for i in [begin, end) over num_threads() threads, in contiguous chunks of about
// n / (4 x threads) iterations that the threads claim in order. Work below `grain` iterations per
// thread runs serially. fn must not throw.
template <class Fn>
void parallel_for(index_t begin, index_t end, Fn&& fn, index_t grain = 1) {
  const index_t n = end - begin;
  if (n <= 0) return;
#if defined(_OPENMP)
  const int threads = num_threads();
  if (threads > 1 && n >= 2 * grain && !in_parallel_region()) {
#if defined(GRAPHMOE_OPENMP_LOOPS)
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t i = begin; i < end; ++i) fn(i);
#else
    // contiguous chunks, four per thread: a late or descheduled thread's share is taken over
    auto body = [&](index_t i) { fn(begin + i); };
    detail::ThreadPool::instance().run(n, (n + 4 * threads - 1) / (4 * threads), threads, body);
#endif
    return;
  }
#else
  (void)grain;
#endif
  for (index_t i = begin; i < end; ++i) fn(i);
}

// Runs fn(i) for the independent work items i in [0, n) spread over the threads (dynamic
// schedule: items may differ in size, as experts do), each item's GEMMs single-threaded. This is
// the right split when items are many and each GEMM is small (experts, sequences); with one
// thread, or n == 1, the items run in order and each GEMM may use the threads. fn must not throw.
template <class Fn>
void parallel_items(index_t n, Fn&& fn) {
  if (num_threads() <= 1 || n <= 1 || in_parallel_region()) {
    for (index_t i = 0; i < n; ++i) fn(i);
    return;
  }
#if defined(_OPENMP) && defined(GRAPHMOE_OPENMP_LOOPS)
#pragma omp parallel for num_threads(num_threads()) schedule(dynamic, 1)
  for (index_t i = 0; i < n; ++i) fn(i);
#elif defined(_OPENMP)
  detail::ThreadPool::instance().run(n, 1, num_threads(), fn);
#else
  for (index_t i = 0; i < n; ++i) fn(i);
#endif
}

}  // namespace graphmoe
