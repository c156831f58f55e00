// GELU (tanh and erf forms): naive formula, gradient checks, float vs double, extreme inputs,
// bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "graphmoe/ops/gelu.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
const GeluForm kForms[] = {GeluForm::Tanh, GeluForm::Erf};
const char* form_name(GeluForm f) { return f == GeluForm::Tanh ? "tanh" : "erf"; }

// The textbook formulas in long double.
double naive_gelu(GeluForm form, double xd) {
  const long double x = xd;
  const long double pi = 3.14159265358979323846264338327950288L;
  if (form == GeluForm::Erf)
    return static_cast<double>(0.5L * x * (1.0L + std::erf(x / std::sqrt(2.0L))));
  return static_cast<double>(
      0.5L * x * (1.0L + std::tanh(std::sqrt(2.0L / pi) * (x + 0.044715L * x * x * x))));
}
double naive_gelu_derivative(GeluForm form, double xd) {
  const long double x = xd;
  const long double pi = 3.14159265358979323846264338327950288L;
  if (form == GeluForm::Erf)
    return static_cast<double>(0.5L * (1.0L + std::erf(x / std::sqrt(2.0L))) +
                               x * std::exp(-0.5L * x * x) / std::sqrt(2.0L * pi));
  const long double k = std::sqrt(2.0L / pi);
  const long double t = std::tanh(k * (x + 0.044715L * x * x * x));
  return static_cast<double>(0.5L * (1.0L + t) +
                             0.5L * x * (1.0L - t * t) * k * (1.0L + 3.0L * 0.044715L * x * x));
}
}  // namespace

TEST_CASE("gelu: forward and backward match the naive formulas") {
  Rng rng(41);
  auto x = random_tensor<double>({3, 50}, rng, -6.0, 6.0);
  x(0, 0) = 0.0;
  x(0, 1) = 1.0;
  auto dy = random_tensor<double>({3, 50}, rng);
  for (GeluForm form : kForms) {
    CAPTURE(form_name(form));
    Tensor<double> y, dx;
    gelu_forward(form, x, y);
    gelu_backward(form, x, dy, dx);
    REQUIRE(y.shape() == x.shape());
    for (index_t i = 0; i < x.numel(); ++i) {
      CHECK(y.data()[i] ==
            doctest::Approx(naive_gelu(form, x.data()[i])).epsilon(1e-13).scale(1e-3));
      CHECK(dx.data()[i] == doctest::Approx(dy.data()[i] * naive_gelu_derivative(form, x.data()[i]))
                                .epsilon(1e-13)
                                .scale(1e-3));
    }
    CHECK(y(0, 0) == 0.0);
    CHECK(dx(0, 0) == doctest::Approx(0.5 * dy(0, 0)).epsilon(1e-15));
  }
  // Known values: GELU_erf(1) = Phi(1) = 0.841344746...; the tanh form approximates it to ~1e-4.
  Tensor<double> one = Tensor<double>::from({1}, {1.0}), ye, yt;
  gelu_forward(GeluForm::Erf, one, ye);
  gelu_forward(GeluForm::Tanh, one, yt);
  CHECK(ye(0) == doctest::Approx(0.8413447460685429).epsilon(1e-15));
  CHECK(yt(0) == doctest::Approx(0.8411919906082768).epsilon(1e-14));
}

TEST_CASE("gelu: gradient check, both forms (double)") {
  Rng rng(42);
  for (GeluForm form : kForms) {
    CAPTURE(form_name(form));
    auto x = random_tensor<double>({4, 9}, rng, -4.0, 4.0);
    auto w = random_tensor<double>({4, 9}, rng);
    auto loss = [&] {
      Tensor<double> y;
      gelu_forward(form, x, y);
      return weighted_sum(y, w);
    };
    auto dx = Tensor<double>::full({4, 9}, 5.0);  // assigned
    gelu_backward(form, x, w, dx);
    check_gradient(std::string("gelu dx ") + form_name(form), x, dx, loss);
  }
}

TEST_CASE("gelu: float agrees with double, in place, any thread count") {
  Rng rng(43);
  auto x = random_tensor<double>({64, 1000}, rng, -8.0, 8.0);
  auto dy = random_tensor<double>({64, 1000}, rng);
  for (GeluForm form : kForms) {
    CAPTURE(form_name(form));
    Tensor<double> yd, dxd;
    Tensor<float> yf, dxf;
    gelu_forward(form, x, yd);
    gelu_backward(form, x, dy, dxd);
    gelu_forward(form, cast<float>(x), yf);
    gelu_backward(form, cast<float>(x), cast<float>(dy), dxf);
    CHECK(max_rel_diff(yf, yd) < 2e-6);
    CHECK(max_rel_diff(dxf, dxd) < 2e-6);
    set_num_threads(2);
    auto y2 = x.clone();
    gelu_forward(form, y2, y2);
    set_num_threads(1);
    CHECK(max_rel_diff(y2, yd) == 0.0);
  }
}

