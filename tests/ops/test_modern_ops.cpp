// RMSNorm, rotary position embeddings and SwiGLU (the ops of Llama-style models): naive
// loop-by-loop evaluations in long double / double, finite-difference gradient checks for every
// input with a gradient, the accumulation and aliasing contracts, thread-count independence,
// float vs double, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/threads.hpp"
#include "graphmoe/ops/heads.hpp"
#include "graphmoe/ops/rmsnorm.hpp"
#include "graphmoe/ops/rope.hpp"
#include "graphmoe/ops/swiglu.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// ---- rmsnorm ------------------------------------------------------------------------------------

// y_ij = x_ij / sqrt(mean_j x_ij^2 + eps) * w_j, in long double; inv_rms into r.
Tensor<double> naive_rmsnorm(const Tensor<double>& x, const Tensor<double>& w, double eps,
                             Tensor<double>& r) {
  Tensor<double> y(x.shape());
  const index_t n = x.rows(), d = x.cols();
  r = Tensor<double>(Shape{n});
  for (index_t i = 0; i < n; ++i) {
    long double ss = 0;
    for (index_t j = 0; j < d; ++j)
      ss += static_cast<long double>(x.data()[i * d + j]) * x.data()[i * d + j];
    const long double inv = 1.0L / std::sqrt(ss / d + eps);
    r.data()[i] = static_cast<double>(inv);
    for (index_t j = 0; j < d; ++j)
      y.data()[i * d + j] = static_cast<double>(x.data()[i * d + j] * inv * w.data()[j]);
  }
  return y;
}

Tensor<std::int32_t> make_positions(std::vector<std::int32_t> p) {
  Tensor<std::int32_t> t(Shape{static_cast<index_t>(p.size())});
  for (std::size_t i = 0; i < p.size(); ++i) t.data()[i] = p[i];
  return t;
}

// ---- rope ---------------------------------------------------------------------------------------

// The rotation of one head at position pos, as an explicit dh x dh matrix R (y = R x), for the
// layout's pairs (a, b): R_aa = R_bb = cos, R_ab = -sin, R_ba = sin.
std::vector<double> rope_matrix(index_t dh, std::int32_t pos, double theta, RopeLayout layout) {
  std::vector<double> r(static_cast<std::size_t>(dh * dh), 0.0);
  for (index_t i = 0; i < dh / 2; ++i) {
    const index_t a = layout == RopeLayout::HalfSplit ? i : 2 * i;
    const index_t b = layout == RopeLayout::HalfSplit ? i + dh / 2 : 2 * i + 1;
    const double freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / dh);
    const double angle = pos * freq;
    r[a * dh + a] = std::cos(angle);
    r[b * dh + b] = std::cos(angle);
    r[a * dh + b] = -std::sin(angle);
    r[b * dh + a] = std::sin(angle);
  }
  return r;
}

// y = R x per head (transpose = false) or R^T x (transpose = true).
Tensor<double> naive_rope(const Tensor<double>& x, const Tensor<std::int32_t>& pos, index_t heads,
                          double theta, RopeLayout layout, bool transpose) {
  Tensor<double> y(x.shape());
  const index_t n = x.rows(), cols = x.cols(), dh = cols / heads;
  for (index_t i = 0; i < n; ++i) {
    const auto r = rope_matrix(dh, pos.data()[i], theta, layout);
    for (index_t h = 0; h < heads; ++h)
      for (index_t a = 0; a < dh; ++a) {
        double s = 0;
        for (index_t b = 0; b < dh; ++b)
          s += (transpose ? r[b * dh + a] : r[a * dh + b]) * x.data()[i * cols + h * dh + b];
        y.data()[i * cols + h * dh + a] = s;
      }
  }
  return y;
}

// x in the Interleaved order (2i, 2i+1) moved to the HalfSplit order (i, i + dh/2), per head.
Tensor<double> interleaved_to_half(const Tensor<double>& x, index_t heads) {
  Tensor<double> y(x.shape());
  const index_t n = x.rows(), cols = x.cols(), dh = cols / heads;
  for (index_t i = 0; i < n; ++i)
    for (index_t h = 0; h < heads; ++h)
      for (index_t p = 0; p < dh / 2; ++p) {
        y.data()[i * cols + h * dh + p] = x.data()[i * cols + h * dh + 2 * p];
        y.data()[i * cols + h * dh + p + dh / 2] = x.data()[i * cols + h * dh + 2 * p + 1];
      }
  return y;
}

