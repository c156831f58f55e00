// LayerNorm: naive formula, gradient checks for x, gamma and beta, accumulation contract,
// thread-count independence, float vs double, large offsets, bad input.
#include <doctest/doctest.h>

#include <cmath>

#include "graphmoe/ops/layernorm.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
// y_ij = (x_ij - mean_i) / sqrt(var_i + eps) * gamma_j + beta_j, in long double.
Tensor<double> naive_layernorm(const Tensor<double>& x, const Tensor<double>& gamma,
                               const Tensor<double>& beta, double eps) {
  Tensor<double> y(x.shape());
  const index_t n = x.rows(), d = x.cols();
  for (index_t i = 0; i < n; ++i) {
    long double mu = 0, var = 0;
    for (index_t j = 0; j < d; ++j) mu += x.data()[i * d + j];
    mu /= d;
    for (index_t j = 0; j < d; ++j) var += (x.data()[i * d + j] - mu) * (x.data()[i * d + j] - mu);
    var /= d;
    for (index_t j = 0; j < d; ++j)
      y.data()[i * d + j] = static_cast<double>(
          (x.data()[i * d + j] - mu) / std::sqrt(var + eps) * gamma(j) + beta(j));
  }
  return y;
}
}  // namespace

TEST_CASE("layernorm: forward matches the naive formula and fills mean and rstd") {
  Rng rng(31);
  auto x = random_tensor<double>({2, 3, 10}, rng, -2.0, 3.0);
  auto gamma = random_tensor<double>({10}, rng, 0.5, 1.5);
  auto beta = random_tensor<double>({10}, rng);
  const double eps = 1e-5;
  Tensor<double> y, mean, rstd;
  layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
  REQUIRE(mean.shape() == Shape{6});
  REQUIRE(rstd.shape() == Shape{6});
  auto ny = naive_layernorm(x, gamma, beta, eps);
  for (index_t i = 0; i < y.numel(); ++i)
    CHECK(y.data()[i] == doctest::Approx(ny.data()[i]).epsilon(1e-13));
  for (index_t i = 0; i < 6; ++i) {
    double mu = 0, var = 0;
    for (index_t j = 0; j < 10; ++j) mu += x.data()[i * 10 + j] / 10;
    for (index_t j = 0; j < 10; ++j)
      var += (x.data()[i * 10 + j] - mu) * (x.data()[i * 10 + j] - mu) / 10;
    CHECK(mean(i) == doctest::Approx(mu).epsilon(1e-14));
    CHECK(rstd(i) == doctest::Approx(1 / std::sqrt(var + eps)).epsilon(1e-13));
  }
  // With gamma = 1, beta = 0 each row has mean 0 and variance var / (var + eps).
  Tensor<double> y1, m1, r1;
  layernorm_forward(x, Tensor<double>::full({10}, 1.0), Tensor<double>({10}), eps, y1, m1, r1);
  double s = 0, sq = 0;
  for (index_t j = 0; j < 10; ++j) {
    s += y1.data()[j];
    sq += y1.data()[j] * y1.data()[j];
  }
  CHECK(std::abs(s) < 1e-12);
  CHECK(sq / 10 == doctest::Approx(1.0).epsilon(1e-3));
}

TEST_CASE("layernorm: gradient check for x, gamma and beta (double)") {
  Rng rng(32);
  auto x = random_tensor<double>({5, 7}, rng, -2.0, 2.0);
  auto gamma = random_tensor<double>({7}, rng, 0.5, 1.5);
  auto beta = random_tensor<double>({7}, rng);
  auto w = random_tensor<double>({5, 7}, rng);
  const double eps = 1e-5;
  auto loss = [&] {
    Tensor<double> y, mean, rstd;
    layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
    return weighted_sum(y, w);
  };
  Tensor<double> y, mean, rstd;
  layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
  auto dx = Tensor<double>::full({5, 7}, 42.0);  // assigned
  Tensor<double> dgamma({7}), dbeta({7});        // accumulated into zeros
  layernorm_backward(x, gamma, mean, rstd, w, dx, dgamma, dbeta);
  check_gradient("layernorm dx", x, dx, loss);
  check_gradient("layernorm dgamma", gamma, dgamma, loss);
  check_gradient("layernorm dbeta", beta, dbeta, loss);
}

