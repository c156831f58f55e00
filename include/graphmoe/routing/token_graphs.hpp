// graphmoe/routing/token_graphs.hpp: token-graph implementations, p = G r within each sequence.
//
// Every token graph has the same members:
//   configure(d_model, cfg)                     (or declare(arena, prefix, d_model, cfg), bind(arena)
//                                               and init(rng) for a graph with parameters: the
//                                               Similarity graph's learned temperature)
//   forward(u, r, ctx, p)                       p assigned (N, E)
//   backward(u, r, p, dp, ctx, dr, du)          dr assigned, du accumulated (+=)
//   mean_entropy()                              mean row entropy of G in the last forward
// Tokens are rows of u (N, D); consecutive blocks of ctx.seq_len rows are one sequence.
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/routing/attention_cache.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

template <class T, class B = cpu>
struct GraphContext {
  index_t seq_len = 0;                          // tokens per sequence
  AttentionCache<T, B>* attention = nullptr;    // required by the Attention graph
};

namespace detail {
template <class T, class B>
void check_graph_inputs(const char* op, const Tensor<T, B>& u, const Tensor<T, B>& r,
                        index_t seq_len) {
  GRAPHMOE_CHECK(u.rank() == 2 && r.rank() == 2 && u.rows() == r.rows(), op,
                 "u must be (N, D) and r (N, E) with the same N, got u ", u.shape(), " and r ",
                 r.shape());
  GRAPHMOE_CHECK(seq_len >= 1 && u.rows() % seq_len == 0, op, "seq_len = ", seq_len,
                 " does not divide the ", u.rows(), " tokens");
}
// The Similarity graph's temperature for tokens of width d_model (every backend).
inline double similarity_tau(index_t d_model, const RouterConfig& cfg) {
  // Fixed, and Learned's initial value: similarity_tau; ScaledSqrtD: similarity_tau * sqrt(D)
  const double tau = cfg.tau_mode == TauMode::ScaledSqrtD
                         ? cfg.similarity_tau * std::sqrt(static_cast<double>(d_model))
                         : cfg.similarity_tau;
  GRAPHMOE_CHECK(tau > 0, "Similarity", "tau must be > 0, got ", tau);
  return tau;
}

// The Attention graph's cache, checked against n tokens of width d_model (every backend).
template <class T, class B>
const AttentionCache<T, B>& check_attention_cache(const GraphContext<T, B>& ctx, index_t n,
                                               index_t d_model) {
  GRAPHMOE_CHECK(ctx.attention != nullptr, "Attention",
                 "the Attention token graph needs the attention layer's cache (probs, v, w_o, "
                 "out) and none was given");
  const AttentionCache<T, B>& c = *ctx.attention;
  const index_t len = ctx.seq_len, nb = n / len, nh = c.num_heads;
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

// p = r (every backend: two copies).
template <class T, class B>
class GraphImpl<Independent, T, B> {
 public:
  void configure(index_t, const RouterConfig&) {}
  void forward(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphContext<T, B>& ctx,
               Tensor<T, B>& p) {
    detail::check_graph_inputs("Independent", u, r, ctx.seq_len);
    prepare_output("Independent", "p", p, r.shape());
    p.copy_from(r);
  }
  void backward(const Tensor<T, B>&, const Tensor<T, B>& r, const Tensor<T, B>&,
                const Tensor<T, B>& dp, const GraphContext<T, B>&, Tensor<T, B>& dr,
                Tensor<T, B>&) {
    prepare_output("Independent", "dr", dr, r.shape());
    dr.copy_from(dp);
  }
  double mean_entropy() const { return 0.0; }
  double mean_self_weight() const { return 1.0; }  // G = I
};

// p_i = sum_j S[i,j] r_j,  S = softmax_j(u_i . u_j / tau) within each sequence (j <= i if causal).
//
// Computed like attention with Q = K = U and values r, one block of kBlock rows at a time
// (causal blocks only touch the columns j < block end):
//   forward   L = U_blk U^T / tau,  S = exp(L - lse),  p_blk = S r
//   backward  dr += S^T dp_blk;  dL = S o (dp_blk r^T - rowdot(dp, p));
//             dU_blk += dL U / tau;  dU += dL^T U_blk / tau
// Options (RouterConfig): tau fixed, scaled by sqrt(D), or learned (tau = exp(log_tau), one
// parameter, d loss / d log_tau = -sum_ij dL_ij L_ij); similarity_exclude_self leaves S[i,i] out
// of its row (L_ii = -inf; a row with no other entry keeps it); similarity_projection uses
// L = Q U^T / tau with Q = U W_s (W_s a (D, D) parameter from the identity): the query side Q
// gets the row gradient dQ_blk = dL U / tau, then dU += dQ W_s^T and dW_s += U^T dQ.
// By default the S rows are kept from forward for backward (N x T values, T the sequence
// length); RouterConfig::similarity_recompute keeps only the row log-sum-exp (O(N)) and
// recomputes each (kBlock, T) block of S in backward, trading one more U U^T GEMM for memory.
// Sequences run in parallel (one per thread, single-threaded GEMMs).
template <class T>
class GraphImpl<Similarity, T, cpu> {
 public:
  static constexpr index_t kBlock = 64;

  // TauMode::Learned declares "<prefix>log_tau" (shape (1)) and similarity_projection
  // "<prefix>w_s" (shape (D, D)); without them the graph has no parameter (configure suffices).
  void declare(ParameterArena<T, cpu>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    configure(d_model, cfg);
    if (cfg.tau_mode == TauMode::Learned) id_log_tau_ = arena.add(prefix + "log_tau", Shape{1});
    if (cfg.similarity_projection) id_w_s_ = arena.add(prefix + "w_s", Shape{d_model, d_model});
  }
  void bind(const ParameterArena<T, cpu>& arena) {
    if (id_log_tau_ >= 0) {
      log_tau_ = arena.value(id_log_tau_);
      dlog_tau_ = arena.grad(id_log_tau_);
    }
    if (id_w_s_ >= 0) {
      w_s_ = arena.value(id_w_s_);
      dw_s_ = arena.grad(id_w_s_);
    }
  }
  void init(Rng&) {
    if (id_log_tau_ >= 0) log_tau_.data()[0] = static_cast<T>(std::log(cfg_.similarity_tau));
    if (id_w_s_ >= 0) as_matrix(w_s_).setIdentity();
  }
  void configure(index_t d_model, const RouterConfig& cfg) {
    cfg_ = cfg;
    d_model_ = d_model;
    tau_ = detail::similarity_tau(d_model, cfg);
  }
  // The temperature of the last forward (the learned one's current value).
  double tau() const { return tau_; }

  void forward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const GraphContext<T, cpu>& ctx,
               Tensor<T, cpu>& p) {
    detail::check_graph_inputs("Similarity", u, r, ctx.seq_len);
    if (cfg_.tau_mode == TauMode::Learned) {
      GRAPHMOE_CHECK(!log_tau_.empty(), "Similarity",
                     "a learned temperature needs its parameter: declare and bind the graph "
                     "(RouterImpl does) instead of configure alone");
      tau_ = std::exp(static_cast<double>(log_tau_.data()[0]));
      GRAPHMOE_CHECK(std::isfinite(tau_) && tau_ > 0, "Similarity", "the learned temperature is ",
                     tau_, " (log_tau = ", static_cast<double>(log_tau_.data()[0]), ")");
    }
    if (cfg_.similarity_projection) {
      GRAPHMOE_CHECK(!w_s_.empty(), "Similarity",
                     "similarity_projection needs its parameter W_s: declare and bind the graph "
                     "(RouterImpl does) instead of configure alone");
      GRAPHMOE_CHECK(u.cols() == d_model_, "Similarity", "u has ", u.cols(),
                     " columns, W_s was declared for D = ", d_model_);
    }
    const index_t n = u.rows(), len = ctx.seq_len;
    prepare_output("Similarity", "p", p, r.shape());
    // the query side of the logits: U itself, or Q = U W_s (kept for backward)
    if (cfg_.similarity_projection) {
      q_ = Tensor<T, cpu>(u.shape());
      as_matrix(q_).noalias() = as_matrix(u) * as_matrix(w_s_);
    } else {
      q_ = Tensor<T, cpu>();
    }
    lse_ = Tensor<T, cpu>(Shape{n});
    entropy_ = Tensor<T, cpu>(Shape{n});
    self_ = Tensor<T, cpu>(Shape{n});
    if (!cfg_.similarity_recompute && (s_.empty() || s_.shape() != Shape{n, len}))
      s_ = Tensor<T, cpu>(Shape{n, len});
    if (cfg_.similarity_recompute) s_ = Tensor<T, cpu>();
    auto U = as_matrix(u);
    auto Q = as_matrix(cfg_.similarity_projection ? q_ : u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    const T inv_tau = static_cast<T>(1.0 / tau_);
    parallel_items(n / len, [&](index_t seq) {
      const index_t s0 = seq * len;
      RowMatrix<T> scratch;
      for (index_t i0 = 0; i0 < len; i0 += kBlock) {
        const index_t bi = std::min(kBlock, len - i0);
        const index_t jn = cfg_.causal ? i0 + bi : len;
        auto run = [&](auto&& S) {
          S.noalias() = inv_tau * Q.middleRows(s0 + i0, bi) * U.middleRows(s0, jn).transpose();
          softmax_block(S, i0, s0 + i0);
          P.middleRows(s0 + i0, bi).noalias() = S * R.middleRows(s0, jn);
        };
        if (cfg_.similarity_recompute) {
          scratch.resize(bi, jn);
          run(scratch);
        } else {
          auto Sall = as_matrix(s_);
          if (jn < len) Sall.block(s0 + i0, jn, bi, len - jn).setZero();
          run(Sall.block(s0 + i0, 0, bi, jn));
        }
      }
    });
  }

  void backward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                const Tensor<T, cpu>& dp, const GraphContext<T, cpu>& ctx, Tensor<T, cpu>& dr,
                Tensor<T, cpu>& du) {
    const index_t n = u.rows(), len = ctx.seq_len;
    prepare_output("Similarity", "dr", dr, r.shape());
    dr.zero();
    auto U = as_matrix(u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    const bool to_u = !cfg_.detach_graph;
    if (to_u) check_shape("Similarity::backward", "du", du, u.shape());
    auto dU = as_matrix(du);
    const bool proj = cfg_.similarity_projection;
    if (proj)
      GRAPHMOE_CHECK(q_.shape() == u.shape(), "Similarity::backward",
                     "no forward of these ", n, " tokens to take the gradient of");
    auto Q = as_matrix(proj ? q_ : u);
    // the query side's gradient: into dU directly, or into dQ (then dU += dQ W_s^T, dW_s += U^T dQ)
    Tensor<T, cpu> dq;
    if (proj && to_u) dq = Tensor<T, cpu>(u.shape());  // zero-initialised
    auto dQ = as_matrix(proj && to_u ? dq : du);
    const T inv_tau = static_cast<T>(1.0 / tau_);
    // learned tau: d loss / d log_tau = -sum_ij dL_ij L_ij = -(1/tau) sum_i q_i . (dL U)_i, summed
    // per sequence (in double) and added after the parallel loop
    const bool to_tau = to_u && !dlog_tau_.empty();
    std::vector<double> dlog_tau(to_tau ? static_cast<std::size_t>(n / len) : 0, 0.0);
    parallel_items(n / len, [&](index_t seq) {
      const index_t s0 = seq * len;
      RowMatrix<T> scratch, dL, dLU;
      Eigen::Matrix<T, Eigen::Dynamic, 1> rowdot;
      for (index_t i0 = 0; i0 < len; i0 += kBlock) {
        const index_t bi = std::min(kBlock, len - i0);
        const index_t jn = cfg_.causal ? i0 + bi : len;
        const auto Ub = Q.middleRows(s0 + i0, bi);  // the queries (U itself without projection)
        const auto Us = U.middleRows(s0, jn);
        auto run = [&](const auto& S) {
          const auto dPb = dP.middleRows(s0 + i0, bi);
          dR.middleRows(s0, jn).noalias() += S.transpose() * dPb;
          if (!to_u) return;
          rowdot = (dPb.array() * P.middleRows(s0 + i0, bi).array()).rowwise().sum();
          dL.noalias() = dPb * R.middleRows(s0, jn).transpose();
          dL = S.array() * (dL.colwise() - rowdot).array();
          if (to_tau) {
            dLU.noalias() = dL * Us;
            dQ.middleRows(s0 + i0, bi) += inv_tau * dLU;
            dlog_tau[static_cast<std::size_t>(seq)] -=
                static_cast<double>(inv_tau) * (Ub.array() * dLU.array()).template cast<double>().sum();
          } else {
            dQ.middleRows(s0 + i0, bi).noalias() += inv_tau * dL * Us;
          }
          dU.middleRows(s0, jn).noalias() += inv_tau * dL.transpose() * Ub;
        };
        if (cfg_.similarity_recompute) {
          scratch.noalias() = inv_tau * Ub * Us.transpose();
          for (index_t a = 0; a < bi; ++a) {
            const T l = lse_.data()[s0 + i0 + a];
            const index_t valid = cfg_.causal ? i0 + a + 1 : jn;
            scratch.row(a).head(valid) = (scratch.row(a).head(valid).array() - l).exp();
            scratch.row(a).tail(jn - valid).setZero();
            if (masks_self(valid)) scratch(a, i0 + a) = T(0);
          }
          run(scratch);
        } else {
          run(as_matrix(s_).block(s0 + i0, 0, bi, jn));
        }
      }
    });
    if (to_tau) {
      double total = 0;
      for (double x : dlog_tau) total += x;
      dlog_tau_.data()[0] += static_cast<T>(total);
    }
    if (proj && to_u) {
      dU.noalias() += as_matrix(dq) * as_matrix(w_s_).transpose();
      as_matrix(dw_s_).noalias() += U.transpose() * as_matrix(dq);
    }
  }

  double mean_entropy() const {
    return entropy_.empty() ? 0.0 : static_cast<double>(as_vector(entropy_).mean());
  }
  const Tensor<T, cpu>& row_entropy() const { return entropy_; }
  // S[i,i] of every token in the last forward, (N): 1 where S is the identity.
  const Tensor<T, cpu>& self_weight() const { return self_; }
  double mean_self_weight() const {
    return self_.empty() ? 1.0 : static_cast<double>(as_vector(self_).template cast<double>().mean());
  }

 private:
  // In place: logits (bi, jn) of rows [i0, i0 + bi) of one sequence -> probabilities; saves lse,
  // the row entropy H = lse - sum_j S_j L_j and the self-weight S[i,i] at global row g0 + a.
  template <class M>
  void softmax_block(M&& L, index_t i0, index_t g0) {
    for (index_t a = 0; a < L.rows(); ++a) {
      const index_t valid = cfg_.causal ? i0 + a + 1 : L.cols();
      auto row = L.row(a).head(valid);
      const bool mask = masks_self(valid);
      if (mask) row(i0 + a) = std::numeric_limits<T>::lowest();
      const T mx = row.maxCoeff();
      // e_j = exp(l_j - mx); H = log(sum e) - sum e (l - mx) / sum e (the masked entry: e = 0)
      auto shifted = (row.array() - mx).eval();
      if (mask) shifted(i0 + a) = T(0);
      auto e = shifted.exp().eval();
      if (mask) e(i0 + a) = T(0);
      const T sum = e.sum();
      const T dot = (e * shifted).sum();
      lse_.data()[g0 + a] = mx + std::log(sum);
      entropy_.data()[g0 + a] = std::log(sum) - dot / sum;
      row = e.matrix() / sum;
      L.row(a).tail(L.cols() - valid).setZero();
      self_.data()[g0 + a] = L(a, i0 + a);
    }
  }

  // Whether row i's own entry is left out (exclude_self, and the row has another entry).
  bool masks_self(index_t valid) const { return cfg_.similarity_exclude_self && valid > 1; }

  RouterConfig cfg_;
  index_t d_model_ = 0;
  double tau_ = 1.0;
  Tensor<T, cpu> lse_, entropy_, self_, s_, q_;
  index_t id_log_tau_ = -1, id_w_s_ = -1;
  Tensor<T, cpu> log_tau_, dlog_tau_, w_s_, dw_s_;
};

// p_i = sum_j A^p[i,j] r_j with the attention posterior of Lemma 1 for head h*:
//   log A^p[i,j] = log A_h[i,j] + (a_i . m_hj - |m_hj|^2 / 2) / sigma^2 - (normaliser over j),
//   m_hj = H * W_o,h v_hj + b_o   (the Gaussian mean W_h x_j; the |a_i|^2 term cancels over j),
// computed in log space. h* = argmin_h of the mean attention-row entropy of the sequence
// (HeadChoice::PerSequence), or of its prefix up to row i (PerSequenceCausal); see
// docs/routers.md for the choice of tensors and the factor H.
template <class T>
class GraphImpl<Attention, T, cpu> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    cfg_ = cfg;
    d_model_ = d_model;
  }

