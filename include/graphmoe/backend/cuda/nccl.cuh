// graphmoe/backend/cuda/nccl.cuh: NcclCommunicator (graphmoe::dist::Communicator over NCCL,
// device memory), the CUDA backend's transport behind the interface of core/communicator.hpp.
//
// Needs CUDA and NCCL: link graphmoe::nccl (built when CMake finds nccl.h and libnccl;
// GRAPHMOE_ENABLE_NCCL), which brings graphmoe::cuda and the NCCL library. Host code only (no
// kernels): a .cu or, with the CUDA include directory, a .cpp can include it. One GPU per rank.
//
//   graphmoe::dist::MpiEnvironment mpi(argc, argv);
//   graphmoe::dist::MpiCommunicator host;                  // bootstraps the NCCL unique id
//   cudaSetDevice(local_rank);                              // before the NCCL communicator
//   auto comm = graphmoe::dist::NcclCommunicator::over(host);
//   comm.all_reduce_sum(grads_on_device, n, graphmoe::dist::ElementType::F32);
//
// Buffers are DEVICE pointers (memory_space() == Device), on the device that was current when the
// communicator was constructed; use the communicator from a thread whose current device is that
// one. The typed range overloads take device memory too (a std::span over device memory): a
// std::vector is host memory, and NCCL refuses it (ncclInvalidArgument, an Error as below).
//
// Streams and synchronisation: every operation runs on one stream, by default the CUDA backend's
// (cuda_stream(), the legacy default stream, so it is ordered after every kernel the backend
// launched), and waits for that stream before it returns: the library's callers read results on
// the host right after a collective (clip_grad_norm's norm, the counts of expert parallelism), and
// a buffer is safe to reuse once the call returns. Overlapping communication with computation is
// future work.
//
// Counts: NCCL takes size_t counts, so all_reduce_sum and broadcast are one call each, and
// max_count() is INT64_MAX / 2 (no practical limit; the halving keeps the base class's sums of a
// block and its displacement from overflowing).
//
// Errors: bad arguments are caught before any NCCL call, on every rank alike
// (core/communicator.hpp's agreement, which runs over this communicator: one tiny device
// all-reduce). Every NCCL or CUDA call is checked; a failure throws graphmoe::Error naming the
// operation, the call and ncclGetErrorString (or the CUDA error's name and string), on the rank
// where it failed. After each operation the communicator also asks NCCL for asynchronous errors
// (ncclCommGetAsyncError: a network failure, a peer whose connection broke) while it waits for the
// stream. On any transport error the communicator aborts its NCCL communicator (ncclCommAbort:
// NCCL's kernels stop and its resources are freed, so this rank does not wait forever) and is
// broken: every later operation throws, and the job should end (as with MPI).
//
// A peer that dies: NCCL itself has no time limit on a collective. The other ranks' kernels keep
// waiting for the dead rank's data; a network transport may report the broken connection as an
// asynchronous error (how soon depends on the transport: InfiniBand retries for NCCL_IB_TIMEOUT /
// NCCL_IB_RETRY_CNT first), but peers on the same node (shared memory, NVLink) can wait forever.
// Options::timeout turns that into an Error: an operation that has not finished after that long
// aborts the communicator and throws (off by default: 0 waits forever, as NCCL does). Under MPI,
// an exception that leaves main through MpiEnvironment then ends the job (MPI_Abort).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/communicator.hpp"

namespace graphmoe::dist {

namespace detail {

inline ncclDataType_t nccl_type(ElementType type) {
  switch (type) {
    case ElementType::F32:
      return ncclFloat32;
    case ElementType::F64:
      return ncclFloat64;
    case ElementType::I32:
      return ncclInt32;
    case ElementType::I64:
      return ncclInt64;
  }
  ::graphmoe::detail::throw_error("dist::NcclCommunicator", "unknown element type ",
                                  static_cast<int>(type));
}

// "graphmoe::<op>: <call> failed: <ncclGetErrorString> (ncclResult_t <rc>)[: <ncclGetLastError>]"
[[noreturn]] inline void throw_nccl_error(const char* op, const char* call, ncclResult_t rc,
                                          ncclComm_t comm) {
  std::string last;
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21300
  if (const char* text = ncclGetLastError(comm); text != nullptr && text[0] != '\0') {
    last = std::string(": ") + text;
  }
#else
  (void)comm;
#endif
  ::graphmoe::detail::throw_error(op, call, " failed: ", ncclGetErrorString(rc), " (ncclResult_t ",
                                  static_cast<int>(rc), ")", last);
}

[[noreturn]] inline void throw_cuda_call_error(const char* op, const char* call, cudaError_t err) {
  ::graphmoe::detail::throw_error(op, call, " failed: ", cudaGetErrorName(err), ": ",
                                  cudaGetErrorString(err));
}

}  // namespace detail

struct NcclCommunicatorOptions {
  // How long one operation may wait for its stream before the communicator aborts and throws
  // (a peer that died, a rank that never entered the collective). 0: wait forever (NCCL's own
  // behaviour). Should be the same on every rank; not checked.
  std::chrono::milliseconds timeout{0};
};

class NcclCommunicator final : public Communicator {
 public:
  using Options = NcclCommunicatorOptions;