const RopeLayout kLayouts[] = {RopeLayout::HalfSplit, RopeLayout::Interleaved};

// ---- swiglu -------------------------------------------------------------------------------------

double naive_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

// ================================== rmsnorm ======================================================

TEST_CASE("rmsnorm: forward matches the naive formula and fills inv_rms") {
  Rng rng(41);
  auto x = random_tensor<double>({2, 3, 10}, rng, -2.0, 3.0);
  auto w = random_tensor<double>({10}, rng, 0.5, 1.5);
  const double eps = 1e-6;
  Tensor<double> y, r, nr;
  rmsnorm_forward(x, w, eps, y, r);
  REQUIRE(y.shape() == x.shape());
  REQUIRE(r.shape() == Shape{6});
  const auto ny = naive_rmsnorm(x, w, eps, nr);
  for (index_t i = 0; i < y.numel(); ++i)
    CHECK(y.data()[i] == doctest::Approx(ny.data()[i]).epsilon(1e-14));
  for (index_t i = 0; i < 6; ++i) CHECK(r(i) == doctest::Approx(nr(i)).epsilon(1e-14));
  // a known value: the row (3, 4) has mean square 12.5
  Tensor<double> x2({1, 2});
  x2.data()[0] = 3;
  x2.data()[1] = 4;
  Tensor<double> y2, r2;
  rmsnorm_forward(x2, Tensor<double>::full({2}, 2.0), 0.5, y2, r2);
  CHECK(r2(0) == doctest::Approx(1.0 / std::sqrt(13.0)).epsilon(1e-15));
  CHECK(y2.data()[1] == doctest::Approx(8.0 / std::sqrt(13.0)).epsilon(1e-15));
}

TEST_CASE("rmsnorm: gradient check for x and weight (double)") {
  Rng rng(42);
  auto x = random_tensor<double>({5, 7}, rng, -2.0, 2.0);
  auto w = random_tensor<double>({7}, rng, 0.5, 1.5);
  auto dy = random_tensor<double>({5, 7}, rng);
  const double eps = 1e-5;
  auto loss = [&] {
    Tensor<double> y, r;
    rmsnorm_forward(x, w, eps, y, r);
    return weighted_sum(y, dy);
  };
  Tensor<double> y, r;
  rmsnorm_forward(x, w, eps, y, r);
  auto dx = Tensor<double>::full({5, 7}, 42.0);  // assigned
  Tensor<double> dw({7});                          // accumulated into zeros
  rmsnorm_backward(x, w, r, dy, dx, dw);
  check_gradient("rmsnorm dx", x, dx, loss);
  check_gradient("rmsnorm dweight", w, dw, loss);
}

TEST_CASE("rmsnorm: dx is assigned, dweight accumulates, thread count and aliasing") {
  Rng rng(43);
  auto x = random_tensor<double>({1100, 48}, rng, -3.0, 3.0);
  auto w = random_tensor<double>({48}, rng);
  auto dy = random_tensor<double>({1100, 48}, rng);
  Tensor<double> y1, r1, dx1, dw1;  // dw1 empty: allocated as zeros
  rmsnorm_forward(x, w, 1e-5, y1, r1);
  rmsnorm_backward(x, w, r1, dy, dx1, dw1);
  REQUIRE(dw1.shape() == Shape{48});
  auto dx2 = dx1.clone(), dw2 = dw1.clone();
  rmsnorm_backward(x, w, r1, dy, dx2, dw2);
  CHECK(max_rel_diff(dx2, dx1) == 0.0);
  for (index_t j = 0; j < 48; ++j) {
    CHECK(dw2(j) == doctest::Approx(2 * dw1(j)).epsilon(1e-15));
    double s = 0;  // dweight_j = sum_i dy_ij x_ij inv_rms_i
    for (index_t i = 0; i < 1100; ++i) s += dy(i, j) * x(i, j) * r1(i);
    CHECK(dw1(j) == doctest::Approx(s).epsilon(1e-12));
  }
  set_num_threads(2);
  Tensor<double> y3, r3, dx3, dw3;
  rmsnorm_forward(x, w, 1e-5, y3, r3);
  rmsnorm_backward(x, w, r3, dy, dx3, dw3);
  set_num_threads(1);
  CHECK(max_rel_diff(y3, y1) == 0.0);
  CHECK(max_rel_diff(dx3, dx1) == 0.0);
  CHECK(max_rel_diff(dw3, dw1) == 0.0);  // bit-identical: fixed blocks, reduced in order
  auto xi = x.clone();
  Tensor<double> ri;
  rmsnorm_forward(xi, w, 1e-5, xi, ri);
  CHECK(max_rel_diff(xi, y1) == 0.0);
  auto dyi = dy.clone();
  Tensor<double> dwi;
  rmsnorm_backward(x, w, r1, dyi, dyi, dwi);
  CHECK(max_rel_diff(dyi, dx1) == 0.0);
  CHECK(max_rel_diff(dwi, dw1) == 0.0);
}

