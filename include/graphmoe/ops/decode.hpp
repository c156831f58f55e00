// graphmoe/ops/decode.hpp: the incremental-decoding ops, one new token per row of a step, one row
// per sequence slot or a chunk of a slot's rows at consecutive positions (core/decode.hpp:
// DecodeRows, KVCache, AttentionStep and the graphs' routing caches). Every op appends all the
// rows' cache entries (below: the assignments to K, V, U, R, msq) before any row reads the cache,
// so the row at t of a chunk reads what the chunk's earlier rows wrote.
//
//   attention_decode        row i (slot s, position t): K_c[s, t] = k_ic, V_c[s, t] = v_ic for
//                           every cached head c, then for every query head h (c = h / g, g =
//                           H / Hkv)  A = softmax_j(q_ih . K_c[s, j] / sqrt(dh)), j <= t,
//                           o_ih = A V_c[s, 0..t]; probs and the row entropies are outputs (the
//                           Attention graph reads them), as in attention_forward.
//   similarity_graph_decode U[s, t] = u_i, R[s, t] = r_i, then S_i = softmax_j(q_i . u_j / tau)
//                           over j <= t (q_i = u_i, or u_i W_s under projection; exclude_self
//                           leaves j = t out when t > 0), p_i = S_i R[s, 0..t].
//   attention_graph_decode  R[s, t] = r_i and |m_ht|^2 of every head appended; the slot's
//                           attention-row entropies of positions 0..t (prefix sums, kept per
//                           position) choose h* (PerSequenceCausal); p_i =
//                           A^p_i R[s, 0..t] with A^p_i the posterior row of Lemma 1.
// Each equals the corresponding forward op's row t of a causal sequence (ops/attention.hpp,
// ops/token_graph.hpp) up to rounding. weights (optional, (n, max_len)): row i's S_i or A^p_i
// over positions 0..t, zero beyond (what `generate --explain` shows).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// the backend's system runs through its tag (backend/cpu/decode.hpp, backend/cuda/decode.cuh).
#pragma once

#include <cmath>
#include <vector>

#include "graphmoe/backend/cpu/decode.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

namespace detail {
// A (n, width) input of a decode step.
template <class T, class B>
void check_decode_rows(const char* op, const char* what, const Tensor<T, B>& x, index_t n,
                       index_t width) {
  GRAPHMOE_CHECK(!x.empty() && x.rank() == 2 && x.dim(0) == n && x.dim(1) == width, op, what,
                 " must be (", n, ", ", width, ") for this step's rows, got ",
                 (x.empty() ? std::string("an empty tensor") : x.shape().str()));
}
template <class T, class B>
void prepare_decode_weights(const char* op, Tensor<T, B>* weights, index_t n, index_t max_len) {
  if (weights == nullptr) return;
  prepare_output(op, "weights", *weights, Shape{n, max_len});
  weights->zero();
}
}  // namespace detail

// q (n, H dh), k, v (n, Hkv dh) of the step's rows; kv allocated (S, Hkv, max_len, dh) for H
// query heads (KVCache: Hkv = H without grouping). probs (n, H, max_len), row_entropy (n, H) and
// out (n, H dh) are prepared (allocated when empty).
template <class T, Backend B>
void attention_decode(const Tensor<T, B>& q, const Tensor<T, B>& k, const Tensor<T, B>& v,
                      const DecodeRows& rows, KVCache<T, B>& kv, Tensor<T, B>& probs,
                      Tensor<T, B>& row_entropy, Tensor<T, B>& out) {
  constexpr const char* op = "attention_decode";
  GRAPHMOE_CHECK(!kv.k.empty() && kv.k.rank() == 4 && kv.v.shape() == kv.k.shape(), op,
                 "the KV cache is not allocated as (S, Hkv, max_len, dh)");
  GRAPHMOE_CHECK(kv.heads() % kv.kv_heads() == 0, op, "the KV cache's ", kv.kv_heads(),
                 " key/value heads do not divide its ", kv.heads(), " query heads");
  rows.validate(op, kv.slots(), kv.max_len());
  const index_t n = rows.size(), width = kv.heads() * kv.head_dim(),
                kv_width = kv.kv_heads() * kv.head_dim();
  detail::check_decode_rows(op, "q", q, n, width);
  detail::check_decode_rows(op, "k", k, n, kv_width);
  detail::check_decode_rows(op, "v", v, n, kv_width);
  prepare_output(op, "probs", probs, Shape{n, kv.heads(), kv.max_len()});
  probs.zero();
  prepare_output(op, "row_entropy", row_entropy, Shape{n, kv.heads()});
  prepare_output(op, "out", out, q.shape());
  attention_decode(B{}, q, k, v, rows, kv, probs, row_entropy, out);
}

