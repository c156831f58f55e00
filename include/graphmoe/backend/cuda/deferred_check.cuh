// graphmoe/backend/cuda/deferred_check.cuh: the CUDA backend's deferred content checks
// (the contract: core/deferred_check.hpp).
//
// Inside with_deferred_checks(cuda{}, body) the checks that can wait (check_finite, softmax and
// log-softmax, top-k, the renormalised gates, the capacity mask, the padded dispatch plan: the
// ones that construct their flag with FirstIndexFlag::Deferrable) write their "first bad index" into a slot of one device array of
// the batch (one memset for the batch instead of one per check) and return pending. Every read of
// device data to the host inside the scope (copy.cuh's to_host and read_device_value: the
// dispatch plan's expert offsets) first queues an asynchronous copy of the slots taken so far
// into page-locked host memory, so the one drain of the stream that read costs delivers the
// flags as well. When body returns the batch reads whatever is still unread (a synchronisation
// only if a check ran after the last read) and throws the first flagged check's error.
//
// The batch also carries deferred values (take_value): an op that computes a number the host
// needs later (the router's load-balancing loss) writes it into a slot, and the batch's next read
// delivers it to the op's target (a double that must outlive the scope).
//
// The batch holds kCapacity slots (256: about 6 checks per MoE layer, so a language model's
// forward of 40 MoE layers fits in one scope; 2 KB of page-locked memory); a check beyond them, or any check when page-locked memory
// cannot be had, reads at once as outside a scope. A scope opened inside another joins it. Only
// the thread that opened the scope defers (the backend runs one stream: device.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

class DeviceCheckBatch;

// The thread's open batch, or null.
inline DeviceCheckBatch*& active_device_checks() {
  thread_local DeviceCheckBatch* active = nullptr;
  return active;
}

class DeviceCheckBatch {
 public:
  static constexpr index_t kCapacity = 256;
  static constexpr unsigned long long kNone = ~0ull;

