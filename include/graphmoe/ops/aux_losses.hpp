// graphmoe/ops/aux_losses.hpp: auxiliary router losses and their gradients.
//
// Switch load balancing (Fedus et al. 2021; Megatron moe_utils.py normalisation):
//     L_lb = E * sum_e f_e P_e,   f_e = (slots routed to e) / (N k),   P_e = mean_i p_ie
// f is a count (no gradient); dL_lb / dp_ie = E f_e / N.
//
// Sequence-wise balance loss (DeepSeek-V3 eqs. 17-20; Megatron-Core's seq_aux_loss), over the
// B = N / T sequences of T consecutive rows:
//     p'_ti = p_ti / sum_j p_tj,   f_bi = E / (k T) * (slots of sequence b routed to i),
//     P_bi = (1/T) sum_{t in b} p'_ti,   L_seq = (1/B) sum_b sum_i f_bi P_bi
// f is a count (no gradient); dL_seq / dp_ti = (g_i - sum_j g_j p'_tj) / sum_j p_tj with
// g_i = f_bi / (T B). Every slot of the indices counts, the dropped ones too (as in L_lb). A row
// of p whose sum is not > 0 or not finite throws, naming the row. seq_aux_loss computes the value
// and the gradient in one call (CUDA: on host copies, one synchronisation); the router calls it
// in forward (value) and backward (gradient).
//
// Router z-loss (ST-MoE, Zoph et al. 2022):
//     L_z = mean_i (logsumexp_e gamma_ie)^2,   dL_z / dgamma_ie = 2 lse_i softmax(gamma_i)_e / N
//
// What a router uses (routing/router.hpp), so that a GPU training step reads nothing back for
// them before its loss:
//   load_balance_loss_into(p, indices, value)      L_lb into `value`: at once, or, inside
//       with_deferred_checks on a backend that defers (CUDA: load_balance_value), with the scope's
//       next read to the host, at the latest when it ends (`value` must outlive the scope). An id
//       outside [0, E) throws (a deferrable check).
//   load_balance_loss_backward(p, indices, coef, dp)   dp += coef dL_lb/dp, for ids the forward
//       checked (a backend may skip ids outside [0, E) instead of reading a flag back: CUDA's
//       load_balance_gradient)
//   z_loss_into(gamma, value), z_loss_backward(gamma, coef, dgamma)   the same pair for L_z
//       (CUDA: z_loss_value, z_loss_gradient)
// A backend without those hooks runs load_balance_loss (z_loss) for both.
//
// Every backend computes the same values (the host arithmetic of core/aux_losses.hpp; the CUDA
// hooks sum in double on the device: equal to rounding). Op layer:
// the arguments are checked here, once for every backend; then load_balance_loss(B{}, ...) /
// z_loss(B{}, ...) run the backend's system (backend/cpu/aux_losses.hpp,
// backend/cuda/aux_losses.cuh, or a user backend's overload found by argument-dependent lookup),
// which returns the first expert id out of range, if any (core/offender.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "graphmoe/backend/cpu/aux_losses.hpp"
#include "graphmoe/core/aux_losses.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
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

template <class T, Backend B>
void load_balance_loss_into(const Tensor<T, B>& p, const Tensor<std::int32_t, B>& indices,
                            double& value) {
  constexpr const char* op = "load_balance_loss";
  GRAPHMOE_CHECK(indices.rows() == p.rows(), op, "indices ", indices.shape(), " do not match p ",
                 p.shape());
  if constexpr (requires { load_balance_value(B{}, p, indices, value); }) {
    report_check(load_balance_value(B{}, p, indices, value), [e = p.cols()](const Offender& bad) {
      detail::throw_error("load_balance_loss", "expert id ", static_cast<std::int64_t>(bad.value),
                          " out of [0, ", e, ")");
    });
  } else {
    value = load_balance_loss(p, indices, 0.0, nullptr);
  }
}

