// graphmoe/core/attention_cache.hpp: what the Attention token graph reads from the attention
// layer before the MoE, and the gradients it sends back.
//
// In a pre-norm block  x = LN1(h),  a = MHA(x) = concat_h(A_h V_h) W_o^T + b_o,  h' = h + a,
// u = LN2(h'),  MoE(u). The Attention graph (Lemma 1) needs, for the sequence's head h*:
//   A_h     the attention probabilities                         probs (B, H, T, T)
//   W_h x_j the mean of u_i given z_i = j, h_i = h              from v (B, T, D) and w_o, b_o
//   u_i     the variable that Gaussian describes                out = a (B, T, D)
// See docs/routers.md for why these tensors play those roles.
#pragma once

#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// Attention probabilities at or below this floor count as 0 in the Attention graph (both backends):
// the posterior's gradient into A is dL / A, which overflows a float for the denormal
// probabilities that a sharp head produces (the trained attention LM of docs/results.md hit NaN
// gradients this way). Above the floor, |dL / A| <= |dL| * 1e19 (float). Entries this small carry
// no weight in A^p unless their Gaussian factor exceeds exp(43) (float) or exp(345) (double).
template <class T>
GRAPHMOE_HOST_DEVICE constexpr T attention_prior_floor() {
  return sizeof(T) >= 8 ? static_cast<T>(1e-150) : static_cast<T>(1e-19);
}

template <class T, class B = cpu>
struct AttentionCache {
  index_t num_heads = 0;
  Tensor<T, B> probs;  // (B, H, T, T)  softmax(q k^T / sqrt(dh)) per head, masked entries 0
  Tensor<T, B> v;      // (B, T, D)     values (bias included); head h: columns [h dh, (h+1) dh)
  Tensor<T, B> w_o;    // (D, D)        output projection, a = o w_o^T + b_o
  Tensor<T, B> b_o;    // (D) or empty  output bias
  Tensor<T, B> out;    // (B, T, D)     the attention sublayer output a
  Tensor<T, B> row_entropy;  // (B, H, T) or empty: H(A_h[i,:]) from the attention softmax; the
                             // graph computes it from probs when empty (H T^2 logarithms)
  // The attention layer is causal: probs is 0 above the diagonal (j > i), and the CUDA graph's
  // (T, T) products skip that half (the CPU graph finds the zero columns in probs itself). Set by
  // MultiHeadAttention; a hand-made cache that sets it with probs nonzero above the diagonal gets
  // those entries treated as 0 on the GPU.
  bool causal = false;

  // Gradients the Attention graph ACCUMULATES into during backward (allocated by the attention
  // layer with the shapes above; empty ones are skipped, e.g. when the graph is detached).
  Tensor<T, B> dprobs, dv, dw_o, db_o, dout;
};

}  // namespace graphmoe