TEST_CASE("rmsnorm: float agrees with double, a zero row stays finite") {
  Rng rng(44);
  auto x = random_tensor<double>({200, 96}, rng, -3.0, 3.0);
  auto w = random_tensor<double>({96}, rng, 0.5, 1.5);
  auto dy = random_tensor<double>({200, 96}, rng);
  Tensor<double> yd, rd, dxd, dwd;
  Tensor<float> yf, rf, dxf, dwf;
  rmsnorm_forward(x, w, 1e-6, yd, rd);
  rmsnorm_backward(x, w, rd, dy, dxd, dwd);
  const auto xf = cast<float>(x), wf = cast<float>(w);
  rmsnorm_forward(xf, wf, 1e-6, yf, rf);
  rmsnorm_backward(xf, wf, rf, cast<float>(dy), dxf, dwf);
  CHECK(max_rel_diff(yf, yd) < 2e-6);
  CHECK(max_rel_diff(rf, rd) < 2e-6);
  CHECK(max_rel_diff(dxf, dxd) < 1e-5);
  CHECK(max_rel_diff(dwf, dwd) < 1e-5);
  Tensor<float> z({2, 8}), y, r, dx, dw;
  rmsnorm_forward(z, Tensor<float>::full({8}, 1.0f), 1e-6, y, r);
  CHECK(r(0) == doctest::Approx(1 / std::sqrt(1e-6)).epsilon(1e-6));
  rmsnorm_backward(z, Tensor<float>::full({8}, 1.0f), r, Tensor<float>::full({2, 8}, 1.0f), dx, dw);
  for (index_t i = 0; i < dx.numel(); ++i) CHECK(std::isfinite(dx.data()[i]));
}

TEST_CASE("rmsnorm: bad input") {
  Tensor<double> x({4, 5}), w({5}), y, r;
  CHECK_THROWS_WITH_AS(rmsnorm_forward(x, Tensor<double>({4}), 1e-5, y, r),
                       doctest::Contains("rmsnorm_forward: weight has shape (4), expected (5)"),
                       Error);
  CHECK_THROWS_WITH_AS(rmsnorm_forward(x, w, 0.0, y, r),
                       doctest::Contains("rmsnorm_forward: eps must be positive and finite, got 0"),
                       Error);
  CHECK_THROWS_WITH_AS(rmsnorm_forward(x, w, -1e-5, y, r), doctest::Contains("eps must be positive"),
                       Error);
  CHECK_THROWS_WITH_AS(rmsnorm_forward(x, w, std::nan(""), y, r),
                       doctest::Contains("eps must be positive"), Error);
  Tensor<double> r_bad({5});
  CHECK_THROWS_WITH_AS(rmsnorm_forward(x, w, 1e-5, y, r_bad),
                       doctest::Contains("output inv_rms has shape (5), expected (4)"), Error);
  CHECK_THROWS_WITH_AS(rmsnorm_forward(Tensor<double>(), w, 1e-5, y, r),
                       doctest::Contains("rmsnorm_forward: x must be a non-empty tensor"), Error);
  rmsnorm_forward(x, w, 1e-5, y, r);
  Tensor<double> dx, dw;
  CHECK_THROWS_WITH_AS(rmsnorm_backward(x, w, r, Tensor<double>({5, 4}), dx, dw),
                       doctest::Contains("rmsnorm_backward: dy has shape (5, 4), expected (4, 5)"),
                       Error);
  Tensor<double> dy({4, 5}), dw_bad({6});
  CHECK_THROWS_WITH_AS(rmsnorm_backward(x, w, r, dy, dx, dw_bad),
                       doctest::Contains("output dweight has shape (6), expected (5)"), Error);
  CHECK_THROWS_WITH_AS(rmsnorm_backward(x, w, r.slice(0, 3), dy, dx, dw),
                       doctest::Contains("rmsnorm_backward: inv_rms has shape (3), expected (4)"),
                       Error);
}

