// graphmoe/core/thread_pool.hpp: the worker threads behind parallel_for and parallel_items
// (core/threads.hpp); internal.
//
// Why not OpenMP's fork-join: a parallel region ends at a barrier that every thread of the team
// must reach, and idle OpenMP workers spin (libgomp: about 300,000 iterations) before they sleep.
// When another process shares a core, the descheduled thread holds up every region until the
// scheduler runs it again, while its partner spins on the other core; a training step has hundreds
// of regions. bench_lm beside one busy process kept a small fraction of its idle speed that way
// (docs/benchmarks.md, "Contention"). Here:
//   - work is claimed, not assigned: the caller and the workers take chunks of items from one
//     atomic counter, and the caller returns when every item is done, not when every worker has
//     checked in; a worker that wakes late finds nothing left and goes back to waiting, so a
//     descheduled thread delays a loop only by the chunk it already holds;
//   - idle workers spin for a short while (50 us; GRAPHMOE_SPIN_US) and then sleep on a futex (C++20
//     std::atomic::wait), so they give the core back within microseconds, not milliseconds;
//   - the caller wakes sleeping workers only when there are any (no system call otherwise).
// Each loop is its own Job object, shared by the threads that took part, so a late worker can
// never take items of a later loop with an earlier loop's function.
//
// One loop runs on the pool at a time: a second thread calling parallel_for meanwhile (two user
// threads, say) runs its loop serially instead of waiting. The pool is created on first use and
// never destroyed (its workers sleep until the process exits).
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace graphmoe::detail {

// True on a pool worker while it runs items, and on the caller while it runs a loop: nested loops
// run serially.
inline bool& in_pool_loop() {
  static thread_local bool flag = false;
  return flag;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class ThreadPool {
 public:
  // How long an idle thread spins before it sleeps, by default: long enough to cover the serial
  // code between two loops of a training step, short enough to give a shared core back quickly.
  // The environment variable GRAPHMOE_SPIN_US (read once, when the pool is created) overrides it:
  // 0 sleeps at once (the least CPU for others), larger values wake faster on a machine of one's own.
  static constexpr std::int64_t kDefaultSpinMicros = 50;
  static constexpr std::int64_t kMaxSpinMicros = 1000000;

  static ThreadPool& instance() {
    static ThreadPool* pool = new ThreadPool(spin_micros_from_env());  // never destroyed: workers
    return *pool;                                                     // may still be asleep
  }

  // GRAPHMOE_SPIN_US as a number of microseconds in [0, kMaxSpinMicros], or the default when unset;
  // throws graphmoe::Error naming the variable for anything else.
  static std::int64_t spin_micros_from_env() {
    const char* v = std::getenv("GRAPHMOE_SPIN_US");
    if (v == nullptr || *v == '\0') return kDefaultSpinMicros;
    char* end = nullptr;
    errno = 0;
    const long long us = std::strtoll(v, &end, 10);
    GRAPHMOE_CHECK(std::isdigit(static_cast<unsigned char>(*v)) && errno == 0 && end != v &&
                       *end == '\0' && us >= 0 && us <= kMaxSpinMicros,
                   "GRAPHMOE_SPIN_US", "must be a whole number of microseconds in [0, ",
                   kMaxSpinMicros, "], got '", v, "'");
    return us;
  }
  std::int64_t spin_micros() const { return spin_micros_; }

  // Calls body(i) for every i in [0, n), in chunks of `chunk` consecutive items, on the calling
  // thread and up to threads - 1 workers. Returns when all items are done. body must not throw
  // (std::terminate if it does).
  template <class Body>
  void run(index_t n, index_t chunk, int threads, Body& body) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock() || threads <= 1) {  // another thread's loop is on the pool
      serial(n, body);
      return;
    }
    ensure_workers(threads - 1);
    auto job = std::make_shared<Job>();
    job->n = n;
    // chunks are counted in 32 bits (futex-sized atomics)
    job->chunk = std::max<index_t>({index_t{1}, chunk, (n >> 30) + 1});
    job->body = &body;
    job->call = [](void* b, index_t i) { (*static_cast<Body*>(b))(i); };
    job->max_helpers = threads - 1;
    {
      std::lock_guard<std::mutex> lock(job_mutex_);
      job_ = job;
    }
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) epoch_.notify_all();
    in_pool_loop() = true;
    work_on(*job);
    in_pool_loop() = false;
    wait_done(*job);
    {
      std::lock_guard<std::mutex> lock(job_mutex_);
      job_.reset();
    }
  }

 private:
  struct Job {
    index_t n = 0, chunk = 1;
    void* body = nullptr;
    void (*call)(void*, index_t) = nullptr;
    int max_helpers = 0;
    std::atomic<int> helpers{0};        // workers that joined this job
    std::atomic<index_t> next{0};       // first unclaimed item
    std::atomic<std::int32_t> done_chunks{0};
    std::atomic<std::int32_t> caller_waiting{0};
    std::int32_t chunks() const { return static_cast<std::int32_t>((n + chunk - 1) / chunk); }
  };

  // (Nested loops inside find the pool busy too, and run serially.)
  template <class Body>
  static void serial(index_t n, Body& body) {
    for (index_t i = 0; i < n; ++i) body(i);
  }

  // Claims and runs chunks until none is left. noexcept: a body that throws ends the program (as
  // inside OpenMP's loops) instead of unwinding the caller while workers still run its chunks.
  static void work_on(Job& job) noexcept {
    for (;;) {
      const index_t b = job.next.fetch_add(job.chunk);
      if (b >= job.n) return;
      const index_t e = std::min(job.n, b + job.chunk);
      for (index_t i = b; i < e; ++i) job.call(job.body, i);
      if (job.done_chunks.fetch_add(1) + 1 == job.chunks() && job.caller_waiting.load() != 0)
        job.done_chunks.notify_all();
    }
  }

  // The caller: spin briefly, then sleep until the last chunk is done.
  void wait_done(Job& job) const {
    const std::int32_t total = job.chunks();
    if (spin_until([&] { return job.done_chunks.load() == total; })) return;
    job.caller_waiting.store(1);
    for (std::int32_t d = job.done_chunks.load(); d != total; d = job.done_chunks.load())
      job.done_chunks.wait(d);
  }

  // Spins up to spin_micros_ for pred(); returns whether it holds.
  template <class Pred>
  bool spin_until(Pred&& pred) const {
    if (spin_micros_ == 0) return pred();
    const auto start = std::chrono::steady_clock::now();
    for (int k = 1;; ++k) {
      if (pred()) return true;
      cpu_relax();
      if ((k & 63) == 0 && std::chrono::steady_clock::now() - start >
                                 std::chrono::microseconds(spin_micros_))
        return pred();
    }
  }

  void ensure_workers(int count) {
    std::lock_guard<std::mutex> lock(job_mutex_);
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this] { worker_loop(); });
      workers_.back().detach();
    }
  }

  void worker_loop() {
    std::uint32_t seen = epoch_.load();
    for (;;) {
      if (!spin_until([&] { return epoch_.load() != seen; })) {
        sleepers_.fetch_add(1);
        epoch_.wait(seen);  // returns at once if the epoch moved since `seen`
        sleepers_.fetch_sub(1);
      }
      seen = epoch_.load();
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(job_mutex_);
        job = job_;
      }
      if (!job || job->helpers.fetch_add(1) >= job->max_helpers) continue;
      in_pool_loop() = true;
      work_on(*job);
      in_pool_loop() = false;
    }
  }

  explicit ThreadPool(std::int64_t spin_micros) : spin_micros_(spin_micros) {}

  std::mutex run_mutex_;  // held by the thread whose loop is on the pool
  std::mutex job_mutex_;  // guards job_ and workers_
  std::shared_ptr<Job> job_;
  std::vector<std::thread> workers_;
  std::atomic<std::uint32_t> epoch_{0};  // bumped for every loop
  std::atomic<int> sleepers_{0};         // workers asleep on epoch_
  const std::int64_t spin_micros_;
};

}  // namespace graphmoe::detail
