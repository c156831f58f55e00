// Blended<G> (routing/graphs/blended.hpp): p = (1 - w) r + w G r, w = clamp(a, 0, 1), a learned.
//   naive evaluation     p equals (1 - w) r + w (G r) of G run alone, for Similarity and Attention,
//                        a inside and outside [0, 1]; every row a distribution
//   a = 0                p is r bit for bit; the whole router chooses the same experts with the
//                        same gates and gives the scorer the same gradients as the router
//                        without a graph; a's gradient is the one-sided derivative when a step
//                        from it enters [0, 1], else 0
//   gradient checks      (double) dr, du, d a, G's own parameters (a learned temperature) and
//                        the attention cache's gradients, at a = 0 (all but a) and inside (0, 1),
//                        whole routers; beyond a bound, a's gradient only points back inside
//   options and errors   Blended's init, G's options read through it, a bad init refused
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>

#include "graphmoe/routing/router.hpp"
#include "routing/router_fixtures.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

void check_arena(ParameterArena<double>& arena, const std::function<double()>& loss) {
  for (const auto& info : arena.params()) {
    if (!info.trainable) continue;
    CAPTURE(info.name);
    Tensor<double> v = arena.value(info.name);
    check_gradient(info.name, v, arena.grad(info.name), loss);
  }
}

// A Blended<G> graph declared in its own arena, its weight set to a.
template <class G>
struct BlendedGraph {
  ParameterArena<double> arena;
  BlendedImpl<G, double, cpu> g;
  BlendedGraph(index_t d, const RouterConfig& cfg, double a) {
    g.declare(arena, "graph.", d, cfg);
    arena.allocate();
    g.bind(arena);
    Rng rng(5);
    g.init(rng);
    arena.value("graph.blend").data()[0] = a;
  }
};

}  // namespace

TEST_CASE("blended graph: p = (1 - w) r + w G r, the graph run alone (Similarity, Attention)") {
  Rng rng(31);
  const index_t nb = 2, len = 6, d = 4, e = 5;
  auto u = random_normal<double>({nb * len, d}, rng);
  auto r = random_probs<double>(nb * len, e, rng);
  auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
  for (const double a : {0.0, 0.35, 1.0, -0.2, 1.7}) {
    CAPTURE(a);
    const double w = std::clamp(a, 0.0, 1.0);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = true;
    cfg.options<Similarity>().tau = 0.8;
    // Similarity
    {
      BlendedGraph<Similarity> b(d, cfg, a);
      GraphImpl<Similarity, double> s;
      s.configure(d, cfg);
      Tensor<double> p, q;
      b.g.forward(u, r, {len, nullptr}, p);
      s.forward(u, r, {len, nullptr}, q);
      REQUIRE(p.shape() == r.shape());
      for (index_t i = 0; i < r.numel(); ++i) {
        const double want = (1 - w) * r.data()[i] + w * q.data()[i];
        CHECK(p.data()[i] == doctest::Approx(want).epsilon(1e-14));
        CHECK(p.data()[i] >= 0.0);
        if (w == 0.0) CHECK(p.data()[i] == r.data()[i]);  // bit for bit
      }
      for (index_t t = 0; t < r.rows(); ++t) {  // rows stay distributions
        double sum = 0;
        for (index_t j = 0; j < e; ++j) sum += p(t, j);
        CHECK(sum == doctest::Approx(1.0).epsilon(1e-14));
      }
      CHECK(b.g.mean_entropy() == s.mean_entropy());
      CHECK(b.g.blend() == a);
      CHECK(b.g.weight() == w);
      CHECK(b.g.mean_self_weight() ==
            doctest::Approx((1 - w) + w * s.mean_self_weight()).epsilon(1e-14));
    }
    // Attention (the head choice and A^p are the inner graph's)
    {
      BlendedGraph<Attention> b(d, cfg, a);
      GraphImpl<Attention, double> s;
      s.configure(d, cfg);
      Tensor<double> p, q;
      b.g.forward(u, r, {len, &cache}, p);
      s.forward(u, r, {len, &cache}, q);
      for (index_t i = 0; i < r.numel(); ++i)
        CHECK(p.data()[i] == doctest::Approx((1 - w) * r.data()[i] + w * q.data()[i]).epsilon(1e-14));
    }
  }
}