// ==================================== rope =======================================================

TEST_CASE("rope: forward and backward match the explicit rotation, both layouts") {
  Rng rng(51);
  const index_t heads = 3, dh = 8;
  auto x = random_tensor<double>({2, 3, heads * dh}, rng);
  const auto pos = make_positions({0, 1, 2, 7, 100, 4095});
  for (const RopeLayout layout : kLayouts) {
    CAPTURE(static_cast<int>(layout));
    for (const double theta : {10000.0, 500000.0, 3.5}) {
      Tensor<double> y, dx;
      rope_forward(x, pos, heads, theta, layout, y);
      REQUIRE(y.shape() == x.shape());
      const auto ny = naive_rope(x, pos, heads, theta, layout, false);
      CHECK(max_rel_diff(y, ny) < 1e-14);
      rope_backward(x, pos, heads, theta, layout, dx);
      const auto ndx = naive_rope(x, pos, heads, theta, layout, true);
      CHECK(max_rel_diff(dx, ndx) < 1e-14);
    }
    // position 0 is the identity, exactly; the inverse undoes the rotation
    Tensor<double> y0, back;
    rope_forward(x, make_positions({0, 0, 0, 0, 0, 0}), heads, 10000.0, layout, y0);
    CHECK(max_rel_diff(y0, x) == 0.0);
    Tensor<double> y;
    rope_forward(x, pos, heads, 10000.0, layout, y);
    rope_backward(y, pos, heads, 10000.0, layout, back);
    CHECK(max_rel_diff(back, x) < 1e-14);
  }
}

TEST_CASE("rope: known values") {
  // dh = 4, theta = 100: inv_freq = (1, 0.1); position 3 rotates pair 0 by 3, pair 1 by 0.3.
  Tensor<double> x({1, 4});
  for (index_t j = 0; j < 4; ++j) x.data()[j] = static_cast<double>(j + 1);  // (1, 2, 3, 4)
  const auto pos = make_positions({3});
  Tensor<double> yh, yi;
  rope_forward(x, pos, 1, 100.0, RopeLayout::HalfSplit, yh);  // pairs (0, 2), (1, 3)
  CHECK(yh.data()[0] == doctest::Approx(1 * std::cos(3.0) - 3 * std::sin(3.0)).epsilon(1e-15));
  CHECK(yh.data()[2] == doctest::Approx(3 * std::cos(3.0) + 1 * std::sin(3.0)).epsilon(1e-15));
  CHECK(yh.data()[1] == doctest::Approx(2 * std::cos(0.3) - 4 * std::sin(0.3)).epsilon(1e-15));
  CHECK(yh.data()[3] == doctest::Approx(4 * std::cos(0.3) + 2 * std::sin(0.3)).epsilon(1e-15));
  rope_forward(x, pos, 1, 100.0, RopeLayout::Interleaved, yi);  // pairs (0, 1), (2, 3)
  CHECK(yi.data()[0] == doctest::Approx(1 * std::cos(3.0) - 2 * std::sin(3.0)).epsilon(1e-15));
  CHECK(yi.data()[1] == doctest::Approx(2 * std::cos(3.0) + 1 * std::sin(3.0)).epsilon(1e-15));
  CHECK(yi.data()[2] == doctest::Approx(3 * std::cos(0.3) - 4 * std::sin(0.3)).epsilon(1e-15));
  CHECK(yi.data()[3] == doctest::Approx(4 * std::cos(0.3) + 3 * std::sin(0.3)).epsilon(1e-15));
}

