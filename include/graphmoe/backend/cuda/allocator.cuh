// graphmoe/backend/cuda/allocator.cuh: device memory for Tensor<T, cuda>.
//
// backend_allocator<cuda> draws from one process-wide caching allocator over cudaMalloc/cudaFree
// (no managed memory). Training allocates the same activation and gradient shapes every step, and
// cudaMalloc/cudaFree are slow and synchronise the device, so freed blocks are kept in free lists
// and handed out again:
//
//   - sizes are rounded up to a size class: 512 bytes minimum, then four classes per power of two
//     (5/4, 6/4, 7/4 and 2 times 2^n), so a block wastes less than 25 %;
//   - one free list per (device, size class); a request takes a cached block of exactly its class
//     or calls cudaMalloc;
//   - when cudaMalloc runs out of memory, every cached block of that device is released and the
//     call is retried once before graphmoe::Error is thrown;
//   - cuda_empty_cache() releases all cached blocks, cuda_memory_stats() reports the counters,
//     cuda_reset_peak_memory() restarts the high-water mark.
//
// Reuse is safe because the backend issues all work on one stream, cuda_stream() (device.cuh):
// a block freed while a kernel still reads it is only written by work queued after that kernel.
// The allocator is thread-safe (one mutex) and deliberately never destroyed, so tensors that
// outlive main() (statics) can still be freed. Errors are graphmoe::Error naming the CUDA call.
//
// Under the tests' CPU emulation of CUDA (tests/cuda/emulation) the allocator tells it about every
// block handed out and returned, so that it can fill the bytes past a tensor's end with a canary
// and report a kernel that wrote there.
//
// zero() and copy() are stream-ordered (cudaMemsetAsync, cudaMemcpyAsync device to device on the
// backend's stream), like the kernels.
//
// Graph-private pools (CudaGraph, graph.cuh). A CUDA graph bakes the addresses of every buffer its
// captured work touches into the graph, and replays write them again; a block the capture freed
// must therefore never be handed to anyone else while the graph lives. begin_pool() routes every
// allocation to a new pool until end_pool(): a request takes a free block of the pool, else a free
// block of the general lists, else cudaMalloc (in cudaStreamCaptureModeRelaxed for that call, as
// a capture otherwise forbids it); such blocks belong to the pool, and when freed (during the
// capture or after it, e.g. a layer's cache the capture allocated) they return to the pool's own
// free lists, reused only by allocations routed to that pool; so does any block freed during the
// capture (a buffer from before it that the captured work read, then replaced: the replays still
// read it). release_pool() (the graph is destroyed) hands the pool's free blocks to the general
// lists; its blocks still live return there when freed.
//
// Blocks from before a capture, freed after it. The graph also holds the addresses of buffers
// that existed when it was captured (a model's parameters, its buffers from the warm-up step, the
// inputs). When such a block is freed while the graph lives (the model run eagerly at another
// shape between replays reallocates its buffers), it is held back from reuse until every graph
// that may hold it is destroyed: each allocation carries a serial number, each pool the serial at
// which its capture began, and a freed block whose serial precedes a live pool's (or that belongs
// to a pool, or that more than the capturing pool may hold) waits in a list of held blocks with
// the ids of those pools. So replays never write into memory handed to someone else: they keep
// computing on the buffers they were captured with (the model's new buffers are its eager
// runs'), which is the step the graph recorded. What it cannot see is an input that the caller
// reallocated instead of writing in place: the replays read the old buffer (graph.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

struct CudaMemoryStats {
  std::size_t bytes_in_use = 0;     // size classes of the live blocks
  std::size_t bytes_cached = 0;     // held in free lists
  std::size_t peak_bytes_in_use = 0;
  std::size_t cuda_malloc_calls = 0;
  std::size_t cache_hits = 0;       // allocations served from a free list
  // freed blocks held back from reuse while a CUDA graph that may touch them lives (allocator's
  // header comment), and the free blocks of graphs' private pools
  std::size_t bytes_held_for_graphs = 0;
};

namespace detail {

class CudaCachingAllocator {
 public:
  static constexpr std::size_t kMinBlock = 512;

  static CudaCachingAllocator& instance() {
    static CudaCachingAllocator* a = new CudaCachingAllocator();  // never destroyed, see above
    return *a;
  }

  // The size class of a request of `bytes`.
  static std::size_t size_class(std::size_t bytes) {
    if (bytes <= kMinBlock) return kMinBlock;
    const int e = static_cast<int>(std::bit_width(bytes - 1)) - 1;  // 2^e < bytes <= 2^(e + 1)
    const std::size_t step = (std::size_t(1) << e) / 4;
    return (bytes + step - 1) / step * step;
  }

