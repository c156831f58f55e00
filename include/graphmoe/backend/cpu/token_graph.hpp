// graphmoe/backend/cpu/token_graph.hpp: the CPU system's token graphs, Similarity and Attention
// (contract, options and argument checks: ops/token_graph.hpp, which calls these through the
// backend tag; the graph classes are routing/graphs/similarity.hpp and attention.hpp).
//
// ---- Similarity: p_i = sum_j S[i,j] r_j,  S = softmax_j(u_i . u_j / tau) -----------------------
// Computed like attention with Q = K = U and values r, one block of kBlock rows at a time
// (causal blocks only touch the columns j < block end):
//   forward   L = U_blk U^T / tau,  S = exp(L - lse),  p_blk = S r
//   backward  dr += S^T dp_blk;  dL = S o (dp_blk r^T - rowdot(dp, p));
//             dU_blk += dL U / tau;  dU += dL^T U_blk / tau
// A learned tau = exp(log_tau) gets d loss / d log_tau = -sum_ij dL_ij L_ij; exclude_self sets
// L_ii = -inf (a row with no other entry keeps it); projection uses L = Q U^T / tau with
// Q = U W_s: the query side Q gets the row gradient dQ_blk = dL U / tau, then dU += dQ W_s^T and
// dW_s += U^T dQ.
// Memory: with args.store the S rows of forward are kept for backward (N x T values, T the
// sequence length); without, only the row log-sum-exp (O(N)) and each (kBlock, T) block of S is
// recomputed in backward, trading one more U U^T GEMM for memory. Either way the scratch is
// O(kBlock x T) per thread (docs/routers.md, "Memory").
// Sequences run in parallel (one per thread, single-threaded GEMMs). Every product goes through
// detail::gemm_view (backend/cpu/gemm.hpp) on views of one type, stored S rows and scratch alike,
// which keeps the graph's compile time down to the Eigen product code gemm already instantiates.
//
// ---- Attention: p_i = sum_j A^p[i,j] r_j, the attention posterior of Lemma 1 for head h* -------
//   log A^p[i,j] = log A_h[i,j] + (a_i . m_hj - |m_hj|^2 / 2) / sigma^2 - (normaliser over j),
//   m_hj = H * W_o,h v_hj + b_o   (the Gaussian mean W_h x_j; the |a_i|^2 term cancels over j),
// computed in log space. h* = argmin_h of the mean attention-row entropy of the sequence
// (HeadChoice::PerSequence), or of its prefix up to row i (PerSequenceCausal); see
// docs/routers.md for the choice of tensors and the factor H.
//
// In the head's dh = D / H dimensions: a_i . m_hj = q_i . v_hj + a_i . b_o with
// q_i = H a_i W_o,h (dh values), and a_i . b_o is the same for every j, so it cancels in the
// row's softmax (as does |b_o|^2 in |m_hj|^2 = H^2 v_hj^T K_h v_hj + 2 H v_hj . w_h + |b_o|^2,
// K_h = W_o,h^T W_o,h, w_h = W_o,h^T b_o). The (T, T) products then cost T^2 dh, not T^2 D.
// Per sequence and used head h, in blocks of kBlock rows i0..i0+bi (rows of other heads 0):
//   forward   Q_blk = H Aout_blk W_o,h (bi, dh);  G = Q_blk V_h^T (bi, jn) -> A^p in log space
//             (lse kept);  p_blk += A^p_blk R
//   (jn: the block's columns up to its last prior A > floor, block_cols: i0 + bi for a causal
//   attention layer, so causal blocks cost half, as in the Similarity graph)
//   backward  dR += A^p_blk^T dp_blk;  dL = A^p o (dp_blk R^T - rowdot(dp, p)) (bi, jn);
//             dprobs_h += dL / A (A > floor);  dQ = dL V_h;  dV_h += dL^T Q_blk / sigma^2;
//             dout_blk += H dQ W_o,h^T / sigma^2;  dW_o,h += H Aout_blk^T dQ / sigma^2;
//             colsum_h += column sums of dL;
//   then      from -|m_hj|^2 / (2 sigma^2) weighted by colsum_j, with Y = M_h W_o,h =
//             H V_h K_h + 1 w_h^T:  dV_h -= H colsum o Y / sigma^2,  dW_o,h -= H M_h^T
//             diag(colsum) V_h / sigma^2,  db_o -= M_h^T colsum / sigma^2.
// Memory: with args.store A^p (N x T values) is kept for backward; without, each row's
// log-sum-exp is kept and the block's A^p recomputed (one more Q V^T product). The graph's own
// memory is O(kBlock x T + T x dh) per thread besides A^p when stored; the cache's probs
// (B, H, T, T) belong to the attention layer.
//
// The CPU fills every field of the states (core/token_graph.hpp); its own part of the Attention
// state (AttentionGraphBackendState<T, cpu>, below) holds each row's log-sum-exp and h*.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/backend/cpu/detail/extern_instances.hpp"
#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/backend/cpu/gemm.hpp"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/core/token_graph.hpp"

