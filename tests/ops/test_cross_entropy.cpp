// Cross-entropy: naive log-sum-exp formula, ignore_index, gradient check, float vs double, large
// logits, bad targets.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "graphmoe/ops/cross_entropy.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
using Targets = Tensor<std::int32_t>;

// -(1/n) sum_i [x_{i,t_i} - log sum_j exp(x_ij)] over the rows not ignored, in long double.
double naive_cross_entropy(const Tensor<double>& logits, const Targets& t, std::int32_t ignore) {
  const index_t rows = logits.rows(), cols = logits.cols();
  long double total = 0;
  index_t n = 0;
  for (index_t i = 0; i < rows; ++i) {
    if (t.data()[i] == ignore) continue;
    long double z = 0;
    for (index_t j = 0; j < cols; ++j)
      z += std::exp(static_cast<long double>(logits.data()[i * cols + j]));
    total -= static_cast<long double>(logits.data()[i * cols + t.data()[i]]) - std::log(z);
    ++n;
  }
  return n == 0 ? 0.0 : static_cast<double>(total / n);
}

Targets random_targets(index_t n, std::int32_t classes, Rng& rng) {
  Targets t({n});
  for (index_t i = 0; i < n; ++i)
    t(i) = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(classes)));
  return t;
}
}  // namespace

TEST_CASE("cross_entropy: matches the naive formula, with and without ignored rows") {
  Rng rng(21);
  auto logits = random_tensor<double>({6, 5}, rng, -3.0, 3.0);
  auto t = random_targets(6, 5, rng);
  Tensor<double> lp;
  const double loss = cross_entropy_forward(logits, t, lp);
  CHECK(loss == doctest::Approx(naive_cross_entropy(logits, t, -100)).epsilon(1e-13));
  REQUIRE(lp.shape() == logits.shape());
  for (index_t i = 0; i < 6; ++i) {
    double z = 0;
    for (index_t j = 0; j < 5; ++j) z += std::exp(logits(i, j));
    for (index_t j = 0; j < 5; ++j)
      CHECK(lp(i, j) == doctest::Approx(logits(i, j) - std::log(z)).epsilon(1e-13));
  }
  // Ignored rows leave the mean over the others; a custom ignore_index works the same way.
  t(1) = -100;
  t(4) = -100;
  const double loss_ign = cross_entropy_forward(logits, t, lp);
  CHECK(loss_ign == doctest::Approx(naive_cross_entropy(logits, t, -100)).epsilon(1e-13));
  CHECK(loss_ign != doctest::Approx(loss));
  t(1) = 7;
  t(4) = 7;
  CHECK(cross_entropy_forward(logits, t, lp, 7) == doctest::Approx(loss_ign).epsilon(1e-15));
  // A known value: uniform logits over C classes give log C.
  Tensor<double> flat({3, 8}), lp2;
  CHECK(cross_entropy_forward(flat, Targets::from({3}, {0, 5, 7}), lp2) ==
        doctest::Approx(std::log(8.0)));
}

TEST_CASE("cross_entropy: backward matches (softmax - onehot) * dloss / n, zero ignored rows") {
  Rng rng(22);
  auto logits = random_tensor<double>({5, 4}, rng, -2.0, 2.0);
  auto t = Targets::from({5}, {3, -100, 0, 2, -100});
  Tensor<double> lp;
  cross_entropy_forward(logits, t, lp);
  auto dlogits = Tensor<double>::full({5, 4}, 99.0);  // assigned, not accumulated
  cross_entropy_backward(lp, t, 2.5, dlogits);
  for (index_t i = 0; i < 5; ++i) {
    double z = 0;
    for (index_t j = 0; j < 4; ++j) z += std::exp(logits(i, j));
    for (index_t j = 0; j < 4; ++j) {
      const double expected =
          t(i) == -100 ? 0.0 : (std::exp(logits(i, j)) / z - (t(i) == j ? 1.0 : 0.0)) * 2.5 / 3.0;
      CHECK(dlogits(i, j) == doctest::Approx(expected).epsilon(1e-13));
    }
  }
}

