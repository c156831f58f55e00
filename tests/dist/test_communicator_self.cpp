// SelfCommunicator (world size 1, no MPI): the collectives are identities or a copy to itself,
// and every argument check of Communicator fires as it does on many ranks.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/communicator.hpp"
#include "graphmoe/train/distributed_checkpoint.hpp"
#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/layers/moe.hpp"
#include "graphmoe/train/training_state.hpp"
#include "support/errors.hpp"

using namespace graphmoe;
using graphmoe::test::contains;
using graphmoe::test::error_of;
using dist::ElementType;
using dist::SelfCommunicator;

namespace {

template <class T>
std::vector<T> iota_values(std::size_t n, T start) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<T>(i));
  return v;
}

// A host-memory communicator that claims device memory: the Tensor<T, cpu> overloads must
// refuse it.
class DeviceClaimingCommunicator final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  dist::MemorySpace memory_space() const override { return dist::MemorySpace::Device; }
  index_t max_count() const override { return 1 << 20; }
  void barrier() override {}

 protected:
  void all_reduce_sum_impl(void*, index_t, ElementType) override { ++calls; }
  void broadcast_impl(void*, index_t, ElementType, int) override { ++calls; }
  void all_to_all_v_impl(const void*, const index_t*, const index_t*, void*, const index_t*,
                         const index_t*, ElementType) override {
    ++calls;
  }
  void min_over_ranks(std::span<std::int64_t>) override {}

 public:
  int calls = 0;
};

}  // namespace

TEST_CASE_TEMPLATE("SelfCommunicator: collectives on one rank", T, float, double, std::int32_t,
                   std::int64_t) {
  SelfCommunicator comm;
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  CHECK(comm.memory_space() == dist::MemorySpace::Host);
  comm.barrier();

  const std::vector<T> original = iota_values<T>(19, T(3));
  std::vector<T> v = original;
  comm.all_reduce_sum(v);
  CHECK(v == original);
  comm.broadcast(v, 0);
  CHECK(v == original);

  // all_to_all_v with one rank: the one block goes to itself; the buffers may be longer.
  const std::vector<index_t> counts{7};
  std::vector<T> recv(10, T(-1));
  comm.all_to_all_v(original, counts, recv, counts);
  for (std::size_t i = 0; i < 7; ++i) CHECK(recv[i] == original[i]);
  for (std::size_t i = 7; i < 10; ++i) CHECK(recv[i] == T(-1));

  std::vector<index_t> got_counts;
  const std::vector<T> got = comm.all_to_all_v(original, counts, got_counts);
  CHECK(got_counts == counts);
  CHECK(got == std::vector<T>(original.begin(), original.begin() + 7));

  CHECK(comm.exchange_counts(std::vector<index_t>{5}) == std::vector<index_t>{5});
  CHECK(comm.all_gather(42) == std::vector<index_t>{42});

  // Tensors: the 1-D result of the exchanging overload, and in-place reductions of a view.
  auto t = Tensor<T>::from(Shape{2, 3}, iota_values<T>(6, T(1)));
  std::vector<index_t> t_counts;
  Tensor<T> rows = comm.all_to_all_v(t, std::vector<index_t>{6}, t_counts);
  CHECK(rows.shape() == Shape{6});
  CHECK(rows.to_vector() == t.to_vector());
  comm.all_reduce_sum(t);
  comm.broadcast(t[1], 0);
  CHECK(t.to_vector() == iota_values<T>(6, T(1)));
}

TEST_CASE(
    "SelfCommunicator: all_reduce_sum of a ParameterArena's gradients leaves them as they are") {
  ParameterArena<float> arena;
  arena.add("a", Shape{3, 5});
  arena.add("b", Shape{7});
  arena.allocate();
  for (index_t i = 0; i < arena.grads().numel(); ++i) arena.grads().data()[i] = 0.5f * i;
  SelfCommunicator comm;
  comm.all_reduce_sum(arena.grads());
  for (index_t i = 0; i < arena.grads().numel(); ++i) CHECK(arena.grads().data()[i] == 0.5f * i);
}

TEST_CASE("SelfCommunicator: zero counts and empty buffers are fine") {
  SelfCommunicator comm;
  std::vector<float> empty;
  comm.all_reduce_sum(empty);
  comm.broadcast(empty, 0);
  comm.all_to_all_v(empty, std::vector<index_t>{0}, empty, std::vector<index_t>{0});
  comm.all_reduce_sum(nullptr, 0, ElementType::F32);
  std::vector<index_t> counts;
  CHECK(comm.all_to_all_v(empty, std::vector<index_t>{0}, counts).empty());
  CHECK(counts == std::vector<index_t>{0});
}

