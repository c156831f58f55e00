// graphmoe/routing/aux_losses.hpp: auxiliary router losses and their gradients.
//
// Switch load balancing (Fedus et al. 2021; Megatron moe_utils.py normalisation):
//     L_lb = E * sum_e f_e P_e,   f_e = (slots routed to e) / (N k),   P_e = mean_i p_ie
// f is a count (no gradient); dL_lb / dp_ie = E f_e / N. With a token graph on, P uses p, the
// distribution the selector actually ranks (after the graph), so the loss balances the decisions
// the router makes; with the Independent graph p = r and this is the usual Switch loss.
//
// Router z-loss (ST-MoE, Zoph et al. 2022):
//     L_z = mean_i (logsumexp_e gamma_ie)^2,   dL_z / dgamma_ie = 2 lse_i softmax(gamma_i)_e / N
// on the scorer's logits gamma (before the graph).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/eigen.hpp"

namespace graphmoe {

// Returns L_lb; if dp is non-empty, adds coef * dL_lb/dp to it.
template <class T>
double load_balance_loss(const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                         double coef, Tensor<T, cpu>* dp) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  GRAPHMOE_CHECK(indices.rows() == n, "load_balance_loss", "indices ", indices.shape(),
                 " do not match p ", p.shape());
  std::vector<double> f(static_cast<std::size_t>(e), 0.0);
  for (index_t s = 0; s < slots; ++s) {
    const std::int32_t x = indices.data()[s];
    GRAPHMOE_CHECK(x >= 0 && x < e, "load_balance_loss", "expert id ", x, " out of [0, ", e, ")");
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
  return loss;
}

// Returns L_z; if dgamma is non-empty, adds coef * dL_z/dgamma to it.
template <class T>
double z_loss(const Tensor<T, cpu>& gamma, double coef, Tensor<T, cpu>* dgamma) {
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

}  // namespace graphmoe
