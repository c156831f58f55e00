// graphmoe/ops/elementwise.hpp: the small element-wise and broadcast ops that layers need besides
// GEMMs, so that a layer's body is the same on every backend.
//
//   add_row_vector(b, y)           y[i, :] += b            y (..., C) read as (rows, C), b (C)
//   accumulate_column_sums(dy, db) db += sum_i dy[i, :]    dy (..., C) read as (rows, C), db (C)
//   add(a, b, out)                 out = a + b             same number of elements; out
//                                                          prepared with a's shape (may alias
//                                                          a or b): a residual in one pass
//   axpy(alpha, x, y)              y += alpha x            same number of elements
//   scale(t, alpha)                t *= alpha
//   fill(t, value)                 t[:] = value
//   fill_normal(t, rng, stddev)    t[:] ~ N(0, stddev^2), drawn in flat order from rng (the same
//                                  values on every backend for the same rng state)
//   copy_from_host(dst, src)       dst = src, src a host tensor of dst's shape
//   read_scalar(t)                 t's first value, on the host
//   accumulate_dot(a, b, alpha, d) d[0] += alpha sum_i a_i b_i   (d a one-element tensor; the
//                                  sum in double, in index order)
//   normalize_rows(x, norms)       x_i <- x_i / max(|x_i|, eps), norms_i = max(|x_i|, eps)
//   normalize_rows_backward(y, norms, eps, dy)
//                                  y = x / n: dy_i <- (dy_i - y_i (y_i . dy_i)) / n_i, or dy_i / eps
//                                  where the norm was clamped (y = x / eps is linear in x)
//   scale_rows(x, s, y)            y[i, :] = s[i] x[i, :]   x (N, C), s (N) (y prepared; may be x)
//   row_dots(a, b, d)              d[i] = sum_j a[i, j] b[i, j]   (d prepared (N); the sum in
//                                  column order)
//   sigmoid_forward(x, y)          y = 1 / (1 + exp(-x))   (y prepared with x's shape; may be x)
//   sigmoid_backward(y, dy, dx)    dx = dy y (1 - y), from the forward's output y (assigned; dx
//                                  may be dy)
//   patchify(images, P, H, W, C, patches)
//                                  images (B, H, W, C) -> patches (B Np, P P C), Np = (H/P)(W/P):
//                                  patch (py, px) of image b is row b Np + py (W/P) + px, read
//                                  row-major within the patch, channels innermost (ViT's order)
//   check_finite(op, what, t)      throws naming the first NaN or Inf entry of t (core/tensor.hpp
//                                  has the CPU tensor's check; this one serves every other backend)
//
// The outputs are updated in place through their handles (a Tensor is a handle, so a slice or a
// view may be passed). Column sums run over the rows in order for every column, so the result does
// not depend on the thread count.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// X(B{}, ...) runs the backend's system (backend/cpu/elementwise.hpp, backend/cuda/elementwise.cuh,
// or a user backend's overload found by argument-dependent lookup).
#pragma once

#include <string>

#include "graphmoe/backend/cpu/elementwise.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
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
inline void check_patchify(index_t numel, index_t patch, index_t height, index_t width,
                           index_t channels) {
  GRAPHMOE_CHECK(patch >= 1 && height % patch == 0 && width % patch == 0 && channels >= 1 &&
                     numel % (height * width * channels) == 0,
                 "patchify", "images of ", numel, " values cannot be cut into ", patch, "x",
                 patch, " patches of ", height, "x", width, "x", channels, " images");
}
}  // namespace detail

template <class T, Backend B>
void add_row_vector(const Tensor<T, B>& b, const Tensor<T, B>& y) {
  detail::check_row_vector("add_row_vector", "b", y, b);
  add_row_vector(B{}, b, y);
}

template <class T, Backend B>
void accumulate_column_sums(const Tensor<T, B>& dy, const Tensor<T, B>& db) {
  detail::check_row_vector("accumulate_column_sums", "db", dy, db);
  accumulate_column_sums(B{}, dy, db);
}

template <class T, Backend B>
void add(const Tensor<T, B>& a, const Tensor<T, B>& b, Tensor<T, B>& out) {
  detail::check_same_size("add", a, b);
  prepare_output("add", "out", out, a.shape());
  add(B{}, a, b, out);
}

template <class T, Backend B>
void axpy(T alpha, const Tensor<T, B>& x, const Tensor<T, B>& y) {
  detail::check_same_size("axpy", x, y);
  axpy(B{}, alpha, x, y);
}

template <class T, Backend B>
void scale(const Tensor<T, B>& t, T alpha) {
  scale(B{}, t, alpha);
}