TEST_CASE("SelfCommunicator: bad input raises graphmoe::Error naming the problem") {
  SelfCommunicator comm;
  std::vector<double> a(8, 1.0), b(8, 0.0);

  std::string e = error_of([&] { comm.all_reduce_sum(a.data(), -3, ElementType::F64); });
  CHECK(contains(e, "graphmoe::dist::all_reduce_sum: data has a negative element count -3"));
  CHECK(contains(e, "(rank 0 of 1)"));
  e = error_of([&] { comm.all_reduce_sum(nullptr, 4, ElementType::F64); });
  CHECK(contains(e, "data is a null pointer with 4 elements"));

  e = error_of([&] { comm.broadcast(a, 1); });
  CHECK(contains(e, "graphmoe::dist::broadcast: root 1 is out of range for 1 ranks"));
  e = error_of([&] { comm.broadcast(a, -1); });
  CHECK(contains(e, "root -1 is out of range"));

  // Count vectors of the wrong length, negative counts, counts beyond the buffers.
  e = error_of([&] {
    comm.all_to_all_v(a, std::vector<index_t>{1, 1}, b, std::vector<index_t>{1});
  });
  CHECK(contains(e, "graphmoe::dist::all_to_all_v: send_counts has 2 entries for 1 ranks"));
  e = error_of([&] { comm.all_to_all_v(a, std::vector<index_t>{1}, b, std::vector<index_t>{}); });
  CHECK(contains(e, "recv_counts has 0 entries for 1 ranks"));
  e = error_of([&] { comm.all_to_all_v(a, std::vector<index_t>{-2}, b, std::vector<index_t>{1}); });
  CHECK(contains(e, "send_counts[0] = -2 is negative"));
  e = error_of([&] { comm.all_to_all_v(a, std::vector<index_t>{9}, b, std::vector<index_t>{9}); });
  CHECK(contains(e,
                 "send_counts sum to at least 9 elements (through rank 0) but the buffer holds 8"));
  e = error_of([&] {
    comm.all_to_all_v(a, std::vector<index_t>{2}, std::span<double>(b.data(), 1),
                      std::vector<index_t>{2});
  });
  CHECK(contains(e,
                 "recv_counts sum to at least 2 elements (through rank 0) but the buffer holds 1"));
  // Counts near the top of index_t do not overflow the checks.
  e = error_of([&] {
    comm.all_to_all_v(a, std::vector<index_t>{std::numeric_limits<index_t>::max()}, b,
                      std::vector<index_t>{1});
  });
  CHECK(contains(e, "exceeds what the transport takes in one block"));

  // Overlapping buffers (here the same one), and a receive count that is not what is sent.
  e = error_of([&] {
    comm.all_to_all_v(a.data(), 8, std::vector<index_t>{4}, a.data() + 4, 4,
                      std::vector<index_t>{4}, ElementType::F64);
  });
  CHECK(contains(e, "the send and receive buffers overlap"));
  comm.all_to_all_v(a.data(), 4, std::vector<index_t>{4}, a.data() + 4, 4, std::vector<index_t>{4},
                    ElementType::F64);  // adjacent, not overlapping
  e = error_of([&] { comm.all_to_all_v(a, std::vector<index_t>{3}, b, std::vector<index_t>{2}); });
  CHECK(contains(e, "SelfCommunicator sends 3 elements to itself but expects 2"));

  e = error_of([&] { comm.exchange_counts(std::vector<index_t>{1, 2, 3}); });
  CHECK(contains(e, "graphmoe::dist::exchange_counts: send_counts has 3 entries for 1 ranks"));
  e = error_of([&] { comm.exchange_counts(std::vector<index_t>{-1}); });
  CHECK(contains(e, "send_counts[0] = -1 is negative"));
}

TEST_CASE("Communicator: the Tensor<T, cpu> overloads refuse a device-memory communicator") {
  DeviceClaimingCommunicator comm;
  auto t = Tensor<float>::from(Shape{2}, {1.0f, 2.0f});
  const std::string e = error_of([&] { comm.all_reduce_sum(t); });
  CHECK(contains(e, "graphmoe::dist::all_reduce_sum: a Tensor<T, cpu> (host memory) was given"));
  CHECK(contains(error_of([&] { comm.broadcast(t, 0); }), "device memory"));
  std::vector<index_t> counts;
  CHECK(contains(error_of([&] { comm.all_to_all_v(t, std::vector<index_t>{2}, counts); }),
                 "device memory"));
  CHECK(comm.calls == 0);
  // The raw form is the one a device-memory communicator takes.
  comm.all_reduce_sum(t.data(), 2, ElementType::F32);
  CHECK(comm.calls == 1);
}

