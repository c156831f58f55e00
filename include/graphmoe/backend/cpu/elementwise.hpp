// graphmoe/backend/cpu/elementwise.hpp: the small element-wise and broadcast ops that layers need
// besides GEMMs, so that a layer's body is the same on every backend (backend/cuda/elementwise.cuh
// has the same functions on Tensor<T, cuda>).
//
//   add_row_vector(b, y)           y[i, :] += b            y (..., C) read as (rows, C), b (C)
//   accumulate_column_sums(dy, db) db += sum_i dy[i, :]    dy (..., C) read as (rows, C), db (C)
//   axpy(alpha, x, y)              y += alpha x            same number of elements
//   scale(t, alpha)                t *= alpha
//   fill(t, value)                 t[:] = value
//   fill_normal(t, rng, stddev)    t[:] ~ N(0, stddev^2), drawn in flat order from rng
//   copy_from_host(dst, src)       dst = src, src a host tensor of dst's shape
//   read_scalar(t)                 t's first value, on the host
//   accumulate_dot(a, b, alpha, d) d[0] += alpha sum_i a_i b_i   (d a one-element tensor; the
//                                  sum in double, in index order)
//   normalize_rows(x, norms)       x_i <- x_i / max(|x_i|, eps), norms_i = max(|x_i|, eps)
//   normalize_rows_backward(y, norms, eps, dy)
//                                  y = x / n: dy_i <- (dy_i - y_i (y_i . dy_i)) / n_i, or dy_i / eps
//                                  where the norm was clamped (y = x / eps is linear in x)
//   patchify(images, P, H, W, C, patches)
//                                  images (B, H, W, C) -> patches (B Np, P P C), Np = (H/P)(W/P):
//                                  patch (py, px) of image b is row b Np + py (W/P) + px, read
//                                  row-major within the patch, channels innermost (ViT's order)
//
// The outputs are updated in place through their handles (a Tensor is a handle, so a slice or a
// view may be passed). Column sums run over the rows in order for every column, so the result does
// not depend on the thread count (the CUDA version sums in the same order, one thread per column).
#pragma once

#include <algorithm>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
template <class T, class B>
void check_row_vector(const char* op, const char* what, const Tensor<T, B>& m,
                      const Tensor<T, B>& v) {
  GRAPHMOE_CHECK(!m.empty() && m.rank() >= 1, op, "the matrix operand is empty or a scalar");
  GRAPHMOE_CHECK(v.rank() == 1 && v.numel() == m.cols(), op, what, " has shape ", v.shape(),
                 ", expected (", m.cols(), ") for a matrix of shape ", m.shape());
}
template <class T, class B>
void check_same_size(const char* op, const Tensor<T, B>& x, const Tensor<T, B>& y) {
  GRAPHMOE_CHECK(x.numel() == y.numel() && !y.empty(), op, "x has shape ", x.shape(),
                 " and y has shape ", y.shape(), ": they must have the same number of elements");
}
}  // namespace detail

template <class T>
void add_row_vector(const Tensor<T, cpu>& b, const Tensor<T, cpu>& y) {
  detail::check_row_vector("add_row_vector", "b", y, b);
  as_matrix(y).rowwise() += as_vector(b).transpose();
}

template <class T>
void accumulate_column_sums(const Tensor<T, cpu>& dy, const Tensor<T, cpu>& db) {
  detail::check_row_vector("accumulate_column_sums", "db", dy, db);
  as_vector(db) += as_matrix(dy).colwise().sum().transpose();
}

template <class T>
void axpy(T alpha, const Tensor<T, cpu>& x, const Tensor<T, cpu>& y) {
  detail::check_same_size("axpy", x, y);
  as_vector(y) += alpha * as_vector(x);
}

template <class T>
void scale(const Tensor<T, cpu>& t, T alpha) {
  as_vector(t) *= alpha;
}

template <class T>
void fill(const Tensor<T, cpu>& t, T value) {
  std::fill(t.data(), t.data() + t.numel(), value);
}

template <class T>
void fill_normal(const Tensor<T, cpu>& t, Rng& rng, double stddev) {
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(rng.normal(0.0, stddev));
}

template <class T>
void copy_from_host(const Tensor<T, cpu>& dst, const Tensor<T, cpu>& src) {
  Tensor<T, cpu> d = dst;
  d.copy_from(src);
}

template <class T>
T read_scalar(const Tensor<T, cpu>& t) {
  GRAPHMOE_CHECK(t.numel() >= 1, "read_scalar", "the tensor is empty");
  return t.data()[0];
}

template <class T>
void accumulate_dot(const Tensor<T, cpu>& a, const Tensor<T, cpu>& b, T alpha,
                    const Tensor<T, cpu>& d) {
  detail::check_same_size("accumulate_dot", a, b);
  GRAPHMOE_CHECK(d.numel() == 1, "accumulate_dot", "the destination has shape ", d.shape(),
                 ", expected one element");
  double s = 0;
  for (index_t i = 0; i < a.numel(); ++i)
    s += static_cast<double>(a.data()[i]) * static_cast<double>(b.data()[i]);
  d.data()[0] += alpha * static_cast<T>(s);
}

template <class T>
void normalize_rows(const Tensor<T, cpu>& x, Tensor<T, cpu>& norms, T eps) {
  prepare_output("normalize_rows", "norms", norms, Shape{x.rows()});
  auto m = as_matrix(x);
  for (index_t i = 0; i < m.rows(); ++i) {
    const T nrm = std::max(m.row(i).norm(), eps);
    norms.data()[i] = nrm;
    m.row(i) /= nrm;
  }
}

template <class T>
void normalize_rows_backward(const Tensor<T, cpu>& y, const Tensor<T, cpu>& norms, T eps,
                             const Tensor<T, cpu>& dy) {
  check_shape("normalize_rows_backward", "dy", dy, y.shape());
  auto ym = as_matrix(y);
  auto g = as_matrix(dy);
  for (index_t i = 0; i < ym.rows(); ++i) {
    const T nrm = norms.data()[i];
    if (nrm > eps) g.row(i) -= ym.row(i) * ym.row(i).dot(g.row(i));
    g.row(i) /= nrm;
  }
}

namespace detail {
inline void check_patchify(index_t numel, index_t patch, index_t height, index_t width,
                           index_t channels) {
  GRAPHMOE_CHECK(patch >= 1 && height % patch == 0 && width % patch == 0 && channels >= 1 &&
                     numel % (height * width * channels) == 0,
                 "patchify", "images of ", numel, " values cannot be cut into ", patch, "x",
                 patch, " patches of ", height, "x", width, "x", channels, " images");
}
}  // namespace detail

template <class T>
void patchify(const Tensor<T, cpu>& images, index_t patch, index_t height, index_t width,
              index_t channels, Tensor<T, cpu>& patches) {
  detail::check_patchify(images.numel(), patch, height, width, channels);
  const index_t per_image = height * width * channels, b = images.numel() / per_image;
  const index_t pw = width / patch, np = (height / patch) * pw, pd = patch * patch * channels;
  prepare_output("patchify", "patches", patches, Shape{b * np, pd});
  for (index_t i = 0; i < b; ++i)
    for (index_t p = 0; p < np; ++p) {
      const index_t py = p / pw, px = p % pw;
      T* dst = patches.data() + (i * np + p) * pd;
      for (index_t y = 0; y < patch; ++y)
        for (index_t x = 0; x < patch; ++x)
          for (index_t c = 0; c < channels; ++c)
            *dst++ = images.data()[i * per_image +
                                   ((py * patch + y) * width + (px * patch + x)) * channels + c];
    }
}

}  // namespace graphmoe
