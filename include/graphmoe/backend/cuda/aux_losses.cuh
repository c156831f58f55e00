// graphmoe/backend/cuda/aux_losses.cuh: the auxiliary router losses for routers running on
// graphmoe::cuda (contract and argument checks: ops/aux_losses.hpp, which calls these through the
// backend tag).
//
// The losses reduce (N, E) scores to one number that the training loop reads on the host anyway,
// so this version copies p (or gamma) and the ids to the host (128 KB at the paper's medium shape,
// one synchronisation), evaluates the host arithmetic of core/aux_losses.hpp there (the CPU's)
// and adds the gradient back on the device. Both losses are off by default (RouterConfig's
// coefficients are 0), so a router without them never takes this path. Same values as the CPU by
// construction.
#pragma once

#include <cstdint>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/core/aux_losses.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T>
LossValue load_balance_loss(cuda, const Tensor<T, cuda>& p,
                            const Tensor<std::int32_t, cuda>& indices, double coef,
                            Tensor<T, cuda>* dp) {
  const Tensor<T, cpu> hp = to_host(p);
  const Tensor<std::int32_t, cpu> hi = to_host(indices);
  const bool grad = dp != nullptr && !dp->empty();
  Tensor<T, cpu> hdp = grad ? Tensor<T, cpu>(dp->shape()) : Tensor<T, cpu>();
  const LossValue loss = detail::load_balance_loss_host<T>(hp, hi, coef, grad ? &hdp : nullptr);
  if (grad && !loss.bad.found()) axpy(T(1), to_device(hdp), *dp);
  return loss;
}

template <class T>
double z_loss(cuda, const Tensor<T, cuda>& gamma, double coef, Tensor<T, cuda>* dgamma) {
  const Tensor<T, cpu> hg = to_host(gamma);
  const bool grad = dgamma != nullptr && !dgamma->empty();
  Tensor<T, cpu> hdg = grad ? Tensor<T, cpu>(dgamma->shape()) : Tensor<T, cpu>();
  const double loss = detail::z_loss_host<T>(hg, coef, grad ? &hdg : nullptr);
  if (grad) axpy(T(1), to_device(hdg), *dgamma);
  return loss;
}

}  // namespace graphmoe