  void forward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const GraphContext<T, cpu>& ctx,
               Tensor<T, cpu>& p) {
    detail::check_graph_inputs("Attention", u, r, ctx.seq_len);
    const AttentionCache<T, cpu>& c = check_cache(ctx, u.rows());
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads;
    prepare_output("Attention", "p", p, r.shape());
    if (post_.empty() || post_.shape() != Shape{n, len}) post_ = Tensor<T, cpu>(Shape{n, len});
    seq_len_ = len;
    head_.assign(static_cast<std::size_t>(n), 0);
    row_entropy_.assign(static_cast<std::size_t>(n), 0.0);
    const T inv_var = static_cast<T>(1.0 / (cfg_.attention_sigma * cfg_.attention_sigma));
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    constexpr T floor = attention_prior_floor<T>();
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto Ap = as_matrix(post_);
    std::vector<std::string> errors(static_cast<std::size_t>(n / len));
    parallel_items(n / len, [&](index_t b) {
      const index_t s0 = b * len;
      choose_heads(c, b, len, s0);
      auto Aout = as_matrix(c.out).middleRows(s0, len);
      RowMatrix<T> M, G;
      Eigen::Matrix<T, Eigen::Dynamic, 1> msq;
      for (index_t h = 0; h < nh; ++h) {
        if (!head_used(s0, len, h)) continue;
        head_mean(c, b, h, len, M);
        msq = M.rowwise().squaredNorm();
        G.noalias() = Aout * M.transpose();  // (T, T): a_i . m_hj
        const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len) * len, len, len);
        for (index_t i = 0; i < len; ++i) {
          if (head_[static_cast<std::size_t>(s0 + i)] != h) continue;
          auto row = Ap.row(s0 + i);
          // log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2, -inf where A <= attention_prior_floor
          row = (A.row(i).array() > floor)
                    .select(A.row(i).array().log() +
                                (G.row(i).array() - T(0.5) * msq.transpose().array()) * inv_var,
                            kNegInf);
          const T mx = row.maxCoeff();
          if (!(mx > kNegInf)) {
            errors[static_cast<std::size_t>(b)] = "attention row " + std::to_string(i) +
                                                  " of sequence " + std::to_string(b) +
                                                  " is all zero";
            return;
          }
          auto shifted = (row.array() - mx).eval();
          auto e = (shifted > kNegInf).select(shifted.exp(), T(0)).eval();
          const T sum = e.sum();
          const T dot = (shifted > kNegInf).select(e * shifted, T(0)).sum();
          row = e.matrix() / sum;
          row_entropy_[static_cast<std::size_t>(s0 + i)] = static_cast<double>(std::log(sum) - dot / sum);
        }
      }
      P.middleRows(s0, len).noalias() = Ap.middleRows(s0, len) * R.middleRows(s0, len);
    });
    for (const auto& e : errors) GRAPHMOE_CHECK(e.empty(), "Attention", e);
  }

  void backward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                const Tensor<T, cpu>& dp, const GraphContext<T, cpu>& ctx, Tensor<T, cpu>& dr,
                Tensor<T, cpu>&) {
    AttentionCache<T, cpu>& c = *ctx.attention;
    check_cache(ctx, u.rows());
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads, nseq = n / len;
    const index_t dh = c.v.cols() / nh;
    prepare_output("Attention", "dr", dr, r.shape());
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    auto Ap = as_matrix(post_);
    const T inv_var = static_cast<T>(1.0 / (cfg_.attention_sigma * cfg_.attention_sigma));
    const T fh = static_cast<T>(nh);
    // w_o and b_o are shared by the sequences: per-sequence partial gradients, summed after.
    std::vector<RowMatrix<T>> dwo(static_cast<std::size_t>(nseq));
    std::vector<Eigen::Matrix<T, 1, Eigen::Dynamic>> dbo(static_cast<std::size_t>(nseq));
    parallel_items(nseq, [&](index_t b) {
      const index_t s0 = b * len;
      const auto Aps = Ap.middleRows(s0, len);
      const auto dPs = dP.middleRows(s0, len);
      dR.middleRows(s0, len).noalias() = Aps.transpose() * dPs;
      if (cfg_.detach_graph) return;
      RowMatrix<T> dL, M, dLh, dM;
      Eigen::Matrix<T, Eigen::Dynamic, 1> rowdot, colsum;
      rowdot = (dPs.array() * P.middleRows(s0, len).array()).rowwise().sum();
      dL.noalias() = dPs * R.middleRows(s0, len).transpose();
      dL = Aps.array() * (dL.colwise() - rowdot).array();
      auto Aout = as_matrix(c.out).middleRows(s0, len);
      auto& dW = dwo[static_cast<std::size_t>(b)];
      auto& dB = dbo[static_cast<std::size_t>(b)];
      dW = RowMatrix<T>::Zero(c.w_o.rows(), c.w_o.cols());
      dB = Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(c.w_o.rows());
      for (index_t h = 0; h < nh; ++h) {
        if (!head_used(s0, len, h)) continue;
        dLh = dL;
        for (index_t i = 0; i < len; ++i)
          if (head_[static_cast<std::size_t>(s0 + i)] != h) dLh.row(i).setZero();
        // into log A_h: dA = dL / A where A > attention_prior_floor (0 where forward used -inf)
        if (!c.dprobs.empty()) {
          const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len) * len, len, len);
          MatrixMap<T> dA(c.dprobs.data() + ((b * nh + h) * len) * len, len, len);
          dA.array() += (A.array() > attention_prior_floor<T>()).select(dLh.array() / A.array(), T(0));
        }
        head_mean(c, b, h, len, M);
        if (!c.dout.empty()) as_matrix(c.dout).middleRows(s0, len).noalias() += inv_var * dLh * M;
        colsum = dLh.colwise().sum().transpose();
        dM.noalias() = inv_var * dLh.transpose() * Aout;
        dM -= inv_var * (M.array().colwise() * colsum.array()).matrix();
        // m = H v_h W_o,h^T + b_o
        auto V = as_matrix(c.v).middleRows(s0, len).middleCols(h * dh, dh);
        auto Wo = as_matrix(c.w_o).middleCols(h * dh, dh);  // (D, dh)
        if (!c.dv.empty())
          as_matrix(c.dv).middleRows(s0, len).middleCols(h * dh, dh).noalias() += fh * dM * Wo;
        dW.middleCols(h * dh, dh).noalias() += fh * dM.transpose() * V;
        dB += dM.colwise().sum();
      }
    });
    if (cfg_.detach_graph) return;
    for (index_t b = 0; b < nseq; ++b) {
      if (!c.dw_o.empty()) as_matrix(c.dw_o) += dwo[static_cast<std::size_t>(b)];
      if (!c.db_o.empty()) as_vector(c.db_o) += dbo[static_cast<std::size_t>(b)].transpose();
    }
  }

  double mean_entropy() const {
    if (row_entropy_.empty()) return 0.0;
    double s = 0;
    for (double e : row_entropy_) s += e;
    return s / static_cast<double>(row_entropy_.size());
  }
  // Mean over tokens of A^p[i,i] in the last forward (1 where A^p is the identity).
  double mean_self_weight() const {
    if (post_.empty() || seq_len_ == 0) return 1.0;
    const index_t n = post_.rows();
    double s = 0;
    for (index_t i = 0; i < n; ++i) s += static_cast<double>(post_.data()[i * seq_len_ + i % seq_len_]);
    return s / static_cast<double>(n);
  }
  // h* of each token in the last forward.
  const std::vector<int>& heads() const { return head_; }
  // A^p of the last forward, (N, T): row i holds token i's posterior over its sequence.
  const Tensor<T, cpu>& posterior() const { return post_; }

 private:
  const AttentionCache<T, cpu>& check_cache(const GraphContext<T, cpu>& ctx, index_t n) const {
    return detail::check_attention_cache(ctx, n, d_model_);
  }

  bool head_used(index_t s0, index_t len, index_t h) const {
    for (index_t i = 0; i < len; ++i)
      if (head_[static_cast<std::size_t>(s0 + i)] == h) return true;
    return false;
  }

  // M = H * V_h W_o,h^T + b_o for sequence b: (T, D)
  void head_mean(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t len,
                 RowMatrix<T>& M) const {
    const index_t nh = c.num_heads, dh = c.v.cols() / nh;
    auto V = as_matrix(c.v).middleRows(b * len, len).middleCols(h * dh, dh);
    auto Wo = as_matrix(c.w_o).middleCols(h * dh, dh);
    M.noalias() = static_cast<T>(nh) * V * Wo.transpose();
    if (!c.b_o.empty()) M.rowwise() += as_vector(c.b_o).transpose();
  }

  // Attention-row entropies H(A_h[i,:]) for sequence b; h* per token by the configured rule
  // (lowest mean entropy, ties to the lower head index).
  void choose_heads(const AttentionCache<T, cpu>& c, index_t b, index_t len, index_t s0) {
    const index_t nh = c.num_heads;
    std::vector<double> prefix(static_cast<std::size_t>(nh), 0.0);
    std::vector<double> ent(static_cast<std::size_t>(nh * len));
    for (index_t h = 0; h < nh; ++h) {
      if (!c.row_entropy.empty()) {  // from the attention layer's softmax
        const T* e = c.row_entropy.data() + (b * nh + h) * len;
        for (index_t i = 0; i < len; ++i) ent[static_cast<std::size_t>(h * len + i)] = static_cast<double>(e[i]);
        continue;
      }
      const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len) * len, len, len);
      // -sum_j a log a, with 0 log 0 = 0 (log of the smallest normal is finite)
      const Eigen::Matrix<T, Eigen::Dynamic, 1> e =
          -(A.array() * A.array().max(std::numeric_limits<T>::min()).log()).rowwise().sum();
      for (index_t i = 0; i < len; ++i)
        ent[static_cast<std::size_t>(h * len + i)] = static_cast<double>(e(i));
    }
    auto argmin_prefix = [&](index_t upto) {  // mean over rows [0, upto]
      int best = 0;
      double best_v = std::numeric_limits<double>::infinity();
      for (index_t h = 0; h < nh; ++h) {
        const double v = prefix[static_cast<std::size_t>(h)] / static_cast<double>(upto + 1);
        if (v < best_v) { best_v = v; best = static_cast<int>(h); }
      }
      return best;
    };
    if (cfg_.head_choice == HeadChoice::PerSequence) {
      for (index_t h = 0; h < nh; ++h)
        for (index_t i = 0; i < len; ++i)
          prefix[static_cast<std::size_t>(h)] += ent[static_cast<std::size_t>(h * len + i)];
      const int best = argmin_prefix(len - 1);
      for (index_t i = 0; i < len; ++i) head_[static_cast<std::size_t>(s0 + i)] = best;
    } else {
      for (index_t i = 0; i < len; ++i) {
        for (index_t h = 0; h < nh; ++h)
          prefix[static_cast<std::size_t>(h)] += ent[static_cast<std::size_t>(h * len + i)];
        head_[static_cast<std::size_t>(s0 + i)] = argmin_prefix(i);
      }
    }
  }

  RouterConfig cfg_;
  index_t d_model_ = 0;
  index_t seq_len_ = 0;
  Tensor<T, cpu> post_;
  std::vector<int> head_;
  std::vector<double> row_entropy_;
};

}  // namespace graphmoe
