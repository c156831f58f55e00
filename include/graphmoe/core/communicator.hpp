// graphmoe/core/communicator.hpp: the collectives the library programs against, and
// SelfCommunicator (one process, no MPI).
//
// Communicator is an abstract interface. Data parallelism will all-reduce a ParameterArena's one
// contiguous grads() buffer; expert parallelism will all-to-all-v token rows. Implementations:
//   SelfCommunicator  world size 1, host memory, always available (this header)
//   MpiCommunicator   an MPI communicator, host memory (graphmoe/dist/mpi.hpp, needs MPI)
//   NcclCommunicator  NCCL, device memory (graphmoe/backend/cuda/nccl.cuh, needs CUDA and NCCL)
// The core of every operation is a raw pointer, an element count and an ElementType, and this
// class reads the data only through the implementation (it checks counts, never dereferences
// buffers), so device pointers fit. Typed overloads for float, double, int32 and int64 ranges and
// Tensor<T, cpu> sit on top.
//
// Collective contract (every operation but rank() / size() / memory_space()):
// - every rank calls the same operations in the same order (as in MPI);
// - counts are in elements; all_to_all_v lays out the blocks for (from) ranks 0, 1, ... one after
//   the other in rank order, with no gaps;
// - arguments are checked on every rank, and the ranks then agree on the outcome with one small
//   extra reduction (Communicator::agree): if any rank's arguments are bad, or the ranks passed
//   different element counts, types or roots, EVERY rank throws graphmoe::Error (the bad rank
//   names its own problem, the others name the rank that failed), so no rank is left waiting in a
//   collective that the others never enter. After such an Error the communicator is still usable.
// - errors reported by the transport itself (an MPI call that fails) are thrown on the rank where
//   they happen; afterwards the communicator is broken (the MPI standard leaves its state
//   undefined), and the job should end (see graphmoe/dist/mpi.hpp, MpiEnvironment).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ranges>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe::dist {

// The element types the collectives move. Sums are in the element type itself (integer sums
// wrap as the transport's do; float sums are rounded in an order each transport chooses).
enum class ElementType : std::int32_t { F32, F64, I32, I64 };

inline const char* element_type_name(ElementType t) {
  switch (t) {
    case ElementType::F32:
      return "float32";
    case ElementType::F64:
      return "float64";
    case ElementType::I32:
      return "int32";
    case ElementType::I64:
      return "int64";
  }
  return "unknown";
}

inline std::size_t element_size(ElementType t) {
  switch (t) {
    case ElementType::F32:
      return 4;
    case ElementType::F64:
      return 8;
    case ElementType::I32:
      return 4;
    case ElementType::I64:
      return 8;
  }
  ::graphmoe::detail::throw_error("dist::element_size", "unknown element type ",
                                  static_cast<int>(t));
}

// float, double, std::int32_t, std::int64_t.
template <class T>
concept CommElement = std::same_as<T, float> || std::same_as<T, double> ||
    std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t>;

template <CommElement T>
inline constexpr ElementType element_type_of = std::same_as<T, float>          ? ElementType::F32
                                               : std::same_as<T, double>       ? ElementType::F64
                                               : std::same_as<T, std::int32_t> ? ElementType::I32
                                                                               : ElementType::I64;

// A contiguous sized range of CommElement (std::vector, std::array, std::span, ...) ...
template <class R>
concept CommRange = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    CommElement<std::remove_cv_t<std::ranges::range_value_t<R>>>;
// ... whose elements can be written (for in-place operations and receive buffers).
template <class R>
concept MutableCommRange =
    CommRange<R> && !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

// Where a communicator's buffers live: host memory (Self, MPI) or device memory (NCCL,
// graphmoe/backend/cuda/nccl.cuh). The Tensor<T, cpu> overloads refuse a communicator whose memory is
// not host.
enum class MemorySpace { Host, Device };