namespace graphmoe {

// The CPU implements every option of the token graphs.
constexpr TokenGraphSupport token_graph_support(cpu) {
  return TokenGraphSupport{true, true, true};
}

// The value of a one-entry parameter (the learned log_tau).
template <class T>
double token_graph_scalar(cpu, const Tensor<T, cpu>& t) {
  return static_cast<double>(t.data()[0]);
}

namespace detail {

// ---- Similarity ---------------------------------------------------------------------------------

// The lse and entropy of one softmax row of S.
template <class T>
struct SimilarityRowStats {
  T lse;      // max + log Z
  T entropy;  // log Z - sum_j S_j (l_j - max)
};

// In place: the logits x[0, n) of one row of S -> its probabilities, entry `skip` (exclude_self;
// -1: none) exactly 0. The exponentials go through exp_nonpositive (detail/vexp.hpp), so an entry
// far below the row's maximum is exactly 0 as with std::exp: Eigen's packet exp alone returns
// about 1e-39 there, a subnormal that made every product it reached (p = S R) several times
// slower; with u of norm about sqrt(D) and tau = 1 most of a long row is that far below. The
// forward's rows and a decode step's rows (backend/cpu/decode.hpp) both use it.
template <class T>
SimilarityRowStats<T> similarity_softmax_row(T* x, index_t n, index_t skip = -1) {
  Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>> row(x, n);
  if (skip >= 0) row(skip) = std::numeric_limits<T>::lowest();
  const T mx = row.maxCoeff();
  // e_j = exp(l_j - mx); H = log(sum e) - sum e (l - mx) / sum e (the skipped entry: e = 0)
  Eigen::Array<T, 1, Eigen::Dynamic> shifted = row - mx, e(n);
  if (skip >= 0) shifted(skip) = T(0);
  exp_nonpositive(shifted.data(), e.data(), n);
  if (skip >= 0) e(skip) = T(0);
  const T sum = e.sum();
  const T dot = (e * shifted).sum();
  row = e / sum;
  return {mx + std::log(sum), std::log(sum) - dot / sum};
}

template <class T>
class SimilarityGraphCpu {
 public:
  static constexpr index_t kBlock = 64;

  SimilarityGraphCpu(const SimilarityGraphArgs& args, SimilarityGraphState<T, cpu>& st)
      : args_(args), st_(st) {}

