// graphmoe/ops/token_graph.hpp: the token graphs' numerical work, p = G r within each sequence.
//
// Tokens are rows of u (N, D), their expert scores rows of r (N, E); consecutive blocks of
// seq_len rows are one sequence, and G mixes the scores of a sequence's tokens only.
//
//   Similarity  G = S = softmax_j(u_i . u_j / tau) row-wise (j <= i when causal), or
//               softmax_j(q_i . u_j / tau) with Q = U W_s (projection); tau fixed or
//               tau = exp(log_tau) (learned); exclude_self leaves S[i,i] out of its row (a row
//               with no other entry keeps it).
//   Attention   G = A^p, the attention posterior of Lemma 1 for each token's head h*, from the
//               attention layer's cache (core/attention_cache.hpp); see docs/routers.md.
//
//   Blended     p = r + w (q - r), q = G r of another graph, w = clamp(a, 0, 1) of a learned scalar a
//               (one value on the backend): graph_blend, graph_blend_backward, graph_blend_residual
//               (routing/graphs/blended.hpp)
//
//   forward    p (N, E) assigned; the state (core/token_graph.hpp) keeps what backward needs
//   backward   dr (N, E) assigned; du (Similarity), the learned parameters' gradients and the
//              attention cache's gradients accumulated (+=), none of them when args.detach
//
// The graph classes of routing/graphs/ (GraphImpl<Similarity | Attention, T, B>) resolve their
// options into the args structs, own the state and the parameters, and call these.
//
// Op layer: the arguments (shapes, the state of a previous forward, the attention cache, the
// options a backend supports) are checked and the outputs prepared here, once for every backend,
// with one set of messages; then the backend's system runs through its tag
// (backend/cpu/token_graph.hpp, backend/cuda/token_graph.cuh, or a user backend's overloads found
// by argument-dependent lookup). A backend declares what it implements with
// token_graph_support(B{}) (core/token_graph.hpp).
#pragma once

#include <cmath>
#include <type_traits>
#include <vector>

#include "graphmoe/backend/cpu/token_graph.hpp"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

namespace detail {
// u (N, D) and r (N, E) with the same N, seq_len dividing N (every token graph).
template <class T, class B>
void check_graph_inputs(const char* op, const Tensor<T, B>& u, const Tensor<T, B>& r,
                        index_t seq_len) {
  GRAPHMOE_CHECK(u.rank() == 2 && r.rank() == 2 && u.rows() == r.rows(), op,
                 "u must be (N, D) and r (N, E) with the same N, got u ", u.shape(), " and r ",
                 r.shape());
  GRAPHMOE_CHECK(seq_len >= 1 && u.rows() % seq_len == 0, op, "seq_len = ", seq_len,
                 " does not divide the ", u.rows(), " tokens");
}

// The Attention graph's cache (null: none given), checked against n tokens in sequences of len
// and width d_model.
template <class T, class B>
const AttentionCache<T, B>& check_attention_cache(const AttentionCache<T, B>* cache, index_t n,
                                                  index_t len, index_t d_model) {
  GRAPHMOE_CHECK(cache != nullptr, "Attention",
                 "the Attention token graph needs the attention layer's cache (probs, v, w_o, "
                 "out) and none was given");
  const AttentionCache<T, B>& c = *cache;
  const index_t nb = n / len, nh = c.num_heads;
  GRAPHMOE_CHECK(nh >= 1 && !c.probs.empty() && !c.v.empty() && !c.w_o.empty() &&
                     !c.out.empty(),
                 "Attention", "attention cache is incomplete (num_heads = ", nh,
                 "; probs, v, w_o and out must be set)");
  GRAPHMOE_CHECK(c.probs.shape() == (Shape{nb, nh, len, len}), "Attention",
                 "attention probs have shape ", c.probs.shape(), ", expected ",
                 Shape{nb, nh, len, len});
  GRAPHMOE_CHECK(c.v.rows() == n && c.v.cols() % nh == 0, "Attention", "values have shape ",
                 c.v.shape(), " for ", n, " tokens and ", nh, " heads");
  GRAPHMOE_CHECK(c.w_o.shape() == (Shape{d_model, c.v.cols()}), "Attention",
                 "w_o has shape ", c.w_o.shape(), ", expected ", Shape{d_model, c.v.cols()});
  GRAPHMOE_CHECK(c.out.rows() == n && c.out.cols() == d_model, "Attention",
                 "attention output has shape ", c.out.shape(), ", expected (", n, ", ",
                 d_model, ")");
  GRAPHMOE_CHECK(c.b_o.empty() || c.b_o.numel() == d_model, "Attention", "b_o has shape ",
                 c.b_o.shape());
  GRAPHMOE_CHECK(c.row_entropy.empty() || c.row_entropy.shape() == (Shape{nb, nh, len}),
                 "Attention", "row_entropy has shape ", c.row_entropy.shape(), ", expected ",
                 Shape{nb, nh, len});
  return c;
}
}  // namespace detail

