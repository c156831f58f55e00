// graphmoe/backend/cpu/layernorm.hpp: the CPU system's layer normalisation (contract and
// argument checks: ops/layernorm.hpp, which calls these through the backend tag).
//
// Rows are split over set_num_threads() threads. The mean and variance are computed in two passes
// in double (no E[x^2] - E[x]^2 cancellation). The parameter gradients are reduced from per-block
// partial sums over fixed blocks of rows, in block order, so dgamma and dbeta are free of data
// races and bit-identical for every thread count. The cache mean and rstd are stored in T.
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
// Rows per block of the parameter-gradient partial sums. Fixed (not derived from the thread
// count) so that the summation order, hence the result, does not depend on the thread count.
inline constexpr index_t kLayernormBlockRows = 64;
}  // namespace detail

// y (x's shape), mean and rstd (N) prepared by ops/layernorm.hpp.
template <class T>
void layernorm_forward(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& gamma,
                       const Tensor<T, cpu>& beta, T eps, Tensor<T, cpu>& y, Tensor<T, cpu>& mean,
                       Tensor<T, cpu>& rstd) {
  const index_t n = x.rows(), d = x.cols();
  const T* xs = x.data();
  const T* g = gamma.data();
  const T* b = beta.data();
  T* ys = y.data();
  T* ms = mean.data();
  T* rs = rstd.data();
  parallel_for(
      0, n,
      [&](index_t i) {
        const T* xr = xs + i * d;
        T* yr = ys + i * d;
        const double mu =
            detail::accumulate_double(d, [&](index_t j) { return xr[j]; }) / static_cast<double>(d);
        const auto squared_deviation = [&](index_t j) {
          const double c = static_cast<double>(xr[j]) - mu;
          return c * c;
        };
        const double var = detail::accumulate_double(d, squared_deviation) / static_cast<double>(d);
        const T m = static_cast<T>(mu);
        const T r = static_cast<T>(1.0 / std::sqrt(var + static_cast<double>(eps)));
        ms[i] = m;
        rs[i] = r;
        for (index_t j = 0; j < d; ++j) yr[j] = (xr[j] - m) * r * g[j] + b[j];
      },
      std::max<index_t>(1, 8192 / d));
}

// dx (x's shape), dgamma and dbeta (D) prepared by ops/layernorm.hpp.
template <class T>
void layernorm_backward(cpu, const Tensor<T, cpu>& x, const Tensor<T, cpu>& gamma,
                        const Tensor<T, cpu>& mean, const Tensor<T, cpu>& rstd,
                        const Tensor<T, cpu>& dy, Tensor<T, cpu>& dx, Tensor<T, cpu>& dgamma,
                        Tensor<T, cpu>& dbeta) {
  const index_t n = x.rows(), d = x.cols();

  const index_t block = detail::kLayernormBlockRows;
  const T* xs = x.data();
  const T* g = gamma.data();
  const T* ms = mean.data();
  const T* rs = rstd.data();
  const T* dys = dy.data();
  T* dxs = dx.data();
  const double inv_d = 1.0 / static_cast<double>(d);
  // acc: the block's sum_i dy_ij xhat_ij in [0, d) and sum_i dy_ij in [d, 2d)
  const std::vector<double> total = detail::blocked_row_sums(
      n, 2 * d, block, std::max<index_t>(1, 16384 / (block * d)), [&](index_t i, double* acc) {
        double* pg = acc;
        double* pb = acc + d;
        const T* xr = xs + i * d;
        const T* dyr = dys + i * d;
        T* dxr = dxs + i * d;
        const T m = ms[i], r = rs[i];
        for (index_t j = 0; j < d; ++j) {
          const T xhat = (xr[j] - m) * r;
          pg[j] += static_cast<double>(dyr[j]) * static_cast<double>(xhat);
          pb[j] += static_cast<double>(dyr[j]);
        }
        const double sum_g = detail::accumulate_double(d, [&](index_t j) { return dyr[j] * g[j]; });
        const double sum_gx = detail::accumulate_double(d, [&](index_t j) {
          return static_cast<double>(dyr[j] * g[j]) * static_cast<double>((xr[j] - m) * r);
        });
        const T mean_g = static_cast<T>(sum_g * inv_d);
        const T mean_gx = static_cast<T>(sum_gx * inv_d);
        for (index_t j = 0; j < d; ++j) {
          const T xhat = (xr[j] - m) * r;
          dxr[j] = r * (dyr[j] * g[j] - mean_g - xhat * mean_gx);
        }
      });
  T* dg = dgamma.data();
  T* db = dbeta.data();
  for (index_t j = 0; j < d; ++j) {
    dg[j] += static_cast<T>(total[static_cast<std::size_t>(j)]);
    db[j] += static_cast<T>(total[static_cast<std::size_t>(d + j)]);
  }
}

}  // namespace graphmoe
