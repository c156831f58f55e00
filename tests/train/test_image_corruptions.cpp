// Image corruptions (train/image_corruptions.hpp) against independent evaluations: blur against a
// direct 2-D convolution in double, contrast against its formula, Gaussian noise by its
// statistics; determinism and subset invariance of the noise, severity monotonicity, identities
// (a blurred constant image, the contrast-kept mean), names, and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/train/image_corruptions.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// The severity tables, written out again here (not read from the header).
const std::vector<double> kNoiseStd = {0.08, 0.12, 0.18, 0.26, 0.38};
const std::vector<double> kBlurSigma = {0.5, 0.75, 1.0, 1.25, 1.5};
const std::vector<double> kContrast = {0.4, 0.3, 0.2, 0.1, 0.05};

template <class T>
Tensor<T, cpu> random_images(index_t n, index_t h, index_t w, index_t c, std::uint64_t seed) {
  Rng rng(seed);
  return random_tensor<T>(Shape{n, h, w, c}, rng, 0.0, 1.0);
}

// Direct 2-D convolution with the (2r+1)^2 Gaussian kernel exp(-(dy^2 + dx^2) / (2 sigma^2)),
// normalised over the whole square, r = ceil(3 sigma), edge pixels replicated.
template <class T>
Tensor<double, cpu> naive_blur(const Tensor<T, cpu>& x, double sigma) {
  const index_t n = x.dim(0), h = x.dim(1), w = x.dim(2), c = x.dim(3);
  const index_t r = static_cast<index_t>(std::ceil(3 * sigma));
  double norm = 0;
  for (index_t dy = -r; dy <= r; ++dy)
    for (index_t dx = -r; dx <= r; ++dx)
      norm += std::exp(-static_cast<double>(dy * dy + dx * dx) / (2 * sigma * sigma));
  Tensor<double, cpu> y(x.shape());
  for (index_t i = 0; i < n; ++i)
    for (index_t yy = 0; yy < h; ++yy)
      for (index_t xx = 0; xx < w; ++xx)
        for (index_t ch = 0; ch < c; ++ch) {
          double s = 0;
          for (index_t dy = -r; dy <= r; ++dy)
            for (index_t dx = -r; dx <= r; ++dx) {
              const index_t sy = std::min(h - 1, std::max<index_t>(0, yy + dy));
              const index_t sx = std::min(w - 1, std::max<index_t>(0, xx + dx));
              s += std::exp(-static_cast<double>(dy * dy + dx * dx) / (2 * sigma * sigma)) *
                   static_cast<double>(x(i, sy, sx, ch));
            }
          y(i, yy, xx, ch) = s / norm;
        }
  return y;
}

template <class T>
double max_abs_diff(const Tensor<T, cpu>& a, const Tensor<double, cpu>& b) {
  REQUIRE(a.shape() == b.shape());
  double m = 0;
  for (index_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::abs(static_cast<double>(a.data()[i]) - b.data()[i]));
  return m;
}

template <class A, class B>
double l2_distance(const Tensor<A, cpu>& a, const Tensor<B, cpu>& b) {
  REQUIRE(a.shape() == b.shape());
  double s = 0;
  for (index_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i]);
    s += d * d;
  }
  return std::sqrt(s);
}

