// graphmoe/routing/graphs/similarity_cuda.cuh: the Similarity token graph on the GPU,
// GraphImpl<Similarity, T, cuda> (the contract and its differences from the CPU graph of
// graphs/similarity.hpp: routing/token_graphs_cuda.cuh).
#pragma once

#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/routing/graphs/common_cuda.cuh"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/graphs/similarity.hpp"  // detail::similarity_tau

namespace graphmoe {

// p_i = sum_j S[i,j] r_j,  S = softmax_j(u_i . u_j / tau) within each sequence (j <= i if causal),
// by the fused kernels of backend/cuda/token_graph.cuh: S is never stored (see the file comment).
template <class T>
class GraphImpl<Similarity, T, cuda> {
 public:
  void configure(index_t d_model, const RouterConfig& cfg) {
    opts_ = cfg.options<Similarity>();
    validate_options(opts_);
    GRAPHMOE_CHECK(opts_.tau_mode != TauMode::Learned && !opts_.exclude_self && !opts_.projection,
                   "Similarity",
                   "a learned temperature, Options::exclude_self and Options::projection are "
                   "implemented on the CPU backend only");
    causal_ = cfg.causal;
    tau_ = detail::similarity_tau(d_model, opts_);
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
                                    static_cast<T>(1.0 / tau_), causal_);
  }

  void backward(const Tensor<T, cuda>& u, const Tensor<T, cuda>& r, const Tensor<T, cuda>& p,
                const Tensor<T, cuda>& dp, const GraphContext<T, cuda>& ctx,
                Tensor<T, cuda>& dr, Tensor<T, cuda>& du) {
    const index_t n = u.rows();
    prepare_output("Similarity", "dr", dr, r.shape());
    const bool to_u = !opts_.detach;
    if (to_u) check_shape("Similarity::backward", "du", du, u.shape());
    GRAPHMOE_CHECK(lse_.shape() == Shape{n}, "Similarity::backward",
                   "no forward of these ", n, " tokens to take the gradient of");
    detail::similarity_backward_cuda(u, r, p, dp, lse_, dr, to_u ? du.data() : nullptr,
                                     ctx.seq_len, static_cast<T>(1.0 / tau_), causal_);
  }

  double mean_entropy() const { return detail::device_mean(entropy_); }
  const Tensor<T, cuda>& row_entropy() const { return entropy_; }

 private:
  Similarity::Options opts_;
  bool causal_ = false;
  double tau_ = 1.0;
  Tensor<T, cuda> lse_, entropy_;
};

}  // namespace graphmoe
