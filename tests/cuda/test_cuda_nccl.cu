// test_cuda_nccl: NcclCommunicator (graphmoe/backend/cuda/nccl.cuh) with one rank on one GPU.
//
// Built when graphmoe::nccl exists (CUDA and NCCL): compiling and linking it instantiates every
// typed operation of the header, which is the check that runs without a GPU. Without a CUDA device
// the program prints "skipped: no CUDA device" and exits with 77, which ctest reports as skipped
// (SKIP_RETURN_CODE). With one, every collective runs on device buffers against the expected host
// values (world size 1: a sum or a broadcast leaves the data as it is, all_to_all_v copies the one
// block), and the argument errors are checked to be raised before any NCCL call (the
// communicator is not aborted by them and works afterwards).
//
// The same file runs in CI as test_emu_cuda_nccl: compiled by the C++ compiler on the CUDA
// emulation (tests/cuda/emulation), linked against the emulated one-rank NCCL
// (tests/cuda/emulation/nccl.cpp) instead of libnccl.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/nccl.cuh"

using graphmoe::Error;
using graphmoe::index_t;
using graphmoe::dist::ElementType;
using graphmoe::dist::MemorySpace;
using graphmoe::dist::NcclCommunicator;

namespace {

// cudaMalloc'd memory holding a copy of `host`; back() copies it to the host.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : n_(host.size()) {
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, (n_ == 0 ? 1 : n_) * sizeof(T)) == cudaSuccess);
    data_ = static_cast<T*>(p);
    if (n_ > 0) {
      REQUIRE(cudaMemcpy(data_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) ==
              cudaSuccess);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }

  T* data() const { return data_; }
  std::span<T> span() const { return {data_, n_}; }
  index_t size() const { return static_cast<index_t>(n_); }
  std::vector<T> back() const {
    std::vector<T> host(n_);
    if (n_ > 0) {
      REQUIRE(cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost) ==
              cudaSuccess);
    }
    return host;
  }

 private:
  std::size_t n_;
  T* data_ = nullptr;
};

template <class T>
std::vector<T> iota(std::size_t n, T first) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(first + static_cast<T>(i) * T(3));
  return v;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

NcclCommunicator make_comm() { return NcclCommunicator(NcclCommunicator::unique_id(), 0, 1); }

// Every typed operation for one element type.
template <class T>
void typed_operations(NcclCommunicator& comm) {
  CAPTURE(graphmoe::dist::element_type_name(graphmoe::dist::element_type_of<T>));
  const std::vector<T> values = iota<T>(37, T(5));

  // all_reduce_sum: typed (a span over device memory) and raw
  DeviceBuffer<T> a(values);
  comm.all_reduce_sum(a.span());
  CHECK(a.back() == values);
  comm.all_reduce_sum(a.data(), a.size(), graphmoe::dist::element_type_of<T>);
  CHECK(a.back() == values);

  // broadcast from rank 0
  DeviceBuffer<T> b(values);
  comm.broadcast(b.span(), 0);
  CHECK(b.back() == values);

  // all_to_all_v: the one block to itself, into a longer receive buffer
  DeviceBuffer<T> send(values);
  DeviceBuffer<T> recv(std::vector<T>(values.size() + 4, T(-1)));
  const std::vector<index_t> counts = {static_cast<index_t>(values.size()) - 2};
  std::span<const T> send_view(send.data(), values.size());
  comm.all_to_all_v(send_view, counts, recv.span(), counts);
  std::vector<T> want(values.begin(), values.end() - 2);
  want.resize(values.size() + 4, T(-1));
  CHECK(recv.back() == want);

  // zero counts: nothing moves (no NCCL call), the receive buffer is untouched
  DeviceBuffer<T> untouched(std::vector<T>(3, T(7)));
  const std::vector<index_t> zero = {0};
  comm.all_to_all_v(std::span<const T>(send.data(), 0), zero, untouched.span(), zero);
  CHECK(untouched.back() == std::vector<T>(3, T(7)));
}

}  // namespace