// ---- Similarity ---------------------------------------------------------------------------------

// Refuses a reduced precision on a backend without tensor-core products or for a T other than
// float (graph: the message's prefix).
template <class T, Backend B>
void token_graph_check_precision(const char* graph, GraphPrecision precision) {
  if (precision == GraphPrecision::Exact) return;
  GRAPHMOE_CHECK(token_graph_support(B{}).reduced_precision, graph, "precision ",
                 graph_precision_name(precision), " needs tensor-core products, which the ",
                 B::name, " backend does not have: use GraphPrecision::Exact");
  GRAPHMOE_CHECK((std::is_same_v<T, float>), graph, "precision ", graph_precision_name(precision),
                 " rounds float inputs: it needs a float router (use GraphPrecision::Exact)");
}

// Refuses the Similarity options that backend B does not implement (token_graph_support), and a
// reduced precision for a T other than float.
template <class T, Backend B>
void similarity_graph_check_support(bool learned_tau, bool exclude_self, bool projection,
                                    GraphPrecision precision = GraphPrecision::Exact) {
  const TokenGraphSupport s = token_graph_support(B{});
  GRAPHMOE_CHECK((s.learned_tau || !learned_tau) && (s.exclude_self || !exclude_self) &&
                     (s.projection || !projection),
                 "Similarity", "the ", B::name,
                 " backend does not implement a learned temperature, Options::exclude_self or "
                 "Options::projection");
  token_graph_check_precision<T, B>("Similarity", precision);
}

// Refuses the Attention graph's precision where backend B or T cannot run it.
template <class T, Backend B>
void attention_graph_check_support(GraphPrecision precision) {
  token_graph_check_precision<T, B>("Attention", precision);
}

// p (N, E) = S r. A learned temperature is read from params.log_tau into state.tau first;
// otherwise state.tau is used as set. params.w_s is read under projection.
template <class T, Backend B>
void similarity_graph_forward(const Tensor<T, B>& u, const Tensor<T, B>& r,
                              const SimilarityGraphArgs& args,
                              const SimilarityGraphParams<T, B>& params,
                              SimilarityGraphState<T, B>& state, Tensor<T, B>& p) {
  detail::check_graph_inputs("Similarity", u, r, args.seq_len);
  if (args.learned_tau) {
    GRAPHMOE_CHECK(!params.log_tau.empty(), "Similarity",
                   "a learned temperature needs its parameter: declare and bind the graph "
                   "(RouterImpl does) instead of configure alone");
    const double log_tau = token_graph_scalar(B{}, params.log_tau);
    state.tau = std::exp(log_tau);
    GRAPHMOE_CHECK(std::isfinite(state.tau) && state.tau > 0, "Similarity",
                   "the learned temperature is ", state.tau, " (log_tau = ", log_tau, ")");
  }
  if (args.projection) {
    GRAPHMOE_CHECK(!params.w_s.empty(), "Similarity",
                   "Options::projection needs its parameter W_s: declare and bind the graph "
                   "(RouterImpl does) instead of configure alone");
    GRAPHMOE_CHECK(u.cols() == args.d_model, "Similarity", "u has ", u.cols(),
                   " columns, W_s was declared for D = ", args.d_model);
  }
  prepare_output("Similarity", "p", p, r.shape());
  similarity_graph_forward(B{}, u, r, args, params, state, p);
}

