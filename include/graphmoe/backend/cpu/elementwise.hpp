// graphmoe/backend/cpu/elementwise.hpp: the CPU system's small element-wise and broadcast ops
// (the list, contract and argument checks: ops/elementwise.hpp, which calls these through the
// backend tag).
//
// On Eigen maps or plain loops. Column sums run over the rows in order for every
// column, so the result does not depend on the thread count (the CUDA version sums in the same
// order, one thread per column). accumulate_dot sums in double, in index order.
#pragma once

#include <algorithm>
#include <cmath>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
void add_row_vector(cpu, const Tensor<T, cpu>& b, const Tensor<T, cpu>& y) {
  as_matrix(y).rowwise() += as_vector(b).transpose();
}

template <class T>
void accumulate_column_sums(cpu, const Tensor<T, cpu>& dy, const Tensor<T, cpu>& db) {
  as_vector(db) += as_matrix(dy).colwise().sum().transpose();
}

template <class T>
void add(cpu, const Tensor<T, cpu>& a, const Tensor<T, cpu>& b, const Tensor<T, cpu>& out) {
  as_vector(out) = as_vector(a) + as_vector(b);  // element-wise: out may alias a or b
}

template <class T>
void axpy(cpu, T alpha, const Tensor<T, cpu>& x, const Tensor<T, cpu>& y) {
  as_vector(y) += alpha * as_vector(x);
}

template <class T>
void scale(cpu, const Tensor<T, cpu>& t, T alpha) {
  as_vector(t) *= alpha;
}

template <class T>
void fill(cpu, const Tensor<T, cpu>& t, T value) {
  std::fill(t.data(), t.data() + t.numel(), value);
}

template <class T>
void fill_normal(cpu, const Tensor<T, cpu>& t, Rng& rng, double stddev) {
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(rng.normal(0.0, stddev));
}

template <class T>
void copy_from_host(cpu, const Tensor<T, cpu>& dst, const Tensor<T, cpu>& src) {
  Tensor<T, cpu> d = dst;
  d.copy_from(src);
}

template <class T>
T read_scalar(cpu, const Tensor<T, cpu>& t) {
  return t.data()[0];
}

template <class T>
void accumulate_dot(cpu, const Tensor<T, cpu>& a, const Tensor<T, cpu>& b, T alpha,
                    const Tensor<T, cpu>& d) {
  double s = 0;
  for (index_t i = 0; i < a.numel(); ++i)
    s += static_cast<double>(a.data()[i]) * static_cast<double>(b.data()[i]);
  d.data()[0] += alpha * static_cast<T>(s);
}

template <class T>
void normalize_rows(cpu, const Tensor<T, cpu>& x, Tensor<T, cpu>& norms, T eps) {
  auto m = as_matrix(x);
  for (index_t i = 0; i < m.rows(); ++i) {
    const T nrm = std::max(m.row(i).norm(), eps);
    norms.data()[i] = nrm;
    m.row(i) /= nrm;
  }
}

template <class T>
void normalize_rows_backward(cpu, const Tensor<T, cpu>& y, const Tensor<T, cpu>& norms, T eps,
                             const Tensor<T, cpu>& dy) {
  auto ym = as_matrix(y);
  auto g = as_matrix(dy);
  for (index_t i = 0; i < ym.rows(); ++i) {
    const T nrm = norms.data()[i];
    if (nrm > eps) g.row(i) -= ym.row(i) * ym.row(i).dot(g.row(i));
    g.row(i) /= nrm;
  }
}

template <class T>
void scale_rows(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& s, const Tensor<T, cpu>& y) {
  const index_t n = x.rows(), c = x.cols();
  for (index_t i = 0; i < n; ++i) {
    const T si = s.data()[i];
    for (index_t j = 0; j < c; ++j) y.data()[i * c + j] = x.data()[i * c + j] * si;
  }
}

template <class T>
void row_dots(cpu, const Tensor<T, cpu>& a, const Tensor<T, cpu>& b, const Tensor<T, cpu>& d) {
  const index_t n = a.rows(), c = a.cols();
  for (index_t i = 0; i < n; ++i) {
    T sum = 0;
    for (index_t j = 0; j < c; ++j) sum += a.data()[i * c + j] * b.data()[i * c + j];
    d.data()[i] = sum;
  }
}

// The logistic function without overflow: exp of a non-positive argument only.
template <class T>
T sigmoid_value(T x) {
  if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

template <class T>
void sigmoid_forward(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& y) {
  for (index_t i = 0; i < x.numel(); ++i) y.data()[i] = sigmoid_value(x.data()[i]);
}

template <class T>
void sigmoid_backward(cpu, const Tensor<T, cpu>& y, const Tensor<T, cpu>& dy,
                      const Tensor<T, cpu>& dx) {
  for (index_t i = 0; i < y.numel(); ++i) {
    const T v = y.data()[i];
    dx.data()[i] = dy.data()[i] * v * (T(1) - v);
  }
}

template <class T>
void patchify(cpu, const Tensor<T, cpu>& images, index_t patch, index_t height, index_t width,
               index_t channels, Tensor<T, cpu>& patches) {
  const index_t per_image = height * width * channels, b = images.numel() / per_image;
  const index_t pw = width / patch, np = (height / patch) * pw, pd = patch * patch * channels;
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
