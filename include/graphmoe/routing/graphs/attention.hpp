// graphmoe/routing/graphs/attention.hpp: the Attention token graph, GraphImpl<Attention, T, B>
// (one class for every backend).
#pragma once

#include <cstddef>
#include <vector>

#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/token_graph.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

// p_i = sum_j A^p[i,j] r_j with the attention posterior of Lemma 1 for head h*:
//   log A^p[i,j] = log A_h[i,j] + (a_i . m_hj - |m_hj|^2 / 2) / sigma^2 - (normaliser over j),
//   m_hj = H * W_o,h v_hj + b_o   (the Gaussian mean W_h x_j; the |a_i|^2 term cancels over j),
// h* = argmin_h of the mean attention-row entropy of the sequence (HeadChoice::PerSequence), or
// of its prefix up to row i (PerSequenceCausal); see docs/routers.md for the choice of tensors and
// the factor H. The graph reads the attention layer's cache (GraphContext::attention,
// core/attention_cache.hpp) and sends its gradients back into it.
// Attention::Options::memory: Store keeps A^p (N x T values) for backward; Recompute keeps each
// row's log-sum-exp and recomputes the block's A^p; Auto stores while T <= kGraphStoreMaxLen.
// The numerical work is the op attention_graph_forward / _backward (ops/token_graph.hpp; how each
// backend computes it: backend/cpu/token_graph.hpp, backend/cuda/attention_graph.cuh).
//
// Backends differ in what the last forward keeps (the accessors say what each holds):
//   CPU   A^p when it stores (stores()), the row entropies and the self weights A^p[i,i] on the
//         host.
//   CUDA  always A^p on the device (Options::memory is ignored, stores() is true); no self
//         weights (self_weight() is empty, mean_self_weight() 1); the row entropies stay on the
//         device (row_entropy() is empty; mean_entropy() reads them back, synchronising, and
//         averages in double); heads() reads h* back when asked.
template <class T, class B>
class GraphImpl<Attention, T, B> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Attention>();
    validate_options(opts_);
    head_choice_ = opts_.head_choice_for(cfg.causal);
    attention_graph_check_support<T, B>(opts_.precision);
    d_model_ = d_model;
  }

  void forward(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphContext<T, B>& ctx,
               Tensor<T, B>& p) {
    const AttentionGraphArgs args = args_for(ctx.seq_len, true);
    attention_graph_forward(u, r, ctx.attention, args, state_, p);
  }

  void backward(const Tensor<T, B>& u, const Tensor<T, B>& r, const Tensor<T, B>& p,
                const Tensor<T, B>& dp, const GraphContext<T, B>& ctx, Tensor<T, B>& dr,
                Tensor<T, B>&) {
    const AttentionGraphArgs args = args_for(ctx.seq_len, false);
    attention_graph_backward(u, r, p, dp, ctx.attention, args, state_, dr);
  }

  // The incremental form (routing/concepts.hpp): its logits q_i . v_hj read the attention layer's
  // V cache; the routing cache keeps each token's r, |m_hj|^2 of every head and the prefix sums
  // of the attention-row entropies, which choose h* from the prefix (PerSequenceCausal, the causal
  // router's head choice): E + 2 H values per token. decode_heads(): h* of each row of the
  // last decode step.
  using decode_cache = AttentionDecodeCache<T, B>;
  void decode_init(decode_cache& c, const GraphDecodeDims& dims) const {
    c.r = Tensor<T, B>(Shape{dims.slots, dims.max_len, dims.num_experts});
    c.msq = Tensor<T, B>(Shape{dims.slots, dims.num_heads, dims.max_len});
    c.entropy_prefix.assign(static_cast<std::size_t>(dims.slots * dims.max_len * dims.num_heads), 0.0);
  }
  void decode(const Tensor<T, B>&, const Tensor<T, B>& r, const GraphDecodeContext<T, B>& ctx,
              decode_cache& c, Tensor<T, B>& p) {
    GRAPHMOE_CHECK(ctx.rows != nullptr, "Attention", "a decode step needs its rows");
    GRAPHMOE_CHECK(ctx.attention != nullptr, "Attention",
                   "the Attention token graph decodes from the attention layer's step (the "
                   "router's GraphDecodeContext::attention), and none was given");
    attention_graph_decode(r, *ctx.rows, *ctx.attention, args_for(1, false), c, p, decode_heads_,
                           ctx.weights);
  }
  const std::vector<int>& decode_heads() const { return decode_heads_; }

  double mean_entropy() const { return attention_graph_mean_entropy(state_); }
  // Mean over tokens of A^p[i,i] in the last forward (1 where A^p is the identity, and while
  // self_weight() is empty).
  double mean_self_weight() const { return token_graph_mean_self_weight(state_.self); }
  // A^p[i,i] of every token in the last forward, (N). Empty on a backend that does not compute
  // it (CUDA).
  const Tensor<T, B>& self_weight() const { return state_.self; }
  // H(A^p[i,:]) of every token in the last forward, on the host. Empty on a backend that keeps
  // the entropies on the device (CUDA: mean_entropy() reads them).
  const std::vector<double>& row_entropy() const { return state_.row_entropy; }
  // h* of each token in the last forward (every backend; on CUDA read back from the device when
  // asked: the forward does not wait for it).
  std::vector<int> heads() const { return attention_graph_heads(state_); }
  // Whether the last forward kept A^p for backward (Options::memory, graph_stores; CUDA: always).
  bool stores() const { return state_.stores; }
  // A^p of the last forward, (N, T): row i holds token i's posterior over its sequence. Kept only
  // when the forward stored it (empty before any forward).
  const Tensor<T, B>& posterior() const {
    GRAPHMOE_CHECK(state_.stores || state_.tokens == 0, "Attention",
                   "posterior(): the last forward did not keep A^p (Options::memory is Recompute, "
                   "or Auto with sequences of ", state_.seq_len, " > kGraphStoreMaxLen = ",
                   kGraphStoreMaxLen, " tokens); set memory = GraphMemory::Store to read it");
    return state_.post;
  }

 private:
  // The options resolved for one call. forward: the memory choice for this sequence length
  // (graph_stores); backward follows the forward's (the state's stores).
  AttentionGraphArgs args_for(index_t seq_len, bool forward) const {
    AttentionGraphArgs a;
    a.seq_len = seq_len;
    a.d_model = d_model_;
    a.sigma = opts_.sigma;
    a.causal_heads = head_choice_ == HeadChoice::PerSequenceCausal;
    a.store = forward && seq_len >= 1 ? graph_stores(opts_.memory, seq_len) : state_.stores;
    a.detach = opts_.detach;
    a.precision = opts_.precision;
    return a;
  }

  Attention::Options opts_;
  HeadChoice head_choice_ = HeadChoice::PerSequence;
  index_t d_model_ = 0;
  AttentionGraphState<T, B> state_;
  std::vector<int> decode_heads_;
};

}  // namespace graphmoe
