// Dropout: the counter-based mask rule element by element, determinism, offsets, kept fraction,
// gradient check with a fixed mask, float vs double, bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>

#include "graphmoe/ops/dropout.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
using Mask = Tensor<std::uint8_t>;

bool same_mask(const Mask& a, const Mask& b) {
  REQUIRE(a.shape() == b.shape());
  for (index_t i = 0; i < a.numel(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return true;
}
}  // namespace

TEST_CASE("dropout: every element follows the documented rule, at any offset alignment") {
  Rng rng(51);
  auto x = random_tensor<double>({7, 1301}, rng);  // more than one chunk, odd sizes
  const double p = 0.3;
  const std::uint64_t seed = 0x123456789abcdefull;
  for (std::uint64_t offset : {0ull, 1ull, 2ull, 3ull, 4097ull, (1ull << 33) + 5}) {
    CAPTURE(offset);
    Tensor<double> y;
    Mask mask;
    dropout_forward(p, seed, offset, x, y, mask);
    REQUIRE(mask.shape() == x.shape());
    int wrong = 0;
    for (index_t i = 0; i < x.numel(); ++i) {
      const std::uint64_t n = offset + static_cast<std::uint64_t>(i);
      const bool dropped = uniform_float(philox_word(seed, n)) < p;
      const double expected = dropped ? 0.0 : x.data()[i] * (1 / (1 - p));
      if (mask.data()[i] != (dropped ? 0 : 1) || y.data()[i] != expected) ++wrong;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("dropout: same seed and offset give the same mask, other offsets or seeds do not") {
  Rng rng(52);
  auto x = random_tensor<float>({300}, rng);
  Tensor<float> y1, y2, y3, y4;
  Mask m1, m2, m3, m4;
  dropout_forward(0.5f, 7, 1000, x, y1, m1);
  dropout_forward(0.5f, 7, 1000, x, y2, m2);
  dropout_forward(0.5f, 7, 1300, x, y3, m3);
  dropout_forward(0.5f, 8, 1000, x, y4, m4);
  CHECK(same_mask(m1, m2));
  CHECK(max_rel_diff(y1, y2) == 0.0);
  CHECK_FALSE(same_mask(m1, m3));
  CHECK_FALSE(same_mask(m1, m4));
  // Advancing the offset by numel per call (Rng::skip) splits one long stream: two calls on halves
  // equal one call on the whole.
  Rng stream(7, 1000);
  auto a = x.slice(0, 120), b = x.slice(120, 300);
  Tensor<float> ya, yb;
  Mask ma, mb;
  dropout_forward(0.5f, stream.seed(), stream.skip(static_cast<std::uint64_t>(a.numel())), a, ya,
                  ma);
  dropout_forward(0.5f, stream.seed(), stream.skip(static_cast<std::uint64_t>(b.numel())), b, yb,
                  mb);
  CHECK(stream.position() == 1300);
  for (index_t i = 0; i < 300; ++i) CHECK(m1(i) == (i < 120 ? ma(i) : mb(i - 120)));
  // Independent of the thread count.
  set_num_threads(2);
  Tensor<float> big_x({50000}), yt;
  Mask mt, ms;
  big_x.fill(1.0f);
  dropout_forward(0.5f, 7, 3, big_x, yt, mt);
  set_num_threads(1);
  Tensor<float> ys;
  dropout_forward(0.5f, 7, 3, big_x, ys, ms);
  CHECK(same_mask(mt, ms));
}

TEST_CASE("dropout: kept fraction is 1 - p and the mean is preserved") {
  const index_t n = 200000;
  auto x = Tensor<double>::full({n}, 2.0);
  for (double p : {0.1, 0.5, 0.9}) {
    CAPTURE(p);
    Tensor<double> y;
    Mask mask;
    dropout_forward(p, 99, 0, x, y, mask);
    double kept = 0, sum = 0;
    for (index_t i = 0; i < n; ++i) {
      kept += mask(i);
      sum += y(i);
    }
    // Binomial standard deviation sqrt(p (1 - p) / n) <= 1.2e-3; allow 5 of them.
    CHECK(std::abs(kept / n - (1 - p)) < 5 * std::sqrt(p * (1 - p) / n));
    CHECK(sum / n == doctest::Approx(2.0).epsilon(5 * std::sqrt(p / ((1 - p) * n))));
  }
}

TEST_CASE("dropout: p = 0 is the identity") {
  Rng rng(53);
  auto x = random_tensor<float>({5, 6}, rng);
  Tensor<float> y, dx;
  Mask mask;
  dropout_forward(0.0f, 1, 0, x, y, mask);
  CHECK(max_rel_diff(y, x) == 0.0);
  for (index_t i = 0; i < mask.numel(); ++i) CHECK(mask.data()[i] == 1);
  dropout_backward(0.0f, mask, x, dx);
  CHECK(max_rel_diff(dx, x) == 0.0);
}

TEST_CASE("dropout: gradient check with a fixed mask (double)") {
  Rng rng(54);
  auto x = random_tensor<double>({6, 11}, rng);
  auto w = random_tensor<double>({6, 11}, rng);
  const double p = 0.4;
  const std::uint64_t seed = 5, offset = 17;
  auto loss = [&] {
    Tensor<double> y;
    Mask m;
    dropout_forward(p, seed, offset, x, y, m);
    return weighted_sum(y, w);
  };
  Tensor<double> y;
  Mask mask;
  dropout_forward(p, seed, offset, x, y, mask);
  index_t dropped = 0;
  for (index_t i = 0; i < mask.numel(); ++i) dropped += mask.data()[i] == 0;
  REQUIRE(dropped > 0);  // the check must see both kinds of entries
  REQUIRE(dropped < mask.numel());
  auto dx = Tensor<double>::full({6, 11}, 3.0);  // assigned
  dropout_backward(p, mask, w, dx);
  check_gradient("dropout dx", x, dx, loss);
  for (index_t i = 0; i < mask.numel(); ++i)
    CHECK(dx.data()[i] == (mask.data()[i] ? w.data()[i] * (1 / (1 - p)) : 0.0));
}

TEST_CASE("dropout: float agrees with double and draws the same mask") {
  Rng rng(55);
  auto x = random_tensor<double>({40, 100}, rng);
  auto dy = random_tensor<double>({40, 100}, rng);
  Tensor<double> yd, dxd;
  Tensor<float> yf, dxf;
  Mask md, mf;
  dropout_forward(0.25, 11, 2, x, yd, md);  // 0.25 is exact in both types
  dropout_forward(0.25f, 11, 2, cast<float>(x), yf, mf);
  CHECK(same_mask(md, mf));
  CHECK(max_rel_diff(yf, yd) < 1e-7);
  dropout_backward(0.25, md, dy, dxd);
  dropout_backward(0.25f, mf, cast<float>(dy), dxf);
  CHECK(max_rel_diff(dxf, dxd) < 1e-7);
}

TEST_CASE("dropout: bad input") {
  Tensor<float> x({4, 4}), y, dx;
  Mask mask;
  CHECK_THROWS_WITH_AS(
      dropout_forward(1.0f, 0, 0, x, y, mask),
      doctest::Contains("dropout_forward: drop probability p must lie in [0, 1), got 1"), Error);
  CHECK_THROWS_WITH_AS(dropout_forward(-0.1f, 0, 0, x, y, mask), doctest::Contains("got -0.1"),
                       Error);
  CHECK_THROWS_WITH_AS(dropout_forward(std::nanf(""), 0, 0, x, y, mask),
                       doctest::Contains("must lie in [0, 1)"), Error);
  Mask bad_mask({16});
  CHECK_THROWS_WITH_AS(dropout_forward(0.5f, 0, 0, x, y, bad_mask),
                       doctest::Contains("output mask has shape (16), expected (4, 4)"), Error);
  Tensor<float> dy({4, 4});
  CHECK_THROWS_WITH_AS(
      dropout_backward(0.5f, bad_mask, dy, dx),
      doctest::Contains("dropout_backward: mask has shape (16), expected dy's shape (4, 4)"),
      Error);
  CHECK_THROWS_WITH_AS(dropout_backward(1.5f, Mask({4, 4}), dy, dx), doctest::Contains("got 1.5"),
                       Error);
}
