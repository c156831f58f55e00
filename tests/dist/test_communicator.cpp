// MpiCommunicator under mpiexec (ctest runs it with 2 and with 4 ranks). Every collective is
// checked against what each rank can compute on its own: the data are functions of the sending
// rank, the receiving rank and the index, small enough that float sums are exact in any order.
//
// Every rank runs every test case in the same order. Only CHECK is used (never REQUIRE), so that
// a failed assertion on one rank does not make it skip a collective that the others enter; a
// rank that did would hang the job until ctest's TIMEOUT (and the alarm below) end it.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/dist/mpi.hpp"
#include "support/errors.hpp"

using namespace graphmoe;
using graphmoe::test::contains;
using graphmoe::test::error_of;
using dist::ElementType;
using dist::MpiCommunicator;

namespace {

// The value rank `rank` holds at index i before a reduction or broadcast. Integers stay exact;
// floats are multiples of 1/4 below 2^10, so their sums over 4 ranks are exact in any order.
template <class T>
T value(int rank, index_t i) {
  if constexpr (std::is_same_v<T, std::int64_t>) {
    return (std::int64_t{rank + 1} << 40) + i;  // needs all 64 bits
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>((rank + 1) * 100000 + i);
  } else {
    return static_cast<T>((rank + 1) * 0.25 + static_cast<double>(i % 97));
  }
}

template <class T>
T sum_over_ranks(int size, index_t i) {
  T s = T(0);
  for (int r = 0; r < size; ++r) s += value<T>(r, i);
  return s;
}

// How many elements rank `src` sends to rank `dst`: uneven, with zeros.
index_t count(int src, int dst) { return (src * 3 + dst * 5) % 4 * 3; }

// Element k of the block from `src` to `dst`.
template <class T>
T payload(int src, int dst, index_t k) {
  const std::int64_t base = src * 1000 + dst * 100 + k;
  if constexpr (std::is_same_v<T, std::int64_t>) return (std::int64_t{1} << 40) + base;
  return static_cast<T>(base);
}

// This rank's send buffer for counts c(src, dst), blocks in destination order.
template <class T, class C>
std::vector<T> send_buffer(int me, int size, C c, std::vector<index_t>& send_counts) {
  std::vector<T> send;
  send_counts.assign(static_cast<std::size_t>(size), 0);
  for (int dst = 0; dst < size; ++dst) {
    send_counts[static_cast<std::size_t>(dst)] = c(me, dst);
    for (index_t k = 0; k < c(me, dst); ++k) send.push_back(payload<T>(me, dst, k));
  }
  return send;
}

// Checks that recv holds the blocks from every rank to `me`, in source order.
template <class T, class C>
void check_received(int me, int size, C c, const std::vector<T>& recv) {
  std::size_t at = 0;
  for (int src = 0; src < size; ++src) {
    for (index_t k = 0; k < c(src, me); ++k, ++at) {
      CHECK(at < recv.size());
      if (at < recv.size()) CHECK(recv[at] == payload<T>(src, me, k));
    }
  }
}

}  // namespace

