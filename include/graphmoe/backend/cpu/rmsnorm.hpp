// graphmoe/backend/cpu/rmsnorm.hpp: the CPU system's RMS normalisation (contract and argument
// checks: ops/rmsnorm.hpp, which calls these through the backend tag).
//
// Rows are split over set_num_threads() threads; each row's mean square and the backward's row
// sum are accumulated in double. The weight gradient is reduced from per-block partial sums (in
// double) over fixed blocks of 64 rows, in block order, so dweight is free of data races and
// bit-identical for every thread count. The cache inv_rms is stored in T.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "graphmoe/backend/cpu/detail/blocked_rows.hpp"
#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {
// Rows per block of the weight-gradient partial sums (fixed: the order does not depend on the
// thread count).
inline constexpr index_t kRmsnormBlockRows = 64;
}  // namespace detail

// y (x's shape) and inv_rms (N) prepared by ops/rmsnorm.hpp.
template <class T>
void rmsnorm_forward(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& weight, double eps,
                     Tensor<T, cpu>& y, Tensor<T, cpu>& inv_rms) {
  const index_t n = x.rows(), d = x.cols();
  const T* xs = x.data();
  const T* w = weight.data();
  T* ys = y.data();
  T* rs = inv_rms.data();
  parallel_for(
      0, n,
      [&](index_t i) {
        const T* xr = xs + i * d;
        T* yr = ys + i * d;
        const double ms = detail::accumulate_double(d, [&](index_t j) {
                            const double v = static_cast<double>(xr[j]);
                            return v * v;
                          }) /
                          static_cast<double>(d);
        const T r = static_cast<T>(1.0 / std::sqrt(ms + eps));
        rs[i] = r;
        for (index_t j = 0; j < d; ++j) yr[j] = static_cast<T>(xr[j] * r) * w[j];
      },
      std::max<index_t>(1, 8192 / d));
}

// dx (x's shape) and dweight (D) prepared by ops/rmsnorm.hpp.
template <class T>
void rmsnorm_backward(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& weight,
                      const Tensor<T, cpu>& inv_rms, const Tensor<T, cpu>& dy, Tensor<T, cpu>& dx,
                      Tensor<T, cpu>& dweight) {
  const index_t n = x.rows(), d = x.cols();
  const index_t block = detail::kRmsnormBlockRows;
  const T* xs = x.data();
  const T* w = weight.data();
  const T* rs = inv_rms.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  const double inv_d = 1.0 / static_cast<double>(d);
  // acc: the block's sum_i dy_ij xhat_ij
  const std::vector<double> total = detail::blocked_row_sums(
      n, d, block, std::max<index_t>(1, 16384 / (block * d)), [&](index_t i, double* acc) {
        const T* xr = xs + i * d;
        const T* dyr = dys + i * d;
        T* dxr = dxs + i * d;
        const T r = rs[i];
        for (index_t j = 0; j < d; ++j)
          acc[j] += static_cast<double>(dyr[j]) * static_cast<double>(xr[j] * r);
        const double sum_gx = detail::accumulate_double(d, [&](index_t j) {
          return static_cast<double>(dyr[j] * w[j]) * static_cast<double>(xr[j] * r);
        });
        const T mean_gx = static_cast<T>(sum_gx * inv_d);
        // every read of row i (dy_i) happens above: dx may alias dy
        for (index_t j = 0; j < d; ++j) dxr[j] = r * (dyr[j] * w[j] - xr[j] * r * mean_gx);
      });
  T* dw = dweight.data();
  for (index_t j = 0; j < d; ++j) dw[j] += static_cast<T>(total[static_cast<std::size_t>(j)]);
}

}  // namespace graphmoe