template <class T, Backend B>
void fill(const Tensor<T, B>& t, T value) {
  fill(B{}, t, value);
}

template <class T, Backend B>
void fill_normal(const Tensor<T, B>& t, Rng& rng, double stddev) {
  fill_normal(B{}, t, rng, stddev);
}

template <class T, Backend B>
void copy_from_host(const Tensor<T, B>& dst, const Tensor<T, cpu>& src) {
  copy_from_host(B{}, dst, src);
}

template <class T, Backend B>
T read_scalar(const Tensor<T, B>& t) {
  GRAPHMOE_CHECK(t.numel() >= 1, "read_scalar", "the tensor is empty");
  return read_scalar(B{}, t);
}

template <class T, Backend B>
void accumulate_dot(const Tensor<T, B>& a, const Tensor<T, B>& b, T alpha, const Tensor<T, B>& d) {
  detail::check_same_size("accumulate_dot", a, b);
  GRAPHMOE_CHECK(d.numel() == 1, "accumulate_dot", "the destination has shape ", d.shape(),
                 ", expected one element");
  accumulate_dot(B{}, a, b, alpha, d);
}

template <class T, Backend B>
void normalize_rows(const Tensor<T, B>& x, Tensor<T, B>& norms, T eps) {
  prepare_output("normalize_rows", "norms", norms, Shape{x.rows()});
  normalize_rows(B{}, x, norms, eps);
}

template <class T, Backend B>
void normalize_rows_backward(const Tensor<T, B>& y, const Tensor<T, B>& norms, T eps,
                             const Tensor<T, B>& dy) {
  check_shape("normalize_rows_backward", "dy", dy, y.shape());
  normalize_rows_backward(B{}, y, norms, eps, dy);
}

template <class T, Backend B>
void scale_rows(const Tensor<T, B>& x, const Tensor<T, B>& s, Tensor<T, B>& y) {
  GRAPHMOE_CHECK(x.rank() == 2 && !x.empty(), "scale_rows", "x must be a non-empty (N, C) matrix, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  check_shape("scale_rows", "s", s, Shape{x.rows()});
  prepare_output("scale_rows", "y", y, x.shape());
  scale_rows(B{}, x, s, y);
}

template <class T, Backend B>
void row_dots(const Tensor<T, B>& a, const Tensor<T, B>& b, Tensor<T, B>& d) {
  GRAPHMOE_CHECK(a.rank() == 2 && !a.empty(), "row_dots", "a must be a non-empty (N, C) matrix, got ",
                 (a.empty() ? "an empty tensor" : a.shape().str()));
  check_shape("row_dots", "b", b, a.shape());
  prepare_output("row_dots", "d", d, Shape{a.rows()});
  row_dots(B{}, a, b, d);
}

template <class T, Backend B>
void sigmoid_forward(const Tensor<T, B>& x, Tensor<T, B>& y) {
  GRAPHMOE_CHECK(!x.empty(), "sigmoid_forward", "x is empty");
  prepare_output("sigmoid_forward", "y", y, x.shape());
  sigmoid_forward(B{}, x, y);
}

template <class T, Backend B>
void sigmoid_backward(const Tensor<T, B>& y, const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  GRAPHMOE_CHECK(!y.empty(), "sigmoid_backward", "y is empty");
  check_shape("sigmoid_backward", "dy", dy, y.shape());
  prepare_output("sigmoid_backward", "dx", dx, y.shape());
  sigmoid_backward(B{}, y, dy, dx);
}

template <class T, Backend B>
void patchify(const Tensor<T, B>& images, index_t patch, index_t height, index_t width,
              index_t channels, Tensor<T, B>& patches) {
  detail::check_patchify(images.numel(), patch, height, width, channels);
  const index_t per_image = height * width * channels, b = images.numel() / per_image;
  const index_t pw = width / patch, np = (height / patch) * pw, pd = patch * patch * channels;
  prepare_output("patchify", "patches", patches, Shape{b * np, pd});
  patchify(B{}, images, patch, height, width, channels, patches);
}

// The backend returns the first NaN or Inf entry of t (core/offender.hpp). A CPU tensor takes
// core/tensor.hpp's check_finite (the more specialised overload), with the same message.
template <class T, Backend B>
void check_finite(const char* op, const char* what, const Tensor<T, B>& t) {
  report_check(check_finite(B{}, t),
               [where = std::string(op), name = std::string(what),
                shape = t.shape()](const Offender& bad) {
                 detail::throw_error(where.c_str(), name, " of shape ", shape, " holds ", bad.value,
                                     " at flat index ", bad.index);
               });
}

}  // namespace graphmoe
