// graphmoe/routing/graphs/independent.hpp: the Independent token graph, G = I (p = r): the
// graph of the plain softmax, X-MoE and SMoE-Dropout routers. One implementation for every
// backend.
#pragma once

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/token_graph.hpp"  // detail::check_graph_inputs
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

// p = r. An empty output shares r's storage (no copy: the router's p and r are then one tensor,
// as is the backward's dr with dp); a given output receives a copy.
template <class T, class B>
class GraphImpl<Independent, T, B> {
 public:
  void configure(index_t, const RouterConfig&) {}
  void forward(const Tensor<T, B>& u, const Tensor<T, B>& r, const GraphContext<T, B>& ctx,
               Tensor<T, B>& p) {
    detail::check_graph_inputs("Independent", u, r, ctx.seq_len);
    share_or_copy("p", r, p);
  }
  void backward(const Tensor<T, B>&, const Tensor<T, B>& r, const Tensor<T, B>&,
                const Tensor<T, B>& dp, const GraphContext<T, B>&, Tensor<T, B>& dr,
                Tensor<T, B>&) {
    check_shape("Independent::backward", "dp", dp, r.shape());
    share_or_copy("dr", dp, dr);
  }
  // The incremental form: p = r needs nothing from earlier tokens.
  struct decode_cache {
    index_t values_per_token() const { return 0; }
  };
  void decode_init(decode_cache&, const GraphDecodeDims&) const {}
  void decode(const Tensor<T, B>&, const Tensor<T, B>& r, const GraphDecodeContext<T, B>& ctx,
              decode_cache&, Tensor<T, B>& p) {
    share_or_copy("p", r, p);
    if (ctx.weights != nullptr) *ctx.weights = Tensor<T, B>();  // no graph weights to show
  }
  double mean_entropy() const { return 0.0; }
  double mean_self_weight() const { return 1.0; }  // G = I

 private:
  static void share_or_copy(const char* what, const Tensor<T, B>& src, Tensor<T, B>& dst) {
    if (dst.empty()) {
      dst = src;
      return;
    }
    prepare_output("Independent", what, dst, src.shape());
    dst.copy_from(src);
  }
};

}  // namespace graphmoe
