// graphmoe/routing/token_graphs_cuda.cuh: the token graphs on the GPU, GraphImpl<Policy, T, cuda>.
//
// Same members, contract, options and error messages as the CPU graphs (token_graphs.hpp):
//   configure(d_model, cfg)
//   forward(u, r, ctx, p)                       p assigned (N, E)
//   backward(u, r, p, dp, ctx, dr, du)          dr assigned, du accumulated (+=)
//   mean_entropy()                              mean row entropy of G in the last forward
// on Tensor<T, cuda> (T = float or double), with GraphContext<T, cuda> and AttentionCache<T, cuda>.
// The kernels are in backend/cuda/token_graph.cuh.
//
// Differences from the CPU graphs, none of them in the results beyond rounding:
//   - Similarity never stores S: the forward is one fused online-softmax kernel that keeps the
//     row log-sum-exp and entropy (O(N)), and the backward recomputes S tile by tile. So
//     RouterConfig::similarity_recompute is ignored: the GPU path always recomputes (it costs one
//     more U U^T product in backward, as similarity_recompute does on the CPU).
//   - row_entropy() (Similarity) and posterior() (Attention) are device tensors; heads() is a
//     host vector, copied back during forward (the forward synchronises the stream there, and
//     once more to read the all-zero-row flag, as the softmax op does).
//   - mean_entropy() reads the N row entropies back to the host (synchronises) and averages them
//     in double.
//   - Sums run in other orders (tiles, warp reductions, cuBLAS) and the float kernels use fused
//     multiply-adds: float results agree with the CPU to about 1e-6 relative.
#pragma once

#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include <cstdint>
#include <limits>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/routing/attention_cache.hpp"
#include "graphmoe/routing/token_graphs.hpp"

namespace graphmoe {

namespace detail {
// The mean of the n values of a device vector, in double (synchronises).
template <class T>
double device_mean(const Tensor<T, cuda>& x) {
  if (x.empty() || x.numel() == 0) return 0.0;
  const Tensor<T, cpu> h = to_host(x);
  double s = 0;
  for (index_t i = 0; i < h.numel(); ++i) s += static_cast<double>(h.data()[i]);
  return s / static_cast<double>(h.numel());
}
}  // namespace detail

// GraphImpl<Independent, T, B> (p = r) is the backend-generic one of token_graphs.hpp.

// p_i = sum_j S[i,j] r_j,  S = softmax_j(u_i . u_j / tau) within each sequence (j <= i if causal),
// by the fused kernels of backend/cuda/token_graph.cuh: S is never stored (see the file comment).
template <class T>
class GraphImpl<Similarity, T, cuda> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    GRAPHMOE_CHECK(cfg.tau_mode != TauMode::Learned && !cfg.similarity_exclude_self &&
                       !cfg.similarity_projection,
                   "Similarity",
                   "a learned temperature, similarity_exclude_self and similarity_projection are "
                   "implemented on the CPU backend only");
    cfg_ = cfg;
    tau_ = detail::similarity_tau(d_model, cfg);
  }
  double tau() const { return tau_; }

  void forward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
               const GraphContext<T, cuda>& ctx, Tensor<T, cuda>& p) {
    detail::check_graph_inputs("Similarity", u, r, ctx.seq_len);
    const index_t n = u.rows();
    prepare_output("Similarity", "p", p, r.shape());
    if (lse_.empty() || lse_.shape() != Shape{n}) lse_ = Tensor<T, cuda>(Shape{n});
    entropy_ = Tensor<T, cuda>(Shape{n});
    detail::similarity_forward_cuda(u, r, p, lse_, entropy_, ctx.seq_len,
                                    static_cast<T>(1.0 / tau_), cfg_.causal);
  }

  void backward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                const Tensor<T, cuda>& dp, const GraphContext<T, cuda>& ctx,
                Tensor<T, cuda>& dr, Tensor<T, cuda>& du) {
    const index_t n = u.rows();
    prepare_output("Similarity", "dr", dr, r.shape());
    const bool to_u = !cfg_.detach_graph;
    if (to_u) check_shape("Similarity::backward", "du", du, u.shape());
    GRAPHMOE_CHECK(lse_.shape() == Shape{n}, "Similarity::backward",
                   "no forward of these ", n, " tokens to take the gradient of");
    detail::similarity_backward_cuda(u, r, p, dp, lse_, dr, to_u ? du.data() : nullptr,
                                     ctx.seq_len, static_cast<T>(1.0 / tau_), cfg_.causal);
  }

  double mean_entropy() const { return detail::device_mean(entropy_); }
  const Tensor<T, cuda>& row_entropy() const { return entropy_; }

 private:
  RouterConfig cfg_;
  double tau_ = 1.0;
  Tensor<T, cuda> lse_, entropy_;
};

