// graphmoe/testing/router_gradcheck.hpp: the gradient check of a whole router, user policies
// included (the checker itself: graphmoe/testing/gradcheck.hpp, whose comment has the method).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "graphmoe/core/mode.hpp"
#include "graphmoe/routing/router.hpp"
#include "graphmoe/testing/gradcheck.hpp"

namespace graphmoe::testing {

// A whole router on n tokens (u ~ N(0, 1), width d_model, sequences of seq_len) under
// L = sum_ij w_ij gates_ij + load_balance_coef lb + z_loss_coef z + seq_aux_loss_coef seq
// (w ~ N(0, 1), fixed): the
// gradient of u and of every trainable parameter the router's policies declared. The router is
// declared in its own arena with prefix "router.", initialised from Rng(seed) and set to
// Mode::Eval. Routers whose graph needs the attention layer's cache (the Attention graph) need a
// whole MoE layer or model: use check_arena_gradients there.
template <class Policy>
std::vector<GradcheckResult> check_router_gradients(RouterConfig cfg, index_t n, index_t d_model,
                                                    index_t seq_len, std::uint64_t seed = 1,
                                                    const GradcheckOptions& opt = {}) {
  static_assert(!Policy::needs_attention,
                "graphmoe::testing::check_router_gradients: this router's token graph reads the "
                "attention layer's cache; check an MoE layer or model with check_arena_gradients");
  constexpr const char* op = "testing::check_router_gradients";
  GRAPHMOE_CHECK(n >= 1 && d_model >= 1 && seq_len >= 1 && n % seq_len == 0, op,
                 "need n, d_model, seq_len >= 1 with seq_len dividing n, got n = ", n,
                 ", d_model = ", d_model, ", seq_len = ", seq_len);
  ParameterArena<double, cpu> arena;
  RouterImpl<Policy, double, cpu> router;
  router.declare(arena, "router.", d_model, cfg);
  arena.allocate();
  router.bind(arena);
  Rng rng(seed);
  router.init(rng);
  router.set_mode(Mode::Eval);

  Tensor<double, cpu> u(Shape{n, d_model});
  fill_normal(u, rng, 1.0);
  GraphContext<double, cpu> ctx;
  ctx.seq_len = seq_len;
  const RouterConfig& rc = router.config();
  RouterOutput<double, cpu> out;
  router.forward(u, ctx, out);
  Tensor<double, cpu> w(out.selection.gates.shape());
  fill_normal(w, rng, 1.0);

  const auto loss = [&]() {
    RouterOutput<double, cpu> o;
    router.forward(u, ctx, o);
    GRAPHMOE_CHECK(o.selection.gates.shape() == w.shape(), op,
                   "the selection's shape changed under a perturbation of size h (", opt.h,
                   "): from ", w.shape(), " to ", o.selection.gates.shape(),
                   "; use fewer tokens or a smaller h");
    double l = 0;
    for (index_t i = 0; i < w.numel(); ++i) l += w.data()[i] * o.selection.gates.data()[i];
    return l + rc.load_balance_coef * o.load_balance_loss + rc.z_loss_coef * o.z_loss +
           rc.seq_aux_loss_coef * o.seq_aux_loss;
  };
  const auto backward = [&](Tensor<double, cpu>& du) {
    RouterOutput<double, cpu> o;
    router.forward(u, ctx, o);
    du = Tensor<double, cpu>(u.shape());
    router.backward(u, ctx, o, w, du);
  };

  std::vector<GradcheckResult> results;
  Tensor<double, cpu> du;
  arena.zero_grad();
  backward(du);
  results.push_back(check_gradient("u", u, du, loss, opt));
  for (auto& r : check_arena_gradients(
           arena, loss,
           [&] {
             Tensor<double, cpu> scratch;
             backward(scratch);
           },
           opt))
    results.push_back(std::move(r));
  return results;
}

}  // namespace graphmoe::testing