  void forward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& w_s,
               Tensor<T, cpu>& p) {
    using detail::gemm_view, detail::view_of;
    const index_t n = u.rows(), len = args_.seq_len;
    // the query side of the logits: U itself, or Q = U W_s (kept for backward)
    if (args_.projection) {
      st_.q = Tensor<T, cpu>(u.shape());
      gemm_view(Trans::N, Trans::N, T(1), view_of(as_matrix(u)), view_of(as_matrix(w_s)), T(0),
                view_of(as_matrix(st_.q)));
    } else {
      st_.q = Tensor<T, cpu>();
    }
    st_.lse = Tensor<T, cpu>(Shape{n});
    st_.entropy = Tensor<T, cpu>(Shape{n});
    st_.self = Tensor<T, cpu>(Shape{n});
    st_.stores = args_.store;
    if (st_.stores && (st_.s.empty() || st_.s.shape() != Shape{n, len}))
      st_.s = Tensor<T, cpu>(Shape{n, len});
    if (!st_.stores) st_.s = Tensor<T, cpu>();
    auto U = as_matrix(u);
    auto Q = as_matrix(args_.projection ? st_.q : u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    const T inv_tau = static_cast<T>(1.0 / st_.tau);
    const bool causal = args_.causal;
    parallel_items(n / len, [&](index_t seq) {
      const index_t s0 = seq * len;
      RowMatrix<T> scratch;
      for (index_t i0 = 0; i0 < len; i0 += kBlock) {
        const index_t bi = std::min(kBlock, len - i0);
        const index_t jn = causal ? i0 + bi : len;
        auto run = [&](detail::MatrixView<T> S) {
          gemm_view(Trans::N, Trans::T, inv_tau, view_of(Q.middleRows(s0 + i0, bi)),
                    view_of(U.middleRows(s0, jn)), T(0), S);
          softmax_block(S, i0, s0 + i0);
          gemm_view(Trans::N, Trans::N, T(1), S, view_of(R.middleRows(s0, jn)), T(0),
                    view_of(P.middleRows(s0 + i0, bi)));
        };
        if (!st_.stores) {
          scratch.resize(bi, jn);
          run(view_of(scratch));
        } else {
          auto Sall = as_matrix(st_.s);
          if (jn < len) Sall.block(s0 + i0, jn, bi, len - jn).setZero();
          run(view_of(Sall.block(s0 + i0, 0, bi, jn)));
        }
      }
    });
  }

  void backward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                const Tensor<T, cpu>& dp, SimilarityGraphParams<T, cpu>& params,
                Tensor<T, cpu>& dr, Tensor<T, cpu>& du) {
    using detail::gemm_view, detail::view_of;
    const index_t n = u.rows(), len = args_.seq_len;
    dr.zero();
    auto U = as_matrix(u);
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    const bool to_u = !args_.detach;
    auto dU = as_matrix(du);
    const bool proj = args_.projection;
    const bool causal = args_.causal;
    auto Q = as_matrix(proj ? st_.q : u);
    // the query side's gradient: into dU directly, or into dQ (then dU += dQ W_s^T, dW_s += U^T dQ)
    Tensor<T, cpu> dq;
    if (proj && to_u) dq = Tensor<T, cpu>(u.shape());  // zero-initialised
    auto dQ = as_matrix(proj && to_u ? dq : du);
    const T inv_tau = static_cast<T>(1.0 / st_.tau);
    // learned tau: d loss / d log_tau = -sum_ij dL_ij L_ij = -(1/tau) sum_i q_i . (dL U)_i, summed
    // per sequence (in double) and added after the parallel loop
    const bool to_tau = to_u && !params.dlog_tau.empty();
    std::vector<double> dlog_tau(to_tau ? static_cast<std::size_t>(n / len) : 0, 0.0);
    parallel_items(n / len, [&](index_t seq) {
      const index_t s0 = seq * len;
      RowMatrix<T> scratch, dL, dLU;
      Eigen::Array<T, 1, Eigen::Dynamic> z;  // a recomputed row of logits - lse
      Eigen::Matrix<T, Eigen::Dynamic, 1> rowdot;
      for (index_t i0 = 0; i0 < len; i0 += kBlock) {
        const index_t bi = std::min(kBlock, len - i0);
        const index_t jn = causal ? i0 + bi : len;
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
        if (!st_.stores) {
          scratch.resize(bi, jn);
          gemm_view(Trans::N, Trans::T, inv_tau, view_of(Ub), view_of(Us), T(0), view_of(scratch));
          for (index_t a = 0; a < bi; ++a) {
            const T l = st_.lse.data()[s0 + i0 + a];
            const index_t valid = causal ? i0 + a + 1 : jn;
            z = scratch.row(a).head(valid).array() - l;  // <= 0: l is the row's lse
            exp_nonpositive(z.data(), scratch.row(a).data(), valid);
            scratch.row(a).tail(jn - valid).setZero();
            if (masks_self(valid)) scratch(a, i0 + a) = T(0);
          }
          run(view_of(scratch));
        } else {
          run(view_of(as_matrix(st_.s).block(s0 + i0, 0, bi, jn)));
        }
      }
    });
    if (to_tau) {
      double total = 0;
      for (double x : dlog_tau) total += x;
      params.dlog_tau.data()[0] += static_cast<T>(total);
    }
    if (proj && to_u) {
      gemm_view(Trans::N, Trans::T, T(1), view_of(as_matrix(dq)), view_of(as_matrix(params.w_s)),
                T(1), view_of(dU));
      gemm_view(Trans::T, Trans::N, T(1), view_of(U), view_of(as_matrix(dq)), T(1),
                view_of(as_matrix(params.dw_s)));
    }
  }

 private:
  // In place: logits (bi, jn) of rows [i0, i0 + bi) of one sequence -> probabilities; saves lse,
  // the row entropy H = lse - sum_j S_j L_j and the self-weight S[i,i] at global row g0 + a.
  void softmax_block(detail::MatrixView<T> L, index_t i0, index_t g0) {
    for (index_t a = 0; a < L.rows(); ++a) {
      const index_t valid = args_.causal ? i0 + a + 1 : L.cols();
      const SimilarityRowStats<T> stats =
          similarity_softmax_row(L.row(a).data(), valid, masks_self(valid) ? i0 + a : -1);
      st_.lse.data()[g0 + a] = stats.lse;
      st_.entropy.data()[g0 + a] = stats.entropy;
      L.row(a).tail(L.cols() - valid).setZero();
      st_.self.data()[g0 + a] = L(a, i0 + a);
    }
  }

  // Whether row i's own entry is left out (exclude_self, and the row has another entry).
  bool masks_self(index_t valid) const { return args_.exclude_self && valid > 1; }

  const SimilarityGraphArgs& args_;
  SimilarityGraphState<T, cpu>& st_;
};

// ---- Attention ----------------------------------------------------------------------------------

}  // namespace detail

// What the CPU keeps of an Attention forward for its backward, besides the common fields.
template <class T>
struct AttentionGraphBackendState<T, cpu> {
  Tensor<T, cpu> lse;      // (N) row log-sum-exp of the logits (the backward's recomputed rows)
  std::vector<int> heads;  // (N) h* of each token
};