TEST_CASE("dist::element_type_of and element_size agree with the C++ types") {
  static_assert(dist::element_type_of<float> == ElementType::F32);
  static_assert(dist::element_type_of<double> == ElementType::F64);
  static_assert(dist::element_type_of<std::int32_t> == ElementType::I32);
  static_assert(dist::element_type_of<std::int64_t> == ElementType::I64);
  static_assert(!dist::CommElement<std::uint8_t>);
  static_assert(dist::MutableCommRange<std::vector<float>&>);
  static_assert(!dist::MutableCommRange<const std::vector<float>&>);
  static_assert(dist::CommRange<const std::array<std::int64_t, 3>&>);
  CHECK(dist::element_size(ElementType::F32) == sizeof(float));
  CHECK(dist::element_size(ElementType::F64) == sizeof(double));
  CHECK(dist::element_size(ElementType::I32) == sizeof(std::int32_t));
  CHECK(dist::element_size(ElementType::I64) == sizeof(std::int64_t));
  CHECK(std::string(dist::element_type_name(ElementType::I64)) == "int64");
}

TEST_CASE("dist data parallel on one process: shards tile the batch, averaging and broadcasting are identities") {
  // shards tile the batch in rank order
  index_t next = 0;
  for (int r = 0; r < 4; ++r) {
    const dist::RowRange s = dist::shard_rows(8, r, 4);
    CHECK(s.begin == next);
    CHECK(s.end == next + 2);
    next = s.end;
  }
  CHECK(contains(error_of([] { dist::shard_rows(6, 0, 4); }), "a global batch of 6 sequences does not split into 4 equal shards"));
  CHECK(contains(error_of([] { dist::shard_rows(2, 0, 4); }), "does not split"));
  CHECK(contains(error_of([] { dist::shard_rows(8, 4, 4); }), "rank 4 out of range for a world of 4"));
  CHECK(contains(error_of([] { dist::shard_rows(8, 0, 0); }), "out of range for a world of 0"));
  LMBatch batch{Tensor<std::int32_t>({4, 3}), Tensor<std::int32_t>({4, 3})};
  for (index_t i = 0; i < 12; ++i) {
    batch.inputs.data()[i] = static_cast<std::int32_t>(i);
    batch.targets.data()[i] = static_cast<std::int32_t>(100 + i);
  }
  const LMBatch second = dist::shard(batch, 1, 2);
  CHECK(second.inputs.shape() == Shape{2, 3});
  CHECK(second.inputs.data()[0] == 6);
  CHECK(second.targets.data()[5] == 111);
  CHECK(contains(error_of([&] { dist::shard(batch, 0, 3); }), "does not split into 3 equal shards"));
  LMBatch mismatched{batch.inputs, Tensor<std::int32_t>({4, 2})};
  CHECK(contains(error_of([&] { dist::shard(mismatched, 0, 2); }), "must be the same (B, T)"));

  SelfCommunicator self;
  CHECK(dist::shard(batch, self).inputs.shape() == batch.inputs.shape());
  ParameterArena<float> arena;
  arena.add("w", Shape{5});
  arena.add("b", Shape{2});
  arena.allocate();
  for (index_t i = 0; i < 5; ++i) {
    arena.grad(0).data()[i] = static_cast<float>(i) - 1.5f;
    arena.value(0).data()[i] = 0.25f * static_cast<float>(i);
  }
  const Tensor<float> grads = arena.grads().clone(), values = arena.values().clone();
  dist::average_gradients(self, arena);
  dist::broadcast_parameters(self, arena);
  for (index_t i = 0; i < grads.numel(); ++i) {
    CHECK(arena.grads().data()[i] == grads.data()[i]);
    CHECK(arena.values().data()[i] == values.data()[i]);
  }
  CHECK(dist::mean_over_ranks(self, 2.5) == 2.5);
  CHECK(dist::max_parameter_divergence(self, arena) == 0.0);
  ParameterArena<float> unallocated;
  CHECK(contains(error_of([&] { dist::average_gradients(self, unallocated); }), "not allocated"));
  CHECK(contains(error_of([&] { dist::broadcast_parameters(self, unallocated); }), "not allocated"));
  // a host arena refuses a device-memory communicator
  DeviceClaimingCommunicator device;
  CHECK(contains(error_of([&] { dist::average_gradients(device, arena); }),
                 "the arena's tensors live in host memory, the communicator's in device memory"));
  CHECK(device.calls == 0);
}