// What a communicator was asked to move, counted by its public operations: the payload bytes
// this rank hands the transport (all-reduce and broadcast: the buffer; all-to-all-v: the blocks
// sent and received), not what the transport's algorithm puts on the wire (a ring all-reduce of
// N bytes over W ranks sends and receives 2 (W - 1) / W x N per rank). The argument agreement's
// few integers per operation and the count exchanges are counted apart.
struct Traffic {
  std::int64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  std::int64_t broadcast_calls = 0, broadcast_bytes = 0;
  std::int64_t all_to_all_calls = 0, all_to_all_sent_bytes = 0, all_to_all_received_bytes = 0;
  std::int64_t count_exchange_calls = 0, count_exchange_bytes = 0;  // exchange_counts, all_gather
  std::int64_t agreement_calls = 0, agreement_bytes = 0;
};

class Communicator {
 public:
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // The largest element count the transport takes in one all_to_all_v block or displacement
  // (MPI: INT_MAX). all_reduce_sum and broadcast have no such limit: implementations split them.
  virtual index_t max_count() const = 0;

  virtual void barrier() = 0;

  // The bytes moved since construction or the last reset_traffic() (this rank's view).
  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = Traffic{}; }

  // ---- raw (pointer, element count, element type): the form every implementation provides ----

  // In place: data[i] = sum over ranks of data[i], i < count. count equal on every rank.
  void all_reduce_sum(void* data, index_t count, ElementType type) {
    const char* op = "dist::all_reduce_sum";
    std::string bad = check_buffer("data", data, count);
    agree(op, bad, {static_cast<std::int64_t>(type), count, max_count()},
          {"element type", "element count", "max_count() value"});
    if (count > 0) {
      all_reduce_sum_impl(data, count, type);
      ++traffic_.all_reduce_calls;
      traffic_.all_reduce_bytes += count * static_cast<index_t>(element_size(type));
    }
  }

  // data on every rank := data on rank `root`. count equal on every rank.
  void broadcast(void* data, index_t count, ElementType type, int root) {
    const char* op = "dist::broadcast";
    std::string bad = check_buffer("data", data, count);
    if (bad.empty() && (root < 0 || root >= size())) {
      bad = "root " + std::to_string(root) + " is out of range for " + std::to_string(size()) +
            " ranks";
    }
    agree(op, bad, {static_cast<std::int64_t>(type), count, root, max_count()},
          {"element type", "element count", "root", "max_count() value"});
    if (count > 0) {
      broadcast_impl(data, count, type, root);
      ++traffic_.broadcast_calls;
      traffic_.broadcast_bytes += count * static_cast<index_t>(element_size(type));
    }
  }

  // Rank r sends send[displ_j, displ_j + send_counts[j]) to rank j (displ_j: the sum of
  // send_counts[0..j)) and receives recv_counts[i] elements from rank i into recv, laid out the
  // same way. send_counts and recv_counts have one entry per rank; send_size / recv_size are the
  // buffers' lengths in elements (the counts may sum to less). recv_counts[i] on rank r must equal
  // send_counts[r] on rank i: pass what the peers send, or use exchange_counts() first (the typed
  // overloads without recv_counts do that). The buffers must not overlap.
  void all_to_all_v(const void* send, index_t send_size, std::span<const index_t> send_counts,
                    void* recv, index_t recv_size, std::span<const index_t> recv_counts,
                    ElementType type) {
    const char* op = "dist::all_to_all_v";
    std::vector<index_t> send_displs, recv_displs;
    std::string bad = check_buffer("send", send, send_size);
    if (bad.empty()) bad = check_buffer("recv", recv, recv_size);
    if (bad.empty()) bad = check_counts("send_counts", send_counts, send_size, send_displs);
    if (bad.empty()) bad = check_counts("recv_counts", recv_counts, recv_size, recv_displs);
    if (bad.empty() && send_size > 0 && recv_size > 0) {
      if (overlap(send, send_size, recv, recv_size, element_size(type))) {
        bad = "the send and receive buffers overlap";
      }
    }
    agree(op, bad, {static_cast<std::int64_t>(type)}, {"element type"});
    all_to_all_v_impl(send, send_counts.data(), send_displs.data(), recv, recv_counts.data(),
                      recv_displs.data(), type);
    const auto esize = static_cast<index_t>(element_size(type));
    ++traffic_.all_to_all_calls;
    for (index_t c : send_counts) traffic_.all_to_all_sent_bytes += c * esize;
    for (index_t c : recv_counts) traffic_.all_to_all_received_bytes += c * esize;
  }

  // ---- counts and single values ----

  // recv_counts[i] = send_counts[rank()] on rank i: what each rank will send to this one.
  // Each count must be >= 0, and there must be one per rank (checked and agreed on as above).
  std::vector<index_t> exchange_counts(std::span<const index_t> send_counts) {
    std::string bad;
    if (send_counts.size() != static_cast<std::size_t>(size())) {
      bad = "send_counts has " + std::to_string(send_counts.size()) + " entries for " +
            std::to_string(size()) + " ranks";
    } else {
      for (std::size_t j = 0; j < send_counts.size() && bad.empty(); ++j) {
        if (send_counts[j] < 0) {
          bad = "send_counts[" + std::to_string(j) + "] = " + std::to_string(send_counts[j]) +
                " is negative";
        }
      }
    }
    agree("dist::exchange_counts", bad, {}, {});
    return one_from_each(send_counts.data());
  }

  // result[i] = value on rank i.
  std::vector<index_t> all_gather(index_t value) {
    const std::vector<index_t> send(static_cast<std::size_t>(size()), value);
    return one_from_each(send.data());
  }

  // ---- typed: contiguous ranges (std::vector, std::span, std::array) ----

  template <class R>
  requires MutableCommRange<R>
  void all_reduce_sum(R&& data) {
    using T = std::ranges::range_value_t<R>;
    all_reduce_sum(std::ranges::data(data), size_of(data), element_type_of<T>);
  }

  template <class R>
  requires MutableCommRange<R>
  void broadcast(R&& data, int root) {
    using T = std::ranges::range_value_t<R>;
    broadcast(std::ranges::data(data), size_of(data), element_type_of<T>, root);
  }

  template <class S, class R>
  requires CommRange<S> && MutableCommRange<R> &&
      std::same_as<std::remove_cv_t<std::ranges::range_value_t<S>>, std::ranges::range_value_t<R>>
  void all_to_all_v(const S& send, std::span<const index_t> send_counts, R&& recv,
                    std::span<const index_t> recv_counts) {
    using T = std::ranges::range_value_t<R>;
    all_to_all_v(std::ranges::data(send), size_of(send), send_counts, std::ranges::data(recv),
                 size_of(recv), recv_counts, element_type_of<T>);
  }

  // Exchanges the counts first (exchange_counts), then the data: returns what this rank
  // received, and in recv_counts how much came from each rank. Host-memory communicators only
  // (the result is a std::vector).
  template <class S>
  requires CommRange<S> std::vector<std::remove_cv_t<std::ranges::range_value_t<S>>> all_to_all_v(
      const S& send, std::span<const index_t> send_counts, std::vector<index_t>& recv_counts) {
    using T = std::remove_cv_t<std::ranges::range_value_t<S>>;
    GRAPHMOE_CHECK(memory_space() == MemorySpace::Host, "dist::all_to_all_v",
                   "this overload returns its result in host memory (a std::vector); with a "
                   "communicator whose buffers are in device memory, call exchange_counts and "
                   "pass a device receive buffer");
    recv_counts = exchange_counts(send_counts);
    std::vector<T> recv(static_cast<std::size_t>(checked_sum(recv_counts)));
    all_to_all_v(send, send_counts, recv, recv_counts);
    return recv;
  }

  // ---- typed: CPU tensors (a ParameterArena's grads(), token rows), all elements in order ----

  template <CommElement T>
  void all_reduce_sum(const Tensor<T, cpu>& t) {
    require_host("dist::all_reduce_sum");
    all_reduce_sum(t.data(), t.numel(), element_type_of<T>);
  }

  template <CommElement T>
  void broadcast(const Tensor<T, cpu>& t, int root) {
    require_host("dist::broadcast");
    broadcast(t.data(), t.numel(), element_type_of<T>, root);
  }

  template <CommElement T>
  void all_to_all_v(const Tensor<T, cpu>& send, std::span<const index_t> send_counts,
                    const Tensor<T, cpu>& recv, std::span<const index_t> recv_counts) {
    require_host("dist::all_to_all_v");
    all_to_all_v(send.data(), send.numel(), send_counts, recv.data(), recv.numel(), recv_counts,
                 element_type_of<T>);
  }

  // Counts exchanged first; returns a 1-D tensor of what this rank received (view it as rows).
  template <CommElement T>
  Tensor<T, cpu> all_to_all_v(const Tensor<T, cpu>& send, std::span<const index_t> send_counts,
                              std::vector<index_t>& recv_counts) {
    require_host("dist::all_to_all_v");
    recv_counts = exchange_counts(send_counts);
    Tensor<T, cpu> recv(Shape{checked_sum(recv_counts)});
    all_to_all_v(send, send_counts, recv, recv_counts);
    return recv;
  }

 protected:
  // The transport. Called only after every rank's arguments were checked and agreed on: counts
  // are >= 0 (all_reduce_sum_impl and broadcast_impl get count > 0, equal on every rank; they
  // split counts above what the transport takes), all_to_all_v's blocks and displacements are
  // <= max_count() and lie within the buffers.
  virtual void all_reduce_sum_impl(void* data, index_t count, ElementType type) = 0;
  virtual void broadcast_impl(void* data, index_t count, ElementType type, int root) = 0;
  virtual void all_to_all_v_impl(const void* send, const index_t* send_counts,
                                 const index_t* send_displs, void* recv, const index_t* recv_counts,
                                 const index_t* recv_displs, ElementType type) = 0;
  // In place, values[i] := the minimum over ranks of values[i] (a tiny all-reduce).
  virtual void min_over_ranks(std::span<std::int64_t> values) = 0;
  // The count exchange behind exchange_counts and all_gather: recv[i] := send[rank()] on rank i.
  // send and recv are HOST arrays of size() index_t (the counts the library reads on the host),
  // whatever memory_space() says. The default moves them with all_to_all_v_impl, right for a
  // host-memory transport; a device-memory transport (NcclCommunicator) stages them through
  // device memory.
  virtual void exchange_host_counts(const index_t* send, index_t* recv) {
    const std::size_t p = static_cast<std::size_t>(size());
    std::vector<index_t> ones(p, 1), displs(p);
    for (std::size_t j = 0; j < p; ++j) displs[j] = static_cast<index_t>(j);
    all_to_all_v_impl(send, ones.data(), displs.data(), recv, ones.data(), displs.data(),
                      ElementType::I64);
  }

 private:
  template <class R>
  static index_t size_of(const R& r) {
    return static_cast<index_t>(std::ranges::size(r));
  }

  void require_host(const char* op) const {
    GRAPHMOE_CHECK(memory_space() == MemorySpace::Host, op,
                   "a Tensor<T, cpu> (host memory) was given to a communicator whose buffers are "
                   "in device memory");
  }

  // recv[i] = send[rank()] on rank i (send and recv hold one index_t per rank).
  std::vector<index_t> one_from_each(const index_t* send) {
    const std::size_t p = static_cast<std::size_t>(size());
    std::vector<index_t> recv(p, 0);
    exchange_host_counts(send, recv.data());
    ++traffic_.count_exchange_calls;
    traffic_.count_exchange_bytes += static_cast<index_t>(p * sizeof(index_t));
    return recv;
  }

  static bool overlap(const void* a, index_t a_count, const void* b, index_t b_count,
                      std::size_t element_bytes) {
    const auto end_of = [element_bytes](std::uintptr_t begin, index_t count) {
      const auto n = static_cast<std::uintptr_t>(count);
      const std::uintptr_t room = std::numeric_limits<std::uintptr_t>::max() - begin;
      return n > room / element_bytes ? std::numeric_limits<std::uintptr_t>::max()
                                      : begin + n * element_bytes;
    };
    const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
    return pa < end_of(pb, b_count) && pb < end_of(pa, a_count);
  }

  static index_t checked_sum(std::span<const index_t> counts) {
    index_t total = 0;
    for (index_t c : counts) {
      GRAPHMOE_CHECK(c >= 0 && total <= std::numeric_limits<index_t>::max() - c,
                     "dist::all_to_all_v", "received counts are negative or overflow");
      total += c;
    }
    return total;
  }

  static std::string check_buffer(const char* what, const void* data, index_t count) {
    if (count < 0)
      return std::string(what) + " has a negative element count " + std::to_string(count);
    if (count > 0 && data == nullptr) {
      return std::string(what) + " is a null pointer with " + std::to_string(count) + " elements";
    }
    return {};
  }

  // One count per rank, each >= 0 and <= max_count(), their displacements <= max_count(), and the
  // total <= buffer_size. Fills displs (the exclusive prefix sums).
  std::string check_counts(const char* what, std::span<const index_t> counts, index_t buffer_size,
                           std::vector<index_t>& displs) const {
    std::ostringstream os;
    if (counts.size() != static_cast<std::size_t>(size())) {
      os << what << " has " << counts.size() << " entries for " << size() << " ranks";
      return os.str();
    }
    displs.assign(counts.size(), 0);
    index_t total = 0;
    for (std::size_t j = 0; j < counts.size(); ++j) {
      const index_t c = counts[j];
      if (c < 0) {
        os << what << "[" << j << "] = " << c << " is negative";
        return os.str();
      }
      if (c > max_count() || total > max_count()) {
        os << what << "[" << j << "] = " << c << " at displacement " << total
           << " exceeds what the transport takes in one block (" << max_count()
           << " elements; MPI counts and displacements are int)";
        return os.str();
      }
      displs[j] = total;
      total += c;  // <= 2 * max_count(), no overflow
      if (total > buffer_size) {
        os << what << " sum to at least " << total << " elements (through rank " << j
           << ") but the buffer holds " << buffer_size;
        return os.str();
      }
    }
    return {};
  }

  // The ranks agree: `bad` is this rank's complaint (empty when its arguments are fine); `same`
  // are values every rank must pass equally (named by `names`). Throws on every rank when any
  // rank complained or the values differ.
  void agree(const char* op, const std::string& bad, std::initializer_list<std::int64_t> same,
             std::initializer_list<const char*> names) {
    constexpr std::int64_t kFine = std::numeric_limits<std::int64_t>::max();
    std::vector<std::int64_t> v;
    v.reserve(1 + 2 * same.size());
    v.push_back(bad.empty() ? kFine : rank());
    for (std::int64_t x : same) {
      v.push_back(x);
      v.push_back(-x);  // the minimum of -x is minus the maximum of x
    }
    min_over_ranks(v);
    ++traffic_.agreement_calls;
    traffic_.agreement_bytes += static_cast<index_t>(v.size() * sizeof(std::int64_t));
    if (!bad.empty()) {
      ::graphmoe::detail::throw_error(op, bad, " (rank ", rank(), " of ", size(), ")");
    }
    if (v[0] != kFine) {
      ::graphmoe::detail::throw_error(op, "rank ", v[0], " of ", size(),
                                      " passed invalid arguments (its own error says which); rank ",
                                      rank(), "'s were valid, and no data moved");
    }
    std::size_t i = 1;
    for (const char* name : names) {
      const std::int64_t lo = v[i], hi = -v[i + 1];
      if (lo != hi) {
        ::graphmoe::detail::throw_error(op, "the ranks passed different ", name, "s (from ", lo,
                                        " to ", hi,
                                        "); every rank must pass the same; no data moved");
      }
      i += 2;
    }
  }

  Traffic traffic_;
};

// World size 1: rank 0, host memory. all_reduce_sum and broadcast leave the data as it is;
// all_to_all_v copies the one block to itself. Checks arguments exactly as every communicator
// does (so single-process code paths meet the same errors as distributed ones).
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  MemorySpace memory_space() const override { return MemorySpace::Host; }
  index_t max_count() const override { return std::numeric_limits<index_t>::max() / 2; }
  void barrier() override {}

 protected:
  void all_reduce_sum_impl(void*, index_t, ElementType) override {}
  void broadcast_impl(void*, index_t, ElementType, int) override {}
  void all_to_all_v_impl(const void* send, const index_t* send_counts, const index_t*, void* recv,
                         const index_t* recv_counts, const index_t*, ElementType type) override {
    GRAPHMOE_CHECK(send_counts[0] == recv_counts[0], "dist::all_to_all_v",
                   "SelfCommunicator sends ", send_counts[0], " elements to itself but expects ",
                   recv_counts[0]);
    if (send_counts[0] > 0) {
      std::memcpy(recv, send, static_cast<std::size_t>(send_counts[0]) * element_size(type));
    }
  }
  void min_over_ranks(std::span<std::int64_t>) override {}
};

}  // namespace graphmoe::dist
