// graphmoe/routing/graphs/attention.hpp: the Attention token graph on the CPU,
// GraphImpl<Attention, T, cpu>, and the check of the attention layer's cache it reads
// (detail::check_attention_cache, shared with the CUDA graph of graphs/attention_cuda.cuh).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

namespace detail {
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

// p_i = sum_j A^p[i,j] r_j with the attention posterior of Lemma 1 for head h*:
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
// Attention::Options::memory: Store keeps A^p (N x T values) for backward; Recompute keeps each
// row's log-sum-exp and recomputes the block's A^p (one more Q V^T product); Auto stores while
// T <= kGraphStoreMaxLen. The graph's own memory is O(kBlock x T + T x dh) per thread besides
// A^p when stored; the cache's probs (B, H, T, T) belong to the attention layer.
template <class T>
class GraphImpl<Attention, T, cpu> {
 public:
  static constexpr index_t kBlock = 64;

  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Attention>();
    validate_options(opts_);
    head_choice_ = opts_.head_choice_for(cfg.causal);
    d_model_ = d_model;
  }

  void forward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const GraphContext<T, cpu>& ctx,
               Tensor<T, cpu>& p) {
    detail::check_graph_inputs("Attention", u, r, ctx.seq_len);
    const AttentionCache<T, cpu>& c = check_cache(ctx, u.rows());
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads;
    prepare_output("Attention", "p", p, r.shape());
    stores_ = graph_stores(opts_.memory, len);
    if (stores_ && (post_.empty() || post_.shape() != Shape{n, len})) post_ = Tensor<T, cpu>(Shape{n, len});
    if (!stores_) post_ = Tensor<T, cpu>();
    seq_len_ = len;
    head_.assign(static_cast<std::size_t>(n), 0);
    row_entropy_.assign(static_cast<std::size_t>(n), 0.0);
    lse_ = Tensor<T, cpu>(Shape{n});
    self_ = Tensor<T, cpu>(Shape{n});
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    std::vector<std::string> errors(static_cast<std::size_t>(n / len));
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
            if (head_[static_cast<std::size_t>(s0 + i0 + a)] != h) {
              Ap.row(a).setZero();
              continue;
            }
            if (!softmax_row(Ap.row(a), s0 + i0 + a, i0 + a)) {
              errors[static_cast<std::size_t>(b)] = "attention row " + std::to_string(i0 + a) +
                                                    " of sequence " + std::to_string(b) +
                                                    " is all zero";
              return;
            }
            if (stores_) {
              as_matrix(post_).row(s0 + i0 + a).head(jn) = Ap.row(a);
              as_matrix(post_).row(s0 + i0 + a).tail(len - jn).setZero();
            }
          }
          P.middleRows(s0 + i0, bi).noalias() += Ap * R.middleRows(s0, jn);
        }
      }
    });
    for (const auto& e : errors) GRAPHMOE_CHECK(e.empty(), "Attention", e);
  }

  void backward(const Tensor<T, cpu>& u, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
                const Tensor<T, cpu>& dp, const GraphContext<T, cpu>& ctx, Tensor<T, cpu>& dr,
                Tensor<T, cpu>&) {
    detail::check_graph_inputs("Attention::backward", u, r, ctx.seq_len);
    AttentionCache<T, cpu>& c = *ctx.attention;
    check_cache(ctx, u.rows());
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads, nseq = n / len;
    GRAPHMOE_CHECK(lse_.numel() == n && seq_len_ == len &&
                       (!stores_ || post_.shape() == (Shape{n, len})),
                   "Attention::backward", "no forward of these ", n, " tokens in sequences of ",
                   len, " to take the gradient of");
    check_shape("Attention::backward", "p", p, r.shape());
    check_shape("Attention::backward", "dp", dp, r.shape());
    const index_t dh = c.v.cols() / nh;
    prepare_output("Attention", "dr", dr, r.shape());
    auto R = as_matrix(r);
    auto P = as_matrix(p);
    auto dP = as_matrix(dp);
    auto dR = as_matrix(dr);
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));
    const T fh = static_cast<T>(nh);
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
      if (!opts_.detach) {
        dW = RowMatrix<T>::Zero(c.w_o.rows(), c.w_o.cols());
        dB = Eigen::Matrix<T, 1, Eigen::Dynamic>::Zero(c.w_o.rows());
      }
      RowMatrix<T> Q, Ap, dL, dQ, dVh;
      Eigen::Matrix<T, Eigen::Dynamic, 1> msq, colsum, rowdot;
      for (index_t h = 0; h < nh; ++h) {
        if (!head_used(s0, len, h)) continue;
        if (!stores_) head_msq(c, b, h, len, msq);
        if (!opts_.detach) {
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
          if (!opts_.detach || !stores_) head_query(c, b, h, i0, bi, Q);
          // this block's A^p rows of head h (the others 0): kept, or recomputed from lse
          if (stores_) {
            Ap = as_matrix(post_).block(s0 + i0, 0, bi, jn);
          } else {
            logits(c, b, h, i0, bi, jn, Q, msq, Ap);
          }
          for (index_t a = 0; a < bi; ++a) {
            if (head_[static_cast<std::size_t>(s0 + i0 + a)] != h) {
              Ap.row(a).setZero();
            } else if (!stores_) {  // the logits are -inf at or below the floor: exp gives 0
              detail::exp_shifted(Ap.row(a).data(), lse_.data()[s0 + i0 + a], Ap.row(a).data(), jn);
            }
          }
          const auto dPb = dP.middleRows(s0 + i0, bi);
          dRs.topRows(jn).noalias() += Ap.transpose() * dPb;
          if (opts_.detach) continue;
          rowdot = (dPb.array() * P.middleRows(s0 + i0, bi).array()).rowwise().sum();
          dL.noalias() = dPb * Rs.topRows(jn).transpose();
          dL = Ap.array() * (dL.colwise() - rowdot).array();
          // into log A_h: dA = dL / A where A > attention_prior_floor (0 where forward used -inf)
          if (!c.dprobs.empty()) {
            MatrixMap<T> dA(c.dprobs.data() + ((b * nh + h) * len) * len, len, len);
            for (index_t a = 0; a < bi; ++a) {
              if (head_[static_cast<std::size_t>(s0 + i0 + a)] != h) continue;
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
        if (opts_.detach) continue;
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
    if (opts_.detach) return;
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
    return self_.empty() ? 1.0 : static_cast<double>(as_vector(self_).template cast<double>().mean());
  }
  // A^p[i,i] of every token in the last forward, (N).
  const Tensor<T, cpu>& self_weight() const { return self_; }
  // H(A^p[i,:]) of every token in the last forward.
  const std::vector<double>& row_entropy() const { return row_entropy_; }
  // h* of each token in the last forward.
  const std::vector<int>& heads() const { return head_; }
  // Whether the last forward kept A^p for backward (Options::memory, graph_stores).
  bool stores() const { return stores_; }
  // A^p of the last forward, (N, T): row i holds token i's posterior over its sequence. Kept only
  // when the forward stored it (empty before any forward).
  const Tensor<T, cpu>& posterior() const {
    GRAPHMOE_CHECK(stores_ || lse_.empty(), "Attention",
                   "posterior(): the last forward did not keep A^p (Options::memory is Recompute, "
                   "or Auto with sequences of ", seq_len_, " > kGraphStoreMaxLen = ",
                   kGraphStoreMaxLen, " tokens); set memory = GraphMemory::Store to read it");
    return post_;
  }

 private:
  const AttentionCache<T, cpu>& check_cache(const GraphContext<T, cpu>& ctx, index_t n) const {
    return detail::check_attention_cache(ctx, n, d_model_);
  }

  bool head_used(index_t s0, index_t len, index_t h) const {
    for (index_t i = 0; i < len; ++i)
      if (head_[static_cast<std::size_t>(s0 + i)] == h) return true;
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
  // per row (a_i . b_o, |b_o|^2 / 2: the class comment)
  void logits(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t i0, index_t bi,
              index_t jn, const RowMatrix<T>& Q, const Eigen::Matrix<T, Eigen::Dynamic, 1>& msq,
              RowMatrix<T>& L) const {
    const index_t len = seq_len_, nh = c.num_heads, dh = c.v.cols() / nh;
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));
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
    lse_.data()[g] = mx + static_cast<T>(std::log(sum));
    self_.data()[g] = i < row.size() ? row(i) : T(0);
    row_entropy_[static_cast<std::size_t>(g)] = std::log(sum) - dot / sum;
    return true;
  }

  // Q = H Aout W_o,h for rows [i0, i0 + bi) of sequence b: (bi, dh)
  void head_query(const AttentionCache<T, cpu>& c, index_t b, index_t h, index_t i0, index_t bi,
                  RowMatrix<T>& Q) const {
    const index_t nh = c.num_heads, dh = c.v.cols() / nh;
    Q.noalias() = static_cast<T>(nh) * as_matrix(c.out).middleRows(b * seq_len_ + i0, bi) *
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
    if (head_choice_ == HeadChoice::PerSequence) {
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

  Attention::Options opts_;
  HeadChoice head_choice_ = HeadChoice::PerSequence;
  index_t d_model_ = 0;
  index_t seq_len_ = 0;
  bool stores_ = false;  // the last forward's choice, which its backward follows
  Tensor<T, cpu> post_, lse_, self_;
  std::vector<int> head_;
  std::vector<double> row_entropy_;
};

}  // namespace graphmoe
