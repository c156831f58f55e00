// A small MoE layer for the layer and selector tests: configured with tiny sizes, built (declare,
// allocate, bind, init) from a seed, and its gradients checked against central differences.
#pragma once

#include <cstdint>

#include "graphmoe/layers/moe.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

namespace graphmoe::test {

template <class Policy, class T = double>
struct MoEFixture {
  MoEConfig cfg;
  ParameterArena<T> arena;
  MoELayer<Policy, T> layer;

  explicit MoEFixture(index_t d = 4, index_t f = 3, index_t e = 4, index_t k = 2) {
    cfg.d_model = d;
    cfg.d_ff = f;
    cfg.router.num_experts = e;
    cfg.router.k = k;
    cfg.router.allow_unused_options = true;  // one fixture for every router
    cfg.router.options<graphmoe::ScheduledTopK>().k_min = 1;
    cfg.router.options<graphmoe::ScheduledTopK>().k_max = k;
    cfg.router.options<graphmoe::ScheduledTopK>().schedule_steps = 1;
    cfg.router.options<graphmoe::CosineScorer>().dim = 3;
    test::set_scorer_init_std(cfg.router, 0.5);
    cfg.init_std = 0.5;
  }
  void build(std::uint64_t seed) {
    layer.declare(arena, "moe.", cfg);
    arena.allocate();
    layer.bind(arena);
    Rng rng(seed);
    layer.init(rng);
    layer.router().set_step(1);
  }
  // After layer.backward: du against u (when check_du) and every trainable parameter's gradient
  // against central differences of loss().
  template <class Loss>
  void check_gradients(Tensor<T>& u, const Tensor<T>& du, Loss&& loss, bool check_du = true) {
    if (check_du) check_gradient("du", u, du, loss);
    for (const auto& info : arena.params()) {
      if (!info.trainable) continue;
      Tensor<T> v = arena.value(info.name);
      check_gradient(info.name, v, arena.grad(info.name), loss);
    }
  }
};

}  // namespace graphmoe::test
