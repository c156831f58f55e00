// tests/support/router_options.hpp: set an option that several built-in policies have, for tests
// that run one body over many routers (a router reads only its own policies' options, so each
// helper sets RouterConfig::allow_unused_options: the options of the other policy are unused).
#pragma once

#include "graphmoe/routing/policies.hpp"

namespace graphmoe::test {

// W ~ N(0, s^2) for the linear, sigmoid and frozen-random scorers (the cosine scorer has its own init).
inline void set_scorer_init_std(RouterConfig& cfg, double s) {
  cfg.allow_unused_options = true;
  cfg.options<LinearScorer>().init_std = s;
  cfg.options<FrozenRandomScorer>().init_std = s;
  cfg.options<SigmoidScorer>().init_std = s;
}

// No gradient through S or A^p, for either graph.
inline void set_graph_detach(RouterConfig& cfg, bool detach) {
  cfg.allow_unused_options = true;
  cfg.options<Similarity>().detach = detach;
  cfg.options<Attention>().detach = detach;
}

// Whether both graphs keep their (N, T) matrix for backward (GraphMemory).
inline void set_graph_memory(RouterConfig& cfg, GraphMemory memory) {
  cfg.allow_unused_options = true;
  cfg.options<Similarity>().memory = memory;
  cfg.options<Attention>().memory = memory;
}

}  // namespace graphmoe::test