// p_i = sum_j A^p[i,j] r_j with the attention posterior of Lemma 1 for head h*, as the CPU
// GraphImpl<Attention> (token_graphs.hpp, docs/routers.md): h* from the attention-row entropies
// (the cache's row_entropy, or computed from probs), then for every head in use the means
// M_h = H V_h W_o,h^T + b_o, the logits log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2 of the tokens
// with that head, their softmax (stored, (N, T)) and p = A^p r.
template <class T>
class GraphImpl<Attention, T, cuda> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    cfg_ = cfg;
    d_model_ = d_model;
  }

  void forward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r,
               const GraphContext<T, cuda>& ctx, Tensor<T, cuda>& p) {
    detail::check_graph_inputs("Attention", u, r, ctx.seq_len);
    const AttentionCache<T, cuda>& c = check_cache(ctx, u.rows());
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads, nb = n / len, e = r.cols();
    const index_t dm = d_model_;
    prepare_output("Attention", "p", p, r.shape());
    if (post_.empty() || post_.shape() != Shape{n, len}) post_ = Tensor<T, cuda>(Shape{n, len});
    row_entropy_ = Tensor<T, cuda>(Shape{n});
    head_dev_ = Tensor<std::int32_t, cuda>(Shape{n});
    head_.assign(static_cast<std::size_t>(n), 0);
    if (n == 0) return;
    const T inv_var = static_cast<T>(1.0 / (cfg_.attention_sigma * cfg_.attention_sigma));

    // h* per token
    Tensor<T, cuda> ent = c.row_entropy;
    if (ent.empty()) {
      ent = Tensor<T, cuda>(Shape{nb, nh, len});
      detail::launch_kernel<detail::attention_row_entropy_kernel<T>>(
          detail::graph_warp_rows_blocks(nb * nh * len), detail::kThreads, c.probs.data(),
          ent.data(), nb * nh * len, len);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
    }
    Tensor<double, cuda> prefix(Shape{nb, nh});
    detail::launch_kernel<detail::attention_choose_heads_kernel<T>>(
        detail::grid_for(nb), detail::kThreads, ent.data(), nb, nh, len,
        cfg_.head_choice == HeadChoice::PerSequenceCausal, prefix.data(), head_dev_.data());
    GRAPHMOE_CUDA_CHECK_LAUNCH();
    const Tensor<std::int32_t, cpu> heads_host = to_host(head_dev_);
    head_.assign(heads_host.data(), heads_host.data() + n);

    // the posterior rows, one head at a time
    detail::FirstIndexFlag bad;
    Tensor<T, cuda> m(Shape{n, dm}), msq(Shape{n}), g(Shape{n, len});
    for (index_t h = 0; h < nh; ++h) {
      if (!head_used(h)) continue;
      head_mean(c, h, m, msq);
      // g = a m^T per sequence (T, T)
      detail::graph_gemm(Trans::N, Trans::T, len, len, dm, T(1), c.out.data(), dm, len * dm,
                         m.data(), dm, len * dm, T(0), g.data(), len, len * len, nb);
      detail::launch_kernel<detail::attention_posterior_rows_kernel<T>>(
          detail::grid_for_rows(n), detail::threads_for_row(len), c.probs.data(), g.data(),
          msq.data(), head_dev_.data(), post_.data(), row_entropy_.data(), bad.get(), n, nh, len,
          static_cast<std::int32_t>(h), inv_var);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
    }
    const index_t first_bad = bad.read();
    if (first_bad >= 0) {
      const index_t b = first_bad / (nh * len), i = first_bad % len;
      GRAPHMOE_CHECK(false, "Attention", "attention row ", i, " of sequence ", b, " is all zero");
    }
    // p = A^p r per sequence
    detail::graph_gemm(Trans::N, Trans::N, len, e, len, T(1), post_.data(), len, len * len,
                       r.data(), e, len * e, T(0), p.data(), e, len * e, nb);
  }

  void backward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                const Tensor<T, cuda>& dp, const GraphContext<T, cuda>& ctx,
                Tensor<T, cuda>& dr, Tensor<T, cuda>&) {
    check_cache(ctx, u.rows());
    AttentionCache<T, cuda>& c = *ctx.attention;
    const index_t n = u.rows(), len = ctx.seq_len, nh = c.num_heads, nb = n / len, e = r.cols();
    const index_t dm = d_model_, dvc = c.v.cols(), dh = dvc / nh;
    prepare_output("Attention", "dr", dr, r.shape());
    GRAPHMOE_CHECK(post_.shape() == (Shape{n, len}), "Attention::backward",
                   "no forward of these ", n, " tokens to take the gradient of");
    if (n == 0) return;
    // dr = A^p^T dp per sequence
    detail::graph_gemm(Trans::T, Trans::N, len, e, len, T(1), post_.data(), len, len * len,
                       dp.data(), e, len * e, T(0), dr.data(), e, len * e, nb);
    if (cfg_.detach_graph) return;
    const T inv_var = static_cast<T>(1.0 / (cfg_.attention_sigma * cfg_.attention_sigma));
    const T fh = static_cast<T>(nh);
    const index_t nt = n * len;

    // dl = A^p o (dp r^T - rowdot(dp, p))   (N, T)
    Tensor<T, cuda> rowdot(Shape{n}), dl(Shape{n, len});
    detail::graph_row_dot_cuda(dp, p, rowdot);
    detail::graph_gemm(Trans::N, Trans::T, len, len, e, T(1), dp.data(), e, len * e, r.data(), e,
                       len * e, T(0), dl.data(), len, len * len, nb);
    detail::launch_kernel<detail::attention_dlogit_kernel<T>>(
        detail::grid_for(nt), detail::kThreads, post_.data(), rowdot.data(), dl.data(), n, len);
    GRAPHMOE_CUDA_CHECK_LAUNCH();

    Tensor<T, cuda> dlh(Shape{n, len}), m(Shape{n, dm}), msq(Shape{n}), colsum(Shape{n}),
        dmean(Shape{n, dm});
    for (index_t h = 0; h < nh; ++h) {
      if (!head_used(h)) continue;
      const auto hh = static_cast<std::int32_t>(h);
      detail::launch_kernel<detail::attention_head_rows_kernel<T>>(
          detail::grid_for(nt), detail::kThreads, dl.data(), head_dev_.data(), dlh.data(), n, len,
          hh);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
      // into log A_h: dA += dl / A where A > 0
      if (!c.dprobs.empty()) {
        detail::launch_kernel<detail::attention_dprobs_kernel<T>>(
            detail::grid_for(nt), detail::kThreads, dl.data(), c.probs.data(), head_dev_.data(),
            c.dprobs.data(), n, nh, len, hh);
        GRAPHMOE_CUDA_CHECK_LAUNCH();
      }
      head_mean(c, h, m, msq);
      // da += dl_h M / sigma^2
      if (!c.dout.empty())
        detail::graph_gemm(Trans::N, Trans::N, len, dm, len, inv_var, dlh.data(), len, len * len,
                           m.data(), dm, len * dm, T(1), c.dout.data(), dm, len * dm, nb);
      // dM = (dl_h^T a - M o colsum(dl_h)) / sigma^2
      detail::launch_kernel<detail::attention_column_sum_kernel<T>>(
          detail::grid_for(n), detail::kThreads, dlh.data(), colsum.data(), n, len);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
      detail::graph_gemm(Trans::T, Trans::N, len, dm, len, inv_var, dlh.data(), len, len * len,
                         c.out.data(), dm, len * dm, T(0), dmean.data(), dm, len * dm, nb);
      detail::launch_kernel<detail::attention_dmean_kernel<T>>(
          detail::grid_for(n * dm), detail::kThreads, m.data(), colsum.data(), dmean.data(), n, dm,
          inv_var);
      GRAPHMOE_CUDA_CHECK_LAUNCH();
      // m = H v_h W_o,h^T + b_o: dv_h += H dM W_o,h, dW_o,h += H dM^T v_h, db_o += sum_j dM_j
      if (!c.dv.empty())
        detail::graph_gemm(Trans::N, Trans::N, n, dh, dm, fh, dmean.data(), dm, 0,
                           c.w_o.data() + h * dh, dvc, 0, T(1), c.dv.data() + h * dh, dvc, 0, 1);
      if (!c.dw_o.empty())
        detail::graph_gemm(Trans::T, Trans::N, dm, dh, n, fh, dmean.data(), dm, 0,
                           c.v.data() + h * dh, dvc, 0, T(1), c.dw_o.data() + h * dh, dvc, 0, 1);
      if (!c.db_o.empty()) {
        detail::launch_kernel<detail::graph_column_sum_add_kernel<T>>(
            detail::grid_for(dm), detail::kThreads, dmean.data(), c.db_o.data(), n, dm);
        GRAPHMOE_CUDA_CHECK_LAUNCH();
      }
    }
  }

  double mean_entropy() const { return detail::device_mean(row_entropy_); }
  // h* of each token in the last forward (host copy).
  const std::vector<int>& heads() const { return head_; }
  // A^p of the last forward, (N, T): row i holds token i's posterior over its sequence.
  const Tensor<T, cuda>& posterior() const { return post_; }

 private:
  const AttentionCache<T, cuda>& check_cache(const GraphContext<T, cuda>& ctx, index_t n) const {
    return detail::check_attention_cache(ctx, n, d_model_);
  }

  bool head_used(index_t h) const {
    for (int x : head_)
      if (x == h) return true;
    return false;
  }

  // m = H v_h W_o,h^T + b_o for all N tokens (N, D), msq = |m_j|^2 (N).
  void head_mean(const AttentionCache<T, cuda>& c, index_t h, Tensor<T, cuda>& m,
                 Tensor<T, cuda>& msq) const {
    const index_t n = c.v.rows(), dvc = c.v.cols(), dh = dvc / c.num_heads, dm = d_model_;
    detail::graph_gemm(Trans::N, Trans::T, n, dm, dh, static_cast<T>(c.num_heads),
                       c.v.data() + h * dh, dvc, 0, c.w_o.data() + h * dh, dvc, 0, T(0), m.data(),
                       dm, 0, 1);
    detail::launch_kernel<detail::attention_mean_finish_kernel<T>>(
        detail::graph_warp_rows_blocks(n), detail::kThreads, m.data(),
        c.b_o.empty() ? nullptr : c.b_o.data(), msq.data(), n, dm);
    GRAPHMOE_CUDA_CHECK_LAUNCH();
  }

  RouterConfig cfg_;
  index_t d_model_ = 0;
  Tensor<T, cuda> post_, row_entropy_;
  Tensor<std::int32_t, cuda> head_dev_;
  std::vector<int> head_;
};

}  // namespace graphmoe
