// graphmoe/routing/graphs/similarity.hpp: the Similarity token graph on the CPU,
// GraphImpl<Similarity, T, cpu>, and its temperature rule (detail::similarity_tau, shared with
// the CUDA graph of graphs/similarity_cuda.cuh).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/ops/gemm.hpp"
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
// Computed like attention with Q = K = U and values r, one block of kBlock rows at a time
// (causal blocks only touch the columns j < block end):
//   forward   L = U_blk U^T / tau,  S = exp(L - lse),  p_blk = S r
//   backward  dr += S^T dp_blk;  dL = S o (dp_blk r^T - rowdot(dp, p));
//             dU_blk += dL U / tau;  dU += dL^T U_blk / tau
// Options (Similarity::Options): tau fixed, scaled by sqrt(D), or learned (tau = exp(log_tau), one
// parameter, d loss / d log_tau = -sum_ij dL_ij L_ij); exclude_self leaves S[i,i] out
// of its row (L_ii = -inf; a row with no other entry keeps it); projection uses
// L = Q U^T / tau with Q = U W_s (W_s a (D, D) parameter from the identity): the query side Q
// gets the row gradient dQ_blk = dL U / tau, then dU += dQ W_s^T and dW_s += U^T dQ.
// Similarity::Options::memory: Store keeps the S rows from forward for backward (N x T values,
// T the sequence length); Recompute keeps only the row log-sum-exp (O(N)) and recomputes each
// (kBlock, T) block of S in backward, trading one more U U^T GEMM for memory; Auto (the default)
// stores while T <= kGraphStoreMaxLen (graph_stores, policies.hpp). Either way the scratch is
// O(kBlock x T) per thread (docs/routers.md, "Memory").
// Sequences run in parallel (one per thread, single-threaded GEMMs). Every product goes through
// detail::gemm_view (backend/cpu/gemm.hpp) on views of one type, stored S rows and scratch alike,
// which keeps the graph's compile time down to the Eigen product code gemm already instantiates.
template <class T>
class GraphImpl<Similarity, T, cpu> {
 public:
  static constexpr index_t kBlock = 64;

