// graphmoe/backend/cpu/softmax.hpp: the CPU system's softmax and log-softmax over the last
// dimension (contract and argument checks: ops/softmax.hpp, which calls these through the backend
// tag).
//
//   softmax:      y_j = exp(x_j - m) / sum_k exp(x_k - m),        m = max_k x_k
//                 dx_j = y_j * (dy_j - sum_k dy_k y_k)
//   log_softmax:  y_j = x_j - m - log(sum_k exp(x_k - m))
//                 dx_j = dy_j - exp(y_j) * sum_k dy_k
//
// Every tensor is read as a (rows, cols) matrix, all dimensions but the last flattened into rows;
// rows are independent and split over set_num_threads() threads. Subtracting the row maximum keeps
// exp() in range for any finite logits; row sums are accumulated in double. exp is vectorised
// (detail/vexp.hpp: Eigen's packet exp, std::exp outside its normal range). -inf entries (masked
// positions) are fine as long as the row has a finite entry: their probability is exactly 0.
//
// The forward functions return the first row without a finite maximum (core/bad_row.hpp), with
// its NaN and +inf counts, for the op layer to throw; such a row is left untouched in y, other
// rows are written. y may be x, dx may be dy.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/core/bad_row.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

// Rows per thread below which a row-wise op over rows of `cols` entries runs serially.
inline index_t softmax_row_grain(index_t cols) {
  return std::max<index_t>(1, 8192 / std::max<index_t>(1, cols));
}

// Lowers `first` to `row` if row is smaller (a lock-free atomic minimum).
inline void softmax_note_bad_row(std::atomic<index_t>& first, index_t row) {
  index_t cur = first.load(std::memory_order_relaxed);
  while (row < cur && !first.compare_exchange_weak(cur, row, std::memory_order_relaxed)) {
  }
}

// Row `row` of x (no finite maximum) with its NaN and +inf counts.
template <class T>
BadRow softmax_bad_row(const Tensor<T, cpu>& x, index_t row) {
  const index_t cols = x.cols();
  const T* p = x.data() + row * cols;
  index_t pos_inf = 0, nan = 0;
  for (index_t j = 0; j < cols; ++j) {
    if (std::isnan(p[j])) ++nan;
    if (p[j] == std::numeric_limits<T>::infinity()) ++pos_inf;
  }
  return {row, nan, pos_inf};
}

// Shared forward of softmax (log = false) and log_softmax (log = true) into y, prepared with x's
// shape; returns the first row of x without a finite maximum, if any.
template <class T>
BadRow softmax_rows(bool log, const Tensor<T, cpu>& x, Tensor<T, cpu>& y) {
  const index_t rows = x.rows(), cols = x.cols();
  const T* xs = x.data();
  T* ys = y.data();
  std::atomic<index_t> first_bad{rows};
  parallel_for(
      0, rows,
      [&](index_t r) {
        const T* xr = xs + r * cols;
        T* yr = ys + r * cols;
        const T m = max_or_nan(xr, cols);
        if (!std::isfinite(m)) {
          softmax_note_bad_row(first_bad, r);
          return;
        }
        if (log) {
          const double sum = sum_exp_shifted(xr, m, cols);
          // (x - m) is exact near the maximum; subtracting m + log(sum) at once would round the
          // small log(sum) to the precision of a large m.
          const T lse = static_cast<T>(std::log(sum));
          for (index_t j = 0; j < cols; ++j) yr[j] = (xr[j] - m) - lse;
        } else {
          const double sum = exp_shifted(xr, m, yr, cols);
          const T inv = static_cast<T>(1.0 / sum);
          for (index_t j = 0; j < cols; ++j) yr[j] *= inv;
        }
      },
      softmax_row_grain(cols));
  const index_t bad = first_bad.load();
  return bad < rows ? softmax_bad_row(x, bad) : BadRow{};
}

}  // namespace detail

// y (x's shape, prepared by ops/softmax.hpp) = softmax(x); returns the first bad row of x.
template <class T>
BadRow softmax_forward(cpu, const Tensor<T, cpu>& x, Tensor<T, cpu>& y) {
  return detail::softmax_rows(false, x, y);
}

// dx = y * (dy - sum(dy * y)) per row; dx prepared by ops/softmax.hpp.
template <class T>
void softmax_backward(cpu, const Tensor<T, cpu>& y, const Tensor<T, cpu>& dy, Tensor<T, cpu>& dx) {
  const index_t rows = y.rows(), cols = y.cols();
  const T* ys = y.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  parallel_for(
      0, rows,
      [&](index_t r) {
        const T* yr = ys + r * cols;
        const T* dyr = dys + r * cols;
        T* dxr = dxs + r * cols;
        const T d = static_cast<T>(detail::accumulate_double(cols, [&](index_t j) {
          return static_cast<double>(dyr[j]) * static_cast<double>(yr[j]);
        }));
        for (index_t j = 0; j < cols; ++j) dxr[j] = yr[j] * (dyr[j] - d);
      },
      detail::softmax_row_grain(cols));
}

// y (x's shape, prepared by ops/softmax.hpp) = log_softmax(x); returns the first bad row of x.
template <class T>
BadRow log_softmax_forward(cpu, const Tensor<T, cpu>& x, Tensor<T, cpu>& y) {
  return detail::softmax_rows(true, x, y);
}

// dx = dy - exp(y) * sum(dy) per row; dx prepared by ops/softmax.hpp.
template <class T>
void log_softmax_backward(cpu, const Tensor<T, cpu>& y, const Tensor<T, cpu>& dy,
                          Tensor<T, cpu>& dx) {
  const index_t rows = y.rows(), cols = y.cols();
  const T* ys = y.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  parallel_for(
      0, rows,
      [&](index_t r) {
        const T* yr = ys + r * cols;
        const T* dyr = dys + r * cols;
        T* dxr = dxs + r * cols;
        const T s =
            static_cast<T>(detail::accumulate_double(cols, [&](index_t j) { return dyr[j]; }));
        detail::for_exp_blocks(yr, T(0), cols, [&](index_t j0, const T* e, index_t m) {
          for (index_t j = 0; j < m; ++j) dxr[j0 + j] = dyr[j0 + j] - e[j] * s;
        });
      },
      detail::softmax_row_grain(cols));
}

}  // namespace graphmoe
