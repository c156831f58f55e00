// The small ops that make layer bodies backend-independent (backend/cpu/elementwise.hpp) and the
// selector's gate ops (backend/cpu/gates.hpp): each against a direct loop, gradient checks for the
// ones with a backward, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>

#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gates.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using graphmoe::test::check_gradient;
using graphmoe::test::random_tensor;
using graphmoe::test::weighted_sum;

TEST_CASE("elementwise: add_row_vector, accumulate_column_sums, axpy, scale, fill") {
  Rng rng(1);
  const auto y0 = random_tensor<double>({3, 4, 5}, rng);
  const auto b = random_tensor<double>({5}, rng);
  Tensor<double> y = y0.clone();
  add_row_vector(b, y);
  for (index_t i = 0; i < 12; ++i)
    for (index_t j = 0; j < 5; ++j)
      CHECK(y.data()[i * 5 + j] == y0.data()[i * 5 + j] + b.data()[j]);

  Tensor<double> db = b.clone();
  accumulate_column_sums(y0, db);
  for (index_t j = 0; j < 5; ++j) {
    double s = b.data()[j];
    for (index_t i = 0; i < 12; ++i) s += y0.data()[i * 5 + j];
    CHECK(db.data()[j] == doctest::Approx(s).epsilon(1e-14));
  }

  // add: a new output with a's shape, a given one of any shape with as many elements, aliases
  Tensor<double> sum;
  add(y0, y, sum);
  CHECK(sum.shape() == y0.shape());
  for (index_t i = 0; i < sum.numel(); ++i) CHECK(sum.data()[i] == y0.data()[i] + y.data()[i]);
  Tensor<double> twice = y.clone();
  add(twice, twice, twice);
  for (index_t i = 0; i < y.numel(); ++i) CHECK(twice.data()[i] == 2 * y.data()[i]);
  CHECK_THROWS_WITH_AS(add(y0, Tensor<double>({3}), sum), doctest::Contains("same number"), Error);
  Tensor<double> wrong({12, 5});
  CHECK_THROWS_WITH_AS(add(y0, y, wrong), doctest::Contains("output out has shape (12, 5)"),
                       Error);

  Tensor<double> z = y0.clone();
  axpy(-0.5, y, z);
  for (index_t i = 0; i < z.numel(); ++i)
    CHECK(z.data()[i] == doctest::Approx(y0.data()[i] - 0.5 * y.data()[i]).epsilon(1e-15));
  scale(z, 2.0);
  fill(y, 7.0);
  for (index_t i = 0; i < y.numel(); ++i) CHECK(y.data()[i] == 7.0);
  CHECK(read_scalar(y) == 7.0);

  CHECK_THROWS_WITH_AS(add_row_vector(Tensor<double>({4}), y), doctest::Contains("b has shape (4)"),
                       Error);
  CHECK_THROWS_WITH_AS(axpy(1.0, Tensor<double>({3}), y), doctest::Contains("same number"), Error);
  CHECK_THROWS_WITH_AS(accumulate_column_sums(y, Tensor<double>({2})),
                       doctest::Contains("db has shape (2)"), Error);
}

TEST_CASE("elementwise: fill_normal draws the rng stream in flat order") {
  Rng a(5), b(5);
  Tensor<float> t({3, 7});
  fill_normal(t, a, 0.5);
  for (index_t i = 0; i < t.numel(); ++i)
    CHECK(t.data()[i] == static_cast<float>(b.normal(0.0, 0.5)));
}

TEST_CASE("elementwise: accumulate_dot, normalize_rows and its gradient check (double)") {
  Rng rng(2);
  const auto a = random_tensor<double>({4, 6}, rng), c = random_tensor<double>({4, 6}, rng);
  Tensor<double> d = Tensor<double>::from({1}, {0.25});
  accumulate_dot(a, c, 3.0, d);
  double s = 0;
  for (index_t i = 0; i < a.numel(); ++i) s += a.data()[i] * c.data()[i];
  CHECK(d.data()[0] == doctest::Approx(0.25 + 3.0 * s).epsilon(1e-14));
  CHECK_THROWS_WITH_AS(accumulate_dot(a, c, 1.0, Tensor<double>({2})),
                       doctest::Contains("expected one element"), Error);

  // Rows of several norms, one below eps (the clamped, linear branch).
  const double eps = 1e-3;
  auto x = random_tensor<double>({5, 6}, rng);
  for (index_t j = 0; j < 6; ++j) x(4, j) *= 1e-5;
  Tensor<double> y = x.clone(), norms;
  normalize_rows(y, norms, eps);
  for (index_t i = 0; i < 5; ++i) {
    double n2 = 0;
    for (index_t j = 0; j < 6; ++j) n2 += x(i, j) * x(i, j);
    const double n = std::max(std::sqrt(n2), eps);
    CHECK(norms(i) == doctest::Approx(n).epsilon(1e-14));
    for (index_t j = 0; j < 6; ++j) CHECK(y(i, j) == doctest::Approx(x(i, j) / n).epsilon(1e-13));
  }
  const auto w = random_tensor<double>({5, 6}, rng);
  Tensor<double> g = w.clone();
  normalize_rows_backward(y, norms, eps, g);
  auto loss = [&] {
    Tensor<double> yy = x.clone(), nn;
    normalize_rows(yy, nn, eps);
    return weighted_sum(yy, w);
  };
  check_gradient("normalize_rows dx", x, g, loss);
}