  // TauMode::Learned declares "<prefix>log_tau" (shape (1)) and Options::projection
  // "<prefix>w_s" (shape (D, D)); without them the graph has no parameter (configure suffices).
  void declare(ParameterArena<T, cpu>& arena, const std::string& prefix, index_t d_model,
               const RouterConfig& cfg) {
    configure(d_model, cfg);
    if (opts_.tau_mode == TauMode::Learned) id_log_tau_ = arena.add(prefix + "log_tau", Shape{1});
    if (opts_.projection) id_w_s_ = arena.add(prefix + "w_s", Shape{d_model, d_model});
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
    if (id_log_tau_ >= 0) log_tau_.data()[0] = static_cast<T>(std::log(opts_.tau));
    if (id_w_s_ >= 0) as_matrix(w_s_).setIdentity();
  }
  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Similarity>();
    validate_options(opts_);
    causal_ = cfg.causal;
    d_model_ = d_model;
    tau_ = detail::similarity_tau(d_model, opts_);
  }
  // The temperature of the last forward (the learned one's current value).
  double tau() const { return tau_; }

  void forward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const GraphContext<T, cpu>& ctx,
               Tensor<T, cpu>& p) {
    using detail::gemm_view, detail::view_of;
    detail::check_graph_inputs("Similarity", u, r, ctx.seq_len);
    if (opts_.tau_mode == TauMode::Learned) {
      GRAPHMOE_CHECK(!log_tau_.empty(), "Similarity",
                     "a learned temperature needs its parameter: declare and bind the graph "
                     "(RouterImpl does) instead of configure alone");
      tau_ = std::exp(static_cast<double>(log_tau_.data()[0]));
      GRAPHMOE_CHECK(std::isfinite(tau_) && tau_ > 0, "Similarity", "the learned temperature is ",
                     tau_, " (log_tau = ", static_cast<double>(log_tau_.data()[0]), ")");
    }
    if (opts_.projection) {
      GRAPHMOE_CHECK(!w_s_.empty(), "Similarity",
                     "Options::projection needs its parameter W_s: declare and bind the graph "
                     "(RouterImpl does) instead of configure alone");
      GRAPHMOE_CHECK(u.cols() == d_model_, "Similarity", "u has ", u.cols(),
                     " columns, W_s was declared for D = ", d_model_);
    }
    const index_t n = u.rows(), len = ctx.seq_len;
    prepare_output("Similarity", "p", p, r.shape());
    // the query side of the logits: U itself, or Q = U W_s (kept for backward)
    if (opts_.projection) {
      q_ = Tensor<T, cpu>(u.shape());
      gemm_view(Trans::N, Trans::N, T(1), view_of(as_matrix(u)), view_of(as_matrix(w_s_)), T(0),
                view_of(as_matrix(q_)));
    } else {
      q_ = Tensor<T, cpu>();
    }
    lse_ = Tensor<T, cpu>(Shape{n});
    entropy_ = Tensor<T, cpu>(Shape{n});
    self_ = Tensor<T, cpu>(Shape{n});
    stores_ = graph_stores(opts_.memory, len);
    if (stores_ && (s_.empty() || s_.shape() != Shape{n, len})) s_ = Tensor<T, cpu>(Shape{n, len});
    if (!stores_) s_ = Tensor<T, cpu>();
    auto U = as_matrix(u);
    auto Q = as_matrix(opts_.projection ? q_ : u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    const T inv_tau = static_cast<T>(1.0 / tau_);
    parallel_items(n / len, [&](index_t seq) {
      const index_t s0 = seq * len;
      RowMatrix<T> scratch;
      for (index_t i0 = 0; i0 < len; i0 += kBlock) {
        const index_t bi = std::min(kBlock, len - i0);
        const index_t jn = causal_ ? i0 + bi : len;
        auto run = [&](detail::MatrixView<T> S) {
          gemm_view(Trans::N, Trans::T, inv_tau, view_of(Q.middleRows(s0 + i0, bi)),
                    view_of(U.middleRows(s0, jn)), T(0), S);
          softmax_block(S, i0, s0 + i0);
          gemm_view(Trans::N, Trans::N, T(1), S, view_of(R.middleRows(s0, jn)), T(0),
                    view_of(P.middleRows(s0 + i0, bi)));
        };
        if (!stores_) {
          scratch.resize(bi, jn);
          run(view_of(scratch));
        } else {
          auto Sall = as_matrix(s_);
          if (jn < len) Sall.block(s0 + i0, jn, bi, len - jn).setZero();
          run(view_of(Sall.block(s0 + i0, 0, bi, jn)));
        }
      }
    });
  }

  void backward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                const Tensor<T, cpu>& dp, const GraphContext<T, cpu>& ctx, Tensor<T, cpu>& dr,
                Tensor<T, cpu>& du) {
    using detail::gemm_view, detail::view_of;
    const index_t n = u.rows(), len = ctx.seq_len;
    detail::check_graph_inputs("Similarity::backward", u, r, len);
    GRAPHMOE_CHECK(lse_.numel() == n && (!stores_ || s_.shape() == (Shape{n, len})),
                   "Similarity::backward", "no forward of these ", n, " tokens in sequences of ",
                   len, " to take the gradient of");
    prepare_output("Similarity", "dr", dr, r.shape());
    dr.zero();
    auto U = as_matrix(u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    const bool to_u = !opts_.detach;
    if (to_u) check_shape("Similarity::backward", "du", du, u.shape());
    auto dU = as_matrix(du);
    const bool proj = opts_.projection;
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
        const index_t jn = causal_ ? i0 + bi : len;
        const auto Ub = Q.middleRows(s0 + i0, bi);  // the queries (U itself without projection)
        const auto Us = U.middleRows(s0, jn);
        auto run = [&](const detail::MatrixView<T>& S) {
          const auto dPb = dP.middleRows(s0 + i0, bi);
          gemm_view(Trans::T, Trans::N, T(1), S, view_of(dPb), T(1),
                    view_of(dR.middleRows(s0, jn)));
          if (!to_u) return;
          rowdot = (dPb.array() * P.middleRows(s0 + i0, bi).array()).rowwise().sum();
          dL.resize(bi, jn);
          gemm_view(Trans::N, Trans::T, T(1), view_of(dPb), view_of(R.middleRows(s0, jn)), T(0),
                    view_of(dL));
          dL = S.array() * (dL.colwise() - rowdot).array();
          if (to_tau) {
            dLU.resize(bi, Us.cols());
            gemm_view(Trans::N, Trans::N, T(1), view_of(dL), view_of(Us), T(0), view_of(dLU));
            dQ.middleRows(s0 + i0, bi) += inv_tau * dLU;
            dlog_tau[static_cast<std::size_t>(seq)] -=
                static_cast<double>(inv_tau) * (Ub.array() * dLU.array()).template cast<double>().sum();
          } else {
            gemm_view(Trans::N, Trans::N, inv_tau, view_of(dL), view_of(Us), T(1),
                      view_of(dQ.middleRows(s0 + i0, bi)));
          }
          gemm_view(Trans::T, Trans::N, inv_tau, view_of(dL), view_of(Ub), T(1),
                    view_of(dU.middleRows(s0, jn)));
        };
        if (!stores_) {
          scratch.resize(bi, jn);
          gemm_view(Trans::N, Trans::T, inv_tau, view_of(Ub), view_of(Us), T(0), view_of(scratch));
          for (index_t a = 0; a < bi; ++a) {
            const T l = lse_.data()[s0 + i0 + a];
            const index_t valid = causal_ ? i0 + a + 1 : jn;
            scratch.row(a).head(valid) = (scratch.row(a).head(valid).array() - l).exp();
            scratch.row(a).tail(jn - valid).setZero();
            if (masks_self(valid)) scratch(a, i0 + a) = T(0);
          }
          run(view_of(scratch));
        } else {
          run(view_of(as_matrix(s_).block(s0 + i0, 0, bi, jn)));
        }
      }
    });
    if (to_tau) {
      double total = 0;
      for (double x : dlog_tau) total += x;
      dlog_tau_.data()[0] += static_cast<T>(total);
    }
    if (proj && to_u) {
      gemm_view(Trans::N, Trans::T, T(1), view_of(as_matrix(dq)), view_of(as_matrix(w_s_)), T(1),
                view_of(dU));
      gemm_view(Trans::T, Trans::N, T(1), view_of(U), view_of(as_matrix(dq)), T(1),
                view_of(as_matrix(dw_s_)));
    }
  }

  double mean_entropy() const {
    return entropy_.empty() ? 0.0 : static_cast<double>(as_vector(entropy_).mean());
  }
  const Tensor<T, cpu>& row_entropy() const { return entropy_; }
  // Whether the last forward kept S for backward (Options::memory, graph_stores).
  bool stores() const { return stores_; }
  // S[i,i] of every token in the last forward, (N): 1 where S is the identity.
  const Tensor<T, cpu>& self_weight() const { return self_; }
  double mean_self_weight() const {
    return self_.empty() ? 1.0 : static_cast<double>(as_vector(self_).template cast<double>().mean());
  }

 private:
  // In place: logits (bi, jn) of rows [i0, i0 + bi) of one sequence -> probabilities; saves lse,
  // the row entropy H = lse - sum_j S_j L_j and the self-weight S[i,i] at global row g0 + a.
  void softmax_block(detail::MatrixView<T> L, index_t i0, index_t g0) {
    for (index_t a = 0; a < L.rows(); ++a) {
      const index_t valid = causal_ ? i0 + a + 1 : L.cols();
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
  bool masks_self(index_t valid) const { return opts_.exclude_self && valid > 1; }

  Similarity::Options opts_;
  bool causal_ = false;
  bool stores_ = false;  // the last forward's choice, which its backward follows
  index_t d_model_ = 0;
  double tau_ = 1.0;
  Tensor<T, cpu> lse_, entropy_, self_, s_, q_;
  index_t id_log_tau_ = -1, id_w_s_ = -1;
  Tensor<T, cpu> log_tau_, dlog_tau_, w_s_, dw_s_;
};

}  // namespace graphmoe