namespace detail {

template <class T>
class AttentionGraphCpu {
 public:
  static constexpr index_t kBlock = 64;

  AttentionGraphCpu(const AttentionGraphArgs& args, AttentionGraphState<T, cpu>& st)
      : args_(args), st_(st) {}

  // Returns the first all-zero attention row (index: b * len + i of the first sequence b that
  // has one, its first such row i of the first head h that meets it), if any.
  Offender forward(const Tensor<T, cpu>& r, const AttentionCache<T, cpu>& c, Tensor<T, cpu>& p) {
    const index_t n = r.rows(), len = args_.seq_len, nh = c.num_heads;
    st_.stores = args_.store;
    if (st_.stores && (st_.post.empty() || st_.post.shape() != Shape{n, len}))
      st_.post = Tensor<T, cpu>(Shape{n, len});
    if (!st_.stores) st_.post = Tensor<T, cpu>();
    st_.seq_len = len;
    st_.backend.heads.assign(static_cast<std::size_t>(n), 0);
    st_.row_entropy.assign(static_cast<std::size_t>(n), 0.0);
    st_.backend.lse = Tensor<T, cpu>(Shape{n});
    st_.self = Tensor<T, cpu>(Shape{n});
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    std::vector<index_t> errors(static_cast<std::size_t>(n / len), -1);
    parallel_items(n / len, [&](index_t b) {
      const index_t s0 = b * len;
      choose_heads(c, b, len, s0);
      P.middleRows(s0, len).setZero();
      RowMatrix<T> Q, Ap;
      Eigen::Matrix<T, Eigen::Dynamic, 1> msq;
      for (index_t h = 0; h < nh; ++h) {
        if (!head_used(s0, len, h)) continue;
        head_msq(c, b, h, len, msq);
        const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len) * len, len, len);
        for (index_t i0 = 0; i0 < len; i0 += kBlock) {
          const index_t bi = std::min(kBlock, len - i0);
          if (!head_used(s0 + i0, bi, h)) continue;
          const index_t jn = block_cols(A, i0, bi);
          head_query(c, b, h, i0, bi, Q);
          logits(c, b, h, i0, bi, jn, Q, msq, Ap);
          for (index_t a = 0; a < bi; ++a) {
            if (st_.backend.heads[static_cast<std::size_t>(s0 + i0 + a)] != h) {
              Ap.row(a).setZero();
              continue;
            }
            if (!softmax_row(Ap.row(a), s0 + i0 + a, i0 + a)) {
              errors[static_cast<std::size_t>(b)] = i0 + a;
              return;
            }
            if (st_.stores) {
              as_matrix(st_.post).row(s0 + i0 + a).head(jn) = Ap.row(a);
              as_matrix(st_.post).row(s0 + i0 + a).tail(len - jn).setZero();
            }
          }
          P.middleRows(s0 + i0, bi).noalias() += Ap * R.middleRows(s0, jn);
        }
      }
    });
    for (index_t b = 0; b < n / len; ++b)
      if (errors[static_cast<std::size_t>(b)] >= 0)
        return {b * len + errors[static_cast<std::size_t>(b)], 0.0};
    return {};
  }

  void backward(const Tensor<T, cpu>& r, const Tensor<T, cpu>& p, const Tensor<T, cpu>& dp,
                AttentionCache<T, cpu>& c, Tensor<T, cpu>& dr) {
    const index_t n = r.rows(), len = args_.seq_len, nh = c.num_heads, nseq = n / len;
    const index_t dh = c.v.cols() / nh;
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    const T inv_var = static_cast<T>(1.0 / (args_.sigma * args_.sigma));
    const T fh = static_cast<T>(nh);
    const bool detach = args_.detach;
    const bool stores = st_.stores;
    constexpr T floor = attention_prior_floor<T>();
    // w_o and b_o are shared by the sequences: per-sequence partial gradients, summed after.
    std::vector<RowMatrix<T>> dwo(static_cast<std::size_t>(nseq));
    std::vector<Eigen::Matrix<T, 1, Eigen::Dynamic>> dbo(static_cast<std::size_t>(nseq));
    parallel_items(nseq, [&](index_t b) {
      const index_t s0 = b * len;
      const auto Rs = R.middleRows(s0, len);
      auto dRs = dR.middleRows(s0, len);
      dRs.setZero();
      auto Aout = as_matrix(c.out).middleRows(s0, len);
      auto& dW = dwo[static_cast<std::size_t>(b)];
      auto& dB = dbo[static_cast<std::size_t>(b)];
      if (!detach) {
        dW = RowMatrix<T>::Zero(c.w_o.rows(), c.w_o.cols());
        dB = Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(c.w_o.rows());
      }
      RowMatrix<T> Q, Ap, dL, dQ, dVh;
      Eigen::Matrix<T, Eigen::Dynamic, 1> msq, colsum, rowdot;
      for (index_t h = 0; h < nh; ++h) {
        if (!head_used(s0, len, h)) continue;
        if (!stores) head_msq(c, b, h, len, msq);
        if (!detach) {
          dVh = RowMatrix<T>::Zero(len, dh);
          colsum = Eigen::Matrix<T, Eigen::Dynamic, 1>::Zero(len);
        }
        const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len) * len, len, len);
        auto V = as_matrix(c.v).middleRows(s0, len).middleCols(h * dh, dh);  // (T, dh)
        auto Wo = as_matrix(c.w_o).middleCols(h * dh, dh);                   // (D, dh)
        for (index_t i0 = 0; i0 < len; i0 += kBlock) {
          const index_t bi = std::min(kBlock, len - i0);
          if (!head_used(s0 + i0, bi, h)) continue;
          const index_t jn = block_cols(A, i0, bi);
          if (!detach || !stores) head_query(c, b, h, i0, bi, Q);
          // this block's A^p rows of head h (the others 0): kept, or recomputed from lse
          if (stores) {
            Ap = as_matrix(st_.post).block(s0 + i0, 0, bi, jn);
          } else {
            logits(c, b, h, i0, bi, jn, Q, msq, Ap);
          }
          for (index_t a = 0; a < bi; ++a) {
            if (st_.backend.heads[static_cast<std::size_t>(s0 + i0 + a)] != h) {
              Ap.row(a).setZero();
            } else if (!stores) {  // the logits are -inf at or below the floor: exp gives 0
              detail::exp_shifted(Ap.row(a).data(), st_.backend.lse.data()[s0 + i0 + a], Ap.row(a).data(),
                                  jn);
            }
          }
          const auto dPb = dP.middleRows(s0 + i0, bi);
          dRs.topRows(jn).noalias() += Ap.transpose() * dPb;
          if (detach) continue;
          rowdot = (dPb.array() * P.middleRows(s0 + i0, bi).array()).rowwise().sum();
          dL.noalias() = dPb * Rs.topRows(jn).transpose();
          dL = Ap.array() * (dL.colwise() - rowdot).array();
          // into log A_h: dA = dL / A where A > attention_prior_floor (0 where forward used -inf)
          if (!c.dprobs.empty()) {
            MatrixMap<T> dA(c.dprobs.data() + ((b * nh + h) * len) * len, len, len);
            for (index_t a = 0; a < bi; ++a) {
              if (st_.backend.heads[static_cast<std::size_t>(s0 + i0 + a)] != h) continue;
              dA.row(i0 + a).head(jn).array() +=
                  (A.row(i0 + a).head(jn).array() > floor)
                      .select(dL.row(a).array() / A.row(i0 + a).head(jn).array(), T(0));
            }
          }
          colsum.head(jn) += dL.colwise().sum().transpose();
          // G = Q V^T: dQ = dL V, dV += dL^T Q; Q = H Aout W_o,h: into dout and dW_o,h
          dVh.topRows(jn).noalias() += dL.transpose() * Q;
          dQ.noalias() = (inv_var * fh) * dL * V.topRows(jn);
          if (!c.dout.empty())
            as_matrix(c.dout).middleRows(s0 + i0, bi).noalias() += dQ * Wo.transpose();
          dW.middleCols(h * dh, dh).noalias() += Aout.middleRows(i0, bi).transpose() * dQ;
        }
        if (detach) continue;
        // -|m_j|^2 / (2 sigma^2), weighted by colsum_j: m_j = H W_o,h v_j + b_o
        RowMatrix<T> Kh = Wo.transpose() * Wo;  // (dh, dh)
        RowMatrix<T> Y = fh * V * Kh;           // M W_o,h = H V K + 1 w^T
        Eigen::Matrix<T, 1, Eigen::Dynamic> wh;
        if (!c.b_o.empty()) {
          wh = as_vector(c.b_o).transpose() * Wo;
          Y.rowwise() += wh;
        }
        dVh -= fh * (Y.array().colwise() * colsum.array()).matrix();
        if (!c.dv.empty())
          as_matrix(c.dv).middleRows(s0, len).middleCols(h * dh, dh).noalias() += inv_var * dVh;
        // sum_j colsum_j m_j v_j^T = H W_o,h (V^T diag(colsum) V) + b_o (colsum^T V)
        const RowMatrix<T> Vc = V.transpose() * (V.array().colwise() * colsum.array()).matrix();
        const Eigen::Matrix<T, 1, Eigen::Dynamic> cv = colsum.transpose() * V;  // (dh)
        dW.middleCols(h * dh, dh).noalias() -= (inv_var * fh * fh) * Wo * Vc;
        dB.noalias() -= (inv_var * fh) * cv * Wo.transpose();
        if (!c.b_o.empty()) {
          dW.middleCols(h * dh, dh).noalias() -=
              (inv_var * fh) * as_vector(c.b_o) * cv;
          dB -= (inv_var * colsum.sum()) * as_vector(c.b_o).transpose();
        }
      }
    });
    if (detach) return;
    for (index_t b = 0; b < nseq; ++b) {
      if (!c.dw_o.empty()) as_matrix(c.dw_o) += dwo[static_cast<std::size_t>(b)];
      if (!c.db_o.empty()) as_vector(c.db_o) += dbo[static_cast<std::size_t>(b)].transpose();
    }
  }

 private:
  bool head_used(index_t s0, index_t len, index_t h) const {
    for (index_t i = 0; i < len; ++i)
      if (st_.backend.heads[static_cast<std::size_t>(s0 + i)] == h) return true;
    return false;
  }

  // 1 + the last column j with A[i, j] > attention_prior_floor over rows [i0, i0 + bi) of one
  // head's probabilities A (T, T), at least 1: A^p is 0 right of it (a causal layer's block ends
  // at column i0 + bi), so the block's products stop there. O(T) per row, against O(T D).
  index_t block_cols(const MatrixMap<T>& A, index_t i0, index_t bi) const {
    constexpr T floor = attention_prior_floor<T>();
    index_t jn = 1;
    for (index_t a = 0; a < bi; ++a) {
      const T* row = A.data() + (i0 + a) * A.cols();
      for (index_t j = A.cols() - 1; j >= jn; --j) {
        if (row[j] > floor) {
          jn = j + 1;
          break;
        }
      }
    }
    return jn;
  }

  // G = Q_blk V_h^T turned into the log-posterior logits of rows [i0, i0 + bi) of sequence b
  // under head h and its first jn columns (block_cols), in place: (bi, jn), -inf where
  // A <= attention_prior_floor:  log A + (q_i . v_j - |m_j|^2 / 2) / sigma^2, up to a constant
  // per row (a_i . b_o, |b_o|^2 / 2: the file comment)
  void logits(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t i0, index_t bi,
              index_t jn, const RowMatrix<T>& Q, const Eigen::Matrix<T, Eigen::Dynamic, 1>& msq,
              RowMatrix<T>& L) const {
    const index_t len = st_.seq_len, nh = c.num_heads, dh = c.v.cols() / nh;
    const T inv_var = static_cast<T>(1.0 / (args_.sigma * args_.sigma));
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    constexpr T floor = attention_prior_floor<T>();
    L.noalias() = Q * as_matrix(c.v).middleRows(b * len, jn).middleCols(h * dh, dh).transpose();
    const MatrixMap<T> A(c.probs.data() + ((b * nh + h) * len + i0) * len, bi, len);
    const auto msq_t = msq.head(jn).transpose().array();
    for (index_t a = 0; a < bi; ++a) {
      // Eigen's packet log over the whole row, then the entries at or below the floor masked
      // (a select around log would evaluate one scalar logf per entry)
      L.row(a).array() = A.row(a).head(jn).array().log() +
                         (L.row(a).array() - T(0.5) * msq_t) * inv_var;
      T* l = L.row(a).data();
      const T* pa = A.row(a).data();
      for (index_t j = 0; j < jn; ++j) l[j] = pa[j] > floor ? l[j] : kNegInf;
    }
  }

  // In place: logits -> A^p row of global token g at position i of its sequence; saves lse, the
  // row entropy and the self weight. False when every entry is -inf (an all-zero attention row).
  template <class Row>
  bool softmax_row(Row&& row, index_t g, index_t i) {
    constexpr T kNegInf = -std::numeric_limits<T>::infinity();
    const T mx = row.maxCoeff();
    if (!(mx > kNegInf)) return false;
    T* x = row.data();
    // e_j = exp(l_j - mx) (0 at -inf, detail::for_exp_blocks), their sum and sum_j e_j (l_j - mx)
    double sum = 0, dot = 0;
    detail::for_exp_blocks(x, mx, row.size(), [&](index_t j0, const T* e, index_t m) {
      sum += detail::accumulate_double(m, [e](index_t k) { return e[k]; });
      T d = 0;
      for (index_t k = 0; k < m; ++k) d += e[k] > T(0) ? e[k] * (x[j0 + k] - mx) : T(0);
      dot += static_cast<double>(d);
      std::copy(e, e + m, x + j0);
    });
    row *= static_cast<T>(1.0 / sum);
    st_.backend.lse.data()[g] = mx + static_cast<T>(std::log(sum));
    st_.self.data()[g] = i < row.size() ? row(i) : T(0);
    st_.row_entropy[static_cast<std::size_t>(g)] = std::log(sum) - dot / sum;
    return true;
  }

  // Q = H Aout W_o,h for rows [i0, i0 + bi) of sequence b: (bi, dh)
  void head_query(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t i0, index_t bi,
                  RowMatrix<T>& Q) const {
    const index_t nh = c.num_heads, dh = c.v.cols() / nh;
    Q.noalias() = static_cast<T>(nh) * as_matrix(c.out).middleRows(b * st_.seq_len + i0, bi) *
                  as_matrix(c.w_o).middleCols(h * dh, dh);
  }

  // |m_j|^2 - |b_o|^2 = H^2 v_j^T K v_j + 2 H v_j . w for sequence b under head h, (T):
  // K = W_o,h^T W_o,h, w = W_o,h^T b_o (|b_o|^2 is the same for every j and cancels)
  void head_msq(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t len,
                Eigen::Matrix<T, Eigen::Dynamic, 1>& msq) const {
    const index_t nh = c.num_heads, dh = c.v.cols() / nh;
    const T fh = static_cast<T>(nh);
    auto V = as_matrix(c.v).middleRows(b * len, len).middleCols(h * dh, dh);
    auto Wo = as_matrix(c.w_o).middleCols(h * dh, dh);
    const RowMatrix<T> K = Wo.transpose() * Wo;
    const RowMatrix<T> VK = V * K;
    msq = (fh * fh) * (VK.array() * V.array()).rowwise().sum();
    if (!c.b_o.empty()) {
      const Eigen::Matrix<T, Eigen::Dynamic, 1> w = Wo.transpose() * as_vector(c.b_o);
      msq.noalias() += (T(2) * fh) * (V * w);
    }
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
    if (!args_.causal_heads) {
      for (index_t h = 0; h < nh; ++h)
        for (index_t i = 0; i < len; ++i)
          prefix[static_cast<std::size_t>(h)] += ent[static_cast<std::size_t>(h * len + i)];
      const int best = argmin_prefix(len - 1);
      for (index_t i = 0; i < len; ++i) st_.backend.heads[static_cast<std::size_t>(s0 + i)] = best;
    } else {
      for (index_t i = 0; i < len; ++i) {
        for (index_t h = 0; h < nh; ++h)
          prefix[static_cast<std::size_t>(h)] += ent[static_cast<std::size_t>(h * len + i)];
        st_.backend.heads[static_cast<std::size_t>(s0 + i)] = argmin_prefix(i);
      }
    }
  }

  const AttentionGraphArgs& args_;
  AttentionGraphState<T, cpu>& st_;
};

}  // namespace detail

