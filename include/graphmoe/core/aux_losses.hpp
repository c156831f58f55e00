// graphmoe/core/aux_losses.hpp: the host arithmetic of the auxiliary router losses (internal), one
// definition for every backend: the CPU system runs it on its tensors (backend/cpu/aux_losses.hpp),
// the CUDA system on host copies (backend/cuda/aux_losses.cuh), so the values are the same by
// construction. Contract and argument checks: ops/aux_losses.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// A loss value, or the first offending entry of the input that kept it from being computed.
struct LossValue {
  double value = 0;
  Offender bad;  // found(): nothing was computed, nothing was written
};

namespace detail {

// L_lb of p (N, E) and indices (N, k); if dp is non-empty, adds coef * dL_lb/dp to it. Returns
// the first expert id outside [0, E) instead (before writing dp).
template <class T>
LossValue load_balance_loss_host(const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                                 double coef, Tensor<T, cpu>* dp) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  std::vector<double> f(static_cast<std::size_t>(e), 0.0);
  for (index_t s = 0; s < slots; ++s) {
    const std::int32_t x = indices.data()[s];
    if (!(x >= 0 && x < e)) return {0.0, Offender{s, static_cast<double>(x)}};
    f[static_cast<std::size_t>(x)] += 1.0 / static_cast<double>(slots);
  }
  auto P = as_matrix(p);
  double loss = 0;
  for (index_t j = 0; j < e; ++j)
    loss += f[static_cast<std::size_t>(j)] * static_cast<double>(P.col(j).sum()) /
            static_cast<double>(n);
  loss *= static_cast<double>(e);
  if (dp != nullptr && !dp->empty()) {
    auto dP = as_matrix(*dp);
    for (index_t j = 0; j < e; ++j)
      dP.col(j).array() += static_cast<T>(coef * static_cast<double>(e) *
                                          f[static_cast<std::size_t>(j)] / static_cast<double>(n));
  }
  return {loss, {}};
}

// L_z of gamma (N, E); if dgamma is non-empty, adds coef * dL_z/dgamma to it.
template <class T>
double z_loss_host(const Tensor<T, cpu>& gamma, double coef, Tensor<T, cpu>* dgamma) {
  const index_t n = gamma.rows();
  auto G = as_matrix(gamma);
  double loss = 0;
  for (index_t i = 0; i < n; ++i) {
    const T mx = G.row(i).maxCoeff();
    const T lse = mx + std::log((G.row(i).array() - mx).exp().sum());
    loss += static_cast<double>(lse) * static_cast<double>(lse);
    if (dgamma != nullptr && !dgamma->empty()) {
      as_matrix(*dgamma).row(i).array() +=
          static_cast<T>(coef * 2.0 / static_cast<double>(n)) * lse * (G.row(i).array() - lse).exp();
    }
  }
  return loss / static_cast<double>(n);
}

}  // namespace detail
}  // namespace graphmoe