TEST_CASE("blended graph gradient check: Similarity (causal, a learned temperature), at a = 0 and "
          "inside (0, 1)") {
  for (const bool learned : {false, true}) {
    for (const bool causal : {false, true}) {
      for (const double a : {0.0, 0.4, 0.85}) {
        CAPTURE(learned);
        CAPTURE(causal);
        CAPTURE(a);
        Rng rng(32);
        const index_t nb = 2, len = 5, d = 3, e = 4;
        auto u = random_normal<double>({nb * len, d}, rng, 0.8);
        auto r = random_probs<double>(nb * len, e, rng);
        auto w = random_normal<double>({nb * len, e}, rng);
        RouterConfig cfg;
        cfg.num_experts = e;
        cfg.causal = causal;
        cfg.options<Similarity>().tau = 0.7;
        if (learned) cfg.options<Similarity>().tau_mode = TauMode::Learned;
        BlendedGraph<Similarity> b(d, cfg, a);
        CHECK(b.arena.contains("graph.log_tau") == learned);
        GraphContext<double> ctx{len, nullptr};
        auto loss = [&] {
          Tensor<double> p;
          b.g.forward(u, r, ctx, p);
          return weighted_sum(p, w);
        };
        Tensor<double> p, dr, du(u.shape());
        b.g.forward(u, r, ctx, p);
        b.arena.zero_grad();
        b.g.backward(u, r, p, w, ctx, dr, du);
        check_gradient("dr", r, dr, loss);
        check_gradient("du", u, du, loss);
        if (a > 0) {
          check_arena(b.arena, loss);
          CHECK(b.arena.grad("graph.blend").data()[0] != 0.0);
        } else {
          // at the bound: the right-hand derivative when a step from 0 would enter [0, 1], else 0
          for (const auto& info : b.arena.params())
            if (info.name != "graph.blend") {
              Tensor<double> v = b.arena.value(info.name);
              check_gradient(info.name, v, b.arena.grad(info.name), loss);
            }
          Tensor<double> av = b.arena.value("graph.blend");
          const double l0 = loss();
          av.data()[0] = 1e-7;
          const double right = (loss() - l0) / 1e-7;
          av.data()[0] = 0.0;
          const double da = b.arena.grad("graph.blend").data()[0];
          if (right < 0) CHECK(da == doctest::Approx(right).epsilon(1e-5));
          else CHECK(da == 0.0);
        }
      }
    }
  }
}