// ---- the backend entry points (ops/token_graph.hpp checks the arguments and prepares p / dr) ----

// Similarity forward: p (N, E) prepared; state.tau set. Fills every field of the state.
template <class T>
void similarity_graph_forward(cpu, const Tensor<T, cpu>& u, const Tensor<T, cpu>& r,
                              const SimilarityGraphArgs& args,
                              const SimilarityGraphParams<T, cpu>& params,
                              SimilarityGraphState<T, cpu>& state, Tensor<T, cpu>& p) {
  detail::SimilarityGraphCpu<T>(args, state).forward(u, r, params.w_s, p);
}

// Similarity backward: dr (N, E) assigned; du, dlog_tau and dW_s accumulated unless detached.
template <class T>
void similarity_graph_backward(cpu, const Tensor<T, cpu>& u, const Tensor<T, cpu>& r,
                               const Tensor<T, cpu>& p, const Tensor<T, cpu>& dp,
                               const SimilarityGraphArgs& args, SimilarityGraphParams<T, cpu>& params,
                               SimilarityGraphState<T, cpu>& state, Tensor<T, cpu>& dr,
                               Tensor<T, cpu>& du) {
  detail::SimilarityGraphCpu<T>(args, state).backward(u, r, p, dp, params, dr, du);
}

