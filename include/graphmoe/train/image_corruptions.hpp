// graphmoe/train/image_corruptions.hpp: seeded image corruptions, a small ImageNet-C analogue
// (Hendrycks & Dietterich 2019, "Benchmarking Neural Network Robustness to Common Corruptions and
// Perturbations"), for measuring how a classifier's accuracy degrades off the clean test set.
//
//   corrupt_images(images, c, severity, seed [, first_index])   a corrupted copy of images
//   corruption_name(c) / parse_corruption(name)                  "gaussian_noise", "blur", "contrast"
//   corruption_parameter(c, severity)                            the table below
//
// Images are (N, H, W, C) tensors of float or double with values in [0, 1] (the layout of
// image_datasets.hpp and VisionMoE). Severity is ImageNet-C's level 1..5; with x a pixel value:
//
//   corruption       parameter                         severity 1     2     3     4     5
//   gaussian_noise   std s:  x' = clip(x + s z, 0, 1)            0.08  0.12  0.18  0.26  0.38
//   blur             sigma (pixels) of a Gaussian blur           0.5   0.75  1.0   1.25  1.5
//   contrast         factor a:  x' = clip((x - m) a + m, 0, 1)   0.4   0.3   0.2   0.1   0.05
//
// gaussian_noise and contrast use ImageNet-C's values exactly (its `gaussian_noise`, `contrast`).
// blur is ImageNet-C's `gaussian_blur` (one of its extra corruptions), whose sigmas 1, 2, 3, 4, 6
// are for 224 x 224 images: on 28 x 28 images (Fashion-MNIST) they would blur an item into a
// smudge, so the sigmas here are SCALED DOWN FOR SMALL IMAGES (0.5 .. 1.5 pixels) and are not
// ImageNet-C's.
//
// Precisely:
//   gaussian_noise  z for pixel j of image g (j the flat index within one H W C image, g =
//                   first_index + the image's row in `images`) is normal number g H W C + j of
//                   the Philox stream for `seed` (core/rng.hpp: Rng(seed, 4 (g H W C + j)).normal()).
//                   So the same seed gives the same corrupted set, image g's noise does not depend
//                   on N, and corrupting a subset (passing its first global index) gives the same
//                   images as corrupting the whole set.
//   blur            a separable Gaussian kernel w_k = exp(-k^2 / (2 sigma^2)) / sum, k in [-r, r],
//                   r = ceil(3 sigma) (skimage's `gaussian`, which ImageNet-C calls, truncates at
//                   4 sigma), applied along W then along H, per image and per channel. Borders
//                   CLAMP (replicate the edge pixel: skimage's default mode 'nearest', which
//                   ImageNet-C uses), so r may exceed the image size. A constant image stays
//                   constant; values stay in [0, 1] (convex combinations), so no clipping.
//   contrast        m = the mean of the image's H W C values (per image, over all channels;
//                   ImageNet-C's code takes one mean per channel: the same for C = 1). For values
//                   in [0, 1], x' lies between x and m, so the clip never acts and the mean of
//                   every image is kept.
// blur and contrast are deterministic: they ignore the seed. Arithmetic is in double, rounded to T
// once per output value.
//
// Checked (graphmoe::Error naming the problem): severity in 1..5, images of rank 4 and non-empty,
// every value finite, first_index >= 0, known corruption names. Values outside [0, 1] are not
// rejected; noise and contrast outputs are clipped to [0, 1] as in ImageNet-C.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

enum class Corruption { GaussianNoise, Blur, Contrast };

// Every corruption, in the order of the enum (what "all" means in the examples).
inline constexpr std::array<Corruption, 3> all_corruptions = {
    Corruption::GaussianNoise, Corruption::Blur, Corruption::Contrast};

inline const char* corruption_name(Corruption c) {
  switch (c) {
    case Corruption::GaussianNoise: return "gaussian_noise";
    case Corruption::Blur: return "blur";
    case Corruption::Contrast: return "contrast";
  }
  GRAPHMOE_CHECK(false, "corruption_name", "unknown Corruption value ", static_cast<int>(c));
  return "";
}

// "gaussian_noise", "blur" or "contrast" (exactly, case-sensitive).
inline Corruption parse_corruption(std::string_view name) {
  std::string valid;
  for (Corruption c : all_corruptions) {
    if (name == corruption_name(c)) return c;
    valid += (valid.empty() ? "" : ", ") + std::string(corruption_name(c));
  }
  GRAPHMOE_CHECK(false, "parse_corruption", "unknown corruption '", std::string(name),
                 "'; valid names: ", valid);
  return Corruption::GaussianNoise;
}

// The noise std, blur sigma (pixels) or contrast factor of severity 1..5 (the header's table).
inline double corruption_parameter(Corruption c, int severity) {
  GRAPHMOE_CHECK(severity >= 1 && severity <= 5, "corruption_parameter",
                 "severity must be in 1..5 (ImageNet-C's levels), got ", severity);
  static constexpr std::array<double, 5> noise_std = {0.08, 0.12, 0.18, 0.26, 0.38};
  static constexpr std::array<double, 5> blur_sigma = {0.5, 0.75, 1.0, 1.25, 1.5};
  static constexpr std::array<double, 5> contrast = {0.4, 0.3, 0.2, 0.1, 0.05};
  const auto s = static_cast<std::size_t>(severity - 1);
  switch (c) {
    case Corruption::GaussianNoise: return noise_std[s];
    case Corruption::Blur: return blur_sigma[s];
    case Corruption::Contrast: return contrast[s];
  }
  GRAPHMOE_CHECK(false, "corruption_parameter", "unknown Corruption value ", static_cast<int>(c));
  return 0;
}

