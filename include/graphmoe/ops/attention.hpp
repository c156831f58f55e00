// graphmoe/ops/attention.hpp: multi-head scaled dot-product attention that keeps the per-head
// probabilities, and its backward.
//
// q, k, v: (B, T, H dh). Head h reads columns [h dh, (h + 1) dh) of each. For every (b, h):
//
//   S = Q_h K_h^T / sqrt(dh)                         (T, T)
//   S[i, j] = -inf for j > i                         when causal
//   P = softmax over each row of S                   probs[b, h]: (T, T), kept
//   O_h = P V_h                                      out[b, :, h dh : (h + 1) dh]
//
// The probabilities are an output, not a hidden intermediate: the attention-aware router reads
// them (its token graph is A^p of one head) and sends a gradient back into them. The backward
// pass therefore takes an optional dprobs_extra (B, H, T, T), added to dL/dP before the softmax
// backward:
//
//   dP  = dO_h V_h^T + dprobs_extra[b, h]
//   dV_h = P^T dO_h
//   dS  = P * (dP - rowsum(P * dP)) / sqrt(dh)       (* elementwise)
//   dQ_h = dS K_h,   dK_h = dS^T Q_h                 (all gradients assigned)
//
// Causal rows hold exact zeros above the diagonal. The optional row entropy (B, H, T) of the
// forward is -sum_j P_ij log P_ij of every probability row; the Attention token graph uses it to
// choose its head. Empty outputs are allocated (prepare_output).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend
// (AttentionDims, core/attention_dims.hpp, carries the dimensions); then attention_forward(B{},
// ...) / attention_backward(B{}, ...) runs the backend's system (backend/cpu/attention.hpp,
// backend/cuda/attention.cuh, or a user backend's overload found by argument-dependent lookup).
#pragma once

#include "graphmoe/backend/cpu/attention.hpp"
#include "graphmoe/core/attention_dims.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

// The shape checks of attention_forward and attention_backward: q (B, T, H dh), k and v q's
// shape, num_heads divides H dh.
template <class T, class B>
AttentionDims attention_dims(const char* op, const Tensor<T, B>& q, const Tensor<T, B>& k,
                             const Tensor<T, B>& v, index_t num_heads) {
  GRAPHMOE_CHECK(!q.empty() && q.rank() == 3, op, "q must be (B, T, H*dh), got ",
                 (q.empty() ? "an empty tensor" : q.shape().str()));
  check_shape(op, "k", k, q.shape());
  check_shape(op, "v", v, q.shape());
  const index_t width = q.dim(2);
  GRAPHMOE_CHECK(num_heads >= 1 && width > 0 && width % num_heads == 0, op, "num_heads = ",
                 num_heads, " does not divide the width ", width, " of q ", q.shape());
  return AttentionDims::of(q.shape(), num_heads);
}

}  // namespace detail

// probs (B, H, T, T) and out (B, T, H dh); empty outputs are allocated.
//
// row_entropy (optional, (B, H, T)): the entropy -sum_j P_ij log P_ij of every probability row.
template <class T, Backend B>
void attention_forward(const Tensor<T, B>& q, const Tensor<T, B>& k, const Tensor<T, B>& v,
                       index_t num_heads, bool causal, Tensor<T, B>& probs, Tensor<T, B>& out,
                       Tensor<T, B>* row_entropy = nullptr) {
  constexpr const char* op = "attention_forward";
  const AttentionDims dims = detail::attention_dims(op, q, k, v, num_heads);
  prepare_output(op, "probs", probs, dims.probs_shape());
  prepare_output(op, "out", out, q.shape());
  if (row_entropy != nullptr)
    prepare_output(op, "row_entropy", *row_entropy, Shape{dims.batch, num_heads, dims.seq});
  attention_forward(B{}, q, k, v, num_heads, causal, probs, out, row_entropy);
}

// dq, dk, dv (B, T, H dh), assigned; empty outputs are allocated. probs is the forward's output;
// dprobs_extra is empty or (B, H, T, T) (when causal, its entries above the diagonal are ignored:
// those probabilities are constant zeros).
template <class T, Backend B>
void attention_backward(const Tensor<T, B>& q, const Tensor<T, B>& k, const Tensor<T, B>& v,
                        index_t num_heads, bool causal, const Tensor<T, B>& probs,
                        const Tensor<T, B>& dout, const Tensor<T, B>& dprobs_extra,
                        Tensor<T, B>& dq, Tensor<T, B>& dk, Tensor<T, B>& dv) {
  constexpr const char* op = "attention_backward";
  const AttentionDims dims = detail::attention_dims(op, q, k, v, num_heads);
  check_shape(op, "probs", probs, dims.probs_shape());
  check_shape(op, "dout", dout, q.shape());
  if (!dprobs_extra.empty()) check_shape(op, "dprobs_extra", dprobs_extra, dims.probs_shape());
  prepare_output(op, "dq", dq, q.shape());
  prepare_output(op, "dk", dk, q.shape());
  prepare_output(op, "dv", dv, q.shape());
  attention_backward(B{}, q, k, v, num_heads, causal, probs, dout, dprobs_extra, dq, dk, dv);
}

}  // namespace graphmoe