// log_tau = log(tau) and W_s = I, for the parameters that are not empty.
template <class T>
void similarity_graph_init(cpu, SimilarityGraphParams<T, cpu>& params, double tau) {
  if (!params.log_tau.empty()) params.log_tau.data()[0] = static_cast<T>(std::log(tau));
  if (!params.w_s.empty()) as_matrix(params.w_s).setIdentity();
}

// The mean row entropy of the last forward (in T, then widened).
template <class T>
double similarity_graph_mean_entropy(cpu, const SimilarityGraphState<T, cpu>& state) {
  return state.entropy.empty() ? 0.0 : static_cast<double>(as_vector(state.entropy).mean());
}

// Attention forward: p (N, E) prepared; the cache checked. Returns the first all-zero attention
// row of the tokens' heads (index b * len + i), if any.
template <class T>
Offender attention_graph_forward(cpu, const Tensor<T, cpu>& r, const AttentionCache<T, cpu>& cache,
                                 const AttentionGraphArgs& args,
                                 AttentionGraphState<T, cpu>& state, Tensor<T, cpu>& p) {
  return detail::AttentionGraphCpu<T>(args, state).forward(r, cache, p);
}

// Attention backward: dr (N, E) assigned; the cache's gradients accumulated unless detached.
template <class T>
void attention_graph_backward(cpu, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                              const Tensor<T, cpu>& dp, AttentionCache<T, cpu>& cache,
                              const AttentionGraphArgs& args, AttentionGraphState<T, cpu>& state,
                              Tensor<T, cpu>& dr) {
  detail::AttentionGraphCpu<T>(args, state).backward(r, p, dp, cache, dr);
}

