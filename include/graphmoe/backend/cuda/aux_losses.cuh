// graphmoe/backend/cuda/aux_losses.cuh: the auxiliary router losses for routers running on
// graphmoe::cuda (contract and argument checks: ops/aux_losses.hpp, which calls these through the
// backend tag).
//
// The load-balancing loss as the router uses it runs on the device:
//   load_balance_value     one block: per expert the column sum of p (double, fixed order) and
//                          the count of its ids (block reductions), L_lb into a device word that is
//                          a deferred value of the open batch (deferred_check.cuh): read with the
//                          step's loss instead of a wait per MoE layer; the id range check is a
//                          deferrable flag
//   load_balance_gradient  the counts (one block), then dp[:, e] += coef E f_e / N (one thread per
//                          entry): no read back; ids outside [0, E) (which the forward's check
//                          reported) are skipped
//   z_loss_value           one block: lse_i per row (each thread's rows), mean of lse^2 summed in
//                          double, into a deferred value like load_balance_value's
//   z_loss_gradient        one thread per row: dgamma_i += (coef 2 / N) lse_i softmax(gamma_i)
// The general ops (load_balance_loss with a value and a gradient, z_loss, and seq_aux_loss, which
// the router uses as it is for both passes) copy p (or gamma) and the
// ids to the host (one synchronisation), evaluate the host arithmetic of core/aux_losses.hpp there
// (the CPU's) and add the gradient back on the device: the references of the tests.
#pragma once

#include <cstdint>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/deferred_check.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/core/aux_losses.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// blockDim.x a multiple of 32, one block: *value = E sum_e f_e P_e; the first id outside [0, E)
// flagged.
template <class T>
__global__ void load_balance_value_kernel(const T* p, const std::int32_t* ids, index_t n,
                                          index_t e, index_t slots, double* value,
                                          unsigned long long* bad) {
  double loss = 0;
  for (index_t x = 0; x < e; ++x) {
    double col = 0;
    unsigned long long count = 0;
    for (index_t i = threadIdx.x; i < n; i += blockDim.x) col += static_cast<double>(to_acc(p[i * e + x]));
    for (index_t s = threadIdx.x; s < slots; s += blockDim.x) count += ids[s] == x ? 1ull : 0ull;
    col = block_reduce(col, SumOp{}, 0.0);
    count = block_reduce(count, SumOp{}, 0ull);
    loss += static_cast<double>(count) / static_cast<double>(slots) * col / static_cast<double>(n);
  }
  for (index_t s = threadIdx.x; s < slots; s += blockDim.x)
    if (!(ids[s] >= 0 && ids[s] < e)) flag_index(bad, s);
  if (threadIdx.x == 0) *value = loss * static_cast<double>(e);
}

// One block: scale[x] = coef E f_x / N, f_x = (ids equal to x) / slots.
template <class I>
__global__ void load_balance_scale_kernel(const I* ids, index_t n, index_t e, index_t slots,
                                            double coef, double* scale) {
  for (index_t x = 0; x < e; ++x) {
    unsigned long long count = 0;
    for (index_t s = threadIdx.x; s < slots; s += blockDim.x) count += ids[s] == x ? 1ull : 0ull;
    count = block_reduce(count, SumOp{}, 0ull);
    if (threadIdx.x == 0)
      scale[x] = coef * static_cast<double>(e) *
                 (static_cast<double>(count) / static_cast<double>(slots)) / static_cast<double>(n);
  }
}

template <class T>
struct AddColumnScaleOp {
  const double* scale;
  T* dp;
  index_t e;
  __device__ void operator()(index_t i) const {
    dp[i] = from_acc<T>(to_acc(dp[i]) + to_acc(static_cast<T>(scale[i % e])));
  }
};

// lse_i = logsumexp of row i of gamma (n, e), in the accumulation type (T's for float / double).
template <class T>
__device__ inline acc_t<T> row_logsumexp(const T* g, index_t e) {
  using A = acc_t<T>;
  A mx = to_acc(g[0]);
  for (index_t x = 1; x < e; ++x) mx = to_acc(g[x]) > mx ? to_acc(g[x]) : mx;
  A s = A(0);
  for (index_t x = 0; x < e; ++x) s += exp_t(to_acc(g[x]) - mx);
  return mx + log_t(s);
}

// One block: *value = mean_i lse_i^2, summed in double (each thread's rows, then the block).
template <class T>
__global__ void z_loss_value_kernel(const T* gamma, index_t n, index_t e, double* value) {
  double s = 0;
  for (index_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double lse = static_cast<double>(row_logsumexp(gamma + i * e, e));
    s += lse * lse;
  }
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) *value = n > 0 ? s / static_cast<double>(n) : 0.0;
}

// One thread per row: dgamma_i += (coef 2 / N) lse_i exp(gamma_i - lse_i).
template <class T>
__global__ void z_loss_gradient_kernel(const T* gamma, index_t n, index_t e, acc_t<T> scale,
                                       T* dgamma) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    const T* g = gamma + i * e;
    const acc_t<T> lse = row_logsumexp(g, e);
    for (index_t x = 0; x < e; ++x)
      dgamma[i * e + x] =
          from_acc<T>(to_acc(dgamma[i * e + x]) + scale * lse * exp_t(to_acc(g[x]) - lse));
  }
}

}  // namespace detail