TEST_CASE("layernorm: dx is assigned, dgamma and dbeta accumulate") {
  Rng rng(33);
  auto x = random_tensor<double>({9, 6}, rng);
  auto gamma = random_tensor<double>({6}, rng);
  auto beta = random_tensor<double>({6}, rng);
  auto dy = random_tensor<double>({9, 6}, rng);
  Tensor<double> y, mean, rstd;
  layernorm_forward(x, gamma, beta, 1e-5, y, mean, rstd);
  Tensor<double> dx1, dg1, db1;  // empty: allocated as zeros
  layernorm_backward(x, gamma, mean, rstd, dy, dx1, dg1, db1);
  REQUIRE(dg1.shape() == Shape{6});
  auto dx2 = dx1.clone(), dg2 = dg1.clone(), db2 = db1.clone();
  layernorm_backward(x, gamma, mean, rstd, dy, dx2, dg2, db2);
  for (index_t i = 0; i < dx1.numel(); ++i) CHECK(dx2.data()[i] == dx1.data()[i]);
  for (index_t j = 0; j < 6; ++j) {
    CHECK(dg2(j) == doctest::Approx(2 * dg1(j)).epsilon(1e-15));
    CHECK(db2(j) == doctest::Approx(2 * db1(j)).epsilon(1e-15));
    double sb = 0;
    for (index_t i = 0; i < 9; ++i) sb += dy(i, j);
    CHECK(db1(j) == doctest::Approx(sb).epsilon(1e-14));
  }
}

TEST_CASE("layernorm: results do not depend on the thread count, in place works") {
  Rng rng(34);
  auto x = random_tensor<double>({1100, 48}, rng, -3.0, 3.0);
  auto gamma = random_tensor<double>({48}, rng);
  auto beta = random_tensor<double>({48}, rng);
  auto dy = random_tensor<double>({1100, 48}, rng);
  Tensor<double> y1, m1, r1, dx1, dg1, db1;
  layernorm_forward(x, gamma, beta, 1e-5, y1, m1, r1);
  layernorm_backward(x, gamma, m1, r1, dy, dx1, dg1, db1);
  set_num_threads(2);
  Tensor<double> y2, m2, r2, dx2, dg2, db2;
  layernorm_forward(x, gamma, beta, 1e-5, y2, m2, r2);
  layernorm_backward(x, gamma, m2, r2, dy, dx2, dg2, db2);
  set_num_threads(1);
  CHECK(max_rel_diff(y2, y1) == 0.0);
  CHECK(max_rel_diff(dx2, dx1) == 0.0);
  CHECK(max_rel_diff(dg2, dg1) == 0.0);  // bit-identical: fixed blocks, reduced in order
  CHECK(max_rel_diff(db2, db1) == 0.0);
  auto xi = x.clone();
  Tensor<double> mi, ri;
  layernorm_forward(xi, gamma, beta, 1e-5, xi, mi, ri);
  CHECK(max_rel_diff(xi, y1) == 0.0);
  auto dyi = dy.clone();
  Tensor<double> dgi, dbi;
  layernorm_backward(x, gamma, m1, r1, dyi, dyi, dgi, dbi);
  CHECK(max_rel_diff(dyi, dx1) == 0.0);
  CHECK(max_rel_diff(dgi, dg1) == 0.0);
}

TEST_CASE("layernorm: float agrees with double") {
  Rng rng(35);
  auto x = random_tensor<double>({200, 96}, rng, -3.0, 3.0);
  auto gamma = random_tensor<double>({96}, rng, 0.5, 1.5);
  auto beta = random_tensor<double>({96}, rng);
  auto dy = random_tensor<double>({200, 96}, rng);
  Tensor<double> yd, md, rd, dxd, dgd, dbd;
  Tensor<float> yf, mf, rf, dxf, dgf, dbf;
  layernorm_forward(x, gamma, beta, 1e-5, yd, md, rd);
  layernorm_backward(x, gamma, md, rd, dy, dxd, dgd, dbd);
  const auto xf = cast<float>(x), gf = cast<float>(gamma);
  layernorm_forward(xf, gf, cast<float>(beta), 1e-5f, yf, mf, rf);
  layernorm_backward(xf, gf, mf, rf, cast<float>(dy), dxf, dgf, dbf);
  CHECK(max_rel_diff(yf, yd) < 2e-6);
  CHECK(max_rel_diff(rf, rd) < 2e-6);
  CHECK(max_rel_diff(dxf, dxd) < 1e-5);
  CHECK(max_rel_diff(dgf, dgd) < 1e-5);
  CHECK(max_rel_diff(dbf, dbd) < 1e-5);
}