template <class T, Backend B>
void load_balance_loss_backward(const Tensor<T, B>& p, const Tensor<std::int32_t, B>& indices,
                                double coef, Tensor<T, B>& dp) {
  constexpr const char* op = "load_balance_loss_backward";
  GRAPHMOE_CHECK(indices.rows() == p.rows(), op, "indices ", indices.shape(), " do not match p ",
                 p.shape());
  check_shape(op, "dp", dp, p.shape());
  if constexpr (requires { load_balance_gradient(B{}, p, indices, coef, dp); })
    load_balance_gradient(B{}, p, indices, coef, dp);
  else
    (void)load_balance_loss(p, indices, coef, &dp);
}

// Returns L_seq of p (N, E) and indices (N, k) of expert ids in [0, E) over sequences of seq_len
// rows (seq_len >= 1 dividing N); if dp is non-empty, adds coef * dL_seq/dp to it.
template <class T, Backend B>
double seq_aux_loss(const Tensor<T, B>& p, const Tensor<std::int32_t, B>& indices, index_t seq_len,
                    double coef, std::type_identity_t<Tensor<T, B>>* dp) {
  constexpr const char* op = "seq_aux_loss";
  GRAPHMOE_CHECK(p.rank() == 2, op, "p has shape ", p.shape(), ", expected (N, E)");
  GRAPHMOE_CHECK(indices.rank() == 2 && indices.rows() == p.rows() && indices.cols() >= 1, op,
                 "indices ", indices.shape(), " do not match p ", p.shape());
  GRAPHMOE_CHECK(seq_len >= 1 && p.rows() % seq_len == 0, op, "seq_len = ", seq_len,
                 " must be >= 1 and divide the ", p.rows(), " rows of p");
  GRAPHMOE_CHECK(std::isfinite(coef), op, "coef must be finite, got ", coef);
  if (dp != nullptr && !dp->empty()) check_shape(op, "dp", *dp, p.shape());
  const SeqAuxLossValue loss = seq_aux_loss(B{}, p, indices, seq_len, coef, dp);
  GRAPHMOE_CHECK(!loss.bad_id.found(), op, "expert id ",
                 static_cast<std::int64_t>(loss.bad_id.value), " out of [0, ", p.cols(), ")");
  GRAPHMOE_CHECK(!loss.bad_row.found(), op, "row ", loss.bad_row.index, " of p sums to ",
                 loss.bad_row.value, "; the scores of every token must have a finite sum > 0");
  return loss.value;
}

// Returns L_z of gamma (N, E); if dgamma is non-empty, adds coef * dL_z/dgamma to it.
template <class T, Backend B>
double z_loss(const Tensor<T, B>& gamma, double coef,
              std::type_identity_t<Tensor<T, B>>* dgamma) {
  GRAPHMOE_CHECK(gamma.rank() == 2, "z_loss", "gamma has shape ", gamma.shape(),
                 ", expected (N, E)");
  if (dgamma != nullptr && !dgamma->empty()) check_shape("z_loss", "dgamma", *dgamma, gamma.shape());
  return z_loss(B{}, gamma, coef, dgamma);
}

// L_z of gamma into `value`: at once, or, inside with_deferred_checks on a backend that defers
// (CUDA: z_loss_value), with the scope's next read (`value` must outlive the scope).
template <class T, Backend B>
void z_loss_into(const Tensor<T, B>& gamma, double& value) {
  GRAPHMOE_CHECK(gamma.rank() == 2, "z_loss", "gamma has shape ", gamma.shape(),
                 ", expected (N, E)");
  if constexpr (requires { z_loss_value(B{}, gamma, value); })
    z_loss_value(B{}, gamma, value);
  else
    value = z_loss(gamma, 0.0, nullptr);
}

// dgamma += coef dL_z/dgamma (CUDA: z_loss_gradient, on the device, no read back).
template <class T, Backend B>
void z_loss_backward(const Tensor<T, B>& gamma, double coef, Tensor<T, B>& dgamma) {
  GRAPHMOE_CHECK(gamma.rank() == 2, "z_loss_backward", "gamma has shape ", gamma.shape(),
                 ", expected (N, E)");
  check_shape("z_loss_backward", "dgamma", dgamma, gamma.shape());
  if constexpr (requires { z_loss_gradient(B{}, gamma, coef, dgamma); })
    z_loss_gradient(B{}, gamma, coef, dgamma);
  else
    (void)z_loss(gamma, coef, &dgamma);
}

}  // namespace graphmoe