// dr (N, E) = S^T dp assigned; unless args.detach, du (N, D, allocated) += dL through S, and the
// learned parameters' gradients (params.dlog_tau, params.dw_s, where not empty) accumulate.
template <class T, Backend B>
void similarity_graph_backward(const Tensor<T, B>& u, const Tensor<T, B>& r, const Tensor<T, B>& p,
                               const Tensor<T, B>& dp, const SimilarityGraphArgs& args,
                               SimilarityGraphParams<T, B>& params,
                               SimilarityGraphState<T, B>& state, Tensor<T, B>& dr,
                               Tensor<T, B>& du) {
  const index_t n = u.rows(), len = args.seq_len;
  detail::check_graph_inputs("Similarity::backward", u, r, len);
  GRAPHMOE_CHECK(state.lse.numel() == n && (!state.stores || state.s.shape() == (Shape{n, len})),
                 "Similarity::backward", "no forward of these ", n, " tokens in sequences of ",
                 len, " to take the gradient of");
  prepare_output("Similarity", "dr", dr, r.shape());
  const bool to_u = !args.detach;
  if (to_u) check_shape("Similarity::backward", "du", du, u.shape());
  if (args.projection)
    GRAPHMOE_CHECK(state.q.shape() == u.shape(), "Similarity::backward",
                   "no forward of these ", n, " tokens to take the gradient of");
  similarity_graph_backward(B{}, u, r, p, dp, args, params, state, dr, du);
}

// The parameters' initial values: log_tau = log(tau), W_s = I (those not empty).
template <class T, Backend B>
void similarity_graph_init(SimilarityGraphParams<T, B>& params, double tau) {
  similarity_graph_init(B{}, params, tau);
}

// The mean over tokens of the row entropy of S in the last forward (0 before any).
template <class T, Backend B>
double similarity_graph_mean_entropy(const SimilarityGraphState<T, B>& state) {
  return similarity_graph_mean_entropy(B{}, state);
}

// ---- Attention ----------------------------------------------------------------------------------

// p (N, E) = A^p r; cache: the attention layer's (null: none, refused).
template <class T, Backend B>
void attention_graph_forward(const Tensor<T, B>& u, const Tensor<T, B>& r,
                             const AttentionCache<T, B>* cache, const AttentionGraphArgs& args,
                             AttentionGraphState<T, B>& state, Tensor<T, B>& p) {
  detail::check_graph_inputs("Attention", u, r, args.seq_len);
  const AttentionCache<T, B>& c =
      detail::check_attention_cache(cache, u.rows(), args.seq_len, args.d_model);
  prepare_output("Attention", "p", p, r.shape());
  const Offender zero_row = attention_graph_forward(B{}, r, c, args, state, p);
  state.tokens = r.rows();
  report_check(zero_row, [len = args.seq_len](const Offender& z) {
    detail::throw_error("Attention", "attention row ", z.index % len, " of sequence ",
                        z.index / len, " is all zero");
  });
}

// h* of every token of the last forward, from the backend's state (CUDA reads it back from the
// device on request).
template <class T, Backend B>
std::vector<int> attention_graph_heads(const AttentionGraphState<T, B>& state) {
  return attention_graph_heads(B{}, state);
}

// dr (N, E) = A^p^T dp assigned; unless args.detach, the cache's gradients (dprobs, dout, dv,
// dw_o, db_o, where not empty) accumulate.
template <class T, Backend B>
void attention_graph_backward(const Tensor<T, B>& u, const Tensor<T, B>& r, const Tensor<T, B>& p,
                              const Tensor<T, B>& dp, AttentionCache<T, B>* cache,
                              const AttentionGraphArgs& args, AttentionGraphState<T, B>& state,
                              Tensor<T, B>& dr) {
  const index_t n = u.rows(), len = args.seq_len;
  detail::check_graph_inputs("Attention::backward", u, r, len);
  detail::check_attention_cache<T, B>(cache, n, len, args.d_model);
  GRAPHMOE_CHECK(state.tokens == n && state.seq_len == len &&
                     (!state.stores || state.post.shape() == (Shape{n, len})),
                 "Attention::backward", "no forward of these ", n, " tokens in sequences of ",
                 len, " to take the gradient of");
  check_shape("Attention::backward", "p", p, r.shape());
  check_shape("Attention::backward", "dp", dp, r.shape());
  prepare_output("Attention", "dr", dr, r.shape());
  attention_graph_backward(B{}, r, p, dp, *cache, args, state, dr);
}