TEST_CASE("rope: the two layouts differ by the permutation of the pairs") {
  Rng rng(52);
  const index_t heads = 2, dh = 6;
  auto x = random_tensor<double>({5, heads * dh}, rng);
  const auto pos = make_positions({0, 3, 9, 17, 31});
  Tensor<double> yi, yh;
  rope_forward(x, pos, heads, 10000.0, RopeLayout::Interleaved, yi);
  rope_forward(interleaved_to_half(x, heads), pos, heads, 10000.0, RopeLayout::HalfSplit, yh);
  CHECK(max_rel_diff(interleaved_to_half(yi, heads), yh) == 0.0);
  // and they are different maps
  Tensor<double> yh_direct;
  rope_forward(x, pos, heads, 10000.0, RopeLayout::HalfSplit, yh_direct);
  CHECK(max_rel_diff(yh_direct, yi) > 1e-3);
}

TEST_CASE("rope: gradient check (double), in place, float agrees with double, rank 3 positions") {
  Rng rng(53);
  const index_t heads = 2, dh = 4;
  auto x = random_tensor<double>({6, heads * dh}, rng);
  auto w = random_tensor<double>({6, heads * dh}, rng);
  const auto pos = make_positions({0, 1, 5, 2, 1000, 33});
  for (const RopeLayout layout : kLayouts) {
    auto loss = [&] {
      Tensor<double> y;
      rope_forward(x, pos, heads, 10000.0, layout, y);
      return weighted_sum(y, w);
    };
    auto dx = Tensor<double>::full(x.shape(), 7.0);  // assigned
    rope_backward(w, pos, heads, 10000.0, layout, dx);
    check_gradient("rope dx", x, dx, loss);
    Tensor<double> y;
    rope_forward(x, pos, heads, 10000.0, layout, y);
    auto xi = x.clone();
    rope_forward(xi, pos, heads, 10000.0, layout, xi);
    CHECK(max_rel_diff(xi, y) == 0.0);
    auto wi = w.clone();
    rope_backward(wi, pos, heads, 10000.0, layout, wi);
    CHECK(max_rel_diff(wi, dx) == 0.0);
    Tensor<float> yf;
    rope_forward(cast<float>(x), pos, heads, 10000.0, layout, yf);
    CHECK(max_rel_diff(yf, y) < 1e-6);
  }
  // positions shaped like x's leading dimensions
  auto x3 = random_tensor<double>({2, 3, heads * dh}, rng);
  Tensor<std::int32_t> p2({2, 3});
  for (index_t i = 0; i < 6; ++i) p2.data()[i] = static_cast<std::int32_t>(3 * i);
  Tensor<double> y3, y3flat;
  rope_forward(x3, p2, heads, 10000.0, RopeLayout::HalfSplit, y3);
  rope_forward(x3, make_positions({0, 3, 6, 9, 12, 15}), heads, 10000.0, RopeLayout::HalfSplit,
               y3flat);
  CHECK(max_rel_diff(y3, y3flat) == 0.0);
}

TEST_CASE("rope: bad input") {
  Tensor<double> x({3, 12}), y;
  const auto pos = make_positions({0, 1, 2});
  const auto L = RopeLayout::HalfSplit;
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 4, 10000.0, L, y),
                       doctest::Contains("rope_forward: the head dimension dh = 3"), Error);
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 5, 10000.0, L, y),
                       doctest::Contains("rope_forward: x has shape (3, 12): its last dimension 12 "
                                         "is not a multiple of num_heads = 5"),
                       Error);
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 0, 10000.0, L, y),
                       doctest::Contains("num_heads must be >= 1"), Error);
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 2, 0.0, L, y),
                       doctest::Contains("rope_forward: theta must be positive and finite, got 0"),
                       Error);
  CHECK_THROWS_WITH_AS(rope_forward(x, make_positions({0, 1}), 2, 10000.0, L, y),
                       doctest::Contains("rope_forward: positions has shape (2), expected (3)"),
                       Error);
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 2, 10000.0, static_cast<RopeLayout>(7), y),
                       doctest::Contains("unknown RopeLayout 7"), Error);
  Tensor<double> y_bad({3, 10});
  CHECK_THROWS_WITH_AS(rope_forward(x, pos, 2, 10000.0, L, y_bad),
                       doctest::Contains("output y has shape (3, 10), expected (3, 12)"), Error);
  const auto neg = make_positions({0, -4, -1});
  auto untouched = Tensor<double>::full({3, 12}, 5.0);
  CHECK_THROWS_WITH_AS(
      rope_forward(x, neg, 2, 10000.0, L, untouched),
      doctest::Contains("rope_forward: position -4 at flat position 1 of positions (3) is negative"),
      Error);
  CHECK(untouched(0, 0) == 5.0);  // the CPU backend scans before it writes
  Tensor<double> dx;
  CHECK_THROWS_WITH_AS(rope_backward(x, neg, 2, 10000.0, L, dx),
                       doctest::Contains("rope_backward: position -4 at flat position 1"), Error);
  CHECK_THROWS_WITH_AS(rope_backward(x, pos, 4, 10000.0, L, dx),
                       doctest::Contains("rope_backward: the head dimension dh = 3"), Error);
}

