// Softmax and log-softmax: naive per-row formula, gradient checks, float vs double, in-place use,
// thread-count independence, large logits, fully masked rows, bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/ops/softmax.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// Softmax (or log-softmax) of every row by the textbook formula in long double, no max shift.
Tensor<double> naive_softmax(const Tensor<double>& x, bool log) {
  Tensor<double> y(x.shape());
  const index_t rows = x.rows(), cols = x.cols();
  for (index_t r = 0; r < rows; ++r) {
    long double z = 0;
    for (index_t j = 0; j < cols; ++j)
      z += std::exp(static_cast<long double>(x.data()[r * cols + j]));
    for (index_t j = 0; j < cols; ++j) {
      const long double e = std::exp(static_cast<long double>(x.data()[r * cols + j]));
      y.data()[r * cols + j] = static_cast<double>(log ? std::log(e / z) : e / z);
    }
  }
  return y;
}
}  // namespace

TEST_CASE("softmax: matches the naive formula, rows sum to one, any rank") {
  Rng rng(11);
  auto x = random_tensor<double>({3, 4, 7}, rng, -3.0, 3.0);
  Tensor<double> y, ly;
  softmax_forward(x, y);
  log_softmax_forward(x, ly);
  REQUIRE(y.shape() == x.shape());
  REQUIRE(ly.shape() == x.shape());
  auto ny = naive_softmax(x, false);
  auto nly = naive_softmax(x, true);
  for (index_t i = 0; i < x.numel(); ++i) {
    CHECK(y.data()[i] == doctest::Approx(ny.data()[i]).epsilon(1e-13));
    CHECK(ly.data()[i] == doctest::Approx(nly.data()[i]).epsilon(1e-13));
  }
  for (index_t r = 0; r < x.rows(); ++r) {
    double s = 0;
    for (index_t j = 0; j < x.cols(); ++j) s += y.data()[r * x.cols() + j];
    CHECK(s == doctest::Approx(1.0).epsilon(1e-14));
  }
  // A known value: softmax(0, log 3) = (1/4, 3/4).
  auto two = Tensor<double>::from({1, 2}, {0.0, std::log(3.0)});
  Tensor<double> p;
  softmax_forward(two, p);
  CHECK(p(0, 0) == doctest::Approx(0.25).epsilon(1e-15));
  CHECK(p(0, 1) == doctest::Approx(0.75).epsilon(1e-15));
}

TEST_CASE("softmax: backward matches the naive Jacobian product") {
  Rng rng(12);
  auto x = random_tensor<double>({4, 6}, rng, -2.0, 2.0);
  auto dy = random_tensor<double>({4, 6}, rng);
  Tensor<double> y, dx, ly, ldx;
  softmax_forward(x, y);
  softmax_backward(y, dy, dx);
  log_softmax_forward(x, ly);
  log_softmax_backward(ly, dy, ldx);
  for (index_t r = 0; r < 4; ++r)
    for (index_t i = 0; i < 6; ++i) {
      // d softmax_j / d x_i = y_j (delta_ij - y_i);  d log_softmax_j / d x_i = delta_ij - y_i
      double s = 0, ls = 0;
      for (index_t j = 0; j < 6; ++j) {
        s += dy(r, j) * y(r, j) * ((i == j ? 1.0 : 0.0) - y(r, i));
        ls += dy(r, j) * ((i == j ? 1.0 : 0.0) - y(r, i));
      }
      CHECK(dx(r, i) == doctest::Approx(s).epsilon(1e-12));
      CHECK(ldx(r, i) == doctest::Approx(ls).epsilon(1e-12));
    }
}

TEST_CASE("softmax: gradient check (double)") {
  Rng rng(13);
  auto x = random_tensor<double>({3, 5}, rng, -2.0, 2.0);
  auto w = random_tensor<double>({3, 5}, rng);
  auto loss = [&] {
    Tensor<double> y;
    softmax_forward(x, y);
    return weighted_sum(y, w);
  };
  Tensor<double> y, dx = Tensor<double>::full({3, 5}, 123.0);  // assigned, not accumulated
  softmax_forward(x, y);
  softmax_backward(y, w, dx);
  check_gradient("softmax dx", x, dx, loss);
}

TEST_CASE("log_softmax: gradient check (double)") {
  Rng rng(14);
  auto x = random_tensor<double>({3, 5}, rng, -2.0, 2.0);
  auto w = random_tensor<double>({3, 5}, rng);
  auto loss = [&] {
    Tensor<double> y;
    log_softmax_forward(x, y);
    return weighted_sum(y, w);
  };
  Tensor<double> y, dx = Tensor<double>::full({3, 5}, -7.0);
  log_softmax_forward(x, y);
  log_softmax_backward(y, w, dx);
  check_gradient("log_softmax dx", x, dx, loss);
}

