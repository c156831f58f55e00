// graphmoe/ops/aux_losses.hpp: auxiliary router losses and their gradients.
//
// Switch load balancing (Fedus et al. 2021; Megatron moe_utils.py normalisation):
//     L_lb = E * sum_e f_e P_e,   f_e = (slots routed to e) / (N k),   P_e = mean_i p_ie
// f is a count (no gradient); dL_lb / dp_ie = E f_e / N.
//
// Router z-loss (ST-MoE, Zoph et al. 2022):
//     L_z = mean_i (logsumexp_e gamma_ie)^2,   dL_z / dgamma_ie = 2 lse_i softmax(gamma_i)_e / N
//
// Every backend computes the same values (the host arithmetic of core/aux_losses.hpp). Op layer:
// the arguments are checked here, once for every backend; then load_balance_loss(B{}, ...) /
// z_loss(B{}, ...) run the backend's system (backend/cpu/aux_losses.hpp,
// backend/cuda/aux_losses.cuh, or a user backend's overload found by argument-dependent lookup),
// which returns the first expert id out of range, if any (core/offender.hpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "graphmoe/backend/cpu/aux_losses.hpp"
#include "graphmoe/core/aux_losses.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// Returns L_lb of p (N, E) and indices (N, k) of expert ids in [0, E); if dp is non-empty, adds
// coef * dL_lb/dp to it. (dp and dgamma may be nullptr: B is deduced from the scores.)
template <class T, Backend B>
double load_balance_loss(const Tensor<T, B>& p, const Tensor<std::int32_t, B>& indices,
                         double coef, std::type_identity_t<Tensor<T, B>>* dp) {
  constexpr const char* op = "load_balance_loss";
  GRAPHMOE_CHECK(indices.rows() == p.rows(), op, "indices ", indices.shape(), " do not match p ",
                 p.shape());
  const LossValue loss = load_balance_loss(B{}, p, indices, coef, dp);
  GRAPHMOE_CHECK(!loss.bad.found(), op, "expert id ", static_cast<std::int64_t>(loss.bad.value),
                 " out of [0, ", p.cols(), ")");
  return loss.value;
}

// Returns L_z of gamma (N, E); if dgamma is non-empty, adds coef * dL_z/dgamma to it.
template <class T, Backend B>
double z_loss(const Tensor<T, B>& gamma, double coef,
              std::type_identity_t<Tensor<T, B>>* dgamma) {
  return z_loss(B{}, gamma, coef, dgamma);
}

}  // namespace graphmoe
