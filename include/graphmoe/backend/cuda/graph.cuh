// graphmoe/backend/cuda/graph.cuh: CUDA graphs of the backend's work (a training step
// without launch overhead).
//
//   CudaGraph g;
//   g.capture([&] { lm.forward(ids, targets); lm.backward(); });  // recorded, nothing runs
//   for (...) {
//     copy the next batch into ids and targets (the same tensors: to_device(host, ids));
//     g.replay();            // one launch for all of it, one wait, then the checks' errors
//   }
//
// capture(body) runs body with the backend's stream (device.cuh) in capture mode
// (cudaStreamCaptureModeThreadLocal): its kernels, asynchronous copies and memsets and cuBLAS
// calls are recorded into a graph, not run. replay() launches the graph on the stream, waits for
// it, delivers the deferred values its work produced (the routers' auxiliary losses and the like:
// core/deferred_check.hpp) and throws the first content check that flagged, with the message the
// work would have thrown when run eagerly. A replay repeats exactly the captured work:
//
//   - every buffer it touches is at the address it had during the capture: the inputs must be
//     written in place between replays (a reallocated input is not seen: the replays read the
//     old buffer), and what it writes (a model's outputs, caches, gradients) is where the capture
//     left the tensors holding it. The memory the captured work allocated lives in the graph's
//     private pool (allocator.cuh) for as long as the graph: nothing outside the graph is handed
//     those blocks. A buffer that existed before the capture (a model's buffers from the warm-up
//     step) and is freed while the graph lives (the model run eagerly at another shape between
//     replays, e.g. an evaluation batch of another size, reallocates its buffers) is held back
//     from reuse until the graph is destroyed (cuda_memory_stats().bytes_held_for_graphs): the
//     replays go on computing the captured step on the buffers they were captured with, and
//     never write memory handed to anyone else. The model's accessors (logits, routing) show its
//     last eager run's buffers then, not the replays': capture again, or keep a second model, to
//     read those after a replay;
//   - the host's values are those of the capture: shapes, scalars passed to kernels (a learning
//     rate, a step count), the expert layout's offsets. Capture again when they change;
//   - the host code between the ops ran once, during the capture: a value the host computes
//     from device results (a loss read back, a count) is what it was then, i.e. undefined. Work
//     that reads device data back to the host or synchronises (to_host, the compact expert layout,
//     an immediate check) cannot be captured: capture() throws graphmoe::Error naming the call,
//     leaves the stream usable and frees what the capture allocated.
//
// The deferred content checks of the captured work (every scope opened inside it joins the
// graph's batch: deferred_check.cuh) are read after each replay; a replay whose checks flag has
// still run to the end (its results are undefined, as an eager run would have thrown), and the
// next replay starts with fresh flags. Targets of deferred values (doubles in the layers) must
// outlive the graph.
//
// One capture at a time per process; nothing else may allocate backend memory on another thread
// during it. Not supported inside with_deferred_checks, or with the legacy default stream (when
// the backend could not create its own: device.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/deferred_check.cuh"
#include "graphmoe/backend/cuda/detail/error.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph() { reset(); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  CudaGraph(CudaGraph&& o) noexcept { *this = std::move(o); }
  CudaGraph& operator=(CudaGraph&& o) noexcept {
    if (this != &o) {
      reset();
      exec_ = std::exchange(o.exec_, nullptr);
      pool_ = std::exchange(o.pool_, 0);
      checks_ = std::move(o.checks_);
      pinned_ = std::exchange(o.pinned_, nullptr);
      replays_ = std::exchange(o.replays_, 0);
    }
    return *this;
  }

  bool captured() const { return exec_ != nullptr; }
  std::size_t replays() const { return replays_; }
  // The deferred checks and values the captured work registered (read after each replay).
  index_t deferred_slots() const { return checks_ ? checks_->slots_taken() : 0; }

  // Records body's work on the backend's stream (see the header comment). Replaces a previous
  // capture of this object.
  template <class F>
  void capture(F&& body) {
    constexpr const char* op = "CudaGraph::capture";
    reset();
    GRAPHMOE_CHECK(detail::active_device_checks() == nullptr, op,
                   "capture inside with_deferred_checks is not supported (the scope would read "
                   "its checks inside the graph)");
    const cudaStream_t stream = cuda_stream();
    GRAPHMOE_CHECK(stream != cudaStreamLegacy, op,
                   "the backend runs on the legacy default stream, which CUDA cannot capture "
                   "(creating the backend's stream failed: device.cuh)");
    GRAPHMOE_CHECK(!cuda_stream_capturing(), op, "the backend's stream is already capturing");
    {  // page-locked memory for the checks' flags: allocated before the capture forbids it
      void* p = nullptr;
      GRAPHMOE_CUDA_CHECK(cudaMallocHost(
          &p, sizeof(unsigned long long) * static_cast<std::size_t>(detail::DeviceCheckBatch::kCapacity)));
      pinned_ = static_cast<unsigned long long*>(p);
    }
    auto& alloc = detail::CudaCachingAllocator::instance();
    pool_ = alloc.begin_pool();
    cudaGraph_t graph = nullptr;
    try {
      GRAPHMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        checks_ = std::make_unique<detail::DeviceCheckBatch>(pinned_);  // its memset: recorded
        std::forward<F>(body)();
        checks_->end_capture();  // the copy of the flags and values: recorded, last
      } catch (...) {
        if (checks_) checks_->end_capture();
        cudaGraph_t discarded = nullptr;
        (void)cudaStreamEndCapture(stream, &discarded);
        if (discarded != nullptr) (void)cudaGraphDestroy(discarded);
        (void)cudaGetLastError();
        throw;
      }
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      if (end != cudaSuccess) {
        (void)cudaGetLastError();
        detail::throw_error(op, cudaGetErrorName(end), ": ", cudaGetErrorString(end),
                            " (the captured work made a call a CUDA graph cannot hold: a read "
                            "back to the host, a synchronisation or an allocation)");
      }
      GRAPHMOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph, 0));
      (void)cudaGraphDestroy(graph);
      alloc.end_pool();
    } catch (const Error& e) {
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      reset();
      const std::string what = e.what();
      if (what.find(op) != std::string::npos) throw;  // capture's own message: as it is
      detail::throw_error(op, "the captured work failed: ", what,
                          what.find("capturing") != std::string::npos
                              ? " (a call a CUDA graph cannot hold: reads back to the host and "
                                "synchronisations cannot be captured)"
                              : "");
    } catch (...) {
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      reset();
      throw;
    }
  }

  // Runs the captured work once on the backend's stream and waits for it; then delivers its
  // deferred values and throws the first flagged check's error (see the header comment).
  void replay() {
    GRAPHMOE_CHECK(captured(), "CudaGraph::replay", "nothing captured (call capture() first)");
    GRAPHMOE_CHECK(!cuda_stream_capturing(), "CudaGraph::replay",
                   "the backend's stream is capturing (replay a graph outside a capture)");
    GRAPHMOE_CUDA_CHECK(cudaGraphLaunch(exec_, cuda_stream()));
    ++replays_;
    cuda_stream_synchronize();
    checks_->after_replay();
  }

  // Frees the graph, returns its pool's free blocks to the general cache (allocator.cuh).
  void reset() noexcept {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
    checks_.reset();
    if (pool_ != 0) detail::CudaCachingAllocator::instance().release_pool(pool_);
    pool_ = 0;
    if (pinned_ != nullptr) (void)cudaFreeHost(pinned_);
    pinned_ = nullptr;
    replays_ = 0;
  }

 private:
  cudaGraphExec_t exec_ = nullptr;
  int pool_ = 0;
  std::unique_ptr<detail::DeviceCheckBatch> checks_;
  unsigned long long* pinned_ = nullptr;
  std::size_t replays_ = 0;
};

}  // namespace graphmoe