TEST_CASE("MpiCommunicator: rank, size and barrier agree with MPI_COMM_WORLD") {
  MpiCommunicator comm;
  int world_rank = -1, world_size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  CHECK(comm.rank() == world_rank);
  CHECK(comm.size() == world_size);
  CHECK(comm.size() >= 2);
  CHECK(comm.memory_space() == dist::MemorySpace::Host);
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(comm.comm(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);  // a duplicate, not MPI_COMM_WORLD itself
  comm.barrier();
  CHECK(comm.all_gather(10 * comm.rank() + 7) == [&] {
    std::vector<index_t> expected;
    for (int r = 0; r < comm.size(); ++r) expected.push_back(10 * r + 7);
    return expected;
  }());
}

TEST_CASE_TEMPLATE("MpiCommunicator: all_reduce_sum", T, float, double, std::int32_t,
                   std::int64_t) {
  MpiCommunicator comm;
  for (index_t n : {index_t{0}, index_t{1}, index_t{1000}}) {
    std::vector<T> v(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = value<T>(comm.rank(), i);
    comm.all_reduce_sum(v);
    for (index_t i = 0; i < n; ++i) {
      CHECK(v[static_cast<std::size_t>(i)] == sum_over_ranks<T>(comm.size(), i));
    }
  }
}

TEST_CASE_TEMPLATE("MpiCommunicator: broadcast from a non-zero root", T, float, double,
                   std::int32_t, std::int64_t) {
  MpiCommunicator comm;
  for (int root : {comm.size() - 1, 1}) {
    const index_t n = 333;
    auto t = Tensor<T>::zeros(Shape{n});
    for (index_t i = 0; i < n; ++i) t(i) = comm.rank() == root ? value<T>(root, i) : T(-7);
    comm.broadcast(t, root);
    for (index_t i = 0; i < n; ++i) CHECK(t(i) == value<T>(root, i));
  }
}

TEST_CASE_TEMPLATE("MpiCommunicator: all_to_all_v with uneven and zero counts", T, float, double,
                   std::int32_t, std::int64_t) {
  MpiCommunicator comm;
  const int me = comm.rank(), p = comm.size();
  std::vector<index_t> send_counts;
  const std::vector<T> send = send_buffer<T>(me, p, count, send_counts);

  // Receive counts given: what each rank can compute. The receive buffer is longer than needed.
  std::vector<index_t> recv_counts;
  index_t total = 0;
  for (int src = 0; src < p; ++src) {
    recv_counts.push_back(count(src, me));
    total += count(src, me);
  }
  std::vector<T> recv(static_cast<std::size_t>(total) + 5, T(-1));
  comm.all_to_all_v(send, send_counts, recv, recv_counts);
  check_received(me, p, count, recv);
  for (std::size_t i = static_cast<std::size_t>(total); i < recv.size(); ++i)
    CHECK(recv[i] == T(-1));

  // Receive counts exchanged first.
  CHECK(comm.exchange_counts(send_counts) == recv_counts);
  std::vector<index_t> exchanged;
  const std::vector<T> got = comm.all_to_all_v(send, send_counts, exchanged);
  CHECK(exchanged == recv_counts);
  CHECK(got.size() == static_cast<std::size_t>(total));
  check_received(me, p, count, got);
}

TEST_CASE("MpiCommunicator: all_to_all_v where rank 0 sends nothing at all") {
  MpiCommunicator comm;
  const int me = comm.rank(), p = comm.size();
  // Rank 0 sends to nobody (an empty buffer); every other rank sends 2 + dst elements to each.
  const auto c = [](int src, int dst) -> index_t { return src == 0 ? 0 : 2 + dst; };
  std::vector<index_t> send_counts;
  const std::vector<double> send = send_buffer<double>(me, p, c, send_counts);
  CHECK(send.empty() == (me == 0));
  std::vector<index_t> recv_counts;
  const std::vector<double> got = comm.all_to_all_v(send, send_counts, recv_counts);
  CHECK(recv_counts[0] == 0);
  CHECK(got.size() == static_cast<std::size_t>((p - 1) * (2 + me)));
  check_received(me, p, c, got);

  // And nobody sends anything.
  std::vector<float> none;
  const std::vector<index_t> zeros(static_cast<std::size_t>(p), 0);
  comm.all_to_all_v(none, zeros, none, zeros);
  CHECK(comm.exchange_counts(zeros) == zeros);
}

TEST_CASE("MpiCommunicator: all_to_all_v of token rows in tensors") {
  MpiCommunicator comm;
  const int me = comm.rank(), p = comm.size();
  const index_t d = 3;  // row width: counts are rows * d elements
  const auto rows = [](int src, int dst) -> index_t { return (src + 2 * dst) % 3; };
  index_t n = 0;
  std::vector<index_t> send_counts;
  for (int dst = 0; dst < p; ++dst) {
    send_counts.push_back(rows(me, dst) * d);
    n += rows(me, dst);
  }
  Tensor<float> send(Shape{n, d});
  index_t r = 0;
  for (int dst = 0; dst < p; ++dst) {
    for (index_t k = 0; k < rows(me, dst); ++k, ++r) {
      for (index_t j = 0; j < d; ++j) send(r, j) = static_cast<float>(me * 100 + dst * 10 + j);
    }
  }
  std::vector<index_t> recv_counts;
  const Tensor<float> got = comm.all_to_all_v(send, send_counts, recv_counts);
  index_t got_rows = 0;
  for (int src = 0; src < p; ++src) {
    CHECK(recv_counts[static_cast<std::size_t>(src)] == rows(src, me) * d);
    got_rows += rows(src, me);
  }
  CHECK(got.shape() == Shape{got_rows * d});
  const Tensor<float> got2d = got.view(Shape{got_rows, d});
  r = 0;
  for (int src = 0; src < p; ++src) {
    for (index_t k = 0; k < rows(src, me); ++k, ++r) {
      for (index_t j = 0; j < d; ++j) {
        CHECK(got2d(r, j) == static_cast<float>(src * 100 + me * 10 + j));
      }
    }
  }
}

TEST_CASE_TEMPLATE("MpiCommunicator: all_reduce_sum of a ParameterArena's gradients", T, float,
                   double) {
  MpiCommunicator comm;
  ParameterArena<T> arena;
  arena.add("block0.attn.w", Shape{64, 48});
  arena.add("block0.attn.b", Shape{48});
  arena.add("block0.moe.experts.w1", Shape{4, 48, 96});
  arena.add("block0.moe.router.w", Shape{48, 5});
  arena.allocate();
  const Tensor<T>& g = arena.grads();
  for (index_t i = 0; i < g.numel(); ++i) g.data()[i] = value<T>(comm.rank(), i);
  comm.all_reduce_sum(g);
  index_t wrong = 0;
  for (index_t i = 0; i < g.numel(); ++i) wrong += g.data()[i] != sum_over_ranks<T>(comm.size(), i);
  CHECK(wrong == 0);
  CHECK(g.numel() > 20000);
}

TEST_CASE(
    "MpiCommunicator: collectives above max_count are split; all_to_all_v blocks are refused") {
  MpiCommunicator comm(MPI_COMM_WORLD, MpiCommunicator::Options{7});
  CHECK(comm.max_count() == 7);
  std::vector<std::int64_t> v(100);
  for (index_t i = 0; i < 100; ++i)
    v[static_cast<std::size_t>(i)] = value<std::int64_t>(comm.rank(), i);
  comm.all_reduce_sum(v);
  for (index_t i = 0; i < 100; ++i) {
    CHECK(v[static_cast<std::size_t>(i)] == sum_over_ranks<std::int64_t>(comm.size(), i));
  }
  std::vector<float> b(50, comm.rank() == 1 ? 2.5f : 0.0f);
  comm.broadcast(b, 1);
  CHECK(b == std::vector<float>(50, 2.5f));

  // Blocks of 7 pass; a block of 8, or a displacement of 14 (7 + 7 before the third rank's
  // block), is beyond what one call takes here (as INT_MAX is with the default options).
  const int p = comm.size();
  std::vector<index_t> sevens(static_cast<std::size_t>(p), 7);
  std::vector<float> send(static_cast<std::size_t>(7 * p), 1.0f), recv(send.size());
  if (p == 2) {
    comm.all_to_all_v(send, sevens, recv, sevens);
    CHECK(recv == send);
  } else {
    const std::string e = error_of([&] { comm.all_to_all_v(send, sevens, recv, sevens); });
    CHECK(contains(e, "send_counts[2] = 7 at displacement 14 exceeds what the transport takes"));
  }
  std::vector<index_t> eights(static_cast<std::size_t>(p), 0);
  eights[0] = 8;
  const std::string e = error_of([&] { comm.all_to_all_v(send, eights, recv, eights); });
  CHECK(contains(e,
                 "send_counts[0] = 8 at displacement 0 exceeds what the transport takes in one "
                 "block (7 elements"));
}

TEST_CASE("MpiCommunicator: bad input raises graphmoe::Error on every rank") {
  MpiCommunicator comm;
  const int me = comm.rank(), p = comm.size();
  const int last = p - 1;
  std::vector<double> a(8, 1.0), b(8, 0.0);
  const std::vector<index_t> ones(static_cast<std::size_t>(p), 1);

  // The same bad argument on every rank: each names it.
  std::string e = error_of([&] { comm.all_reduce_sum(a.data(), -1, ElementType::F64); });
  CHECK(contains(e, "graphmoe::dist::all_reduce_sum: data has a negative element count -1 (rank " +
                        std::to_string(me)));
  e = error_of([&] { comm.broadcast(a, p); });
  CHECK(contains(e, "graphmoe::dist::broadcast: root " + std::to_string(p) + " is out of range"));

  // A bad argument on one rank only: that rank names it, every other rank names that rank.
  const std::string other = "graphmoe::dist::all_to_all_v: rank " + std::to_string(last) + " of " +
                            std::to_string(p) + " passed invalid arguments";
  {
    std::vector<index_t> counts = ones;
    if (me == last) counts.push_back(1);  // one entry too many
    e = error_of([&] { comm.all_to_all_v(a, counts, b, ones); });
    CHECK(contains(e, me == last ? "send_counts has " + std::to_string(p + 1) + " entries for " +
                                       std::to_string(p) + " ranks"
                                 : other));
  }
  {
    std::vector<index_t> counts = ones;
    if (me == last) counts[0] = -4;
    e = error_of([&] { comm.all_to_all_v(a, ones, b, counts); });
    CHECK(contains(e, me == last ? std::string("recv_counts[0] = -4 is negative") : other));
  }
  {
    std::vector<index_t> counts = ones;
    if (me == last) counts[0] = 9;  // beyond the 8 elements of the send buffer
    e = error_of([&] { comm.all_to_all_v(a, counts, b, ones); });
    CHECK(contains(e, me == last ? std::string("send_counts sum to at least 9 elements (through "
                                               "rank 0) but the buffer holds 8")
                                 : other));
  }
  {
    e = error_of([&] {
      if (me == last) {
        comm.all_to_all_v(a.data(), 8, ones, a.data() + 1, 7, ones, ElementType::F64);
      } else {
        comm.all_to_all_v(a, ones, b, ones);
      }
    });
    CHECK(contains(e, me == last ? std::string("the send and receive buffers overlap") : other));
  }
  {
    e = error_of([&] {
      std::vector<index_t> counts = ones;
      if (me == 0) counts.pop_back();
      comm.exchange_counts(counts);
    });
    CHECK(contains(e, me == 0 ? "graphmoe::dist::exchange_counts: send_counts has " +
                                    std::to_string(p - 1) + " entries"
                              : std::string("graphmoe::dist::exchange_counts: rank 0 of")));
  }

  // Arguments valid on each rank but different across ranks.
  e = error_of([&] { comm.all_reduce_sum(a.data(), me == 0 ? 8 : 7, ElementType::F64); });
  CHECK(contains(e,
                 "graphmoe::dist::all_reduce_sum: the ranks passed different element counts "
                 "(from 7 to 8)"));
  e = error_of([&] { comm.broadcast(a, me == 1 ? 1 : 0); });
  CHECK(contains(e, "graphmoe::dist::broadcast: the ranks passed different roots (from 0 to 1)"));
  e = error_of([&] {
    if (me == 0) {
      std::vector<float> f(8, 1.0f);
      comm.all_reduce_sum(f);
    } else {
      comm.all_reduce_sum(a);
    }
  });
  CHECK(contains(e, "the ranks passed different element types"));
  {
    MpiCommunicator uneven(MPI_COMM_WORLD, MpiCommunicator::Options{me == 0 ? 100 : 200});
    e = error_of([&] { uneven.all_reduce_sum(a); });
    CHECK(contains(e, "the ranks passed different max_count() values (from 100 to 200)"));
  }

  // Options out of range: refused before any MPI call, on every rank alike.
  e = error_of([&] { MpiCommunicator bad(MPI_COMM_WORLD, MpiCommunicator::Options{0}); });
  CHECK(contains(e, "graphmoe::dist::MpiCommunicator: Options::max_count = 0 is outside [1, "));
  e = error_of(
      [&] { MpiCommunicator bad(MPI_COMM_WORLD, MpiCommunicator::Options{index_t{1} << 31}); });
  CHECK(contains(e, "Options::max_count = 2147483648 is outside [1, 2147483647]"));
  e = error_of([&] { MpiCommunicator bad(MPI_COMM_NULL); });
  CHECK(contains(e, "the communicator is MPI_COMM_NULL"));

  // After all of that the communicator still works, and no message was left in flight.
  std::vector<std::int32_t> x(4, me + 1);
  comm.all_reduce_sum(x);
  CHECK(x == std::vector<std::int32_t>(4, p * (p + 1) / 2));
}

TEST_CASE("MpiCommunicator: a failing MPI call becomes a graphmoe::Error naming the call") {
  MpiCommunicator comm;
  const std::string e =
      error_of([&] { dist::detail::mpi_check(MPI_ERR_TRUNCATE, "dist::x", "MPI_Alltoallv"); });
  CHECK(contains(e, "graphmoe::dist::x: MPI_Alltoallv failed: "));
  CHECK(contains(e, "truncat"));  // MPI's own error string for MPI_ERR_TRUNCATE
  CHECK(contains(e, "class " + std::to_string(MPI_ERR_TRUNCATE)));
  // A real failing call through the communicator's error handler (MPI_ERRORS_RETURN): a
  // reduction with an invalid root.
  int errhandler_returns = 0;
  MPI_Errhandler h;
  MPI_Comm_get_errhandler(comm.comm(), &h);
  errhandler_returns = h == MPI_ERRORS_RETURN;
  MPI_Errhandler_free(&h);
  CHECK(errhandler_returns == 1);
  int v = 1;
  const std::string e2 = error_of([&] {
    dist::detail::mpi_check(MPI_Bcast(&v, 1, MPI_INT, comm.size() + 3, comm.comm()), "dist::y",
                            "MPI_Bcast");
  });
  CHECK(contains(e2, "graphmoe::dist::y: MPI_Bcast failed: "));
  CHECK(contains(e2, "root"));
}

TEST_CASE("MpiEnvironment: a second one in the same process neither initialises nor finalises") {
  dist::MpiEnvironment again;
  CHECK_FALSE(again.owner());
  CHECK(static_cast<int>(again.provided()) >= MPI_THREAD_FUNNELED);
}

int main(int argc, char** argv) {
  // Whatever happens, no rank outlives a stuck test by much (ctest's TIMEOUT kills mpiexec, which
  // may leave its ranks behind).
  alarm(120);
  dist::MpiEnvironment mpi(argc, argv);
  doctest::Context context(argc, argv);
  const int failed = context.run();
  // Every rank reports the same outcome: failed if any rank failed.
  int any_failed = failed != 0;
  MPI_Allreduce(MPI_IN_PLACE, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (context.shouldExit()) return failed;
  return any_failed;
}