TEST_CASE("blended graph gradient check: Attention, into r and the attention cache") {
  for (const double a : {0.0, 0.6}) {
    CAPTURE(a);
    Rng rng(33);
    const index_t nb = 2, len = 5, heads = 2, d = 4, e = 3;
    auto cache = random_attention_cache<double>(nb, len, heads, d, true, rng);
    auto u = random_normal<double>({nb * len, d}, rng);
    auto r = random_probs<double>(nb * len, e, rng);
    auto w = random_normal<double>({nb * len, e}, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = true;
    cfg.options<Attention>().sigma = 1.5;
    BlendedGraph<Attention> b(d, cfg, a);
    GraphContext<double> ctx{len, &cache};
    auto loss = [&] {
      Tensor<double> p;
      b.g.forward(u, r, ctx, p);
      return weighted_sum(p, w);
    };
    Tensor<double> p, dr, du(u.shape());
    b.g.forward(u, r, ctx, p);
    zero_sinks(cache);
    b.arena.zero_grad();
    b.g.backward(u, r, p, w, ctx, dr, du);
    check_gradient("dr", r, dr, loss);
    if (a > 0) check_arena(b.arena, loss);
    check_gradient("dv", cache.v, cache.dv, loss);
    check_gradient("dout", cache.out, cache.dout, loss);
    if (a == 0.0) CHECK(as_vector(cache.dv).cwiseAbs().maxCoeff() == 0.0);  // dq = w dp = 0
  }
}

TEST_CASE_TEMPLATE("blended router at a = 0 routes as the router without a graph, bit for bit",
                   Policy, BlendedSimilarityRouter, BlendedAttentionRouter) {
  Rng rng(34);
  const index_t nb = 2, len = 7, d = 6, e = 6, k = 2;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  cfg.causal = true;
  cfg.load_balance_coef = 0.05;
  cfg.options<LinearScorer>().init_std = 0.7;
  ParameterArena<double> arena, ref_arena;
  RouterImpl<Policy, double> router;
  RouterImpl<SoftmaxRouter, double> ref;
  router.declare(arena, "router.", d, cfg);
  RouterConfig ref_cfg;
  ref_cfg.num_experts = e;
  ref_cfg.k = k;
  ref_cfg.causal = true;
  ref_cfg.load_balance_coef = 0.05;
  ref.declare(ref_arena, "router.", d, ref_cfg);
  arena.allocate();
  ref_arena.allocate();
  router.bind(arena);
  ref.bind(ref_arena);
  router.init(rng);
  CHECK(arena.value("router.graph.blend").data()[0] == 0.0);  // the default init
  ref_arena.value("router.weight").copy_from(arena.value("router.weight"));
  auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
  GraphContext<double> ctx{len, Policy::needs_attention ? &cache : nullptr};
  auto u = random_normal<double>({nb * len, d}, rng);
  RouterOutput<double> out, ref_out;
  router.forward(u, ctx, out);
  ref.forward(u, ctx, ref_out);
  for (index_t i = 0; i < out.p.numel(); ++i) REQUIRE(out.p.data()[i] == ref_out.p.data()[i]);
  for (index_t i = 0; i < out.selection.indices.numel(); ++i) {
    CHECK(out.selection.indices.data()[i] == ref_out.selection.indices.data()[i]);
    CHECK(out.selection.gates.data()[i] == ref_out.selection.gates.data()[i]);
  }
  CHECK(out.load_balance_loss == ref_out.load_balance_loss);
  auto w = random_normal<double>(out.selection.gates.shape(), rng);
  Tensor<double> du(u.shape()), ref_du(u.shape());
  arena.zero_grad();
  ref_arena.zero_grad();
  zero_sinks(cache);
  router.backward(u, ctx, out, w, du);
  ref.backward(u, ctx, ref_out, w, ref_du);
  for (index_t i = 0; i < du.numel(); ++i) CHECK(du.data()[i] == ref_du.data()[i]);
  const Tensor<double> g = arena.grad("router.weight"), rg = ref_arena.grad("router.weight");
  for (index_t i = 0; i < g.numel(); ++i) CHECK(g.data()[i] == rg.data()[i]);
  CHECK(arena.grad("router.graph.blend").data()[0] <= 0.0);  // a step from 0 only enters [0, 1]
}

TEST_CASE_TEMPLATE("blended router gradient check (gates + load balancing), a != 0", Policy,
                   BlendedSimilarityRouter, BlendedAttentionRouter) {
  Rng rng(35);
  const index_t nb = 2, len = 5, d = 4, e = 4, k = 2;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  cfg.causal = true;
  cfg.load_balance_coef = 0.1;
  cfg.options<LinearScorer>().init_std = 0.5;
  cfg.options<Blended<typename Policy::graph::inner_graph>>().init = 0.45;
  ParameterArena<double> arena;
  RouterImpl<Policy, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  CHECK(arena.value("router.graph.blend").data()[0] == 0.45);
  auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
  GraphContext<double> ctx{len, Policy::needs_attention ? &cache : nullptr};
  auto u = random_normal<double>({nb * len, d}, rng);
  auto w = random_normal<double>({nb * len, k}, rng);
  auto loss = [&] {
    RouterOutput<double> o;
    router.forward(u, ctx, o);
    return weighted_sum(o.selection.gates, w) + cfg.load_balance_coef * o.load_balance_loss;
  };
  RouterOutput<double> out;
  router.forward(u, ctx, out);
  Tensor<double> du(u.shape());
  arena.zero_grad();
  zero_sinks(cache);
  router.backward(u, ctx, out, w, du);
  check_gradient("du", u, du, loss);
  check_arena(arena, loss);
  if (Policy::needs_attention) check_gradient("dv", cache.v, cache.dv, loss);
}

TEST_CASE("blended graph: beyond a bound, a's gradient only points back into [0, 1]") {
  Rng rng(36);
  const index_t nb = 1, len = 6, d = 3, e = 4;
  auto u = random_normal<double>({nb * len, d}, rng);
  auto r = random_probs<double>(nb * len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.causal = true;
  for (const double a : {-0.3, 0.0, 1.0, 1.4}) {
    CAPTURE(a);
    BlendedGraph<Similarity> b(d, cfg, a);
    BlendedGraph<Similarity> inside(d, cfg, 0.5);
    for (const double sign : {1.0, -1.0}) {
      CAPTURE(sign);
      // dp = sign (q - r): sum dp (q - r) = sign |q - r|^2, its sign known
      Tensor<double> q, p, dr, du(u.shape()), dp(r.shape());
      GraphImpl<Similarity, double> s;
      s.configure(d, cfg);
      s.forward(u, r, {len, nullptr}, q);
      for (index_t i = 0; i < r.numel(); ++i) dp.data()[i] = sign * (q.data()[i] - r.data()[i]);
      b.arena.zero_grad();
      b.g.forward(u, r, {len, nullptr}, p);
      b.g.backward(u, r, p, dp, {len, nullptr}, dr, du);
      const double g = b.arena.grad("graph.blend").data()[0];
      const bool out = (a <= 0 && sign > 0) || (a >= 1 && sign < 0);  // descent would leave
      if (out) CHECK(g == 0.0);
      else CHECK(g * sign > 0);
      // dr's direct path uses w = clamp(a, 0, 1)
      if (a > 1) {
        Tensor<double> p1, dr1, du1(u.shape());
        BlendedGraph<Similarity> one(d, cfg, 1.0);
        one.g.forward(u, r, {len, nullptr}, p1);
        one.g.backward(u, r, p1, dp, {len, nullptr}, dr1, du1);
        for (index_t i = 0; i < dr.numel(); ++i) CHECK(dr.data()[i] == dr1.data()[i]);
      }
    }
  }
}

TEST_CASE("blended graph: names, options, errors") {
  CHECK(std::string(Blended<Similarity>::name) == "blended-similarity");
  CHECK(std::string(Blended<Attention>::name) == "blended-attention");
  CHECK(BlendedAttentionRouter::needs_attention);
  CHECK_FALSE(BlendedSimilarityRouter::needs_attention);
  CHECK(BlendedSimilarityRouter::name() == "linear/blended-similarity/topk");
  // the inner graph's options are read through Blended<G> (not "unused")
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.options<Similarity>().tau_mode = TauMode::Learned;
  ParameterArena<double> arena;
  RouterImpl<BlendedSimilarityRouter, double> router;
  router.declare(arena, "r.", 3, cfg);
  CHECK(arena.contains("r.graph.log_tau"));
  CHECK(arena.contains("r.graph.blend"));
  // a bad init
  RouterConfig bad;
  bad.num_experts = 4;
  bad.options<Blended<Similarity>>().init = std::nan("");
  ParameterArena<double> a2;
  RouterImpl<BlendedSimilarityRouter, double> r2;
  CHECK_THROWS_WITH(r2.declare(a2, "r.", 3, bad),
                    doctest::Contains("Blended::Options: init must be in [0, 1], got nan"));
  RouterConfig bad2;
  bad2.num_experts = 4;
  bad2.options<Blended<Similarity>>().init = 1.5;
  ParameterArena<double> a3;
  RouterImpl<BlendedSimilarityRouter, double> r3;
  CHECK_THROWS_WITH(r3.declare(a3, "r.", 3, bad2),
                    doctest::Contains("init must be in [0, 1], got 1.5"));
  // ops: a of the wrong size, q of another shape
  Tensor<double> r(Shape{3, 4}), q(Shape{3, 4}), q2(Shape{4, 3}), a(Shape{2}), p;
  CHECK_THROWS_WITH(graph_blend(r, q, a, p), doctest::Contains("graph_blend: the mixing weight a "
                                                               "must hold one value"));
  Tensor<double> a1(Shape{1});
  CHECK_THROWS_WITH(graph_blend(r, q2, a1, p), doctest::Contains("graph_blend"));
  // backward before a forward
  BlendedGraph<Similarity> b(3, RouterConfig{}, 0.5);
  Tensor<double> u(Shape{4, 3}), rr(Shape{4, 16}), dp(Shape{4, 16}), dr, du(Shape{4, 3});
  CHECK_THROWS_WITH(b.g.backward(u, rr, rr, dp, {4, nullptr}, dr, du),
                    doctest::Contains("no forward of these tokens"));
}
