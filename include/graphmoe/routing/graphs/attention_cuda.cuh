// graphmoe/routing/graphs/attention_cuda.cuh: the Attention token graph on the GPU,
// GraphImpl<Attention, T, cuda> (the contract and its differences from the CPU graph of
// graphs/attention.hpp: routing/token_graphs_cuda.cuh).
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
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/routing/graphs/common_cuda.cuh"
#include "graphmoe/routing/graphs/attention.hpp"  // detail::check_attention_cache
#include "graphmoe/routing/graphs/context.hpp"

namespace graphmoe {

// p_i = sum_j A^p[i,j] r_j with the attention posterior of Lemma 1 for head h*, as the CPU
// GraphImpl<Attention> (graphs/attention.hpp, docs/routers.md): h* from the attention-row entropies
// (the cache's row_entropy, or computed from probs), then for every head in use the means
// M_h = H V_h W_o,h^T + b_o, the logits log A + (a_i . m_j - |m_j|^2 / 2) / sigma^2 of the tokens
// with that head, their softmax (stored, (N, T)) and p = A^p r.
template <class T>
class GraphImpl<Attention, T, cuda> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Attention>();
    validate_options(opts_);
    head_choice_ = opts_.head_choice_for(cfg.causal);
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
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));

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
        head_choice_ == HeadChoice::PerSequenceCausal, prefix.data(), head_dev_.data());
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
    if (opts_.detach) return;
    const T inv_var = static_cast<T>(1.0 / (opts_.sigma * opts_.sigma));
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

  Attention::Options opts_;
  HeadChoice head_choice_ = HeadChoice::PerSequence;
  index_t d_model_ = 0;
  Tensor<T, cuda> post_, row_entropy_;
  Tensor<std::int32_t, cuda> head_dev_;
  std::vector<int> head_;
};

}  // namespace graphmoe