TEST_CASE("gelu: numerical stability at extreme inputs") {
  const float big = 1e20f;  // x^3 overflows float
  auto x = Tensor<float>::from({6}, {-big, -60.0f, -12.0f, 12.0f, 60.0f, big});
  auto dy = Tensor<float>::full({6}, 1.0f);
  for (GeluForm form : kForms) {
    CAPTURE(form_name(form));
    Tensor<float> y, dx;
    gelu_forward(form, x, y);
    gelu_backward(form, x, dy, dx);
    for (index_t i = 0; i < 6; ++i) {
      CHECK(std::isfinite(y(i)));
      CHECK(std::isfinite(dx(i)));
    }
    CHECK(y(0) == 0.0f);
    CHECK(y(5) == big);
    CHECK(y(4) == 60.0f);
    CHECK(dx(0) == 0.0f);
    CHECK(dx(5) == 1.0f);
    CHECK(dx(4) == 1.0f);
    // Large negative inputs: a tiny non-positive output.
    CHECK(y(2) <= 0.0f);
    CHECK(y(2) > -1e-20f);
  }
  // In double, x = -12 keeps the relative accuracy that 0.5 x (1 + erf) would lose entirely.
  Tensor<double> xd = Tensor<double>::from({1}, {-12.0}), yd;
  gelu_forward(GeluForm::Erf, xd, yd);
  CHECK(yd(0) == doctest::Approx(-12.0 * 0.5 * std::erfc(12.0 / std::sqrt(2.0))).epsilon(1e-13));
  CHECK(yd(0) < 0.0);
}

TEST_CASE_TEMPLATE("gelu: the vectorised tanh form equals the scalar formula elementwise", T,
                   float, double) {
  // Block edges (256 elements), in place, and the range where detail::gelu_tanh_block hands
  // elements to the scalar functions (|x| beyond about 9 in float, inf, NaN).
  const T inf = std::numeric_limits<T>::infinity();
  for (index_t n : {index_t{1}, index_t{255}, index_t{257}, index_t{5000}}) {
    CAPTURE(n);
    Tensor<T> x({n}), dy({n});
    for (index_t i = 0; i < n; ++i) {
      x(i) = static_cast<T>(-30.0 + 60.0 * static_cast<double>(i) / static_cast<double>(n));
      dy(i) = static_cast<T>(1.0 + 0.25 * static_cast<double>(i % 7));
    }
    if (n >= 257) {
      x(3) = -inf;
      x(100) = inf;
      x(200) = std::numeric_limits<T>::quiet_NaN();
      x(256) = static_cast<T>(-1e20);
    }
    Tensor<T> y, dx;
    gelu_forward(GeluForm::Tanh, x, y);
    gelu_backward(GeluForm::Tanh, x, dy, dx);
    auto inplace = x.clone();
    gelu_forward(GeluForm::Tanh, inplace, inplace);
    const double tol = sizeof(T) == 4 ? 4e-7 : 1e-15;
    for (index_t i = 0; i < n; ++i) {
      CAPTURE(x(i));
      const T want = detail::gelu_value(GeluForm::Tanh, x(i));
      const T dwant = dy(i) * detail::gelu_derivative(GeluForm::Tanh, x(i));
      // y relative to itself; dy gelu'(x) relative to dy (gelu' = s + 2 x s (1 - s) du/dx
      // cancels near its zero at x = -0.75)
      auto same = [&](T got, T ref, double scale) {
        if (std::isnan(ref)) return std::isnan(got);
        if (std::isinf(ref) || ref == T(0)) return got == ref;
        return std::abs(static_cast<double>(got) - static_cast<double>(ref)) <=
               tol * std::max(std::abs(static_cast<double>(ref)), scale);
      };
      CHECK(same(y(i), want, 0.0));
      CHECK(same(dx(i), dwant, static_cast<double>(dy(i))));
      CHECK((inplace(i) == y(i) || (std::isnan(y(i)) && std::isnan(inplace(i)))));
    }
  }
}

TEST_CASE("gelu: bad input") {
  Tensor<float> x({3, 4}), dy_bad({4, 3}), dx, y_bad({12}), empty;
  CHECK_THROWS_WITH_AS(
      gelu_backward(GeluForm::Tanh, x, dy_bad, dx),
      doctest::Contains("gelu_backward: dy has shape (4, 3), expected x's shape (3, 4)"), Error);
  CHECK_THROWS_WITH_AS(gelu_forward(GeluForm::Erf, x, y_bad),
                       doctest::Contains("output y has shape (12), expected (3, 4)"), Error);
  CHECK_THROWS_WITH_AS(gelu_forward(GeluForm::Erf, empty, dx),
                       doctest::Contains("gelu_forward: x is empty"), Error);
  CHECK_THROWS_WITH_AS(gelu_forward(static_cast<GeluForm>(7), x, dx),
                       doctest::Contains("unknown GeluForm 7"), Error);
}
