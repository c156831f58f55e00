// Top-k: selection against a naive stable sort for every k; the tie rule; infinities; gradient
// check; thread independence; float vs double; bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "graphmoe/ops/topk.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
// Column order of row r by descending value, equal values by ascending column.
template <class T>
std::vector<index_t> naive_order(const Tensor<T>& x, index_t r) {
  const index_t e = x.dim(1);
  std::vector<index_t> order(static_cast<std::size_t>(e));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](index_t a, index_t b) { return x(r, a) > x(r, b); });
  return order;
}

template <class T>
void check_against_naive(const Tensor<T>& x, index_t k) {
  Tensor<T> values;
  Tensor<std::int32_t> indices;
  topk_forward(x, k, values, indices);
  REQUIRE(values.shape() == Shape{x.dim(0), k});
  REQUIRE(indices.shape() == Shape{x.dim(0), k});
  for (index_t r = 0; r < x.dim(0); ++r) {
    const auto order = naive_order(x, r);
    for (index_t j = 0; j < k; ++j) {
      CHECK(indices(r, j) == order[static_cast<std::size_t>(j)]);
      CHECK(values(r, j) == x(r, order[static_cast<std::size_t>(j)]));
    }
  }
}
}  // namespace

TEST_CASE("topk: matches a naive stable sort for every k") {
  Rng rng(21);
  auto x = random_tensor<double>({9, 8}, rng);
  for (index_t k = 1; k <= 8; ++k) {
    CAPTURE(k);
    check_against_naive(x, k);
  }
  // Rounded values: many ties
  auto xt = random_tensor<float>({50, 16}, rng, 0.0, 4.0);
  for (index_t i = 0; i < xt.numel(); ++i) xt.data()[i] = std::floor(xt.data()[i]);
  for (index_t k : {1, 2, 3, 16}) {
    CAPTURE(k);
    check_against_naive(xt, k);
  }
}

TEST_CASE("topk: ties go to the lower index, which comes first") {
  auto x = Tensor<float>::from({3, 5}, {1, 3, 2, 3, 3,     //
                                        7, 7, 7, 7, 7,     //
                                        0, 5, -1, 5, 4});
  Tensor<float> values;
  Tensor<std::int32_t> indices;
  topk_forward(x, 2, values, indices);
  CHECK(indices.to_vector() == std::vector<std::int32_t>{1, 3, 0, 1, 1, 3});
  CHECK(values.to_vector() == std::vector<float>{3, 3, 7, 7, 5, 5});
  Tensor<float> values4;
  Tensor<std::int32_t> indices4;
  topk_forward(x, 4, values4, indices4);
  CHECK(indices4.to_vector() ==
        std::vector<std::int32_t>{1, 3, 4, 2, 0, 1, 2, 3, 1, 3, 4, 0});
}

TEST_CASE("topk: infinities are ordinary values") {
  const float inf = std::numeric_limits<float>::infinity();
  auto x = Tensor<float>::from({2, 4}, {-inf, -inf, -inf, -inf, 1, inf, -inf, inf});
  Tensor<float> values;
  Tensor<std::int32_t> indices;
  topk_forward(x, 3, values, indices);
  CHECK(indices.to_vector() == std::vector<std::int32_t>{0, 1, 2, 1, 3, 0});
  CHECK(values(1, 0) == inf);
  CHECK(values(1, 2) == 1.0f);
}

TEST_CASE("topk: gradient check (double)") {
  Rng rng(22);
  auto x = random_tensor<double>({6, 8}, rng);  // distinct values: selection is locally constant
  for (index_t k : {1, 2, 5}) {
    CAPTURE(k);
    auto w = random_tensor<double>({6, k}, rng);
    auto loss = [&] {
      Tensor<double> values;
      Tensor<std::int32_t> indices;
      topk_forward(x, k, values, indices);
      return weighted_sum(values, w);
    };
    Tensor<double> values;
    Tensor<std::int32_t> indices;
    topk_forward(x, k, values, indices);
    auto dx = Tensor<double>::full({6, 8}, 99.0);  // stale contents must be overwritten
    topk_backward(indices, w, dx);
    check_gradient("dx", x, dx, loss);
  }
}

TEST_CASE("topk: results do not depend on the thread count") {
  Rng rng(23);
  auto x = random_tensor<float>({3000, 16}, rng);
  Tensor<float> v1, v2;
  Tensor<std::int32_t> i1, i2;
  topk_forward(x, 2, v1, i1);
  set_num_threads(2);
  topk_forward(x, 2, v2, i2);
  set_num_threads(1);
  CHECK(v1.to_vector() == v2.to_vector());
  CHECK(i1.to_vector() == i2.to_vector());
}

TEST_CASE("topk: float agrees with double") {
  Rng rng(24);
  auto x = random_tensor<double>({40, 32}, rng);
  Tensor<double> vd;
  Tensor<float> vf;
  Tensor<std::int32_t> id, jf;
  topk_forward(x, 2, vd, id);
  topk_forward(cast<float>(x), 2, vf, jf);
  CHECK(id.to_vector() == jf.to_vector());
  CHECK(max_rel_diff(vf, vd) < 1e-7);
  auto dv = random_tensor<double>({40, 2}, rng);
  Tensor<double> dxd({40, 32});
  Tensor<float> dxf({40, 32});
  topk_backward(id, dv, dxd);
  topk_backward(jf, cast<float>(dv), dxf);
  CHECK(max_rel_diff(dxf, dxd) < 1e-7);
}

TEST_CASE("topk: bad input") {
  Tensor<float> x({4, 8});
  Tensor<float> values;
  Tensor<std::int32_t> indices;
  CHECK_THROWS_WITH_AS(topk_forward(x, 9, values, indices),
                       doctest::Contains("k = 9 is out of range [1, E = 8]"), Error);
  CHECK_THROWS_WITH_AS(topk_forward(x, 0, values, indices),
                       doctest::Contains("k = 0 is out of range"), Error);
  x(2, 5) = std::numeric_limits<float>::quiet_NaN();
  x(3, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(topk_forward(x, 2, values, indices),
                       doctest::Contains("NaN at row 2, column 5"), Error);
  Tensor<float> x3({2, 3, 4}), v_wrong({4, 3});
  CHECK_THROWS_WITH_AS(topk_forward(x3, 2, values, indices), doctest::Contains("(N, E) matrix"),
                       Error);
  Tensor<float> ok({4, 8});
  Tensor<std::int32_t> none;
  CHECK_THROWS_WITH_AS(topk_forward(ok, 2, v_wrong, none),
                       doctest::Contains("output values has shape (4, 3), expected (4, 2)"), Error);

  auto idx = Tensor<std::int32_t>::from({2, 2}, {0, 3, 8, 1});
  Tensor<float> dv({2, 2}), dx({2, 8});
  CHECK_THROWS_WITH_AS(topk_backward(idx, dv, dx),
                       doctest::Contains("index 8 at row 1, slot 0 is out of range"), Error);
  Tensor<float> dv_wrong({2, 3});
  CHECK_THROWS_WITH_AS(topk_backward(idx, dv_wrong, dx),
                       doctest::Contains("dvalues has shape (2, 3), expected (2, 2)"), Error);
  Tensor<float> dx_wrong({3, 8});
  CHECK_THROWS_WITH_AS(topk_backward(idx, dv, dx_wrong), doctest::Contains("dx has shape (3, 8) but indices (2, 2) have 2 rows"), Error);
}
