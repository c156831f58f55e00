// Core: Shape, Tensor, ParameterArena, Rng, thread setting, error messages.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

using namespace graphmoe;

TEST_CASE("shape: numel, rows, cols and printing") {
  Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.rows() == 6);
  CHECK(s.cols() == 4);
  CHECK(s.dim(-1) == 4);
  CHECK(s.str() == "(2, 3, 4)");
  CHECK(Shape{}.numel() == 1);
  // A matrix with no columns still has its rows (the CUDA gemm's k = 0 case found this).
  CHECK(Shape{5, 0}.rows() == 5);
  CHECK(Shape{2, 3, 0}.rows() == 6);
  CHECK(Shape{0, 3}.rows() == 0);
  CHECK(Shape{7}.rows() == 1);
}

TEST_CASE("shape: bad input throws naming the problem") {
  CHECK_THROWS_WITH_AS(Shape({2, -1}), doctest::Contains("negative size -1"), Error);
  CHECK_THROWS_WITH_AS(Shape({1, 2, 3, 4, 5, 6, 7}), doctest::Contains("exceeds the maximum rank"),
                       Error);
  CHECK_THROWS_WITH_AS(Shape({2, 3}).dim(2), doctest::Contains("out of range"), Error);
}

TEST_CASE("tensor: views share storage, clone does not") {
  auto t = Tensor<float>::from({2, 3}, {1, 2, 3, 4, 5, 6});
  auto v = t.view({3, 2});
  v(2, 1) = 60;
  CHECK(t(1, 2) == 60);
  auto row = t[1];
  CHECK(row.shape() == Shape{3});
  CHECK(row(0) == 4);
  auto s = t.slice(1, 2);
  CHECK(s.shape() == Shape{1, 3});
  CHECK(s.data() == t.data() + 3);
  auto c = t.clone();
  c(0, 0) = -1;
  CHECK(t(0, 0) == 1);
  CHECK(reinterpret_cast<std::uintptr_t>(Tensor<float>({5}).data()) % 64 == 0);
}

TEST_CASE("tensor: an empty tensor has no elements") {
  Tensor<float> empty;
  CHECK(empty.empty());
  CHECK(empty.numel() == 0);
  CHECK(empty.bytes() == 0);
  Tensor<double> scalar(Shape{});  // an allocated rank-0 tensor is one value
  CHECK(!scalar.empty());
  CHECK(scalar.numel() == 1);
}