  void* allocate(std::size_t bytes) {
    int device = 0;
    GRAPHMOE_CUDA_CHECK(cudaGetDevice(&device));
    const std::size_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[{device, size}];
    void* p = nullptr;
    std::vector<void*>* pool_list =
        active_pool_ != 0 ? &pools_[active_pool_].free[{device, size}] : nullptr;
    if (pool_list != nullptr && !pool_list->empty()) {
      p = pool_list->back();
      pool_list->pop_back();
      pools_[active_pool_].bytes_free -= size;
      stats_.bytes_held_for_graphs -= size;
      ++stats_.cache_hits;
    } else if (!list.empty()) {
      p = list.back();
      list.pop_back();
      stats_.bytes_cached -= size;
      ++stats_.cache_hits;
    } else {
      cudaError_t err = malloc_device(&p, size);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        release_locked(device);
        err = malloc_device(&p, size);
      }
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        throw_error("cudaMalloc", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                    " allocating ", bytes, " bytes (size class ", size, ") on device ", device,
                    "; graphmoe holds ", stats_.bytes_in_use, " bytes in use");
      }
      ++stats_.cuda_malloc_calls;
    }
    live_[p] = Block{size, device, bytes, active_pool_, next_serial_++};
#if defined(GRAPHMOE_CUDA_EMULATION)
    graphmoe_cuda_emulation::on_tensor_allocate(p, bytes, size);  // poisons the block with NaN
    // a graph's block: its replays may touch all of it, whatever tensor holds it now
    if (active_pool_ != 0) graphmoe_cuda_emulation::on_graph_block(p, size, true);
#endif
    stats_.bytes_in_use += size;
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
    return p;
  }

  void deallocate(void* p) noexcept {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) {  // not ours: hand it back to CUDA rather than leak it
      (void)cudaFree(p);
      return;
    }
    const Block b = it->second;
    live_.erase(it);
    stats_.bytes_in_use -= b.size;
    // the live graphs that may hold the block: its own pool's (allocated during that capture),
    // and every pool whose capture began after the block was allocated (the captured work may
    // have read or written it), the capture under way included
    std::vector<int> holders;
    if (b.pool != 0) holders.push_back(b.pool);
    for (const auto& [id, pool] : pools_)
      if (id != b.pool && b.serial < pool.first_serial) holders.push_back(id);
    if (holders.empty()) {
#if defined(GRAPHMOE_CUDA_EMULATION)
      graphmoe_cuda_emulation::on_tensor_free(p, b.requested, b.size);  // checks the canary
#endif
      stats_.bytes_cached += b.size;
      free_[{b.device, b.size}].push_back(p);
      return;
    }
#if defined(GRAPHMOE_CUDA_EMULATION)
    // the graphs' replays may touch all of it, whatever tensor held it
    if (b.pool == 0) graphmoe_cuda_emulation::on_graph_block(p, b.size, true);