template <class T>
bool same_values(const Tensor<T, cpu>& a, const Tensor<T, cpu>& b) {
  if (a.shape() != b.shape()) return false;
  for (index_t i = 0; i < a.numel(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return true;
}

// Rows [first, first + count) of images, as their own tensor.
template <class T>
Tensor<T, cpu> rows(const Tensor<T, cpu>& x, index_t first, index_t count) {
  return x.slice(first, first + count).clone();
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-6 : 1e-12;
}

}  // namespace

TEST_CASE("corruption names: round trip, the three names, all_corruptions") {
  CHECK(std::string(corruption_name(Corruption::GaussianNoise)) == "gaussian_noise");
  CHECK(std::string(corruption_name(Corruption::Blur)) == "blur");
  CHECK(std::string(corruption_name(Corruption::Contrast)) == "contrast");
  REQUIRE(all_corruptions.size() == 3);
  for (Corruption c : all_corruptions) CHECK(parse_corruption(corruption_name(c)) == c);
  for (int s = 1; s <= 5; ++s) {
    const auto i = static_cast<std::size_t>(s - 1);
    CHECK(corruption_parameter(Corruption::GaussianNoise, s) == kNoiseStd[i]);
    CHECK(corruption_parameter(Corruption::Blur, s) == kBlurSigma[i]);
    CHECK(corruption_parameter(Corruption::Contrast, s) == kContrast[i]);
  }
}

TEST_CASE_TEMPLATE("blur: matches a direct 2-D convolution with clamped borders", T, float, double) {
  // non-square, several channels (an axis mix-up shows), and an image smaller than the kernel
  for (const Shape& shape : {Shape{2, 9, 7, 2}, Shape{1, 3, 2, 3}, Shape{3, 28, 28, 1}}) {
    const auto x = random_images<T>(shape[0], shape[1], shape[2], shape[3], 11);
    for (int s = 1; s <= 5; ++s) {
      CAPTURE(shape);
      CAPTURE(s);
      const auto y = corrupt_images(x, Corruption::Blur, s, 0);
      REQUIRE(y.shape() == x.shape());
      CHECK(max_abs_diff(y, naive_blur(x, kBlurSigma[static_cast<std::size_t>(s - 1)])) <=
            tolerance<T>());
    }
  }
}

TEST_CASE_TEMPLATE("blur: a constant image stays that constant, values stay in [0, 1]", T, float, double) {
  Tensor<T, cpu> x(Shape{2, 6, 5, 3});
  x.fill(static_cast<T>(0.37));
  for (int s = 1; s <= 5; ++s) {
    const auto y = corrupt_images(x, Corruption::Blur, s, 0);
    for (index_t i = 0; i < y.numel(); ++i)
      REQUIRE(std::abs(static_cast<double>(y.data()[i]) - static_cast<double>(T(0.37))) <=
              tolerance<T>());
  }
  const auto r = random_images<T>(2, 10, 10, 1, 5);
  const auto y = corrupt_images(r, Corruption::Blur, 5, 0);
  for (index_t i = 0; i < y.numel(); ++i) REQUIRE((y.data()[i] >= 0 && y.data()[i] <= 1));
}

TEST_CASE_TEMPLATE("contrast: matches (x - mean) c + mean with the mean over each image", T, float, double) {
  const auto x = random_images<T>(3, 5, 4, 2, 21);
  const index_t per = 5 * 4 * 2;
  for (int s = 1; s <= 5; ++s) {
    CAPTURE(s);
    const double c = kContrast[static_cast<std::size_t>(s - 1)];
    const auto y = corrupt_images(x, Corruption::Contrast, s, 0);
    Tensor<double, cpu> expected(x.shape());
    for (index_t i = 0; i < 3; ++i) {
      double m = 0;
      for (index_t j = 0; j < per; ++j) m += static_cast<double>(x.data()[i * per + j]);
      m /= static_cast<double>(per);
      for (index_t j = 0; j < per; ++j) {
        const double v = (static_cast<double>(x.data()[i * per + j]) - m) * c + m;
        expected.data()[i * per + j] = std::min(1.0, std::max(0.0, v));
      }
      // the image's mean is kept (values in [0, 1]: the clip never acts)
      double my = 0;
      for (index_t j = 0; j < per; ++j) my += static_cast<double>(y.data()[i * per + j]);
      CHECK(my / static_cast<double>(per) == doctest::Approx(m).epsilon(1e-6));
    }
    CHECK(max_abs_diff(y, expected) <= tolerance<T>());
  }
}

TEST_CASE("contrast: values outside [0, 1] are clipped, one mean over all channels") {
  // one image of 2 x 2 values, mean 0.5 (over both channels)
  const auto x = Tensor<double, cpu>::from({1, 1, 2, 2}, {2.0, 0.0, 0.5, -0.5});
  const auto y = corrupt_images(x, Corruption::Contrast, 1, 0);
  // mean = 0.5: 2 -> 1.1 -> 1; 0 -> 0.3; 0.5 -> 0.5; -0.5 -> 0.1
  CHECK(y.data()[0] == 1.0);
  CHECK(y.data()[1] == doctest::Approx(0.3));
  CHECK(y.data()[2] == doctest::Approx(0.5));
  CHECK(y.data()[3] == doctest::Approx(0.1));
}

TEST_CASE_TEMPLATE("gaussian_noise: mean 0 and std c on mid-grey images", T, float, double) {
  // On 0.5 the clip at 0 and 1 is symmetric: d = x' - 0.5 = c clip(z, -a, a), a = 0.5 / c, so
  // E d = 0 and E d^2 = c^2 [(2 Phi(a) - 1) - 2 a phi(a) + 2 a^2 (1 - Phi(a))] (a clipped
  // normal). At severity 1 (a = 6.25) nothing clips and the std is c itself.
  const index_t n = 64, h = 28, w = 28;  // 50,176 samples
  Tensor<T, cpu> x(Shape{n, h, w, 1});
  x.fill(static_cast<T>(0.5));
  const double pi = 3.141592653589793;
  for (int s = 1; s <= 5; ++s) {
    CAPTURE(s);
    const double c = kNoiseStd[static_cast<std::size_t>(s - 1)], a = 0.5 / c;
    const double tail = 0.5 * std::erfc(a / std::sqrt(2.0));  // 1 - Phi(a)
    const double phi = std::exp(-0.5 * a * a) / std::sqrt(2 * pi);
    const double expected_sd = c * std::sqrt((1 - 2 * tail) - 2 * a * phi + 2 * a * a * tail);
    const auto y = corrupt_images(x, Corruption::GaussianNoise, s, 42);
    double sum = 0, sq = 0;
    index_t clipped = 0, within = 0;
    for (index_t i = 0; i < y.numel(); ++i) {
      const double v = static_cast<double>(y.data()[i]);
      clipped += v <= 0.0 || v >= 1.0;
      const double d = v - 0.5;
      sum += d;
      sq += d * d;
      within += std::abs(d) <= c;
    }
    const double cnt = static_cast<double>(y.numel());
    const double mean = sum / cnt, sd = std::sqrt(sq / cnt - mean * mean);
    if (s == 1) {
      CHECK(clipped == 0);
      CHECK(expected_sd == doctest::Approx(c).epsilon(1e-9));
    }
    // standard errors: at most c / sqrt(cnt) = c * 0.0045 for the mean, about half that for the std
    CHECK(std::abs(mean) <= 5 * c / std::sqrt(cnt));
    CHECK(std::abs(sd - expected_sd) <= 0.01 * expected_sd);
    // |d| <= c iff |z| <= 1 (a > 1 at every severity): 68.27% (standard error 0.2%)
    CHECK(static_cast<double>(within) / cnt == doctest::Approx(0.6827).epsilon(0.015));
  }
}

TEST_CASE("gaussian_noise: clips to [0, 1] at severity 5, images get different noise") {
  Tensor<double, cpu> x(Shape{2, 28, 28, 1});
  x.fill(0.5);
  const auto y = corrupt_images(x, Corruption::GaussianNoise, 5, 7);
  index_t zeros = 0, ones = 0;
  for (index_t i = 0; i < y.numel(); ++i) {
    REQUIRE((y.data()[i] >= 0.0 && y.data()[i] <= 1.0));
    zeros += y.data()[i] == 0.0;
    ones += y.data()[i] == 1.0;
  }
  CHECK(zeros > 0);  // P(z < -0.5 / 0.38) = 9% of 1568 pixels
  CHECK(ones > 0);
  // image 0 and image 1 (same clean pixels) get independent noise: correlation near 0
  const index_t per = 28 * 28;
  double s01 = 0, s00 = 0, s11 = 0;
  for (index_t j = 0; j < per; ++j) {
    const double a = y.data()[j] - 0.5, b = y.data()[per + j] - 0.5;
    s01 += a * b;
    s00 += a * a;
    s11 += b * b;
  }
  CHECK(std::abs(s01 / std::sqrt(s00 * s11)) < 0.15);  // 4 standard errors of 1 / sqrt(784)
}

TEST_CASE_TEMPLATE("gaussian_noise: the seed decides, the same seed gives the same set", T, float, double) {
  const auto x = random_images<T>(4, 8, 8, 3, 3);
  const auto a = corrupt_images(x, Corruption::GaussianNoise, 3, 1234);
  const auto b = corrupt_images(x, Corruption::GaussianNoise, 3, 1234);
  const auto c = corrupt_images(x, Corruption::GaussianNoise, 3, 1235);
  CHECK(same_values(a, b));
  CHECK_FALSE(same_values(a, c));
  CHECK(l2_distance(a, c) > 0.5);  // many pixels differ, not one
  // the input is not modified
  CHECK(same_values(x, random_images<T>(4, 8, 8, 3, 3)));
  // blur and contrast ignore the seed
  for (Corruption k : {Corruption::Blur, Corruption::Contrast})
    CHECK(same_values(corrupt_images(x, k, 3, 1), corrupt_images(x, k, 3, 2)));
}

TEST_CASE_TEMPLATE("gaussian_noise: an image's noise does not depend on N (subsets)", T, float, double) {
  const auto x = random_images<T>(6, 7, 5, 2, 9);
  const auto all = corrupt_images(x, Corruption::GaussianNoise, 4, 99);
  // a prefix, with the default first_index 0
  CHECK(same_values(corrupt_images(rows(x, 0, 3), Corruption::GaussianNoise, 4, 99), rows(all, 0, 3)));
  // a middle block and a single image, placed with first_index
  CHECK(same_values(corrupt_images(rows(x, 2, 3), Corruption::GaussianNoise, 4, 99, 2), rows(all, 2, 3)));
  CHECK(same_values(corrupt_images(rows(x, 5, 1), Corruption::GaussianNoise, 4, 99, 5), rows(all, 5, 1)));
  // without first_index the block would get image 0's noise: different
  CHECK_FALSE(same_values(corrupt_images(rows(x, 2, 3), Corruption::GaussianNoise, 4, 99), rows(all, 2, 3)));
  // a larger set: the first six images are unchanged
  Tensor<T, cpu> more(Shape{10, 7, 5, 2});
  std::copy_n(x.data(), x.numel(), more.data());
  CHECK(same_values(rows(corrupt_images(more, Corruption::GaussianNoise, 4, 99), 0, 6), all));
}

TEST_CASE_TEMPLATE("every corruption: a stronger severity moves the images further (L2)", T, float, double) {
  // random pixels, plus a smooth gradient so that blur acts on structure too
  auto x = random_images<T>(4, 12, 10, 1, 17);
  for (index_t j = 0; j < 12 * 10; ++j) x.data()[j] = static_cast<T>(static_cast<double>(j) / 119.0);
  for (Corruption c : all_corruptions) {
    CAPTURE(corruption_name(c));
    double prev = 0;
    for (int s = 1; s <= 5; ++s) {
      CAPTURE(s);
      const double d = l2_distance(corrupt_images(x, c, s, 5), x);
      CHECK(d > prev);
      prev = d;
    }
  }
}

TEST_CASE("bad input: severity, rank, empty, NaN, first_index, unknown names") {
  const auto x = random_images<double>(2, 4, 4, 1, 1);
  CHECK_THROWS_WITH_AS(corrupt_images(x, Corruption::Blur, 0, 1),
                       doctest::Contains("severity must be in 1..5"), Error);
  CHECK_THROWS_WITH_AS(corrupt_images(x, Corruption::GaussianNoise, 6, 1),
                       doctest::Contains("got 6"), Error);
  CHECK_THROWS_WITH_AS(corruption_parameter(Corruption::Contrast, 0),
                       doctest::Contains("severity must be in 1..5"), Error);
  CHECK_THROWS_WITH_AS(corrupt_images(Tensor<double, cpu>(Shape{2, 4, 4}), Corruption::Blur, 1, 1),
                       doctest::Contains("must have shape (N, H, W, C), got rank 3"), Error);
  CHECK_THROWS_WITH_AS(corrupt_images(Tensor<double, cpu>(Shape{0, 4, 4, 1}), Corruption::Blur, 1, 1),
                       doctest::Contains("images are empty"), Error);
  auto bad = x.clone();
  bad(1, 2, 3, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(corrupt_images(bad, Corruption::Contrast, 1, 1),
                       doctest::Contains("holds nan at flat index 27"), Error);
  bad(1, 2, 3, 0) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(corrupt_images(bad, Corruption::GaussianNoise, 1, 1),
                       doctest::Contains("holds inf"), Error);
  CHECK_THROWS_WITH_AS(corrupt_images(x, Corruption::GaussianNoise, 1, 1, -1),
                       doctest::Contains("first_index must be >= 0"), Error);
  CHECK_THROWS_WITH_AS(parse_corruption("fog"),
                       doctest::Contains("unknown corruption 'fog'; valid names: gaussian_noise, blur, contrast"),
                       Error);
  CHECK_THROWS_AS(parse_corruption("Blur"), Error);
  CHECK_THROWS_AS(parse_corruption(""), Error);
}