  // A fresh NCCL unique id (ncclGetUniqueId): call it on ONE rank and hand the 128 bytes to every
  // other rank (over() does that through a host communicator).
  static ncclUniqueId unique_id() {
    ncclUniqueId id{};
    if (const ncclResult_t rc = ncclGetUniqueId(&id); rc != ncclSuccess) {
      detail::throw_nccl_error("dist::NcclCommunicator", "ncclGetUniqueId", rc, nullptr);
    }
    return id;
  }

  // Rank `rank` of `size` (ncclCommInitRank, collective: every rank calls it with the same id) on
  // the calling thread's current device; the collectives run on `stream` (not owned).
  NcclCommunicator(const ncclUniqueId& id, int rank, int size,
                   cudaStream_t stream = ::graphmoe::cuda_stream(), Options options = {})
      : stream_(stream), options_(options), rank_(rank), size_(size),
        uncaught_at_start_(std::uncaught_exceptions()) {
    const char* op = "dist::NcclCommunicator";
    GRAPHMOE_CHECK(size >= 1, op, "the world size is ", size, "; it must be at least 1");
    GRAPHMOE_CHECK(0 <= rank && rank < size, op, "rank ", rank, " is out of range for ", size,
                   " ranks");
    GRAPHMOE_CHECK(options.timeout.count() >= 0, op, "Options::timeout is negative (",
                   options.timeout.count(), " ms); 0 waits forever");
    cuda_call(cudaGetDevice(&device_), op, "cudaGetDevice");
    nccl_call(ncclCommInitRank(&comm_, size, id, rank), op, "ncclCommInitRank");
    try {
      reserve_scratch(32, op);
    } catch (...) {
      release();
      throw;
    }
  }

  // The usual bootstrap: rank 0 of `host` (an MpiCommunicator, or any host-memory communicator
  // whose ranks are the GPUs' processes) creates the unique id and broadcasts it through `host`;
  // then every rank joins with host.rank() and host.size(). Collective over `host`. When rank 0
  // cannot create the id, every rank throws (no rank waits in ncclCommInitRank).
  static NcclCommunicator over(Communicator& host, cudaStream_t stream = ::graphmoe::cuda_stream(),
                               Options options = {}) {
    const char* op = "dist::NcclCommunicator::over";
    GRAPHMOE_CHECK(host.memory_space() == MemorySpace::Host, op,
                   "the bootstrap communicator must move host memory (e.g. an MpiCommunicator)");
    static_assert(sizeof(ncclUniqueId) % sizeof(std::int64_t) == 0);
    constexpr std::size_t words = sizeof(ncclUniqueId) / sizeof(std::int64_t);
    // [0]: ncclGetUniqueId's result on rank 0; [1 ...]: the id's bytes
    std::vector<std::int64_t> message(1 + words, 0);
    if (host.rank() == 0) {
      ncclUniqueId id{};
      const ncclResult_t rc = ncclGetUniqueId(&id);
      message[0] = static_cast<std::int64_t>(rc);
      if (rc == ncclSuccess) std::memcpy(&message[1], &id, sizeof id);
    }
    host.broadcast(message, 0);
    if (message[0] != static_cast<std::int64_t>(ncclSuccess)) {
      ::graphmoe::detail::throw_error(
          op, "ncclGetUniqueId failed on rank 0: ",
          ncclGetErrorString(static_cast<ncclResult_t>(message[0])), " (ncclResult_t ", message[0],
          ")");
    }
    ncclUniqueId id{};
    std::memcpy(&id, &message[1], sizeof id);
    return NcclCommunicator(id, host.rank(), host.size(), stream, options);
  }