TEST_CASE("Communicator::traffic counts the payload of each operation, and the agreement apart") {
  SelfCommunicator comm;
  CHECK(comm.traffic().all_reduce_bytes == 0);
  std::vector<double> d(5, 1.0);
  comm.all_reduce_sum(d);
  std::vector<std::int32_t> n(3, 2);
  comm.broadcast(n, 0);
  std::vector<float> send(4, 1.0f), recv(4, 0.0f);
  const std::vector<index_t> counts = {4};
  comm.all_to_all_v(send, counts, recv, counts);
  std::vector<float> none;
  comm.all_reduce_sum(none);  // nothing moves: not counted as a call
  const dist::Traffic t = comm.traffic();
  CHECK(t.all_reduce_calls == 1);
  CHECK(t.all_reduce_bytes == 5 * 8);
  CHECK(t.broadcast_calls == 1);
  CHECK(t.broadcast_bytes == 3 * 4);
  CHECK(t.all_to_all_calls == 1);
  CHECK(t.all_to_all_sent_bytes == 16);
  CHECK(t.all_to_all_received_bytes == 16);
  CHECK(t.agreement_calls == 4);
  CHECK(t.agreement_bytes > 0);
  (void)comm.exchange_counts(counts);
  CHECK(comm.traffic().count_exchange_calls == 1);
  CHECK(comm.traffic().count_exchange_bytes == static_cast<std::int64_t>(sizeof(index_t)));
  comm.reset_traffic();
  CHECK(comm.traffic().agreement_calls == 0);
  CHECK(comm.traffic().all_reduce_bytes == 0);
}

TEST_CASE("expert parallel on one rank: the exchange is a copy, and its checkpoint loads into a "
          "plain layer") {
  // (the many-rank cases are test_expert_parallel's, under mpiexec; this one runs in the
  // sanitizer subset: every buffer of the exchange and the gather, on one rank)
  SelfCommunicator comm;
  MoEConfig cfg;
  cfg.d_model = 5;
  cfg.d_ff = 4;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.router.capacity_factor = 0.5;  // some assignments dropped: the bucket stays home
  ParameterArena<double> pa, ea;
  MoELayer<SoftmaxRouter, double> plain, ep;
  plain.declare(pa, "moe.", cfg);
  ep.declare(ea, "moe.", cfg, comm);
  pa.allocate();
  ea.allocate();
  plain.bind(pa);
  ep.bind(ea);
  Rng r1(5), r2(5);
  plain.init(r1);
  ep.init(r2);
  CHECK(ea.has_shards());
  CHECK(ea.params()[ea.find("moe.experts.w1")].full_shape() == Shape{4, 4, 5});
  Rng rng(6);
  Tensor<double> u(Shape{12, 5}), w(Shape{12, 5});
  fill_normal(u, rng, 1.0);
  fill_normal(w, rng, 1.0);
  Tensor<double> y1, y2, du1, du2;
  plain.forward(u, {4, nullptr}, y1);
  ep.forward(u, {4, nullptr}, y2);
  CHECK(dropped_count(ep.routing().selection) > 0);
  CHECK(ep.expert_exchange().sent_rows() + dropped_count(ep.routing().selection) == 12 * 2);
  CHECK(ep.expert_exchange().received_rows() == ep.expert_exchange().sent_rows());
  plain.backward(w, du1);
  ep.backward(w, du2);
  for (index_t i = 0; i < y1.numel(); ++i) {
    CHECK(y2.data()[i] == doctest::Approx(y1.data()[i]).epsilon(1e-13));
    CHECK(du2.data()[i] == doctest::Approx(du1.data()[i]).epsilon(1e-13));
  }
  AdamW<double> opt(ea, AdamWConfig{});
  opt.step(ea);
  const std::string path =
      (std::filesystem::temp_directory_path() / "graphmoe_self_ep.safetensors").string();
  dist::save_training_state(comm, path, ea, opt, {});
  AdamW<double> opt2(pa, AdamWConfig{});
  load_training_state(load_safetensors(path), pa, opt2);
  CHECK(opt2.steps() == 1);
  for (const auto& p : ea.params()) {
    const Tensor<double> a = ea.value(p.name), b = pa.value(p.name);
    for (index_t i = 0; i < a.numel(); ++i) CHECK(a.data()[i] == b.data()[i]);
  }
  std::remove(path.c_str());
}