TEST_CASE("softmax: float agrees with double") {
  Rng rng(15);
  auto x = random_tensor<double>({32, 129}, rng, -8.0, 8.0);
  auto dy = random_tensor<double>({32, 129}, rng);
  Tensor<double> yd, dxd, lyd, ldxd;
  Tensor<float> yf, dxf, lyf, ldxf;
  softmax_forward(x, yd);
  softmax_backward(yd, dy, dxd);
  log_softmax_forward(x, lyd);
  log_softmax_backward(lyd, dy, ldxd);
  softmax_forward(cast<float>(x), yf);
  softmax_backward(yf, cast<float>(dy), dxf);
  log_softmax_forward(cast<float>(x), lyf);
  log_softmax_backward(lyf, cast<float>(dy), ldxf);
  CHECK(max_rel_diff(yf, yd) < 1e-6);
  CHECK(max_rel_diff(dxf, dxd) < 1e-6);
  CHECK(max_rel_diff(lyf, lyd) < 1e-5);
  CHECK(max_rel_diff(ldxf, ldxd) < 1e-6);
}

TEST_CASE("softmax: in place, and independent of the thread count") {
  Rng rng(16);
  auto x = random_tensor<double>({1000, 40}, rng, -4.0, 4.0);
  auto dy = random_tensor<double>({1000, 40}, rng);
  Tensor<double> y1, dx1;
  softmax_forward(x, y1);
  softmax_backward(y1, dy, dx1);
  set_num_threads(2);
  Tensor<double> y2, dx2;
  softmax_forward(x, y2);
  softmax_backward(y2, dy, dx2);
  set_num_threads(1);
  CHECK(max_rel_diff(y2, y1) == 0.0);
  CHECK(max_rel_diff(dx2, dx1) == 0.0);
  auto inplace = x.clone();
  softmax_forward(inplace, inplace);
  CHECK(max_rel_diff(inplace, y1) == 0.0);
  auto dinplace = dy.clone();
  softmax_backward(y1, dinplace, dinplace);
  CHECK(max_rel_diff(dinplace, dx1) == 0.0);
}

TEST_CASE("softmax: numerical stability with large logits and masked entries") {
  // Logits around 1e4 overflow a naive exp() in any precision; the max shift keeps them exact.
  auto big = Tensor<float>::from({2, 3}, {1e4f, 1e4f - 1.0f, 1e4f - 2.0f, -1e4f, 0.0f, 1e4f});
  Tensor<float> y, ly;
  softmax_forward(big, y);
  log_softmax_forward(big, ly);
  const double z = 1.0 + std::exp(-1.0) + std::exp(-2.0);
  CHECK(y(0, 0) == doctest::Approx(1.0 / z).epsilon(1e-6));
  CHECK(y(0, 2) == doctest::Approx(std::exp(-2.0) / z).epsilon(1e-6));
  CHECK(ly(0, 1) == doctest::Approx(-1.0 - std::log(z)).epsilon(1e-6));
  CHECK(y(1, 2) == 1.0f);
  CHECK(y(1, 0) == 0.0f);
  CHECK(ly(1, 2) == 0.0f);
  CHECK(ly(1, 1) == doctest::Approx(-1e4).epsilon(1e-7));
  for (index_t i = 0; i < 6; ++i) {
    CHECK(std::isfinite(y.data()[i]));
    CHECK(std::isfinite(ly.data()[i]));
  }
  // -inf entries (masked) get probability exactly 0; log-softmax keeps them at -inf and the
  // backward of both stays finite there.
  auto masked = Tensor<double>::from({1, 4}, {0.5, -kInf, 1.5, -kInf});
  Tensor<double> my, mly, mdx, mldx;
  softmax_forward(masked, my);
  log_softmax_forward(masked, mly);
  CHECK(my(0, 1) == 0.0);
  CHECK(my(0, 0) + my(0, 2) == doctest::Approx(1.0));
  CHECK(mly(0, 3) == -kInf);
  auto dy = Tensor<double>::from({1, 4}, {1, 2, 3, 4});
  softmax_backward(my, dy, mdx);
  log_softmax_backward(mly, dy, mldx);
  for (index_t j = 0; j < 4; ++j) {
    CHECK(std::isfinite(mdx(0, j)));
    CHECK(std::isfinite(mldx(0, j)));
  }
  CHECK(mdx(0, 1) == 0.0);
  CHECK(mldx(0, 3) == 4.0);  // dy - exp(-inf) * sum = dy
}

