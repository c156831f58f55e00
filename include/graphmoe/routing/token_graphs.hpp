// graphmoe/routing/token_graphs.hpp: token-graph implementations, p = G r within each sequence.
//
// Every token graph has the same members:
//   configure(d_model, cfg)                     (or declare(arena, prefix, d_model, cfg), bind(arena)
//                                               and init(rng) for a graph with parameters: the
//                                               Similarity graph's learned temperature)
//   forward(u, r, ctx, p)                       p assigned (N, E)
//   backward(u, r, p, dp, ctx, dr, du)          dr assigned, du accumulated (+=)
//   mean_entropy()                              mean row entropy of G in the last forward
// Tokens are rows of u (N, D); consecutive blocks of ctx.seq_len rows are one sequence.
//
// This header includes every built-in graph; each also has its own header, which compiles alone:
//   routing/graphs/context.hpp      GraphContext (what the router passes a graph)
//   routing/graphs/independent.hpp  Independent: G = I (every backend)
//   routing/graphs/similarity.hpp   Similarity: S = softmax(U U^T / tau) (every backend)
//   routing/graphs/attention.hpp    Attention: the attention posterior of Lemma 1 (every backend)
// Similarity and Attention compute through the op layer (ops/token_graph.hpp): the CPU system is
// always there (backend/cpu/token_graph.hpp); a CUDA translation unit gets the GPU one
// (backend/cuda/token_graph.cuh) from graphmoe/cuda.cuh. What each backend keeps of a forward
// (S, self weights, row entropies) is said in the graphs' headers.
#pragma once

#include "graphmoe/routing/graphs/attention.hpp"
#include "graphmoe/routing/graphs/context.hpp"
#include "graphmoe/routing/graphs/independent.hpp"
#include "graphmoe/routing/graphs/similarity.hpp"