TEST_CASE("NcclCommunicator: one rank, what it reports") {
  NcclCommunicator comm = make_comm();
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  CHECK(comm.memory_space() == MemorySpace::Device);
  CHECK(comm.max_count() == std::numeric_limits<index_t>::max() / 2);
  CHECK(comm.stream() == graphmoe::cuda_stream());
  CHECK(comm.device() == graphmoe::cuda_current_device());
  CHECK(comm.comm() != nullptr);
  CHECK_FALSE(comm.broken());
  comm.barrier();
}

TEST_CASE("NcclCommunicator: every collective on device buffers, each element type") {
  NcclCommunicator comm = make_comm();
  typed_operations<float>(comm);
  typed_operations<double>(comm);
  typed_operations<std::int32_t>(comm);
  typed_operations<std::int64_t>(comm);
  CHECK_FALSE(comm.broken());
  // 2 all-reduces, 1 broadcast, 2 all-to-alls per type, and what they moved
  const auto& t = comm.traffic();
  CHECK(t.all_reduce_calls == 8);
  CHECK(t.broadcast_calls == 4);
  CHECK(t.all_to_all_calls == 8);
  CHECK(t.all_reduce_bytes == 2 * 37 * (4 + 8 + 4 + 8));
  CHECK(t.all_to_all_sent_bytes == 35 * (4 + 8 + 4 + 8));
  CHECK(t.agreement_calls == 20);  // one per operation: the device min-reduction of the checks
}

TEST_CASE("NcclCommunicator: counts through the device (exchange_counts, all_gather)") {
  NcclCommunicator comm = make_comm();
  CHECK(comm.exchange_counts(std::vector<index_t>{12345678901}) ==
        std::vector<index_t>{12345678901});
  CHECK(comm.all_gather(-42) == std::vector<index_t>{-42});
  CHECK(comm.traffic().count_exchange_calls == 2);
}

TEST_CASE("NcclCommunicator: argument errors are raised before any NCCL call") {
  NcclCommunicator comm = make_comm();
  DeviceBuffer<float> d(std::vector<float>(8, 1.0f));
  const std::vector<index_t> one = {4}, two = {2, 2}, negative = {-1}, too_many = {9};

  // Each message is the base class's (the agreement ran over this communicator's device
  // min-reduction and named rank 0's own problem); no collective ran and nothing was aborted.
  CHECK(contains(error_of([&] { comm.all_reduce_sum(d.data(), -3, ElementType::F32); }),
                 "data has a negative element count -3 (rank 0 of 1)"));
  CHECK(contains(error_of([&] { comm.all_reduce_sum(nullptr, 4, ElementType::F32); }),
                 "data is a null pointer with 4 elements"));
  CHECK(contains(error_of([&] { comm.broadcast(d.span(), 1); }),
                 "root 1 is out of range for 1 ranks"));
  CHECK(contains(error_of([&] { comm.all_to_all_v(d.data(), 8, two, d.data() + 0, 8, one,
                                                   ElementType::F32); }),
                 "send_counts has 2 entries for 1 ranks"));
  DeviceBuffer<float> r(std::vector<float>(8, 0.0f));
  CHECK(contains(error_of([&] { comm.all_to_all_v(d.data(), 8, negative, r.data(), 8, one,
                                                   ElementType::F32); }),
                 "send_counts[0] = -1 is negative"));
  CHECK(contains(error_of([&] { comm.all_to_all_v(d.data(), 8, one, r.data(), 8, too_many,
                                                   ElementType::F32); }),
                 "recv_counts sum to at least 9 elements (through rank 0) but the buffer holds 8"));
  CHECK(contains(error_of([&] { comm.all_to_all_v(d.data(), 8, one, d.data() + 2, 4, one,
                                                   ElementType::F32); }),
                 "the send and receive buffers overlap"));
  CHECK(contains(error_of([&] { (void)comm.exchange_counts(std::vector<index_t>{-5}); }),
                 "send_counts[0] = -5 is negative"));
  const auto& t = comm.traffic();
  CHECK(t.all_reduce_calls == 0);
  CHECK(t.broadcast_calls == 0);
  CHECK(t.all_to_all_calls == 0);
  CHECK(t.count_exchange_calls == 0);
  CHECK(t.agreement_calls == 8);
  CHECK_FALSE(comm.broken());

  // host memory where the communicator's is device memory: refused before any transfer
  graphmoe::Tensor<float, graphmoe::cpu> host_tensor(graphmoe::Shape{4});
  CHECK(contains(error_of([&] { comm.all_reduce_sum(host_tensor); }),
                 "a Tensor<T, cpu> (host memory) was given to a communicator whose buffers are in "
                 "device memory"));
  std::vector<index_t> recv_counts;
  const std::vector<float> host_send(4);
  CHECK(contains(error_of([&] { (void)comm.all_to_all_v(host_send, one, recv_counts); }),
                 "returns its result in host memory"));

  // still usable
  comm.all_reduce_sum(d.span());
  CHECK(d.back() == std::vector<float>(8, 1.0f));
  CHECK_FALSE(comm.broken());
}