// h* of every token of the last forward.
template <class T>
std::vector<int> attention_graph_heads(cpu, const AttentionGraphState<T, cpu>& state) {
  return state.backend.heads;
}

// The mean row entropy of the last forward (in double).
template <class T>
double attention_graph_mean_entropy(cpu, const AttentionGraphState<T, cpu>& state) {
  if (state.row_entropy.empty()) return 0.0;
  double s = 0;
  for (double e : state.row_entropy) s += e;
  return s / static_cast<double>(state.row_entropy.size());
}

// The mean of the self weights S[i,i] (or A^p[i,i]) of the last forward, in double.
template <class T>
double token_graph_mean_self_weight(cpu, const Tensor<T, cpu>& self) {
  return static_cast<double>(as_vector(self).template cast<double>().mean());
}

// ---- Blended: element-wise, the weight clamped to [0, 1], the sum of da in double in index order --
template <class T>
void graph_blend(cpu, const Tensor<T, cpu>& r, const Tensor<T, cpu>& q, const Tensor<T, cpu>& a,
                 Tensor<T, cpu>& p) {
  const T w = std::clamp(a.data()[0], T(0), T(1));
  const T* rv = r.data();
  const T* qv = q.data();
  T* pv = p.data();
  for (index_t i = 0; i < r.numel(); ++i) pv[i] = rv[i] + w * (qv[i] - rv[i]);
}