TEST_CASE("cross_entropy: the forward reports the count, the backward takes it without a scan") {
  Rng rng(23);
  auto logits = random_tensor<double>({5, 4}, rng, -2.0, 2.0);
  auto t = Targets::from({5}, {3, -100, 0, 2, -100});
  Tensor<double> lp;
  index_t count = -7;
  cross_entropy_forward(logits, t, lp, -100, &count);
  CHECK(count == 3);
  Tensor<double> scanned, given;
  cross_entropy_backward(lp, t, 2.5, scanned);
  cross_entropy_backward(lp, t, 2.5, given, -100, count);
  CHECK(scanned.to_vector() == given.to_vector());
  // given: the targets are not scanned again; a bad one (changed since the forward) is no
  // out-of-range write, its row holds the softmax part only
  auto changed = Targets::from({5}, {3, -100, 9, 2, -100});
  Tensor<double> d2;
  cross_entropy_backward(lp, changed, 2.5, d2, -100, count);
  CHECK(d2(2, 0) == doctest::Approx(std::exp(lp(2, 0)) * 2.5 / 3.0));
  CHECK_THROWS_WITH_AS(cross_entropy_backward(lp, changed, 2.5, d2),  // scanned: refused
                       doctest::Contains("target of row 2 is 9"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy_backward(lp, t, 2.5, d2, -100, 6),
                       doctest::Contains("count = 6 exceeds the 5 rows of targets"), Error);
}

TEST_CASE("cross_entropy: gradient check (double)") {
  Rng rng(23);
  auto logits = random_tensor<double>({2, 3, 6}, rng, -2.0, 2.0);  // (B, T, V) with (B, T) targets
  auto t = Targets::from({2, 3}, {5, 0, -100, 2, 2, 4});
  const double dloss = 0.7;
  auto loss = [&] {
    Tensor<double> lp;
    return dloss * cross_entropy_forward(logits, t, lp);
  };
  Tensor<double> lp, dlogits;
  cross_entropy_forward(logits, t, lp);
  cross_entropy_backward(lp, t, dloss, dlogits);
  check_gradient("cross_entropy dlogits", logits, dlogits, loss);
}

TEST_CASE("cross_entropy: all rows ignored gives loss 0 and zero gradient") {
  Rng rng(24);
  auto logits = random_tensor<double>({3, 4}, rng);
  auto t = Targets::full({3}, -100);
  Tensor<double> lp;
  CHECK(cross_entropy_forward(logits, t, lp) == 0.0);
  auto d = Tensor<double>::full({3, 4}, 1.0);
  cross_entropy_backward(lp, t, 1.0, d);
  for (index_t i = 0; i < d.numel(); ++i) CHECK(d.data()[i] == 0.0);
}

TEST_CASE("cross_entropy: float agrees with double") {
  Rng rng(25);
  auto logits = random_tensor<double>({64, 257}, rng, -6.0, 6.0);
  auto t = random_targets(64, 257, rng);
  t(3) = -100;
  Tensor<double> lpd, dd;
  Tensor<float> lpf, df;
  const double ld = cross_entropy_forward(logits, t, lpd);
  const float lf = cross_entropy_forward(cast<float>(logits), t, lpf);
  cross_entropy_backward(lpd, t, 1.0, dd);
  cross_entropy_backward(lpf, t, 1.0f, df);
  CHECK(lf == doctest::Approx(ld).epsilon(1e-6));
  CHECK(max_rel_diff(lpf, lpd) < 1e-5);
  CHECK(max_rel_diff(df, dd) < 1e-7);
}

TEST_CASE("cross_entropy: numerical stability with logits around 1e4") {
  // Row 0: target is the largest logit, margins 1 and 2; row 1: target 2e4 below the maximum.
  auto logits = Tensor<float>::from({2, 3}, {1e4f, 1e4f - 1.0f, 1e4f - 2.0f, -1e4f, 0.0f, 1e4f});
  auto t = Targets::from({2}, {0, 0});
  Tensor<float> lp, d;
  const float loss = cross_entropy_forward(logits, t, lp);
  const double row0 = std::log(1.0 + std::exp(-1.0) + std::exp(-2.0));
  CHECK(std::isfinite(loss));
  CHECK(loss == doctest::Approx((row0 + 2e4) / 2).epsilon(1e-6));
  cross_entropy_backward(lp, t, 1.0f, d);
  for (index_t i = 0; i < d.numel(); ++i) CHECK(std::isfinite(d.data()[i]));
  CHECK(d(1, 0) == doctest::Approx(-0.5));
  CHECK(d(1, 2) == doctest::Approx(0.5));
}

TEST_CASE("cross_entropy: bad input") {
  Tensor<double> logits({4, 3}), lp, d;
  CHECK_THROWS_WITH_AS(cross_entropy_forward(logits, Targets::from({4}, {0, 1, 3, 2}), lp),
                       doctest::Contains("target of row 2 is 3, outside the class range [0, 3)"),
                       Error);
  CHECK_THROWS_WITH_AS(cross_entropy_forward(logits, Targets::from({4}, {0, -1, 1, 2}), lp),
                       doctest::Contains("target of row 1 is -1"), Error);
  CHECK_THROWS_WITH_AS(
      cross_entropy_forward(logits, Targets::from({3}, {0, 1, 2}), lp),
      doctest::Contains("targets has shape (3), expected (4) for logits of shape (4, 3)"), Error);
  // -100 is the default ignore_index only: with ignore_index = 5 it is an invalid target.
  CHECK_THROWS_WITH_AS(cross_entropy_forward(logits, Targets::from({4}, {0, -100, 1, 2}), lp, 5),
                       doctest::Contains("target of row 1 is -100"), Error);
  Tensor<double> lp_ok;
  cross_entropy_forward(logits, Targets::from({4}, {0, 1, 2, 2}), lp_ok);
  CHECK_THROWS_WITH_AS(cross_entropy_backward(lp_ok, Targets::from({4}, {0, 9, 2, 2}), 1.0, d),
                       doctest::Contains("cross_entropy_backward: target of row 1 is 9"), Error);
  Tensor<double> d_bad({3, 4});
  CHECK_THROWS_WITH_AS(cross_entropy_backward(lp_ok, Targets::from({4}, {0, 1, 2, 2}), 1.0, d_bad),
                       doctest::Contains("output dlogits has shape (3, 4), expected (4, 3)"),
                       Error);
  const double inf = std::numeric_limits<double>::infinity();
  auto masked = Tensor<double>::from({2, 2}, {0, 1, -inf, -inf});
  CHECK_THROWS_WITH_AS(cross_entropy_forward(masked, Targets::from({2}, {0, 1}), lp),
                       doctest::Contains("row 1 of logits (shape (2, 2)) is entirely -inf"), Error);
}

TEST_CASE("cross_entropy: the CPU system's target scan counts the rows and returns the first bad") {
  // Argument checks run once in ops/cross_entropy.hpp; the backend scans the targets and returns
  // the number of rows not ignored and the first bad target instead of throwing.
  const TargetScan ok = cross_entropy_scan_targets(cpu{}, Targets::from({4}, {0, -100, 2, 1}), 3,
                                                   -100);
  CHECK(ok.count == 3);
  CHECK(!ok.bad.found());
  const TargetScan bad = cross_entropy_scan_targets(cpu{}, Targets::from({4}, {0, 1, 3, -1}), 3,
                                                    -100);
  CHECK(bad.bad.found());
  CHECK(bad.bad.index == 2);
  CHECK(bad.bad.value == 3.0);
  const TargetScan all_ignored =
      cross_entropy_scan_targets(cpu{}, Targets::from({2}, {7, 7}), 3, 7);
  CHECK(all_ignored.count == 0);
  CHECK(!all_ignored.bad.found());
}