TEST_CASE("NcclCommunicator: construction errors") {
  const ncclUniqueId id = NcclCommunicator::unique_id();
  CHECK(contains(error_of([&] { NcclCommunicator c(id, 1, 1); }),
                 "rank 1 is out of range for 1 ranks"));
  CHECK(contains(error_of([&] { NcclCommunicator c(id, 0, 0); }),
                 "the world size is 0; it must be at least 1"));
  NcclCommunicator::Options bad;
  bad.timeout = std::chrono::milliseconds(-1);
  CHECK(contains(error_of([&] { NcclCommunicator c(id, 0, 1, graphmoe::cuda_stream(), bad); }),
                 "Options::timeout is negative"));
}

TEST_CASE("NcclCommunicator::over: the unique id through a host communicator") {
  graphmoe::dist::SelfCommunicator host;
  NcclCommunicator::Options options;
  options.timeout = std::chrono::seconds(60);
  NcclCommunicator comm = NcclCommunicator::over(host, graphmoe::cuda_stream(), options);
  CHECK(comm.size() == 1);
  CHECK(host.traffic().broadcast_calls == 1);  // the 128 bytes and rank 0's result
  DeviceBuffer<double> d(iota<double>(5, 0.5));
  comm.all_reduce_sum(d.span());
  CHECK(d.back() == iota<double>(5, 0.5));
  // a device communicator cannot bootstrap another
  CHECK(contains(error_of([&] { (void)NcclCommunicator::over(comm); }),
                 "the bootstrap communicator must move host memory"));
}

#if defined(GRAPHMOE_CUDA_EMULATION)
// The emulated NCCL refuses pointers outside device allocations, as real NCCL refuses host
// memory (on a GPU, whether a host pointer is refused depends on the system: with HMM or ATS,
// pageable memory can be device-accessible, so this case is checked on the emulation only).
TEST_CASE("NcclCommunicator: a transport error aborts the communicator") {
  NcclCommunicator comm = make_comm();
  std::vector<float> host(4, 1.0f);
  const std::string e = error_of([&] { comm.all_reduce_sum(host.data(), 4, ElementType::F32); });
  CHECK(contains(e, "graphmoe::dist::all_reduce_sum: ncclAllReduce failed: invalid argument"));
  CHECK(comm.broken());
  CHECK(contains(error_of([&] { comm.barrier(); }),
                 "the NCCL communicator was aborted after an earlier error"));
  DeviceBuffer<float> d(host);
  CHECK(contains(error_of([&] { comm.all_reduce_sum(d.span()); }),
                 "the NCCL communicator was aborted after an earlier error"));
}
#endif

int main(int argc, char** argv) {
  if (graphmoe::cuda_device_count() == 0) {
    std::printf("test_cuda_nccl: skipped: no CUDA device\n");
    return 77;  // SKIP_RETURN_CODE (tests/CMakeLists.txt)
  }
  doctest::Context context(argc, argv);
  return context.run();
}
