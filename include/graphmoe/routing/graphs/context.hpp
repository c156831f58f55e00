// graphmoe/routing/graphs/context.hpp: what every token graph shares: GraphContext (the
// per-call context the router hands a graph). The input check of the built-in graphs
// (detail::check_graph_inputs) is in ops/token_graph.hpp.
//
// The member contract of a token graph is in routing/token_graphs.hpp; one header per built-in
// graph sits beside this one (independent.hpp, similarity.hpp, attention.hpp).
#pragma once

#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/decode.hpp"

namespace graphmoe {

template <class T, class B = cpu>
struct GraphContext {
  index_t seq_len = 0;                          // tokens per sequence
  AttentionCache<T, B>* attention = nullptr;    // required by the Attention graph
};

// The sizes a graph's routing cache is allocated for (decode_init): `slots` sequences of at most
// max_len tokens, in a model of width d_model with num_experts experts and num_heads attention
// heads.
struct GraphDecodeDims {
  index_t slots = 0, max_len = 0, d_model = 0, num_experts = 0, num_heads = 0;
};

// What the router hands a graph in a decode step (the incremental form, routing/concepts.hpp):
// the step's rows (slot and position of each), the same block's attention step (for a graph that
// reads the attention layer), and optionally where to write each row's graph weights over its
// slot's positions (n, max_len) (`generate --explain`).
template <class T, class B = cpu>
struct GraphDecodeContext {
  const DecodeRows* rows = nullptr;
  const AttentionStep<T, B>* attention = nullptr;
  Tensor<T, B>* weights = nullptr;
};

}  // namespace graphmoe