// =================================== swiglu ======================================================

TEST_CASE("swiglu: forward matches the naive formula, rank 3") {
  Rng rng(61);
  auto gu = random_tensor<double>({2, 3, 10}, rng, -4.0, 4.0);
  Tensor<double> h;
  swiglu_forward(gu, h);
  REQUIRE(h.shape() == Shape({2, 3, 5}));
  for (index_t i = 0; i < 6; ++i)
    for (index_t j = 0; j < 5; ++j) {
      const double g = gu.data()[i * 10 + j], u = gu.data()[i * 10 + 5 + j];
      CHECK(h.data()[i * 5 + j] == doctest::Approx(g * naive_sigmoid(g) * u).epsilon(1e-14));
    }
}

TEST_CASE("swiglu: gradient check (double), assigned, in place") {
  Rng rng(62);
  auto gu = random_tensor<double>({7, 12}, rng, -3.0, 3.0);
  auto w = random_tensor<double>({7, 6}, rng);
  auto loss = [&] {
    Tensor<double> h;
    swiglu_forward(gu, h);
    return weighted_sum(h, w);
  };
  auto dgu = Tensor<double>::full({7, 12}, 9.0);  // assigned
  swiglu_backward(gu, w, dgu);
  check_gradient("swiglu dgu", gu, dgu, loss);
  auto gi = gu.clone();
  swiglu_backward(gi, w, gi);
  CHECK(max_rel_diff(gi, dgu) == 0.0);
}

