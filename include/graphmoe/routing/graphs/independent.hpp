// graphmoe/routing/graphs/independent.hpp: the Independent token graph, G = I (p = r): the
// graph of the plain softmax, X-MoE and SMoE-Dropout routers. One implementation for every
// backend.
#pragma once

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/token_graph.hpp"  // detail::check_graph_inputs
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/policies.hpp"

namespace graphmoe {

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
  // The incremental form: p = r needs nothing from earlier tokens.
  struct decode_cache {
    index_t values_per_token() const { return 0; }
  };
  void decode_init(decode_cache&, const GraphDecodeDims&) const {}
  void decode(const Tensor<T, B>&, const Tensor<T, B>& r, const GraphDecodeContext<T, B>& ctx,
              decode_cache&, Tensor<T, B>& p) {
    prepare_output("Independent", "p", p, r.shape());
    p.copy_from(r);
    if (ctx.weights != nullptr) *ctx.weights = Tensor<T, B>();  // no graph weights to show
  }
  double mean_entropy() const { return 0.0; }
  double mean_self_weight() const { return 1.0; }  // G = I
};

}  // namespace graphmoe