#endif
    if (holders.size() == 1 && holders.front() == active_pool_) {
      // only the capture under way holds it: reused by that capture's later allocations
      Pool& pool = pools_[active_pool_];
      pool.free[{b.device, b.size}].push_back(p);
      pool.bytes_free += b.size;
      stats_.bytes_held_for_graphs += b.size;
      return;
    }
    held_.push_back(Held{p, b.device, b.size, std::move(holders)});
    stats_.bytes_held_for_graphs += b.size;
  }

  // Graph-private pools (see the header comment). One pool receives allocations at a time.
  int begin_pool() {
    std::lock_guard<std::mutex> lock(mu_);
    GRAPHMOE_CHECK(active_pool_ == 0, "CudaGraph::capture",
                   "another capture is under way (one at a time)");
    active_pool_ = ++last_pool_;
    pools_[active_pool_].first_serial = next_serial_;
    return active_pool_;
  }
  void end_pool() {
    std::lock_guard<std::mutex> lock(mu_);
    active_pool_ = 0;
  }
  void release_pool(int id) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_pool_ == id) active_pool_ = 0;
    auto it = pools_.find(id);
    if (it == pools_.end()) return;
    for (auto& [key, list] : it->second.free)
      for (void* p : list) {
#if defined(GRAPHMOE_CUDA_EMULATION)
        graphmoe_cuda_emulation::on_graph_block(p, key.second, false);
#endif
        free_[key].push_back(p);
        stats_.bytes_cached += key.second;
        stats_.bytes_held_for_graphs -= key.second;
      }
    pools_.erase(it);
    for (auto& [p, b] : live_)
      if (b.pool == id) b.pool = 0;
    // held blocks: this graph lets go of them; those no graph holds are free again
    for (std::size_t k = 0; k < held_.size();) {
      Held& h = held_[k];
      std::erase(h.pools, id);
      if (!h.pools.empty()) {
        ++k;
        continue;
      }
#if defined(GRAPHMOE_CUDA_EMULATION)
      graphmoe_cuda_emulation::on_graph_block(h.p, h.size, false);
#endif
      free_[{h.device, h.size}].push_back(h.p);
      stats_.bytes_cached += h.size;
      stats_.bytes_held_for_graphs -= h.size;
      h = std::move(held_.back());
      held_.pop_back();
    }
  }
  // Bytes of free blocks held by pool `id` (0 when there is none).
  std::size_t pool_free_bytes(int id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.bytes_free;
  }

  // cudaFree every cached block (of all devices).
  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    release_locked(-1);
  }

  CudaMemoryStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // Starts a new high-water mark from what is in use now.
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  }

 private:
  struct Block {
    std::size_t size;       // the size class
    int device;
    std::size_t requested;  // the bytes asked for
    int pool = 0;           // the graph pool it belongs to; 0: none
    std::uint64_t serial = 0;  // allocation order
  };
  struct Pool {
    std::map<std::pair<int, std::size_t>, std::vector<void*>> free;
    std::size_t bytes_free = 0;
    std::uint64_t first_serial = 0;  // the first allocation serial of its capture
  };
  struct Held {  // a freed block that live graphs may still touch
    void* p;
    int device;
    std::size_t size;
    std::vector<int> pools;  // the graphs' pools
  };

  CudaCachingAllocator() = default;

  // cudaMalloc; while a capture is under way on this thread, in the relaxed capture mode (a
  // capture forbids cudaMalloc otherwise, and the block's address is fixed from now on anyway).
  static cudaError_t malloc_device(void** p, std::size_t size) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
    const cudaError_t err = cudaMalloc(p, size);
    if (exchanged) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    return err;
  }

  // Frees the cached blocks of `device` (all devices for -1). Called with mu_ held.
  void release_locked(int device) {
    int current = 0;
    const bool switch_device = cudaGetDevice(&current) == cudaSuccess;
    for (auto& [key, list] : free_) {
      if (device >= 0 && key.first != device) continue;
      if (switch_device && key.first != current) (void)cudaSetDevice(key.first);
      for (void* p : list) (void)cudaFree(p);
      stats_.bytes_cached -= key.second * list.size();
      list.clear();
    }
    if (switch_device) (void)cudaSetDevice(current);
  }

  mutable std::mutex mu_;
  std::map<int, Pool> pools_;
  int active_pool_ = 0, last_pool_ = 0;
  std::uint64_t next_serial_ = 0;
  std::vector<Held> held_;
  std::unordered_map<void*, Block> live_;
  std::map<std::pair<int, std::size_t>, std::vector<void*>> free_;  // (device, size class)
  CudaMemoryStats stats_;
};

// A Thrust allocator (thrust::cuda::par(alloc)) so that the temporary storage of Thrust's sorts
// and scans comes from the caching allocator too.
struct CudaThrustAllocator {
  using value_type = char;
  char* allocate(std::ptrdiff_t n) {
    return static_cast<char*>(CudaCachingAllocator::instance().allocate(static_cast<std::size_t>(n)));
  }
  void deallocate(char* p, std::size_t) noexcept { CudaCachingAllocator::instance().deallocate(p); }
};

}  // namespace detail

template <>
struct backend_allocator<cuda> {
  static void* allocate(std::size_t bytes) {
    return detail::CudaCachingAllocator::instance().allocate(bytes);
  }
  static void deallocate(void* p) noexcept { detail::CudaCachingAllocator::instance().deallocate(p); }
  static void zero(void* p, std::size_t bytes) {
    if (bytes > 0) GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_stream()));
  }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes > 0 && dst != src)
      GRAPHMOE_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_stream()));
  }
};

// Counters of the caching allocator (all devices).
inline CudaMemoryStats cuda_memory_stats() {
  return detail::CudaCachingAllocator::instance().stats();
}

// Restarts peak_bytes_in_use from bytes_in_use (to measure the high-water mark of one piece of
// work: reset, run it, read cuda_memory_stats().peak_bytes_in_use).
inline void cuda_reset_peak_memory() { detail::CudaCachingAllocator::instance().reset_peak(); }

// Returns every cached (free) block to CUDA; live tensors are untouched.
inline void cuda_empty_cache() { detail::CudaCachingAllocator::instance().release_cached(); }

}  // namespace graphmoe