// L_z of gamma into `value`: a deferred value inside with_deferred_checks (delivered with the
// batch's next read), else read at once.
template <class T>
void z_loss_value(cuda, const Tensor<T, cuda>& gamma, double& value) {
  const index_t n = gamma.rows(), e = gamma.cols();
  if (n == 0 || e == 0) {
    value = 0.0;
    return;
  }
  detail::DeferredDouble out(value);
  detail::launch_kernel<detail::z_loss_value_kernel<T>>(1, detail::kThreads, gamma.data(), n, e,
                                                        out.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  out.finish();
}

// dgamma += coef dL_z/dgamma, on the device.
template <class T>
void z_loss_gradient(cuda, const Tensor<T, cuda>& gamma, double coef, Tensor<T, cuda>& dgamma) {
  const index_t n = gamma.rows(), e = gamma.cols();
  if (n == 0 || e == 0) return;
  const auto scale = static_cast<detail::acc_t<T>>(coef * 2.0 / static_cast<double>(n));
  detail::launch_kernel<detail::z_loss_gradient_kernel<T>>(detail::grid_for(n), detail::kThreads,
                                                           gamma.data(), n, e, scale,
                                                           dgamma.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
}

// L_lb into `value`: a deferred value inside with_deferred_checks (delivered with the batch's next
// read), else read at once. Returns the first id outside [0, E) (pending inside a scope).
template <class T>
Offender load_balance_value(cuda, const Tensor<T, cuda>& p, const Tensor<std::int32_t, cuda>& indices,
                            double& value) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  detail::FirstIndexFlag bad{detail::FirstIndexFlag::Deferrable{}};
  detail::DeferredDouble out(value);
  detail::launch_kernel<detail::load_balance_value_kernel<T>>(
      1, detail::kThreads, p.data(), indices.data(), n, e, slots, out.get(), bad.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  out.finish();
  return bad.result<Offender>("load_balance_loss", [indices](index_t s) {
    return Offender{s, static_cast<double>(detail::read_device_value(indices.data() + s))};
  });
}

// dp += coef dL_lb/dp, on the device (ids outside [0, E) skipped: the forward reported them).
template <class T>
void load_balance_gradient(cuda, const Tensor<T, cuda>& p, const Tensor<std::int32_t, cuda>& indices,
                           double coef, Tensor<T, cuda>& dp) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  if (n == 0 || e == 0) return;
  auto scale = Tensor<double, cuda>::uninitialized(Shape{e});  // written in full
  detail::launch_kernel<detail::load_balance_scale_kernel<std::int32_t>>(
      1, detail::kThreads, indices.data(), n, e, slots, coef, scale.data());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::for_each_index(n * e, detail::AddColumnScaleOp<T>{scale.data(), dp.data(), e});
}

template <class T>
LossValue load_balance_loss(cuda, const Tensor<T, cuda>& p,
                            const Tensor<std::int32_t, cuda>& indices, double coef,
                            Tensor<T, cuda>* dp) {
  const Tensor<T, cpu> hp = to_host(p);
  const Tensor<std::int32_t, cpu> hi = to_host(indices);
  const bool grad = dp != nullptr && !dp->empty();
  Tensor<T, cpu> hdp = grad ? Tensor<T, cpu>(dp->shape()) : Tensor<T, cpu>();
  const LossValue loss = detail::load_balance_loss_host<T>(hp, hi, coef, grad ? &hdp : nullptr);
  if (grad && !loss.bad.found()) axpy(cuda{}, T(1), to_device(hdp), *dp);
  return loss;
}

// The sequence-wise loss on host copies of p and the ids (one synchronisation; inside a deferred
// scope the copy is one of the batch's reads, which also delivers its flags). Not inside a CUDA
// graph capture.
template <class T>
SeqAuxLossValue seq_aux_loss(cuda, const Tensor<T, cuda>& p,
                             const Tensor<std::int32_t, cuda>& indices, index_t seq_len,
                             double coef, Tensor<T, cuda>* dp) {
  GRAPHMOE_CHECK(!cuda_stream_capturing(), "seq_aux_loss",
                 "the sequence-wise balance loss inside a CUDA graph capture (it reads p and the "
                 "ids back to the host); capture with seq_aux_loss_coef = 0");
  const Tensor<T, cpu> hp = to_host(p);
  const Tensor<std::int32_t, cpu> hi = to_host(indices);
  const bool grad = dp != nullptr && !dp->empty();
  Tensor<T, cpu> hdp = grad ? Tensor<T, cpu>(dp->shape()) : Tensor<T, cpu>();
  const SeqAuxLossValue loss =
      detail::seq_aux_loss_host<T>(hp, hi, seq_len, coef, grad ? &hdp : nullptr);
  if (grad && !loss.bad_id.found() && !loss.bad_row.found()) axpy(cuda{}, T(1), to_device(hdp), *dp);
  return loss;
}

template <class T>
double z_loss(cuda, const Tensor<T, cuda>& gamma, double coef, Tensor<T, cuda>* dgamma) {
  const Tensor<T, cpu> hg = to_host(gamma);
  const bool grad = dgamma != nullptr && !dgamma->empty();
  Tensor<T, cpu> hdg = grad ? Tensor<T, cpu>(dgamma->shape()) : Tensor<T, cpu>();
  const double loss = detail::z_loss_host<T>(hg, coef, grad ? &hdg : nullptr);
  if (grad) axpy(cuda{}, T(1), to_device(hdg), *dgamma);
  return loss;
}

}  // namespace graphmoe
