// graphmoe/backend/cpu/aux_losses.hpp: the CPU system's auxiliary router losses (contract and
// argument checks: ops/aux_losses.hpp, which calls these through the backend tag): the host
// arithmetic of core/aux_losses.hpp run on the tensors in place.
#pragma once

#include <cstdint>

#include "graphmoe/core/aux_losses.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
LossValue load_balance_loss(cpu, const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                            double coef, Tensor<T, cpu>* dp) {
  return detail::load_balance_loss_host(p, indices, coef, dp);
}

template <class T>
SeqAuxLossValue seq_aux_loss(cpu, const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                             index_t seq_len, double coef, Tensor<T, cpu>* dp) {
  return detail::seq_aux_loss_host(p, indices, seq_len, coef, dp);
}

template <class T>
double z_loss(cpu, const Tensor<T, cpu>& gamma, double coef, Tensor<T, cpu>* dgamma) {
  return detail::z_loss_host(gamma, coef, dgamma);
}

}  // namespace graphmoe