TEST_CASE("swiglu: finite for large inputs, float agrees with double") {
  Tensor<float> gu({1, 8});
  const float v[8] = {-1000.0f, -100.0f, 100.0f, 1000.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  for (index_t j = 0; j < 8; ++j) gu.data()[j] = v[j];
  Tensor<float> h, dgu;
  swiglu_forward(gu, h);
  swiglu_backward(gu, Tensor<float>::full({1, 4}, 1.0f), dgu);
  for (index_t j = 0; j < 4; ++j) CHECK(std::isfinite(h.data()[j]));
  for (index_t j = 0; j < 8; ++j) CHECK(std::isfinite(dgu.data()[j]));
  CHECK(h.data()[0] == 0.0f);
  CHECK(h.data()[3] == doctest::Approx(5000.0f));
  CHECK(dgu.data()[0] == 0.0f);                         // silu'(-1000) = 0
  CHECK(dgu.data()[3] == doctest::Approx(5.0f));        // silu'(1000) = 1, times up = 5
  CHECK(dgu.data()[7] == doctest::Approx(1000.0f));     // silu(1000)
  Rng rng(63);
  auto g = random_tensor<double>({50, 64}, rng, -6.0, 6.0);
  auto dh = random_tensor<double>({50, 32}, rng);
  Tensor<double> hd, dd;
  Tensor<float> hf, df;
  swiglu_forward(g, hd);
  swiglu_backward(g, dh, dd);
  swiglu_forward(cast<float>(g), hf);
  swiglu_backward(cast<float>(g), cast<float>(dh), df);
  CHECK(max_rel_diff(hf, hd) < 2e-6);
  CHECK(max_rel_diff(df, dd) < 2e-6);
}

TEST_CASE("swiglu: bad input") {
  Tensor<double> h, dgu;
  CHECK_THROWS_WITH_AS(swiglu_forward(Tensor<double>({3, 5}), h),
                       doctest::Contains("swiglu_forward: gu has shape (3, 5): its last dimension "
                                         "must be even"),
                       Error);
  CHECK_THROWS_WITH_AS(swiglu_forward(Tensor<double>(), h),
                       doctest::Contains("swiglu_forward: gu must be a non-empty tensor"), Error);
  Tensor<double> h_bad({3, 3});
  CHECK_THROWS_WITH_AS(swiglu_forward(Tensor<double>({3, 4}), h_bad),
                       doctest::Contains("output h has shape (3, 3), expected (3, 2)"), Error);
  CHECK_THROWS_WITH_AS(swiglu_backward(Tensor<double>({3, 4}), Tensor<double>({3, 4}), dgu),
                       doctest::Contains("swiglu_backward: dh has shape (3, 4), expected (3, 2)"),
                       Error);
  CHECK_THROWS_WITH_AS(swiglu_backward(Tensor<double>({3, 5}), Tensor<double>({3, 2}), dgu),
                       doctest::Contains("swiglu_backward: gu has shape (3, 5)"), Error);
}

TEST_CASE("concat_heads and split_heads: the columns of each head, inverse of each other") {
  Rng rng(3);
  const index_t n = 4, heads = 3, wa = 2, wb = 5;
  const Tensor<double> a = random_normal<double>({n, heads * wa}, rng);
  const Tensor<double> b = random_normal<double>({n, heads * wb}, rng);
  Tensor<double> y;
  concat_heads(a, b, heads, y);
  REQUIRE(y.shape() == (Shape{n, heads * (wa + wb)}));
  for (index_t i = 0; i < n; ++i)
    for (index_t h = 0; h < heads; ++h)
      for (index_t j = 0; j < wa + wb; ++j)
        CHECK(y(i, h * (wa + wb) + j) == (j < wa ? a(i, h * wa + j) : b(i, h * wb + j - wa)));
  Tensor<double> a2, b2;
  split_heads(y, heads, wa, a2, b2);
  CHECK(a2.to_vector() == a.to_vector());
  CHECK(b2.to_vector() == b.to_vector());
  // one head: a column split
  Tensor<double> c1, c2;
  split_heads(b, 1, 4, c1, c2);
  REQUIRE(c1.shape() == (Shape{n, 4}));
  REQUIRE(c2.shape() == (Shape{n, heads * wb - 4}));
  for (index_t i = 0; i < n; ++i) {
    for (index_t j = 0; j < 4; ++j) CHECK(c1(i, j) == b(i, j));
    for (index_t j = 4; j < heads * wb; ++j) CHECK(c2(i, j - 4) == b(i, j));
  }
}

TEST_CASE("concat_heads and split_heads: bad input") {
  Tensor<double> y, a, b;
  CHECK_THROWS_WITH_AS(concat_heads(Tensor<double>({2, 6}), Tensor<double>({3, 3}), 3, y),
                       doctest::Contains("concat_heads: a has 2 rows and b 3"), Error);
  CHECK_THROWS_WITH_AS(concat_heads(Tensor<double>({2, 6}), Tensor<double>({2, 4}), 3, y),
                       doctest::Contains("concat_heads: b must be an (N, heads * w) matrix with heads = 3"),
                       Error);
  CHECK_THROWS_WITH_AS(concat_heads(Tensor<double>({2, 6}), Tensor<double>({2, 3}), 0, y),
                       doctest::Contains("heads must be >= 1, got 0"), Error);
  CHECK_THROWS_WITH_AS(split_heads(Tensor<double>({2, 6}), 3, 2, a, b),
                       doctest::Contains("split_heads: width_a = 2 must be in [1, 1]"), Error);
  CHECK_THROWS_WITH_AS(split_heads(Tensor<double>({2, 7}), 3, 1, a, b),
                       doctest::Contains("split_heads: x must be an (N, heads * w) matrix"), Error);
  Tensor<double> wrong({2, 5});
  CHECK_THROWS_WITH_AS(split_heads(Tensor<double>({2, 6}), 3, 1, wrong, b),
                       doctest::Contains("output a has shape (2, 5), expected (2, 3)"), Error);
}