  // Frees the NCCL communicator (ncclCommDestroy) and the scratch buffer. ncclCommAbort instead
  // when the communicator is broken, or when an exception unwinds through this destructor that
  // was not active at construction (the other ranks may never reach their destructor).
  ~NcclCommunicator() override {
    if (comm_ == nullptr) {
      free_scratch();
      return;
    }
    if (std::uncaught_exceptions() > uncaught_at_start_) {
      abort_comm();
    } else {
      release();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MemorySpace memory_space() const override { return MemorySpace::Device; }
  index_t max_count() const override { return std::numeric_limits<index_t>::max() / 2; }

  // The NCCL communicator (owned; nullptr once aborted), the stream, the device.
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // True after a transport error or a timeout aborted the communicator.
  bool broken() const { return comm_ == nullptr; }

  // A one-element all-reduce on the device, then the stream is waited for.
  void barrier() override {
    const char* op = "dist::barrier";
    require_usable(op);
    reserve_scratch(1, op);
    cuda_call(cudaMemsetAsync(scratch_, 0, sizeof(std::int64_t), stream_), op, "cudaMemsetAsync");
    nccl_call(ncclAllReduce(scratch_, scratch_, 1, ncclInt64, ncclSum, comm_, stream_), op,
              "ncclAllReduce (barrier)");
    wait(op);
  }

 protected:
  void all_reduce_sum_impl(void* data, index_t count, ElementType type) override {
    const char* op = "dist::all_reduce_sum";
    require_usable(op);
    nccl_call(ncclAllReduce(data, data, static_cast<std::size_t>(count), detail::nccl_type(type),
                            ncclSum, comm_, stream_),
              op, "ncclAllReduce");
    wait(op);
  }

  void broadcast_impl(void* data, index_t count, ElementType type, int root) override {
    const char* op = "dist::broadcast";
    require_usable(op);
    nccl_call(ncclBroadcast(data, data, static_cast<std::size_t>(count), detail::nccl_type(type),
                            root, comm_, stream_),
              op, "ncclBroadcast");
    wait(op);
  }

  void all_to_all_v_impl(const void* send, const index_t* send_counts, const index_t* send_displs,
                         void* recv, const index_t* recv_counts, const index_t* recv_displs,
                         ElementType type) override {
    const char* op = "dist::all_to_all_v";
    require_usable(op);
    send_recv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type, op);
    wait(op);
  }

  // The host values go to a device scratch buffer, are all-reduced (ncclMin, int64) and come back.
  void min_over_ranks(std::span<std::int64_t> values) override {
    const char* op = "dist::NcclCommunicator";
    require_usable(op);
    if (values.empty()) return;
    reserve_scratch(values.size(), op);
    const std::size_t bytes = values.size_bytes();
    cuda_call(cudaMemcpyAsync(scratch_, values.data(), bytes, cudaMemcpyHostToDevice, stream_), op,
              "cudaMemcpyAsync (argument agreement, to the device)");
    nccl_call(ncclAllReduce(scratch_, scratch_, values.size(), ncclInt64, ncclMin, comm_, stream_),
              op, "ncclAllReduce (argument agreement)");
    cuda_call(cudaMemcpyAsync(values.data(), scratch_, bytes, cudaMemcpyDeviceToHost, stream_), op,
              "cudaMemcpyAsync (argument agreement, to the host)");
    wait(op);
  }

  // exchange_counts / all_gather: the host counts through device scratch (send in the first
  // size() words, recv in the next), one element to and from every rank.
  void exchange_host_counts(const index_t* send, index_t* recv) override {
    const char* op = "dist::exchange_counts";
    require_usable(op);
    const std::size_t p = static_cast<std::size_t>(size_);
    reserve_scratch(2 * p, op);
    std::vector<index_t> ones(p, 1), displs(p);
    for (std::size_t j = 0; j < p; ++j) displs[j] = static_cast<index_t>(j);
    const std::size_t bytes = p * sizeof(index_t);
    cuda_call(cudaMemcpyAsync(scratch_, send, bytes, cudaMemcpyHostToDevice, stream_), op,
              "cudaMemcpyAsync (counts, to the device)");
    send_recv(scratch_, ones.data(), displs.data(), scratch_ + p, ones.data(), displs.data(),
              ElementType::I64, op);
    cuda_call(cudaMemcpyAsync(recv, scratch_ + p, bytes, cudaMemcpyDeviceToHost, stream_), op,
              "cudaMemcpyAsync (counts, to the host)");
    wait(op);
  }

 private:
  // ncclGroupStart, one ncclSend / ncclRecv per peer with a non-zero count, ncclGroupEnd
  // (enqueued on the stream; the caller waits).
  void send_recv(const void* send, const index_t* send_counts, const index_t* send_displs,
                 void* recv, const index_t* recv_counts, const index_t* recv_displs,
                 ElementType type, const char* op) {
    const ncclDataType_t t = detail::nccl_type(type);
    const std::size_t es = element_size(type);
    const auto* s = static_cast<const char*>(send);
    auto* r = static_cast<char*>(recv);
    bool any = false;
    for (int j = 0; j < size_; ++j) any = any || send_counts[j] > 0 || recv_counts[j] > 0;
    if (!any) return;
    nccl_call(ncclGroupStart(), op, "ncclGroupStart");
    // Every call of the group is made, so that the group is closed even after a failure; the
    // first failure is reported.
    ncclResult_t first = ncclSuccess;
    const char* first_call = "";
    const auto note = [&](ncclResult_t rc, const char* call) {
      if (rc != ncclSuccess && first == ncclSuccess) {
        first = rc;
        first_call = call;
      }
    };
    for (int j = 0; j < size_; ++j) {
      if (send_counts[j] > 0) {
        note(ncclSend(s + static_cast<std::size_t>(send_displs[j]) * es,
                      static_cast<std::size_t>(send_counts[j]), t, j, comm_, stream_),
             "ncclSend");
      }
      if (recv_counts[j] > 0) {
        note(ncclRecv(r + static_cast<std::size_t>(recv_displs[j]) * es,
                      static_cast<std::size_t>(recv_counts[j]), t, j, comm_, stream_),
             "ncclRecv");
      }
    }
    note(ncclGroupEnd(), "ncclGroupEnd");
    if (first != ncclSuccess) fail_nccl(op, first_call, first);
  }

  void require_usable(const char* op) const {
    GRAPHMOE_CHECK(comm_ != nullptr, op,
                   "the NCCL communicator was aborted after an earlier error (",
                   failure_.empty() ? std::string("see that error") : failure_,
                   "); create a new one (all ranks) or end the job");
  }

  void nccl_call(ncclResult_t rc, const char* op, const char* call) {
    if (rc != ncclSuccess) fail_nccl(op, call, rc);
  }

  void cuda_call(cudaError_t err, const char* op, const char* call) {
    if (err == cudaSuccess) return;
    (void)cudaGetLastError();  // a non-sticky error is consumed here, reported below
    try {
      detail::throw_cuda_call_error(op, call, err);
    } catch (const Error& e) {
      failure_ = e.what();
      abort_comm();
      throw;
    }
  }

  // Reports a failed NCCL call: aborts the communicator (the other ranks may be in the same
  // collective, and this one's state is not to be trusted) and throws.
  [[noreturn]] void fail_nccl(const char* op, const char* call, ncclResult_t rc) {
    try {
      detail::throw_nccl_error(op, call, rc, comm_);
    } catch (const Error& e) {
      failure_ = e.what();
      abort_comm();
      throw;
    }
  }

  void check_async(const char* op) {
    ncclResult_t async = ncclSuccess;
    nccl_call(ncclCommGetAsyncError(comm_, &async), op, "ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress) {
      fail_nccl(op, "an earlier NCCL operation (ncclCommGetAsyncError)", async);
    }
  }

  // Waits for the stream, asking NCCL for asynchronous errors meanwhile; aborts after
  // options_.timeout when it is set.
  void wait(const char* op) {
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now();
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) cuda_call(q, op, "cudaStreamQuery");
      check_async(op);
      if (options_.timeout.count() > 0 && clock::now() - start > options_.timeout) {
        try {
          ::graphmoe::detail::throw_error(
              op, "the operation did not finish within Options::timeout = ",
              options_.timeout.count(),
              " ms (a peer that died or never entered the collective?); the NCCL communicator "
              "was aborted");
        } catch (const Error& e) {
          failure_ = e.what();
          abort_comm();
          throw;
        }
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    check_async(op);
  }

  // Makes the device scratch hold at least n int64 values.
  void reserve_scratch(std::size_t n, const char* op) {
    if (n <= scratch_capacity_) return;
    if (scratch_ != nullptr) {
      // pending work may still read it (every operation waits, so nothing is pending)
      cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_capacity_ = 0;
    }
    void* p = nullptr;
    cuda_call(cudaMalloc(&p, n * sizeof(std::int64_t)), op, "cudaMalloc (scratch)");
    scratch_ = static_cast<std::int64_t*>(p);
    scratch_capacity_ = n;
  }

  // Frees everything after a normal end (ncclCommDestroy), ignoring errors.
  void release() noexcept {
    if (comm_ != nullptr) {
      (void)ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
    free_scratch();
  }

  // ncclCommAbort: stops NCCL's pending kernels and frees the communicator (never throws).
  void abort_comm() noexcept {
    if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    free_scratch();
  }

  void free_scratch() noexcept {
    if (scratch_ != nullptr) {
      (void)cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_capacity_ = 0;
    }
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  Options options_;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  int uncaught_at_start_ = 0;
  std::int64_t* scratch_ = nullptr;
  std::size_t scratch_capacity_ = 0;
  std::string failure_;
};

}  // namespace graphmoe::dist