TEST_CASE("softmax: a fully masked row, +inf or NaN throws instead of writing NaN") {
  auto x = Tensor<double>::from({3, 3}, {0, 1, 2, -kInf, -kInf, -kInf, 3, 4, 5});
  Tensor<double> y;
  CHECK_THROWS_WITH_AS(softmax_forward(x, y),
                       doctest::Contains("row 1 of x (shape (3, 3)) is entirely -inf"), Error);
  Tensor<double> ly;
  CHECK_THROWS_WITH_AS(log_softmax_forward(x, ly), doctest::Contains("log_softmax_forward: row 1"),
                       Error);
  auto pinf = Tensor<float>::from({2, 2}, {0, 1, std::numeric_limits<float>::infinity(), 0});
  Tensor<float> yf;
  CHECK_THROWS_WITH_AS(softmax_forward(pinf, yf),
                       doctest::Contains("row 1 of x (shape (2, 2)) contains +inf"), Error);
  // A NaN anywhere in a row (here next to finite entries) would make the whole row NaN.
  auto nan = Tensor<double>::from({2, 3}, {0, 1, 2, 3, std::nan(""), 5});
  Tensor<double> ynan;
  CHECK_THROWS_WITH_AS(softmax_forward(nan, ynan),
                       doctest::Contains("row 1 of x (shape (2, 3)) contains NaN (1 entries)"),
                       Error);
  // In place, the offending row is left as it was (the message can still describe it).
  auto inplace = x.clone();
  CHECK_THROWS_AS(softmax_forward(inplace, inplace), Error);
  CHECK(inplace(1, 0) == -kInf);
}

TEST_CASE_TEMPLATE("softmax: the vectorised exp equals std::exp, masked entries exactly 0", T, float,
                   double) {
  // detail/vexp.hpp: Eigen's packet exp within a few ulp; std::exp outside its normal range
  // (so -inf gives exactly 0, and subnormal results, +inf and NaN are std::exp's).
  const T inf = std::numeric_limits<T>::infinity();
  for (index_t n : {index_t{0}, index_t{1}, index_t{255}, index_t{256}, index_t{700}}) {
    CAPTURE(n);
    std::vector<T> x(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i)
      x[static_cast<std::size_t>(i)] =
          static_cast<T>(-760.0 + 800.0 * static_cast<double>(i) / static_cast<double>(n));
    if (n == 700) {
      x[0] = -inf;
      x[1] = inf;
      x[2] = std::numeric_limits<T>::quiet_NaN();
      x[3] = static_cast<T>(-87.5);
      x[4] = static_cast<T>(-708.5);
      // around where exp rounds to 0 (detail::vexp_zero: 0 without calling std::exp below it);
      // x - shift below: -103.9, -103.98, -104.01 (float), -745.1, -745.2, -746.01 (double)
      for (int k = 0; k < 6; ++k)
        x[static_cast<std::size_t>(5 + k)] = static_cast<T>(
            -2.5 + std::vector<double>{-103.9, -103.98, -104.01, -745.1, -745.2, -746.01}[k]);
    }
    const T shift = static_cast<T>(-2.5);
    std::vector<T> y(x.size());
    const double sum = detail::exp_shifted(x.data(), shift, y.data(), n);
    const double sum_only = detail::sum_exp_shifted(x.data(), shift, n);
    std::vector<T> inplace = x;
    detail::exp_shifted(inplace.data(), shift, inplace.data(), n);
    double want_sum = 0;
    for (index_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const T want = std::exp(x[k] - shift);
      CAPTURE(x[k]);
      if (std::isnan(want)) {
        CHECK(std::isnan(y[k]));
        continue;
      }
      want_sum += static_cast<double>(want);
      if (want == T(0) || std::isinf(want))
        CHECK(y[k] == want);
      else
        CHECK(std::abs(static_cast<double>(y[k]) - static_cast<double>(want)) <=
              (sizeof(T) == 4 ? 3e-7 : 1e-15) * static_cast<double>(want));
      CHECK(inplace[k] == y[k]);
      if (x[k] == -inf) CHECK(y[k] == T(0));
    }
    if (n == 700) {
      CHECK(std::isnan(sum));
      CHECK(std::isnan(sum_only));
    } else {
      CHECK(sum == doctest::Approx(want_sum).epsilon(1e-6));
      CHECK(sum_only == sum);
    }
  }
}

TEST_CASE("softmax: bad input") {
  Tensor<double> x({2, 3}), y_bad({3, 2}), empty, dy_bad({2, 4}), dx;
  CHECK_THROWS_WITH_AS(softmax_forward(x, y_bad),
                       doctest::Contains("output y has shape (3, 2), expected (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(log_softmax_forward(empty, dx),
                       doctest::Contains("log_softmax_forward: x is empty"), Error);
  CHECK_THROWS_WITH_AS(
      softmax_backward(x, dy_bad, dx),
      doctest::Contains("softmax_backward: dy has shape (2, 4), expected y's shape (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(log_softmax_backward(x, dy_bad, dx),
                       doctest::Contains("dy has shape (2, 4)"), Error);
}
