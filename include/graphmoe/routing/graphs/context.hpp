// graphmoe/routing/graphs/context.hpp: what every token graph shares: GraphContext (the
// per-call context the router hands a graph). The input check of the built-in graphs
// (detail::check_graph_inputs) is in ops/token_graph.hpp.
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

}  // namespace graphmoe
