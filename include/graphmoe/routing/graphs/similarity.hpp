// graphmoe/routing/graphs/similarity.hpp: the Similarity token graph, GraphImpl<Similarity, T, B>
// (one class for every backend), and its temperature rule (detail::similarity_tau).
#pragma once

#include <cmath>
#include <string>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/token_graph.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

namespace detail {
// The Similarity graph's temperature for tokens of width d_model (every backend).
inline double similarity_tau(index_t d_model, const Similarity::Options& opts) {
  // Fixed, and Learned's initial value: opts.tau; ScaledSqrtD: opts.tau * sqrt(D)
  const double tau = opts.tau_mode == TauMode::ScaledSqrtD
                         ? opts.tau * std::sqrt(static_cast<double>(d_model))
                         : opts.tau;
  GRAPHMOE_CHECK(tau > 0, "Similarity", "tau must be > 0, got ", tau);
  return tau;
}
}  // namespace detail

// p_i = sum_j S[i,j] r_j,  S = softmax_j(u_i . u_j / tau) within each sequence (j <= i if causal).
//
// Options (Similarity::Options): tau fixed, scaled by sqrt(D), or learned (tau = exp(log_tau), one
// parameter "<prefix>log_tau"); exclude_self leaves S[i,i] out of its row; projection uses
// L = Q U^T / tau with Q = U W_s (W_s a (D, D) parameter "<prefix>w_s" from the identity);
// memory: Store keeps S (N x T values) for backward, Recompute keeps only the row log-sum-exp and
// recomputes S in backward, Auto (the default) stores while T <= kGraphStoreMaxLen (graph_stores,
// policies.hpp); precision: the (T, T) products in T (Exact) or, on the CUDA backend with a float
// router, on TF32 / bf16 tensor cores. The numerical work is the op similarity_graph_forward /
// _backward (ops/token_graph.hpp; how each backend computes it: backend/cpu/token_graph.hpp,
// backend/cuda/similarity_graph.cuh and similarity_blocks.cuh). A backend that lacks an option
// (token_graph_support) refuses it in configure.
//
// Backends differ in what the last forward keeps (the accessors say what each holds):
//   CPU   S when it stores (stores()), the row entropies and the self weights S[i,i].
//   CUDA  the block path (tensor-core precisions, or any of exclude_self, projection, a learned
//         tau): as the CPU. The fused kernel (Exact, none of those options) never stores S (it
//         keeps the row log-sum-exp and entropy, and backward recomputes S tile by tile:
//         Options::memory is ignored, stores() is false) and has no self weights (self_weight()
//         is empty, mean_self_weight() 1). row_entropy() is a device tensor and mean_entropy()
//         reads it back (synchronises) and averages in double.
template <class T, class B>
class GraphImpl<Similarity, T, B> {
 public:
  // TauMode::Learned declares "<prefix>log_tau" (shape (1)) and Options::projection
  // "<prefix>w_s" (shape (D, D)); without them the graph has no parameter (configure suffices).
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    configure(d_model, cfg);
    if (opts_.tau_mode == TauMode::Learned) id_log_tau_ = arena.add(prefix + "log_tau", Shape{1});
    if (opts_.projection) id_w_s_ = arena.add(prefix + "w_s", Shape{d_model, d_model});
  }
  void bind(const ParameterArena<T, B>& arena) {
    if (id_log_tau_ >= 0) {
      params_.log_tau = arena.value(id_log_tau_);
      params_.dlog_tau = arena.grad(id_log_tau_);
    }
    if (id_w_s_ >= 0) {
      params_.w_s = arena.value(id_w_s_);
      params_.dw_s = arena.grad(id_w_s_);
    }
  }
  void init(Rng&) {
    if (id_log_tau_ >= 0 || id_w_s_ >= 0) similarity_graph_init(params_, opts_.tau);
  }
  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Similarity>();
    validate_options(opts_);
    similarity_graph_check_support<T, B>(opts_.tau_mode == TauMode::Learned, opts_.exclude_self,
                                         opts_.projection, opts_.precision);
    causal_ = cfg.causal;
    d_model_ = d_model;
    state_.tau = detail::similarity_tau(d_model, opts_);
  }
  // The temperature of the last forward (the learned one's current value).
  double tau() const { return state_.tau; }

  void forward(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphContext<T, B>& ctx,
               Tensor<T, B>& p) {
    const SimilarityGraphArgs args = args_for(ctx.seq_len, true);
    similarity_graph_forward(u, r, args, params_, state_, p);
  }

  void backward(const Tensor<T, B>& u, const Tensor<T, B>& r, const Tensor<T, B>& p,
                const Tensor<T, B>& dp, const GraphContext<T, B>& ctx, Tensor<T, B>& dr,
                Tensor<T, B>& du) {
    const SimilarityGraphArgs args = args_for(ctx.seq_len, false);
    similarity_graph_backward(u, r, p, dp, args, params_, state_, dr, du);
  }

  // The incremental form (routing/concepts.hpp): the routing cache keeps every token's u and r
  // (D + E values), from which a new token's row of S and its p follow (ops/decode.hpp).
  using decode_cache = SimilarityDecodeCache<T, B>;
  void decode_init(decode_cache& c, const GraphDecodeDims& dims) const {
    c.u = Tensor<T, B>(Shape{dims.slots, dims.max_len, d_model_});
    c.r = Tensor<T, B>(Shape{dims.slots, dims.max_len, dims.num_experts});
  }
  void decode(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphDecodeContext<T, B>& ctx,
              decode_cache& c, Tensor<T, B>& p) {
    GRAPHMOE_CHECK(ctx.rows != nullptr, "Similarity", "a decode step needs its rows");
    similarity_graph_decode(u, r, *ctx.rows, args_for(1, false), params_, state_.tau, c, p,
                            ctx.weights);
  }

  double mean_entropy() const { return similarity_graph_mean_entropy(state_); }
  // H(S[i,:]) of every token in the last forward, (N) (a device tensor on CUDA).
  const Tensor<T, B>& row_entropy() const { return state_.entropy; }
  // Whether the last forward kept S for backward (Options::memory, graph_stores; CUDA's fused
  // kernel: never).
  bool stores() const { return state_.stores; }
  // S[i,i] of every token in the last forward, (N): 1 where S is the identity. Empty where a
  // backend does not compute it (CUDA's fused kernel).
  const Tensor<T, B>& self_weight() const { return state_.self; }
  // The mean of self_weight(); 1 (G = I) while it is empty.
  double mean_self_weight() const { return token_graph_mean_self_weight(state_.self); }

 private:
  // The options resolved for one call. forward: the memory choice for this sequence length
  // (graph_stores); backward follows the forward's (the state's stores).
  SimilarityGraphArgs args_for(index_t seq_len, bool forward) const {
    SimilarityGraphArgs a;
    a.seq_len = seq_len;
    a.d_model = d_model_;
    a.causal = causal_;
    a.learned_tau = opts_.tau_mode == TauMode::Learned;
    a.exclude_self = opts_.exclude_self;
    a.projection = opts_.projection;
    a.store = forward && seq_len >= 1 ? graph_stores(opts_.memory, seq_len) : state_.stores;
    a.detach = opts_.detach;
    a.precision = opts_.precision;
    return a;
  }

  Similarity::Options opts_;
  bool causal_ = false;
  index_t d_model_ = 0;
  SimilarityGraphState<T, B> state_;
  index_t id_log_tau_ = -1, id_w_s_ = -1;
  SimilarityGraphParams<T, B> params_;
};

}  // namespace graphmoe
