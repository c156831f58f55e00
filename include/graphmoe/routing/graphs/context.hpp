// graphmoe/routing/graphs/context.hpp: what every token graph shares: GraphContext (the
// per-call context the router hands a graph) and the input check of the built-in graphs.
//
// The member contract of a token graph is in routing/token_graphs.hpp; one header per built-in
// graph sits beside this one (independent.hpp, similarity.hpp, attention.hpp).
#pragma once

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/attention_cache.hpp"

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
}  // namespace detail

}  // namespace graphmoe