TEST_CASE("layernorm: numerical stability with a large common offset and constant rows") {
  // x = 1e4 + small noise: a one-pass E[x^2] - E[x]^2 in float would lose every digit of the
  // variance; the two-pass double accumulation keeps float output at float resolution.
  Rng rng(36);
  auto noise = random_tensor<double>({4, 64}, rng, -1.0, 1.0);
  Tensor<double> xd(noise.shape());
  for (index_t i = 0; i < xd.numel(); ++i) xd.data()[i] = 1e4 + noise.data()[i];
  auto ones = Tensor<double>::full({64}, 1.0);
  Tensor<double> zeros({64});
  Tensor<double> yd, md, rd;
  layernorm_forward(xd, ones, zeros, 1e-5, yd, md, rd);
  Tensor<float> yf, mf, rf;
  layernorm_forward(cast<float>(xd), cast<float>(ones), cast<float>(zeros), 1e-5f, yf, mf, rf);
  CHECK(max_rel_diff(yf, yd) < 2e-3);  // limited by float's resolution of 1e4 + noise (~5e-4)
  // A constant row has variance 0: rstd = 1 / sqrt(eps), y = beta, gradients finite.
  auto c = Tensor<float>::full({2, 8}, 3.0f);
  auto g = Tensor<float>::full({8}, 2.0f);
  auto b = Tensor<float>::full({8}, 0.25f);
  Tensor<float> y, m, r, dx, dg, db;
  layernorm_forward(c, g, b, 1e-5f, y, m, r);
  CHECK(r(0) == doctest::Approx(1 / std::sqrt(1e-5)).epsilon(1e-6));
  for (index_t i = 0; i < y.numel(); ++i) CHECK(y.data()[i] == 0.25f);
  layernorm_backward(c, g, m, r, Tensor<float>::full({2, 8}, 1.0f), dx, dg, db);
  for (index_t i = 0; i < dx.numel(); ++i) CHECK(std::isfinite(dx.data()[i]));
}

TEST_CASE("layernorm: bad input") {
  Tensor<double> x({4, 5}), g({5}), b({5}), y, m, r;
  Tensor<double> g_bad({4});
  CHECK_THROWS_WITH_AS(layernorm_forward(x, g_bad, b, 1e-5, y, m, r),
                       doctest::Contains("layernorm_forward: gamma has shape (4), expected (5)"),
                       Error);
  CHECK_THROWS_WITH_AS(layernorm_forward(x, g, b, 0.0, y, m, r),
                       doctest::Contains("eps must be positive and finite, got 0"), Error);
  CHECK_THROWS_WITH_AS(layernorm_forward(x, g, b, -1e-5, y, m, r),
                       doctest::Contains("eps must be positive"), Error);
  Tensor<double> m_bad({5});
  CHECK_THROWS_WITH_AS(layernorm_forward(x, g, b, 1e-5, y, m_bad, r),
                       doctest::Contains("output mean has shape (5), expected (4)"), Error);
  layernorm_forward(x, g, b, 1e-5, y, m, r);
  Tensor<double> dy_bad({5, 4}), dx, dg, db;
  CHECK_THROWS_WITH_AS(
      layernorm_backward(x, g, m, r, dy_bad, dx, dg, db),
      doctest::Contains("layernorm_backward: dy has shape (5, 4), expected (4, 5)"), Error);
  Tensor<double> dy({4, 5}), dg_bad({6});
  CHECK_THROWS_WITH_AS(layernorm_backward(x, g, m, r, dy, dx, dg_bad, db),
                       doctest::Contains("output dgamma has shape (6), expected (5)"), Error);
  CHECK_THROWS_WITH_AS(layernorm_backward(x, g, r.slice(0, 3), r, dy, dx, dg, db),
                       doctest::Contains("mean has shape (3), expected (4)"), Error);
  Tensor<double> empty;
  CHECK_THROWS_WITH_AS(layernorm_forward(empty, g, b, 1e-5, y, m, r),
                       doctest::Contains("an empty tensor"), Error);
}