TEST_CASE("tensor: zeros_on_demand reads as zeros, is written and shared like any tensor") {
  // host memory the system zero-fills page by page (8 MiB: many pages), and an empty one
  Tensor<float> t = Tensor<float>::zeros_on_demand(Shape{1024, 2048});
  REQUIRE(t.shape() == (Shape{1024, 2048}));
  REQUIRE(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  double sum = 0;
  for (index_t i = 0; i < t.numel(); ++i) sum += std::abs(t.data()[i]);
  CHECK(sum == 0);
  for (index_t i = 0; i < t.numel(); i += 997) t.data()[i] = static_cast<float>(i);
  Tensor<float> v = t.view(Shape{2048, 1024});  // shares the storage, which outlives t
  t = Tensor<float>();
  CHECK(v.data()[997 * 5] == 997.0f * 5);
  CHECK(v.data()[1] == 0.0f);
  CHECK(Tensor<float>::zeros_on_demand(Shape{0}).numel() == 0);
}

TEST_CASE("tensor: bad views, slices, indices and copies throw") {
  Tensor<double> t({2, 3});
  CHECK_THROWS_WITH_AS(t.view({4, 2}), doctest::Contains("cannot view a tensor of shape (2, 3) as (4, 2)"), Error);
  CHECK_THROWS_WITH_AS(t.slice(1, 3), doctest::Contains("out of bounds"), Error);
  CHECK_THROWS_WITH_AS(t.at(2, 0), doctest::Contains("index 2 out of range"), Error);
  CHECK_THROWS_WITH_AS(t.at(0), doctest::Contains("1 indices given"), Error);
  Tensor<double> u({3, 2});
  CHECK_THROWS_WITH_AS(t.copy_from(u), doctest::Contains("does not match"), Error);
  CHECK_THROWS_WITH_AS(Tensor<float>::from({2, 2}, {1, 2, 3}), doctest::Contains("3 values given"), Error);
}

TEST_CASE("arena: one buffer, aligned named views, zero_grad") {
  ParameterArena<float> arena;
  arena.add("w", {3, 5});
  arena.add("b", {5});
  CHECK_THROWS_WITH_AS(arena.add("w", {1}), doctest::Contains("duplicate parameter name 'w'"), Error);
  CHECK_THROWS_WITH_AS(arena.value("w"), doctest::Contains("call allocate()"), Error);
  arena.allocate();
  CHECK_THROWS_WITH_AS(arena.add("c", {1}), doctest::Contains("after allocate()"), Error);
  auto w = arena.value("w");
  auto b = arena.value("b");
  CHECK(w.shape() == Shape{3, 5});
  CHECK(b.data() == arena.values().data() + 16);
  CHECK(arena.numel() == 20);
  w(2, 4) = 7;
  CHECK(arena.values().data()[14] == 7);
  arena.grad("b")(1) = 3;
  CHECK(arena.grads().data()[17] == 3);
  arena.zero_grad();
  CHECK(arena.grad("b")(1) == 0);
  CHECK_THROWS_WITH_AS(arena.value("nope"), doctest::Contains("no parameter named 'nope'"), Error);
}

TEST_CASE("rng: Philox4x32-10 matches the Random123 known-answer vectors") {
  auto a = philox4x32_10(std::array<std::uint32_t, 4>{0, 0, 0, 0}, std::array<std::uint32_t, 2>{0, 0});
  CHECK(a == std::array<std::uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  auto b = philox4x32_10(std::array<std::uint32_t, 4>{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                         std::array<std::uint32_t, 2>{0xffffffffu, 0xffffffffu});
  CHECK(b == std::array<std::uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  auto c = philox4x32_10(std::array<std::uint32_t, 4>{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                         std::array<std::uint32_t, 2>{0xa4093822u, 0x299f31d0u});
  CHECK(c == std::array<std::uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("rng: sequential stream equals random access, and resumes from a position") {
  Rng r(1234);
  std::vector<std::uint32_t> words;
  for (int i = 0; i < 11; ++i) words.push_back(r.next_u32());
  for (int i = 0; i < 11; ++i) CHECK(words[i] == philox_word(1234, i));
  Rng s(1234, 7);
  CHECK(s.next_u32() == words[7]);
  CHECK(Rng(1).next_u32() != Rng(2).next_u32());
}

TEST_CASE("rng: uniform and normal moments") {
  Rng r(42);
  const int n = 200000;
  double su = 0, sz = 0, sz2 = 0;
  std::set<std::uint32_t> ints;
  for (int i = 0; i < n; ++i) {
    const float u = r.uniform();
    REQUIRE(u >= 0.0f);
    REQUIRE(u < 1.0f);
    su += u;
    const double z = r.normal();
    sz += z;
    sz2 += z * z;
  }
  for (int i = 0; i < 1000; ++i) ints.insert(r.uniform_int(7));
  CHECK(su / n == doctest::Approx(0.5).epsilon(0.01));
  CHECK(sz / n == doctest::Approx(0.0).epsilon(0.01));
  CHECK(sz2 / n == doctest::Approx(1.0).epsilon(0.01));
  CHECK(ints.size() == 7);
  CHECK(*ints.rbegin() == 6);
}

TEST_CASE("threads: setting is honoured and validated") {
  set_num_threads(2);
  CHECK(num_threads() == 2);
  std::vector<int> hit(1000, 0);
  parallel_for(0, 1000, [&](index_t i) { hit[static_cast<std::size_t>(i)] += 1; });
  for (int h : hit) REQUIRE(h == 1);
  set_num_threads(1);
  CHECK(num_threads() == 1);
  CHECK_THROWS_WITH_AS(set_num_threads(0), doctest::Contains("must be >= 1"), Error);
}

TEST_CASE("threads: parallel_for and parallel_items run every item exactly once, on any thread count") {
  // The pool (core/thread_pool.hpp): every item once, nested loops serial, loops back to back
  // (workers that wake late must not touch the next loop's items), two user threads at once.
  for (int threads : {1, 2, 3, 8}) {
    CAPTURE(threads);
    set_num_threads(std::min(threads, max_num_threads()));
    for (index_t n : {index_t{0}, index_t{1}, index_t{2}, index_t{7}, index_t{1000}, index_t{100003}}) {
      CAPTURE(n);
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
      parallel_for(5, 5 + n, [&](index_t i) { hits[static_cast<std::size_t>(i - 5)].fetch_add(1); });
      int wrong = 0;
      for (auto& h : hits) wrong += h.load() != 1;
      CHECK(wrong == 0);
      std::vector<std::atomic<int>> items(static_cast<std::size_t>(n));
      std::atomic<int> nested_parallel{0};
      parallel_items(n, [&](index_t i) {
        items[static_cast<std::size_t>(i)].fetch_add(1);
        if (!in_parallel_region()) nested_parallel.fetch_add(1);
        // a nested loop runs serially, in order, on this thread
        index_t last = -1;
        bool ordered = true;
        parallel_for(0, 64, [&](index_t j) { ordered = ordered && j == last + 1; last = j; });
        if (!ordered) nested_parallel.fetch_add(1);
      });
      wrong = 0;
      for (auto& h : items) wrong += h.load() != 1;
      CHECK(wrong == 0);
      if (threads > 1 && n > 1) CHECK(nested_parallel.load() == 0);
    }
    // many short loops back to back, each writing its own loop id
    std::vector<index_t> owner(257, -1);
    int mismatches = 0;
    for (index_t loop = 0; loop < 2000; ++loop) {
      parallel_for(0, 257, [&](index_t i) { owner[static_cast<std::size_t>(i)] = loop; });
      for (index_t v : owner) mismatches += v != loop;
    }
    CHECK(mismatches == 0);
  }
  // two user threads running loops at once: one gets the pool, the other runs serially
  set_num_threads(2);
  std::vector<long> sums(2, 0);
  std::vector<std::thread> users;
  for (int u = 0; u < 2; ++u)
    users.emplace_back([&, u] {
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<long> part(1000, 0);
        parallel_for(0, 1000, [&](index_t i) { part[static_cast<std::size_t>(i)] = i; });
        for (long v : part) sums[static_cast<std::size_t>(u)] += v;
      }
    });
  for (auto& t : users) t.join();
  CHECK(sums[0] == 200L * 999 * 1000 / 2);
  CHECK(sums[1] == sums[0]);
  set_num_threads(1);
}

#if defined(_OPENMP)
TEST_CASE("threads: GRAPHMOE_SPIN_US is read as microseconds, and bad values are refused") {
  using detail::ThreadPool;
  const char* old = std::getenv("GRAPHMOE_SPIN_US");
  const std::string saved = old ? old : "";
  unsetenv("GRAPHMOE_SPIN_US");
  CHECK(ThreadPool::spin_micros_from_env() == ThreadPool::kDefaultSpinMicros);
  for (const char* ok : {"0", "200", "1000000"}) {
    setenv("GRAPHMOE_SPIN_US", ok, 1);
    CHECK(ThreadPool::spin_micros_from_env() == std::stoll(ok));
  }
  for (const char* bad : {"abc", "-1", "1000001", "12x", " 5", "99999999999999999999"}) {
    CAPTURE(bad);
    setenv("GRAPHMOE_SPIN_US", bad, 1);
    CHECK_THROWS_WITH_AS(ThreadPool::spin_micros_from_env(),
                         doctest::Contains("GRAPHMOE_SPIN_US: must be a whole number of microseconds"),
                         Error);
  }
  if (old) setenv("GRAPHMOE_SPIN_US", saved.c_str(), 1); else unsetenv("GRAPHMOE_SPIN_US");
}
#endif

TEST_CASE("threads: counts above 4 x the hardware threads are refused, naming the limit") {
  const int hw = hardware_threads();
  REQUIRE(hw >= 1);
  CHECK(max_num_threads() == kMaxThreadsPerHardwareThread * hw);
  set_num_threads(max_num_threads());  // the limit itself is accepted
  CHECK(num_threads() == max_num_threads());
  const std::string limit = "exceeds the limit of " + std::to_string(max_num_threads());
  // 100000 used to crash inside GOMP_parallel; the count is refused and left unchanged
  for (int n : {max_num_threads() + 1, 5000, 40000, 100000, std::numeric_limits<int>::max()}) {
    CAPTURE(n);
    CHECK_THROWS_WITH_AS(set_num_threads(n), doctest::Contains(limit.c_str()), Error);
    CHECK(num_threads() == max_num_threads());
  }
  CHECK_THROWS_WITH_AS(set_num_threads(-3), doctest::Contains("must be >= 1, got -3"), Error);
  set_num_threads(1);
  CHECK(num_threads() == 1);
}

// The host half of the deferred content checks (core/deferred_check.hpp; the CUDA backend's half
// is tested in tests/cuda/test_cuda_layers.cu).
TEST_CASE("deferred checks: report_check reports now, or through the open batch") {
  using graphmoe::BadRow;
  using graphmoe::Offender;
  using graphmoe::detail::DeferredChecks;
  auto report = [](const Offender& o) {
    graphmoe::detail::throw_error("op", "bad value ", o.value, " at ", o.index);
  };
  // immediate results: nothing found, nothing thrown; found: thrown at once
  CHECK_NOTHROW(graphmoe::report_check(Offender{}, report));
  CHECK_THROWS_WITH_AS(graphmoe::report_check(Offender{3, 2.5}, report),
                       "graphmoe::op: bad value 2.5 at 3", graphmoe::Error);
  // a pending result without an open batch is a backend's bug, named
  Offender pending;
  pending.deferred = 0;
  CHECK_THROWS_WITH_AS(graphmoe::report_check(pending, report),
                       doctest::Contains("outside with_deferred_checks"), graphmoe::Error);
  // with a batch: the report is kept and fires with the resolved result
  DeferredChecks batch;
  graphmoe::detail::active_deferred_checks() = &batch;
  const graphmoe::index_t e0 = batch.add<Offender>(
      "first", [](graphmoe::index_t i) { return Offender{i, 0.5 * static_cast<double>(i)}; });
  const graphmoe::index_t e1 =
      batch.add<BadRow>("second", [](graphmoe::index_t i) { return BadRow{i, 1, 0}; });
  pending.deferred = e0;
  graphmoe::report_check(pending, report);
  CHECK(batch.size() == 2);
  graphmoe::detail::active_deferred_checks() = nullptr;
  CHECK_THROWS_WITH_AS(batch.fire(e0, 7), "graphmoe::op: bad value 3.5 at 7", graphmoe::Error);
  // an entry whose op attached no report still throws, naming the op and the index
  CHECK_THROWS_WITH_AS(batch.fire(e1, 4), doctest::Contains("graphmoe::second: bad input at flat index 4"),
                       graphmoe::Error);
  // the report must take the entry's result type
  CHECK_THROWS_WITH_AS(batch.set_report<Offender>(e1, report),
                       doctest::Contains("registered with another result type"), graphmoe::Error);
  CHECK_THROWS_WITH_AS(batch.set_report<Offender>(5, report), doctest::Contains("no entry 5"),
                       graphmoe::Error);
  // the CPU backend checks at once: with_deferred_checks(cpu{}, f) is f()
  int calls = 0;
  graphmoe::with_deferred_checks(graphmoe::cpu{}, [&] { ++calls; });
  CHECK(calls == 1);
  CHECK(graphmoe::detail::active_deferred_checks() == nullptr);
}
