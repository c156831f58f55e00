// graphmoe/routing/graphs/attention.hpp: the Attention token graph on the CPU,
// GraphImpl<Attention, T, cpu>, and the check of the attention layer's cache it reads
// (detail::check_attention_cache, shared with the CUDA graph of graphs/attention_cuda.cuh).
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/routing/attention_cache.hpp"
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
template <class T>
class GraphImpl<Attention, T, cpu> {
 public:
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
    if (post_.empty() || post_.shape() != Shape{n, len}) post_ = Tensor<T, cpu>(Shape{n, len});
    seq_len_ = len;
    head_.assign(static_cast<std::size_t>(n), 0);
    row_entropy_.assign(static_cast<std::size_t>(n), 0.0);
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));
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
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));
    const T fh = static_cast<T>(nh);
    // w_o and b_o are shared by the sequences: per-sequence partial gradients, summed after.
    std::vector<RowMatrix<T>> dwo(static_cast<std::size_t>(nseq));
    std::vector<Eigen::Matrix<T, 1, Eigen::Dynamic>> dbo(static_cast<std::size_t>(nseq));
    parallel_items(nseq, [&](index_t b) {
      const index_t s0 = b * len;
      const auto Aps = Ap.middleRows(s0, len);
      const auto dPs = dP.middleRows(s0, len);
      dR.middleRows(s0, len).noalias() = Aps.transpose() * dPs;
      if (opts_.detach) return;
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
  Tensor<T, cpu> post_;
  std::vector<int> head_;
  std::vector<double> row_entropy_;
};

}  // namespace graphmoe