template <class T>
void graph_blend_backward(cpu, const Tensor<T, cpu>& r, const Tensor<T, cpu>& q,
                          const Tensor<T, cpu>& a, const Tensor<T, cpu>& dp, Tensor<T, cpu>& dq,
                          const Tensor<T, cpu>& da) {
  const T raw = a.data()[0];
  const T w = std::clamp(raw, T(0), T(1));
  double s = 0;
  for (index_t i = 0; i < r.numel(); ++i) {
    dq.data()[i] = w * dp.data()[i];
    s += static_cast<double>(dp.data()[i]) *
         (static_cast<double>(q.data()[i]) - static_cast<double>(r.data()[i]));
  }
  if ((raw <= T(0) && s > 0) || (raw >= T(1) && s < 0)) s = 0;  // a step would leave [0, 1]
  da.data()[0] = static_cast<T>(static_cast<double>(da.data()[0]) + s);
}

template <class T>
void graph_blend_residual(cpu, const Tensor<T, cpu>& a, const Tensor<T, cpu>& dp,
                          const Tensor<T, cpu>& dr) {
  const T c = T(1) - std::clamp(a.data()[0], T(0), T(1));
  for (index_t i = 0; i < dp.numel(); ++i) dr.data()[i] += c * dp.data()[i];
}

// This header's float and double instances, for graphmoe/backend/cpu/instances.hpp (M(, T): their
// explicit instantiation; extern before them with GRAPHMOE_EXTERN_CPU_KERNELS).
#define GRAPHMOE_CPU_TOKEN_GRAPH_INSTANCES(EXTERN, T) \
  EXTERN template void similarity_graph_forward<T>(                                               \
      cpu, const Tensor<T, cpu>&, const Tensor<T, cpu>&, const SimilarityGraphArgs&,              \
      const SimilarityGraphParams<T, cpu>&, SimilarityGraphState<T, cpu>&, Tensor<T, cpu>&);      \
  EXTERN template void similarity_graph_backward<T>(                                              \
      cpu, const Tensor<T, cpu>&, const Tensor<T, cpu>&, const Tensor<T, cpu>&,                   \
      const Tensor<T, cpu>&, const SimilarityGraphArgs&, SimilarityGraphParams<T, cpu>&,          \
      SimilarityGraphState<T, cpu>&, Tensor<T, cpu>&, Tensor<T, cpu>&);                           \
  EXTERN template Offender attention_graph_forward<T>(                                            \
      cpu, const Tensor<T, cpu>&, const AttentionCache<T, cpu>&, const AttentionGraphArgs&,       \
      AttentionGraphState<T, cpu>&, Tensor<T, cpu>&);                                             \
  EXTERN template void attention_graph_backward<T>(                                               \
      cpu, const Tensor<T, cpu>&, const Tensor<T, cpu>&, const Tensor<T, cpu>&,                   \
      AttentionCache<T, cpu>&, const AttentionGraphArgs&, AttentionGraphState<T, cpu>&,           \
      Tensor<T, cpu>&);
GRAPHMOE_CPU_EXTERN_INSTANCES(GRAPHMOE_CPU_TOKEN_GRAPH_INSTANCES)

}  // namespace graphmoe