TEST_CASE("elementwise: patchify reads patches row-major, channels innermost") {
  // 2 images of 4 x 6 x 2, patch 2: 2 x 3 = 6 patches of 8 values each
  Tensor<float> images({2, 4, 6, 2});
  for (index_t i = 0; i < images.numel(); ++i) images.data()[i] = static_cast<float>(i);
  Tensor<float> patches;
  patchify(images, 2, 4, 6, 2, patches);
  REQUIRE(patches.shape() == Shape{12, 8});
  for (index_t b = 0; b < 2; ++b)
    for (index_t p = 0; p < 6; ++p)
      for (index_t y = 0; y < 2; ++y)
        for (index_t x = 0; x < 2; ++x)
          for (index_t c = 0; c < 2; ++c)
            CHECK(patches(b * 6 + p, (y * 2 + x) * 2 + c) == images(b, (p / 3) * 2 + y, (p % 3) * 2 + x, c));
  CHECK_THROWS_WITH_AS(patchify(images, 4, 4, 6, 2, patches), doctest::Contains("cannot be cut"),
                       Error);
}

TEST_CASE("gates: capacity mask in token order, renormalised gates and their gradient check") {
  // 4 tokens, k = 2, E = 3, capacity 2: expert 0 is chosen by tokens 0, 1 and 2 (dropped at 2)
  const auto idx = Tensor<std::int32_t>::from({4, 2}, {0, 1, 0, 2, 1, 0, 2, 1});
  Tensor<std::uint8_t> keep;
  capacity_mask(idx, 3, 2, keep);
  CHECK(count_dropped(keep) == 2);  // expert 0 at token 2, expert 1 at token 3
  const std::vector<std::uint8_t> expected = {1, 1, 1, 1, 1, 0, 1, 0};
  for (index_t a = 0; a < 8; ++a) CHECK(keep.data()[a] == expected[static_cast<std::size_t>(a)]);
  Tensor<std::uint8_t> all;
  capacity_mask(idx, 3, 0, all);
  CHECK(count_dropped(all) == 0);
  for (index_t a = 0; a < 8; ++a) CHECK(all.data()[a] == 1);
  Tensor<std::uint8_t> keep1;
  CHECK_THROWS_WITH_AS(capacity_mask(Tensor<std::int32_t>::from({1, 1}, {3}), 3, 1, keep1),
                       doctest::Contains("expert id 3"), Error);

  Tensor<std::int32_t> ids;
  route_dropped_to(idx, keep, 3, ids);
  for (index_t a = 0; a < 8; ++a) CHECK(ids.data()[a] == (keep.data()[a] ? idx.data()[a] : 3));

  Rng rng(3);
  auto values = random_tensor<double>({4, 2}, rng, 0.1, 1.0);
  Tensor<double> gates;
  renormalized_gates(values, keep, gates);
  for (index_t i = 0; i < 4; ++i)
    for (index_t j = 0; j < 2; ++j)
      CHECK(gates(i, j) == doctest::Approx(keep(i, j) ? values(i, j) / (values(i, 0) + values(i, 1)) : 0.0));
  // gradient through the selected values: dp at the selected experts equals dL/dvalues
  const auto w = random_tensor<double>({4, 2}, rng);
  Tensor<double> dp;
  renormalized_gates_backward(values, idx, keep, gates, w, 3, dp);
  Tensor<double> dvalues({4, 2});
  for (index_t a = 0; a < 8; ++a) dvalues.data()[a] = dp.data()[(a / 2) * 3 + idx.data()[a]];
  auto loss = [&] {
    Tensor<double> g;
    renormalized_gates(values, keep, g);
    return weighted_sum(g, w);
  };
  check_gradient("renormalized_gates dvalues", values, dvalues, loss);
  const auto zero = Tensor<double>::from({1, 2}, {0.0, 0.0});
  Tensor<double> g0;
  CHECK_THROWS_WITH_AS(renormalized_gates(zero, Tensor<std::uint8_t>::from({1, 2}, {1, 1}), g0),
                       doctest::Contains("sum to 0"), Error);
}