// The mean over tokens of the row entropy of A^p in the last forward (0 before any).
template <class T, Backend B>
double attention_graph_mean_entropy(const AttentionGraphState<T, B>& state) {
  return attention_graph_mean_entropy(B{}, state);
}

// The mean of a graph's self weights G[i,i] of the last forward, in double; 1 (G = I) when self
// is empty (before any forward, or on a backend that does not compute them).
template <class T, Backend B>
double token_graph_mean_self_weight(const Tensor<T, B>& self) {
  return self.empty() ? 1.0 : token_graph_mean_self_weight(B{}, self);
}

// ---- Blended (routing/graphs/blended.hpp) --------------------------------------------------------
//   graph_blend(r, q, a, p)                     p = r + w (q - r)                 (p assigned)
//   graph_blend_backward(r, q, a, dp, dq, da)   dq = w dp (assigned); da[0] += g, g = sum dp (q - r)
//                                               in double, rounded once into da; g = 0 where a
//                                               descent step would take a out of [0, 1] (a <= 0 and
//                                               g > 0, or a >= 1 and g < 0)
//   graph_blend_residual(a, dp, dr)             dr += (1 - w) dp
// w = clamp(a[0], 0, 1), so that p stays a convex combination of r and q. r, q, dp, dr: (N, E) of
// one shape; a, da: (1). a is read where it lives (no copy to the host).
namespace detail {
template <class T, class B>
void check_blend_args(const char* op, const Tensor<T, B>& r, const Tensor<T, B>& q,
                      const Tensor<T, B>& a) {
  GRAPHMOE_CHECK(r.rank() == 2, op, "r must be (N, E), got ", r.shape());
  check_shape(op, "q", q, r.shape());
  GRAPHMOE_CHECK(a.numel() == 1, op, "the mixing weight a must hold one value, got ",
                 (a.empty() ? std::string("an empty tensor") : a.shape().str()));
}
}  // namespace detail

template <class T, Backend B>
void graph_blend(const Tensor<T, B>& r, const Tensor<T, B>& q, const Tensor<T, B>& a,
                 Tensor<T, B>& p) {
  detail::check_blend_args("graph_blend", r, q, a);
  prepare_output("graph_blend", "p", p, r.shape());
  if (r.numel() == 0) return;
  graph_blend(B{}, r, q, a, p);
}

template <class T, Backend B>
void graph_blend_backward(const Tensor<T, B>& r, const Tensor<T, B>& q, const Tensor<T, B>& a,
                          const Tensor<T, B>& dp, Tensor<T, B>& dq, const Tensor<T, B>& da) {
  detail::check_blend_args("graph_blend_backward", r, q, a);
  check_shape("graph_blend_backward", "dp", dp, r.shape());
  GRAPHMOE_CHECK(da.numel() == 1, "graph_blend_backward", "da must hold one value, got ",
                 (da.empty() ? std::string("an empty tensor") : da.shape().str()));
  prepare_output("graph_blend_backward", "dq", dq, r.shape());
  if (r.numel() == 0) return;
  graph_blend_backward(B{}, r, q, a, dp, dq, da);
}

template <class T, Backend B>
void graph_blend_residual(const Tensor<T, B>& a, const Tensor<T, B>& dp, const Tensor<T, B>& dr) {
  GRAPHMOE_CHECK(a.numel() == 1, "graph_blend_residual",
                 "the mixing weight a must hold one value, got ",
                 (a.empty() ? std::string("an empty tensor") : a.shape().str()));
  check_shape("graph_blend_residual", "dr", dr, dp.shape());
  if (dp.numel() == 0) return;
  graph_blend_residual(B{}, a, dp, dr);
}

}  // namespace graphmoe