  // Opens the batch on the calling thread (there must be none open: with_deferred_checks joins
  // an open one instead). usable() is false when no page-locked memory could be had.
  DeviceCheckBatch() : DeviceCheckBatch(pinned_flags()) {}
  // The same with the caller's page-locked memory for kCapacity flags (a CUDA graph's batch,
  // graph.cuh: its replays deliver into memory of their own); null: not usable.
  explicit DeviceCheckBatch(unsigned long long* pinned) {
    host_ = pinned;
    if (host_ == nullptr) return;
    slots_ = Tensor<unsigned long long, cuda>::uninitialized(Shape{kCapacity});
    GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(slots_.data(), 0xFF, slots_.bytes(), cuda_stream()));
    active_device_checks() = this;
    active_deferred_checks() = &checks_;
  }
  ~DeviceCheckBatch() { close(); }
  DeviceCheckBatch(const DeviceCheckBatch&) = delete;
  DeviceCheckBatch& operator=(const DeviceCheckBatch&) = delete;

  bool usable() const { return host_ != nullptr; }

  // The device flag for the next check, or null when the batch is full.
  unsigned long long* take_slot(index_t& slot) {
    if (taken_ >= kCapacity) return nullptr;
    slot = taken_++;
    return slots_.data() + slot;
  }

  // A deferred value: the device word the op writes a double into (its bits), delivered to
  // *target with the batch's next read (at the latest when the scope ends); null when the batch
  // is full (the op then reads at once). *target must outlive the scope.
  double* take_value(double* target) {
    index_t slot = -1;
    unsigned long long* p = take_slot(slot);
    if (p == nullptr) return nullptr;
    values_.emplace_back(slot, target);
    static_assert(sizeof(double) == sizeof(unsigned long long));
    return reinterpret_cast<double*>(p);
  }

  // Registers the check that owns `slot`; returns its entry (what the pending result carries).
  template <class R>
  index_t add(const char* op, index_t slot, std::function<R(index_t)> resolve) {
    const index_t entry = checks_.add<R>(op, std::move(resolve));
    slot_of_entry_.push_back(slot);
    return entry;
  }

  // Before a synchronising read of device data: queue the copy of the slots not yet read, so
  // that they arrive with it.
  void before_host_read() {
    if (taken_ <= known_) return;
    GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(host_, slots_.data(),
                                        sizeof(unsigned long long) * static_cast<std::size_t>(taken_),
                                        cudaMemcpyDeviceToHost, cuda_stream()));
    queued_ = taken_;
  }
  // After that read's synchronisation: the queued slots are on the host (values delivered).
  void after_synchronize() {
    known_ = std::max(known_, queued_);
    for (; delivered_ < values_.size() && values_[delivered_].first < known_; ++delivered_)
      std::memcpy(values_[delivered_].second, host_ + values_[delivered_].first, sizeof(double));
  }

  // Reads the slots still unknown: one synchronisation, only if a check ran after the last read.
  void read() {
    if (!usable() || known_ >= taken_) return;
    before_host_read();
    cuda_stream_synchronize();
    after_synchronize();
  }

  // After read(): closes the batch (so that the error's own reads, of the offending row, run as
  // outside a scope) and, if a check flagged an index, throws the first one's error in program
  // order.
  void fire_first() {
    if (!usable()) return;
    const std::vector<unsigned long long> flags(host_, host_ + known_);
    close();
    fire_flagged(flags);
  }

  // A CUDA graph's batch (graph.cuh). At the end of the capture: queues (records) the copy of
  // every slot taken to the page-locked memory and closes the batch, so that nothing else joins
  // it. After each replay has been waited for: delivers the values to their targets and throws
  // the first flagged check's error, as a scope's end would.
  void end_capture() {
    before_host_read();
    close();
  }
  void after_replay() {
    known_ = 0;  // this replay's copy: every value delivered again
    delivered_ = 0;
    after_synchronize();
    fire_flagged(std::vector<unsigned long long>(host_, host_ + known_));
  }
  index_t slots_taken() const { return taken_; }

 private:
  void fire_flagged(const std::vector<unsigned long long>& flags) {
    for (std::size_t e = 0; e < slot_of_entry_.size(); ++e) {
      const auto slot = static_cast<std::size_t>(slot_of_entry_[e]);
      if (slot < flags.size() && flags[slot] != kNone)
        checks_.fire(static_cast<index_t>(e), static_cast<index_t>(flags[slot]));
    }
  }

  void close() {
    if (active_device_checks() == this) {
      active_device_checks() = nullptr;
      active_deferred_checks() = nullptr;
    }
  }

  // kCapacity flags of page-locked host memory per thread, allocated on first use and freed when
  // the thread ends; null if cudaMallocHost fails (the error is cleared).
  static unsigned long long* pinned_flags() {
    struct Pinned {
      unsigned long long* p = nullptr;
      bool tried = false;
      ~Pinned() {
        if (p != nullptr) (void)cudaFreeHost(p);  // at exit the runtime may be gone: ignore
      }
    };
    thread_local Pinned pinned;
    if (!pinned.tried) {
      pinned.tried = true;
      void* p = nullptr;
      if (cudaMallocHost(&p, sizeof(unsigned long long) * kCapacity) == cudaSuccess)
        pinned.p = static_cast<unsigned long long*>(p);
      else
        (void)cudaGetLastError();
    }
    return pinned.p;
  }

  DeferredChecks checks_;
  Tensor<unsigned long long, cuda> slots_;
  unsigned long long* host_ = nullptr;
  std::vector<index_t> slot_of_entry_;
  std::vector<std::pair<index_t, double*>> values_;  // (slot, target), in slot order
  std::size_t delivered_ = 0;
  index_t taken_ = 0, queued_ = 0, known_ = 0;
};

// Hooks of the synchronising reads (copy.cuh).
inline void deferred_checks_before_host_read() {
  if (DeviceCheckBatch* b = active_device_checks()) b->before_host_read();
}
inline void deferred_checks_after_synchronize() {
  if (DeviceCheckBatch* b = active_device_checks()) b->after_synchronize();
}

}  // namespace detail

// Runs body with the deferrable checks' flags kept on the device and read together (above).
template <class F>
void with_deferred_checks(cuda, F&& body) {
  if (detail::active_device_checks() != nullptr) {  // joins the open batch
    std::forward<F>(body)();
    return;
  }
  detail::DeviceCheckBatch batch;
  if (!batch.usable()) {
    std::forward<F>(body)();
    return;
  }
  try {
    std::forward<F>(body)();
  } catch (...) {
    // A check flagged before body threw comes first: its immediate form would have stopped there.
    // If the flags cannot be read (a CUDA error), the original exception stands.
    const std::exception_ptr original = std::current_exception();
    try {
      batch.read();
    } catch (...) {
      std::rethrow_exception(original);
    }
    batch.fire_first();
    throw;
  }
  batch.read();
  batch.fire_first();
}

}  // namespace graphmoe