// u (n, D), r (n, E) of the step's rows; cache.u (S, max_len, D) and cache.r (S, max_len, E)
// allocated; args.causal (decoding is causal); tau: the configured temperature (read from
// params.log_tau instead when args.learned_tau); params.w_s (D, D) under args.projection.
template <class T, Backend B>
void similarity_graph_decode(const Tensor<T, B>& u, const Tensor<T, B>& r, const DecodeRows& rows,
                             const SimilarityGraphArgs& args,
                             const SimilarityGraphParams<T, B>& params, double tau,
                             SimilarityDecodeCache<T, B>& cache, Tensor<T, B>& p,
                             Tensor<T, B>* weights = nullptr) {
  constexpr const char* op = "similarity_graph_decode";
  GRAPHMOE_CHECK(args.causal, "Similarity",
                 "incremental decoding needs a causal graph (RouterConfig::causal): a token "
                 "decoded now cannot see later ones");
  GRAPHMOE_CHECK(!cache.u.empty() && cache.u.rank() == 3 && !cache.r.empty() &&
                     cache.r.rank() == 3 && cache.r.dim(0) == cache.u.dim(0) &&
                     cache.r.dim(1) == cache.u.dim(1),
                 op, "the routing cache is not allocated as u (S, max_len, D), r (S, max_len, E)");
  rows.validate(op, cache.u.dim(0), cache.u.dim(1));
  const index_t n = rows.size();
  detail::check_decode_rows(op, "u", u, n, cache.u.dim(2));
  detail::check_decode_rows(op, "r", r, n, cache.r.dim(2));
  if (args.projection)
    GRAPHMOE_CHECK(!params.w_s.empty() && params.w_s.shape() == Shape({u.cols(), u.cols()}),
                   "Similarity", "projection needs W_s (D, D), got ",
                   (params.w_s.empty() ? std::string("none") : params.w_s.shape().str()));
  if (args.learned_tau) {
    GRAPHMOE_CHECK(!params.log_tau.empty(), "Similarity",
                   "a learned temperature needs the log_tau parameter (declare and bind the graph)");
    tau = std::exp(token_graph_scalar(B{}, params.log_tau));
  }
  GRAPHMOE_CHECK(std::isfinite(tau) && tau > 0, "Similarity", "the temperature is ", tau);
  prepare_output(op, "p", p, r.shape());
  detail::prepare_decode_weights(op, weights, n, cache.u.dim(1));
  similarity_graph_decode(B{}, u, r, rows, args, params.w_s, tau, cache, p, weights);
}

// r (n, E) of the step's rows; step: the same block's attention_decode outputs (probs,
// row_entropy, out) with its w_o, b_o and KV cache; args.causal_heads (h* from the prefix: the
// one head choice a decoder can follow). cache.r (S, max_len, E), cache.msq (S, H, max_len) and
// cache.entropy_prefix (S max_len H) allocated. heads (n): h* of each row.
template <class T, Backend B>
void attention_graph_decode(const Tensor<T, B>& r, const DecodeRows& rows,
                            const AttentionStep<T, B>& step, const AttentionGraphArgs& args,
                            AttentionDecodeCache<T, B>& cache, Tensor<T, B>& p,
                            std::vector<int>& heads, Tensor<T, B>* weights = nullptr) {
  constexpr const char* op = "attention_graph_decode";
  GRAPHMOE_CHECK(args.causal_heads, "Attention",
                 "incremental decoding needs HeadChoice::PerSequenceCausal (h* from the prefix); "
                 "PerSequence reads the whole sequence, later tokens included");
  GRAPHMOE_CHECK(step.kv != nullptr && !step.kv->v.empty(), "Attention",
                 "the Attention graph decodes from the attention layer's step, and none was given");
  const KVCache<T, B>& kv = *step.kv;
  const index_t nh = kv.heads(), len_max = kv.max_len(), width = nh * kv.head_dim();
  rows.validate(op, kv.slots(), len_max);
  const index_t n = rows.size();
  // the block's output is d wide; the heads' concatenation width (H dh, d unless head_dim is set)
  const index_t d = step.out.rank() == 2 ? step.out.cols() : -1;
  GRAPHMOE_CHECK(step.num_heads == nh && step.probs.shape() == Shape({n, nh, len_max}) &&
                     step.row_entropy.shape() == Shape({n, nh}) && d >= 1 &&
                     step.out.shape() == Shape({n, d}) && step.w_o.shape() == Shape({d, width}) &&
                     (step.b_o.empty() || step.b_o.shape() == Shape{d}),
                 "Attention", "the attention step does not match its KV cache (", nh,
                 " heads, width ", width, ", ", n, " rows)");
  GRAPHMOE_CHECK(!cache.r.empty() && cache.r.rank() == 3 && cache.r.dim(0) == kv.slots() &&
                     cache.r.dim(1) == len_max && cache.msq.shape() == Shape({kv.slots(), nh, len_max}) &&
                     static_cast<index_t>(cache.entropy_prefix.size()) == kv.slots() * len_max * nh,
                 op, "the routing cache is not allocated for ", kv.slots(), " slots of ", len_max,
                 " tokens and ", nh, " heads");
  detail::check_decode_rows(op, "r", r, n, cache.r.dim(2));
  prepare_output(op, "p", p, r.shape());
  detail::prepare_decode_weights(op, weights, n, len_max);
  const index_t bad = attention_graph_decode(B{}, r, rows, step, args, cache, p, weights, heads);
  GRAPHMOE_CHECK(bad < 0, "Attention", "token at position ",
                 bad < 0 ? 0 : rows.pos[static_cast<std::size_t>(bad)], " of slot ",
                 bad < 0 ? 0 : rows.slot[static_cast<std::size_t>(bad)],
                 ": its chosen head's attention row is zero everywhere (at or below the prior "
                 "floor), so its posterior A^p is undefined");
}

}  // namespace graphmoe
