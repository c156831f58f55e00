// Embedding: lookup and scatter-add against naive loops; gradient check; accumulation; thread
// independence; float vs double; bad input.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "graphmoe/ops/embedding.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
Tensor<std::int32_t> random_ids(const Shape& shape, std::int32_t vocab, Rng& rng) {
  Tensor<std::int32_t> ids(shape);
  for (index_t i = 0; i < ids.numel(); ++i)
    ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return ids;
}
}  // namespace

TEST_CASE("embedding: forward and backward match naive loops, ids of rank 2") {
  Rng rng(11);
  const index_t vocab = 7, d = 5;
  auto ids = random_ids({3, 4}, vocab, rng);
  ids(0, 0) = 2;
  ids(2, 3) = 2;  // a repeated id: its gradient rows must add up
  auto table = random_tensor<double>({vocab, d}, rng);
  Tensor<double> out;
  embedding_forward(ids, table, out);
  REQUIRE(out.shape() == Shape{3, 4, d});
  for (index_t a = 0; a < 3; ++a)
    for (index_t b = 0; b < 4; ++b)
      for (index_t c = 0; c < d; ++c) CHECK(out(a, b, c) == table(ids(a, b), c));

  auto dout = random_tensor<double>(out.shape(), rng);
  auto dtable = random_tensor<double>({vocab, d}, rng);  // nonzero: backward must add to it
  auto expected = dtable.clone();
  for (index_t a = 0; a < 3; ++a)
    for (index_t b = 0; b < 4; ++b)
      for (index_t c = 0; c < d; ++c) expected(ids(a, b), c) += dout(a, b, c);
  embedding_backward(ids, dout, dtable);
  CHECK(max_rel_diff(dtable, expected) < 1e-15);
}

TEST_CASE("embedding: gradient check (double)") {
  Rng rng(12);
  const index_t vocab = 6, d = 4;
  auto ids = Tensor<std::int32_t>::from({5}, {3, 0, 3, 5, 1});
  auto table = random_tensor<double>({vocab, d}, rng);
  auto w = random_tensor<double>({5, d}, rng);
  auto loss = [&] {
    Tensor<double> out;
    embedding_forward(ids, table, out);
    return weighted_sum(out, w);
  };
  Tensor<double> dtable({vocab, d});
  embedding_backward(ids, w, dtable);
  check_gradient("dtable", table, dtable, loss);
  // rows 2 and 4 were never looked up
  for (index_t c = 0; c < d; ++c) {
    CHECK(dtable(2, c) == 0.0);
    CHECK(dtable(4, c) == 0.0);
  }
}

TEST_CASE("embedding: results do not depend on the thread count") {
  Rng rng(13);
  const index_t vocab = 50, d = 200;  // several column blocks, enough work to go parallel
  auto ids = random_ids({400}, vocab, rng);
  auto table = random_tensor<float>({vocab, d}, rng);
  auto dout = random_tensor<float>({400, d}, rng);
  Tensor<float> out1, out2, dt1({vocab, d}), dt2({vocab, d});
  embedding_forward(ids, table, out1);
  embedding_backward(ids, dout, dt1);
  set_num_threads(2);
  embedding_forward(ids, table, out2);
  embedding_backward(ids, dout, dt2);
  set_num_threads(1);
  CHECK(out1.to_vector() == out2.to_vector());
  CHECK(dt1.to_vector() == dt2.to_vector());  // bitwise: same summation order
}

TEST_CASE("embedding: float agrees with double") {
  Rng rng(14);
  auto ids = random_ids({2, 8}, 20, rng);
  auto table = random_tensor<double>({20, 16}, rng);
  auto dout = random_tensor<double>({2, 8, 16}, rng);
  Tensor<double> outd, dtd({20, 16});
  Tensor<float> outf, dtf({20, 16});
  embedding_forward(ids, table, outd);
  embedding_forward(ids, cast<float>(table), outf);
  embedding_backward(ids, dout, dtd);
  embedding_backward(ids, cast<float>(dout), dtf);
  CHECK(max_rel_diff(outf, outd) < 1e-6);
  CHECK(max_rel_diff(dtf, dtd) < 1e-5);
}

TEST_CASE("embedding: bad input") {
  Tensor<float> table({5, 3});
  Tensor<float> out;
  auto bad = Tensor<std::int32_t>::from({2, 2}, {0, 1, 5, 2});
  CHECK_THROWS_WITH_AS(embedding_forward(bad, table, out),
                       doctest::Contains("id 5 at flat position 2"), Error);
  auto negative = Tensor<std::int32_t>::from({3}, {0, -1, 2});
  CHECK_THROWS_WITH_AS(embedding_forward(negative, table, out),
                       doctest::Contains("id -1 at flat position 1"), Error);
  auto ids = Tensor<std::int32_t>::from({2}, {0, 4});
  Tensor<float> wrong({2, 4});
  CHECK_THROWS_WITH_AS(embedding_forward(ids, table, wrong),
                       doctest::Contains("output out has shape (2, 4), expected (2, 3)"), Error);
  Tensor<float> vec({5});
  CHECK_THROWS_WITH_AS(embedding_forward(ids, vec, out), doctest::Contains("(V, D) matrix"),
                       Error);
  Tensor<float> dout({3, 3}), dtable({5, 3});
  CHECK_THROWS_WITH_AS(embedding_backward(ids, dout, dtable),
                       doctest::Contains("dout has shape (3, 3), expected (2, 3)"), Error);
  Tensor<float> dout_ok({2, 3}), none;
  CHECK_THROWS_WITH_AS(embedding_backward(ids, dout_ok, none),
                       doctest::Contains("dtable must be an allocated"), Error);
  Tensor<float> small({4, 3});
  CHECK_THROWS_WITH_AS(embedding_backward(ids, dout_ok, small),
                       doctest::Contains("id 4 at flat position 1"), Error);
}

TEST_CASE("embedding: the CPU system returns the first bad id, and the op throws before writing") {
  // Argument checks run once in ops/embedding.hpp; the backend scans the ids and returns the
  // first one out of range (flat position and value) instead of throwing.
  const auto ids = Tensor<std::int32_t>::from({2, 3}, {0, 4, 7, 1, -2, 9});
  const Offender bad = embedding_first_bad_id(cpu{}, ids, 5);
  CHECK(bad.found());
  CHECK(bad.index == 2);
  CHECK(bad.value == 7.0);
  CHECK(embedding_first_bad_id(cpu{}, ids, 10).found());  // -2 is still out of range
  CHECK(embedding_first_bad_id(cpu{}, ids, 10).index == 4);
  const auto good = Tensor<std::int32_t>::from({2}, {0, 4});
  CHECK(!embedding_first_bad_id(cpu{}, good, 5).found());

  // embedding_backward leaves dtable untouched when an id is bad.
  auto dtable = Tensor<float>::from({5, 1}, {1, 2, 3, 4, 5});
  const auto dout = Tensor<float>::from({2, 3, 1}, {1, 1, 1, 1, 1, 1});
  CHECK_THROWS_WITH_AS(embedding_backward(ids, dout, dtable),
                       doctest::Contains("id 7 at flat position 2 of ids (2, 3)"), Error);
  for (index_t v = 0; v < 5; ++v) CHECK(dtable(v, 0) == static_cast<float>(v + 1));
}