namespace detail {

inline double clip01(double v) { return std::min(1.0, std::max(0.0, v)); }

// The normalised kernel w_{-r..r} of a Gaussian blur, r = ceil(3 sigma).
inline std::vector<double> gaussian_kernel(double sigma) {
  const int r = static_cast<int>(std::ceil(3.0 * sigma));
  std::vector<double> w(static_cast<std::size_t>(2 * r + 1));
  double sum = 0;
  for (int k = -r; k <= r; ++k)
    sum += (w[static_cast<std::size_t>(k + r)] = std::exp(-0.5 * k * k / (sigma * sigma)));
  for (double& v : w) v /= sum;
  return w;
}

// One 1-D pass of the separable blur over an (H, W, C) image: along x (vertical = false) or y,
// borders clamped, accumulated in double.
template <class Src, class Dst>
void blur_pass(const Src* in, Dst* out, index_t h, index_t w, index_t c,
               const std::vector<double>& kernel, bool vertical) {
  const index_t r = static_cast<index_t>(kernel.size() / 2);
  auto clamp = [](index_t i, index_t n) { return std::min(n - 1, std::max(index_t{0}, i)); };
  for (index_t y = 0; y < h; ++y)
    for (index_t x = 0; x < w; ++x)
      for (index_t ch = 0; ch < c; ++ch) {
        double s = 0;
        for (index_t k = -r; k <= r; ++k) {
          const index_t at = vertical ? clamp(y + k, h) * w + x : y * w + clamp(x + k, w);
          s += kernel[static_cast<std::size_t>(k + r)] * static_cast<double>(in[at * c + ch]);
        }
        out[(y * w + x) * c + ch] = static_cast<Dst>(s);
      }
}

// One image (H, W, C) in, blurred out, borders clamped. tmp holds the W pass, (H, W, C).
template <class T>
void blur_image(const T* in, T* out, index_t h, index_t w, index_t c,
                const std::vector<double>& kernel, std::vector<double>& tmp) {
  blur_pass(in, tmp.data(), h, w, c, kernel, /*vertical=*/false);
  blur_pass(tmp.data(), out, h, w, c, kernel, /*vertical=*/true);
}

}  // namespace detail

// A corrupted copy of images (N, H, W, C) at severity 1..5 (see the header comment). first_index
// is the global index of images[0] in the set it was cut from: it places the noise, so that
// corrupting images [s, s + n) of a set with first_index = s reproduces those rows of the whole
// set's corruption. blur and contrast ignore seed and first_index.
template <class T>
Tensor<T, cpu> corrupt_images(const Tensor<T, cpu>& images, Corruption c, int severity,
                              std::uint64_t seed, index_t first_index = 0) {
  static_assert(std::is_floating_point_v<T>,
                "graphmoe: corrupt_images needs floating-point images (float or double)");
  constexpr const char* op = "corrupt_images";
  GRAPHMOE_CHECK(severity >= 1 && severity <= 5, op,
                 "severity must be in 1..5 (ImageNet-C's levels), got ", severity);
  GRAPHMOE_CHECK(images.rank() == 4, op, "images must have shape (N, H, W, C), got rank ",
                 images.rank(), " shape ", images.shape());
  GRAPHMOE_CHECK(images.numel() > 0, op, "images are empty (shape ", images.shape(), ")");
  GRAPHMOE_CHECK(first_index >= 0, op, "first_index must be >= 0, got ", first_index);
  check_finite(op, "images", images);
  const double param = corruption_parameter(c, severity);
  const index_t n = images.dim(0), h = images.dim(1), w = images.dim(2), ch = images.dim(3);
  const index_t per = h * w * ch;
  Tensor<T, cpu> out(images.shape());
  const T* src = images.data();
  T* dst = out.data();
  switch (c) {
    case Corruption::GaussianNoise:
      for (index_t i = 0; i < n; ++i) {
        Rng rng(seed, 4 * static_cast<std::uint64_t>(first_index + i) * static_cast<std::uint64_t>(per));
        for (index_t j = 0; j < per; ++j) {
          const double z = rng.normal();
          dst[i * per + j] = static_cast<T>(
              detail::clip01(static_cast<double>(src[i * per + j]) + param * z));
        }
      }
      break;
    case Corruption::Blur: {
      const std::vector<double> kernel = detail::gaussian_kernel(param);
      std::vector<double> tmp(static_cast<std::size_t>(per));
      for (index_t i = 0; i < n; ++i)
        detail::blur_image(src + i * per, dst + i * per, h, w, ch, kernel, tmp);
      break;
    }
    case Corruption::Contrast:
      for (index_t i = 0; i < n; ++i) {
        double mean = 0;
        for (index_t j = 0; j < per; ++j) mean += static_cast<double>(src[i * per + j]);
        mean /= static_cast<double>(per);
        for (index_t j = 0; j < per; ++j)
          dst[i * per + j] = static_cast<T>(
              detail::clip01((static_cast<double>(src[i * per + j]) - mean) * param + mean));
      }
      break;
  }
  return out;
}

}  // namespace graphmoe
