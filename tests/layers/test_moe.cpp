// The MoE layer: finite-difference gradient check with every router, expert choice included (with
// and without detaching the token graph), causality of the causal similarity graph, grouped
// dispatch, capacity drops; SwiGLU experts and the SwiGLU FeedForward (with and without biases):
// gradient checks and a naive loop-by-loop evaluation of the experts' output.
#include <doctest/doctest.h>

#include "graphmoe/layers/block.hpp"
#include "graphmoe/layers/moe.hpp"
#include "layers/moe_fixture.hpp"
#include "routing/router_fixtures.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
template <class Policy, class T = double>
using Fixture = MoEFixture<Policy, T>;
}  // namespace

TEST_CASE_TEMPLATE("MoE layer gradient check with every router, graph attached and detached", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SimilarityXMoERouter, AttentionXMoERouter, SMoEDropoutRouter,
                   SimilaritySMoEDropoutRouter, AttentionSMoEDropoutRouter, ExpertChoiceRouter,
                   SimilarityExpertChoiceRouter, AttentionExpertChoiceRouter) {
  // Expert choice refuses the load-balancing loss (every expert takes the same number of tokens)
  constexpr bool expert_choice = selector_chooses_across_tokens<typename Policy::selector>();
  for (bool detach : {false, true}) {
    if (detach && std::is_same_v<typename Policy::graph, Independent>) continue;
    CAPTURE(detach);
    Fixture<Policy> fx;
    test::set_graph_detach(fx.cfg.router, detach);
    fx.cfg.router.causal = true;
    fx.cfg.router.load_balance_coef = expert_choice ? 0.0 : 0.05;
    fx.build(31);
    Rng rng(32);
    const index_t nb = 2, len = 4, d = fx.cfg.d_model;
    auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
    GraphContext<double> ctx{len, Policy::needs_attention ? &cache : nullptr};
    auto u = random_normal<double>({nb * len, d}, rng);
    auto w = random_normal<double>({nb * len, d}, rng);
    auto loss = [&] {
      Tensor<double> y;
      fx.layer.forward(u, ctx, y);
      return weighted_sum(y, w) + 0.05 * fx.layer.routing().load_balance_loss;
    };
    Tensor<double> y, du;
    fx.layer.forward(u, ctx, y);
    fx.arena.zero_grad();
    zero_sinks(cache);
    fx.layer.backward(w, du);
    fx.check_gradients(u, du, loss, !(detach && std::is_same_v<typename Policy::graph, Similarity>));
    if (Policy::needs_attention && !detach) {
      check_gradient("attention dv", cache.v, cache.dv, loss);
      check_gradient("attention dw_o", cache.w_o, cache.dw_o, loss);
      check_gradient("attention dout", cache.out, cache.dout, loss);
    }
  }
}

TEST_CASE_TEMPLATE("MoE layer: causal graph, perturbing token j > i leaves output i unchanged", Policy,
                   SimilarityRouter, SimilarityXMoERouter) {
  Fixture<Policy> fx(6, 5, 4, 2);
  fx.cfg.router.causal = true;
  fx.build(41);
  Rng rng(42);
  const index_t len = 9, d = fx.cfg.d_model;
  auto u = random_normal<double>({2 * len, d}, rng);
  Tensor<double> y0;
  fx.layer.forward(u, {len, nullptr}, y0);
  const auto p0 = fx.layer.routing().p.clone();
  for (index_t j : {3, 8}) {
    auto v = u.clone();
    for (index_t c = 0; c < d; ++c) v(j, c) += 5.0;
    Tensor<double> y1;
    fx.layer.forward(v, {len, nullptr}, y1);
    // The routing scores of earlier tokens are bitwise unchanged. Their outputs agree to rounding:
    // the perturbed token may move to other experts, which changes the row blocks the expert
    // GEMMs see and so the BLAS kernel's blocking, not the arithmetic of any row.
    const auto& p1 = fx.layer.routing().p;
    for (index_t i = 0; i < j; ++i)
      for (index_t c = 0; c < p1.cols(); ++c) REQUIRE(p1(i, c) == p0(i, c));
    CHECK(max_rel_diff(y1.slice(0, j), y0.slice(0, j)) < 1e-13);
    bool changed = false;
    for (index_t c = 0; c < d; ++c) changed |= y1(j, c) != y0(j, c);
    CHECK(changed);
    // the second sequence (rows 9..17) is independent of the first
    CHECK(max_rel_diff(y1.slice(len, 2 * len), y0.slice(len, 2 * len)) < 1e-13);
  }
  // Without the mask, a later token does change earlier outputs.
  Fixture<Policy> fx2(6, 5, 4, 2);
  fx2.cfg.router.causal = false;
  fx2.cfg.router.template options<Similarity>().tau = 5.0;
  fx2.build(41);
  Tensor<double> z0, z1;
  fx2.layer.forward(u, {len, nullptr}, z0);
  auto v = u.clone();
  for (index_t c = 0; c < d; ++c) v(8, c) += 5.0;
  fx2.layer.forward(v, {len, nullptr}, z1);
  CHECK(max_rel_diff(z1.slice(0, 8), z0.slice(0, 8)) > 1e-6);
}

TEST_CASE("MoE layer: tokens are grouped by expert and the output is the gated sum of their experts") {
  Fixture<SoftmaxRouter> fx(5, 4, 3, 2);
  fx.build(51);
  Rng rng(52);
  const index_t n = 12, d = 5;
  auto u = random_normal<double>({n, d}, rng);
  Tensor<double> y;
  fx.layer.forward(u, {n, nullptr}, y);
  const auto& plan = fx.layer.plan();
  const auto& sel = fx.layer.routing().selection;
  CHECK(plan.num_slots() == n * 2);
  // naive: y_i = sum_j g_ij FFN_{e_ij}(u_i), the FFN evaluated densely for the check only
  auto w1 = fx.arena.value("moe.experts.w1"), b1 = fx.arena.value("moe.experts.b1");
  auto w2 = fx.arena.value("moe.experts.w2"), b2 = fx.arena.value("moe.experts.b2");
  for (index_t i = 0; i < n; ++i) {
    std::vector<double> ref(static_cast<std::size_t>(d), 0.0);
    for (index_t j = 0; j < 2; ++j) {
      const index_t e = sel.indices(i, j);
      std::vector<double> hid(4);
      for (index_t f = 0; f < 4; ++f) {
        double s = b1(e, f);
        for (index_t c = 0; c < d; ++c) s += w1(e, f, c) * u(i, c);
        hid[static_cast<std::size_t>(f)] = 0.5 * s * (1 + std::tanh(std::sqrt(2 / M_PI) * (s + 0.044715 * s * s * s)));
      }
      for (index_t c = 0; c < d; ++c) {
        double s = b2(e, c);
        for (index_t f = 0; f < 4; ++f) s += w2(e, c, f) * hid[static_cast<std::size_t>(f)];
        ref[static_cast<std::size_t>(c)] += sel.gates(i, j) * s;
      }
    }
    for (index_t c = 0; c < d; ++c) CHECK(y(i, c) == doctest::Approx(ref[static_cast<std::size_t>(c)]).epsilon(1e-12));
  }
  for (index_t e = 0; e < 3; ++e)
    for (index_t s = plan.offset(e); s < plan.offset(e + 1); ++s) {
      const index_t a = plan.slot_source.data()[s];
      CHECK(sel.indices.data()[a] == e);
    }
}

TEST_CASE("MoE layer: capacity factor drops overflow assignments, which then contribute nothing") {
  Fixture<SoftmaxRouter> fx(4, 3, 4, 2);
  fx.cfg.router.capacity_factor = 0.5;
  fx.build(61);
  Rng rng(62);
  const index_t n = 16, d = 4;
  auto u = random_normal<double>({n, d}, rng);
  Tensor<double> y;
  fx.layer.forward(u, {n, nullptr}, y);
  const auto& sel = fx.layer.routing().selection;
  REQUIRE(dropped_count(sel) > 0);
  // A token whose every assignment was dropped gets zero output.
  for (index_t i = 0; i < n; ++i) {
    if (!sel.keep(i, 0) && !sel.keep(i, 1))
      for (index_t c = 0; c < d; ++c) CHECK(y(i, c) == 0.0);
  }
  // Capacity holds per expert.
  for (index_t e = 0; e < 4; ++e) CHECK(fx.layer.plan().count(e) <= 4);  // ceil(0.5 * 32 / 4)
}

TEST_CASE_TEMPLATE("MoE layer: the padded layout computes the compact layout's outputs and gradients",
                   Policy, SoftmaxRouter, SimilarityRouter, SMoEDropoutRouter) {
  for (double cf : {0.5, 1.0, 2.0}) {
    CAPTURE(cf);
    Fixture<Policy> compact(4, 3, 4, 2), padded(4, 3, 4, 2);
    compact.cfg.router.capacity_factor = padded.cfg.router.capacity_factor = cf;
    compact.cfg.router.load_balance_coef = padded.cfg.router.load_balance_coef = 0.05;
    padded.cfg.layout = ExpertLayout::Padded;
    compact.build(81);
    padded.build(81);
    Rng rng(82);
    const index_t n = 16, d = 4;
    auto u = random_normal<double>({n, d}, rng);
    auto w = random_normal<double>({n, d}, rng);
    Tensor<double> yc, yp, duc, dup;
    compact.layer.forward(u, {8, nullptr}, yc);
    padded.layer.forward(u, {8, nullptr}, yp);
    CHECK(padded.layer.plan().capacity == token_capacity(cf, n, 2, 4));
    CHECK(padded.layer.plan().num_slots() == 4 * token_capacity(cf, n, 2, 4));
    CHECK(compact.layer.plan().capacity == 0);
    CHECK(max_rel_diff(yc, yp) < 1e-13);
    compact.arena.zero_grad();
    padded.arena.zero_grad();
    compact.layer.backward(w, duc);
    padded.layer.backward(w, dup);
    CHECK(max_rel_diff(duc, dup) < 1e-13);
    for (const auto& info : compact.arena.params()) {
      CAPTURE(info.name);
      CHECK(max_rel_diff(compact.arena.grad(info.name), padded.arena.grad(info.name)) < 1e-13);
    }
  }
}

TEST_CASE("MoE layer: gradient check of the padded layout, and what it refuses") {
  Fixture<SimilarityRouter> fx(4, 3, 4, 2);
  fx.cfg.router.capacity_factor = 0.75;  // drops some assignments
  fx.cfg.layout = ExpertLayout::Padded;
  fx.build(91);
  Rng rng(92);
  const index_t n = 8, d = 4;
  auto u = random_normal<double>({n, d}, rng);
  auto w = random_normal<double>({n, d}, rng);
  auto loss = [&] {
    Tensor<double> y;
    fx.layer.forward(u, {4, nullptr}, y);
    return weighted_sum(y, w);
  };
  Tensor<double> y, du;
  fx.layer.forward(u, {4, nullptr}, y);
  REQUIRE(dropped_count(fx.layer.routing().selection) > 0);
  fx.arena.zero_grad();
  fx.layer.backward(w, du);
  fx.check_gradients(u, du, loss);

  Fixture<SoftmaxRouter> dropless;
  dropless.cfg.layout = ExpertLayout::Padded;  // capacity_factor 0: no capacity to pad to
  CHECK_THROWS_WITH_AS(dropless.build(93), doctest::Contains("padded expert layout needs a capacity"),
                       Error);
  Fixture<ExpertChoiceRouter> ec;
  ec.cfg.router.capacity_factor = 1.0;
  ec.cfg.layout = ExpertLayout::Padded;
  CHECK_THROWS_WITH_AS(ec.build(94), doctest::Contains("needs a token-choice selector"), Error);
}

TEST_CASE("MoE layer: bad input") {
  Fixture<SimilarityRouter, float> fx;
  fx.build(71);
  Rng rng(72);
  auto u = random_normal<float>({8, 5}, rng);
  Tensor<float> y;
  CHECK_THROWS_WITH_AS(fx.layer.forward(u, {4, nullptr}, y), doctest::Contains("u has shape (8, 5), expected (N, 4)"), Error);
  auto v = random_normal<float>({8, 4}, rng);
  fx.layer.forward(v, {4, nullptr}, y);
  Tensor<float> dy({7, 4}), du;
  CHECK_THROWS_WITH_AS(fx.layer.backward(dy, du), doctest::Contains("dy has shape (7, 4)"), Error);
  Fixture<AttentionRouter, float> fa;
  fa.build(73);
  CHECK_THROWS_WITH_AS(fa.layer.forward(v, {4, nullptr}, y), doctest::Contains("needs the attention layer's cache"), Error);
}

TEST_CASE("layers used before bind() raise graphmoe::Error naming the step") {
  Rng rng(81);
  auto x = random_normal<float>({8, 4}, rng);
  Tensor<float> y, dx;
  const auto msg = doctest::Contains("before bind()");
  {
    Fixture<SoftmaxRouter, float> fx;  // declared and allocated, never bound
    fx.layer.declare(fx.arena, "moe.", fx.cfg);
    fx.arena.allocate();
    CHECK_THROWS_WITH_AS(fx.layer.forward(x, {4, nullptr}, y), msg, Error);
    CHECK_THROWS_WITH_AS(fx.layer.backward(x, dx), msg, Error);
  }
  {
    ParameterArena<float> arena;
    Linear<float> lin;
    lin.declare(arena, "lin.", 4, 3);
    arena.allocate();
    CHECK_THROWS_WITH_AS(lin.forward(x, y), doctest::Contains("Linear"), Error);
    LayerNorm<float> ln;
    CHECK_THROWS_WITH_AS(ln.forward(x, y), msg, Error);
    FeedForward<float> ffn;
    CHECK_THROWS_WITH_AS(ffn.forward(x, y), msg, Error);
    MultiHeadAttention<float> attn;
    CHECK_THROWS_WITH_AS(attn.forward(x, y), msg, Error);
    TransformerBlock<SimilarityRouter, float> block;
    CHECK_THROWS_WITH_AS(block.forward(x, y), doctest::Contains("TransformerBlock"), Error);
  }
}

// Linear::backward(dy, &dx, true) adds dy W to dx (the attention layer's q, k, v projections
// share one dx this way) and accumulates dW as the plain backward does.
TEST_CASE("Linear: backward with accumulate_dx adds to dx") {
  Rng rng(5);
  ParameterArena<double> arena;
  Linear<double> lin;
  lin.declare(arena, "lin.", 4, 3);
  arena.allocate();
  lin.bind(arena);
  lin.init(rng, 0.5);
  const auto x = random_normal<double>({6, 4}, rng);
  const auto dy = random_normal<double>({6, 3}, rng);
  Tensor<double> y, plain({6, 4});
  lin.forward(x, y);
  lin.backward(dy, &plain);
  const Tensor<double> dw_once = arena.grad("lin.weight").clone();
  const auto base = random_normal<double>({6, 4}, rng);
  Tensor<double> acc = base.clone();
  lin.backward(dy, &acc, true);
  for (index_t i = 0; i < acc.numel(); ++i)
    CHECK(acc.data()[i] == doctest::Approx(base.data()[i] + plain.data()[i]).epsilon(1e-14));
  const Tensor<double> dw = arena.grad("lin.weight");
  for (index_t i = 0; i < dw.numel(); ++i)
    CHECK(dw.data()[i] == doctest::Approx(2 * dw_once.data()[i]).epsilon(1e-14));
  Tensor<double> empty;
  CHECK_THROWS_WITH_AS(lin.backward(dy, &empty, true), doctest::Contains("accumulate_dx needs"),
                       Error);
  CHECK_THROWS_WITH_AS(lin.backward(dy, nullptr, true), doctest::Contains("accumulate_dx needs"),
                       Error);
}

TEST_CASE_TEMPLATE("MoE layer: 2 threads (both parallelisations) agree with 1 thread, forward and backward",
                   Policy, SimilarityRouter, AttentionRouter) {
  Rng rng(81);
  const index_t nb = 3, len = 20, d = 8;
  auto u = random_normal<double>({nb * len, d}, rng);
  auto dy = random_normal<double>({nb * len, d}, rng);
  auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
  GraphContext<double> ctx{len, Policy::needs_attention ? &cache : nullptr};
  Tensor<double> ref_y, ref_du, ref_grads, ref_dv;
  for (int run = 0; run < 3; ++run) {
    set_num_threads(run == 0 ? 1 : 2);
    Fixture<Policy> fx(d, 6, 4, 2);
    fx.cfg.router.causal = true;
    fx.cfg.parallelism = run == 2 ? ExpertParallelism::AcrossExperts : ExpertParallelism::WithinGemm;
    fx.build(82);
    Tensor<double> y, du;
    zero_sinks(cache);
    fx.layer.forward(u, ctx, y);
    fx.layer.backward(dy, du);
    if (run == 0) {
      ref_y = y;
      ref_du = du;
      ref_grads = fx.arena.grads().clone();
      ref_dv = cache.dv.clone();
    } else {
      CAPTURE(run);
      CHECK(max_rel_diff(y, ref_y) < 1e-12);
      CHECK(max_rel_diff(du, ref_du) < 1e-12);
      CHECK(max_rel_diff(fx.arena.grads(), ref_grads) < 1e-12);
      CHECK(max_rel_diff(cache.dv, ref_dv) < 1e-12);
    }
  }
  set_num_threads(1);
}

namespace {
double naive_silu(double x) { return x / (1 + std::exp(-x)); }
}  // namespace

// SwiGLU experts, w1 (E, 2F, D) with the gate rows first: every gradient (both parallelisations,
// with and without biases; without them the arena has no b1, b2).
TEST_CASE_TEMPLATE("MoE layer with SwiGLU experts: gradient check, with and without biases",
                   Policy, SoftmaxRouter, SimilarityRouter) {
  for (bool bias : {true, false})
    for (auto par : {ExpertParallelism::WithinGemm, ExpertParallelism::AcrossExperts}) {
      CAPTURE(bias);
      CAPTURE(static_cast<int>(par));
      Fixture<Policy> fx(4, 3, 4, 2);
      fx.cfg.activation = FfnActivation::SwiGLU;
      fx.cfg.bias = bias;
      fx.cfg.parallelism = par;
      fx.cfg.router.causal = true;
      fx.cfg.router.load_balance_coef = 0.05;
      fx.build(131);
      CHECK(fx.arena.value("moe.experts.w1").shape() == Shape{4, 6, 4});
      CHECK(fx.arena.value("moe.experts.w2").shape() == Shape{4, 4, 3});
      bool has_b1 = false, has_b2 = false;
      for (const auto& info : fx.arena.params()) {
        has_b1 |= info.name == "moe.experts.b1";
        has_b2 |= info.name == "moe.experts.b2";
      }
      CHECK(has_b1 == bias);
      CHECK(has_b2 == bias);
      if (bias) {  // non-zero biases, so that their gradients and adds are exercised
        Rng br(133);
        auto b1 = fx.arena.value("moe.experts.b1"), b2 = fx.arena.value("moe.experts.b2");
        b1.copy_from(random_normal<double>(b1.shape(), br, 0.5));
        b2.copy_from(random_normal<double>(b2.shape(), br, 0.5));
      }
      Rng rng(132);
      const index_t n = 8, d = 4;
      auto u = random_normal<double>({n, d}, rng);
      auto w = random_normal<double>({n, d}, rng);
      auto loss = [&] {
        Tensor<double> y;
        fx.layer.forward(u, {4, nullptr}, y);
        return weighted_sum(y, w) + 0.05 * fx.layer.routing().load_balance_loss;
      };
      Tensor<double> y, du;
      fx.layer.forward(u, {4, nullptr}, y);
      fx.arena.zero_grad();
      fx.layer.backward(w, du);
      fx.check_gradients(u, du, loss);
    }
}

// One expert's SwiGLU output evaluated loop by loop: y_i = sum_j g_ij (silu(x Wg^T + bg) *
// (x Wu^T + bu)) w2^T + b2, Wg = w1[e, :F], Wu = w1[e, F:].
TEST_CASE("MoE layer: SwiGLU experts against a naive evaluation, with and without biases") {
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    const index_t n = 12, d = 5, f = 4, k = 2;
    Fixture<SoftmaxRouter> fx(d, f, 3, k);
    fx.cfg.activation = FfnActivation::SwiGLU;
    fx.cfg.bias = bias;
    fx.build(141);
    Rng rng(142);
    Tensor<double> b1, b2;
    if (bias) {
      b1 = fx.arena.value("moe.experts.b1");
      b2 = fx.arena.value("moe.experts.b2");
      b1.copy_from(random_normal<double>(b1.shape(), rng, 0.5));
      b2.copy_from(random_normal<double>(b2.shape(), rng, 0.5));
    }
    auto u = random_normal<double>({n, d}, rng);
    Tensor<double> y;
    fx.layer.forward(u, {n, nullptr}, y);
    const auto& sel = fx.layer.routing().selection;
    auto w1 = fx.arena.value("moe.experts.w1"), w2 = fx.arena.value("moe.experts.w2");
    REQUIRE(w1.shape() == Shape{3, 2 * f, d});
    for (index_t i = 0; i < n; ++i) {
      std::vector<double> ref(static_cast<std::size_t>(d), 0.0);
      for (index_t j = 0; j < k; ++j) {
        const index_t e = sel.indices(i, j);
        std::vector<double> hid(static_cast<std::size_t>(f));
        for (index_t h = 0; h < f; ++h) {
          double gate = bias ? b1(e, h) : 0.0, up = bias ? b1(e, f + h) : 0.0;
          for (index_t c = 0; c < d; ++c) {
            gate += w1(e, h, c) * u(i, c);
            up += w1(e, f + h, c) * u(i, c);
          }
          hid[static_cast<std::size_t>(h)] = naive_silu(gate) * up;
        }
        for (index_t c = 0; c < d; ++c) {
          double s = bias ? b2(e, c) : 0.0;
          for (index_t h = 0; h < f; ++h) s += w2(e, c, h) * hid[static_cast<std::size_t>(h)];
          ref[static_cast<std::size_t>(c)] += sel.gates(i, j) * s;
        }
      }
      for (index_t c = 0; c < d; ++c)
        CHECK(y(i, c) == doctest::Approx(ref[static_cast<std::size_t>(c)]).epsilon(1e-12));
    }
  }
}

// The dense FeedForward: fc1 (2F, D) with SwiGLU (gate rows first), with and without biases, and
// GELU for comparison; every gradient against central differences, and SwiGLU's output against a
// naive evaluation.
TEST_CASE("FeedForward with GELU and SwiGLU: gradient check, with and without biases") {
  const index_t n = 6, d = 4, f = 3;
  for (auto act : {FfnActivation::Gelu, FfnActivation::SwiGLU})
    for (bool bias : {true, false}) {
      CAPTURE(ffn_activation_name(act));
      CAPTURE(bias);
      ParameterArena<double> arena;
      FeedForward<double> ffn;
      ffn.declare(arena, "ffn.", d, f, GeluForm::Erf, act, bias);
      arena.allocate();
      ffn.bind(arena);
      Rng rng(151);
      ffn.init(rng, 0.6);
      CHECK(ffn.activation() == act);
      const index_t width = act == FfnActivation::SwiGLU ? 2 * f : f;
      CHECK(arena.value("ffn.fc1.weight").shape() == Shape{width, d});
      CHECK(arena.params().size() == (bias ? 4u : 2u));
      if (bias) {
        auto b = arena.value("ffn.fc1.bias");
        b.copy_from(random_normal<double>(b.shape(), rng, 0.5));
      }
      auto x = random_normal<double>({n, d}, rng);
      auto w = random_normal<double>({n, d}, rng);
      auto loss = [&] {
        Tensor<double> y;
        ffn.forward(x, y);
        return weighted_sum(y, w);
      };
      Tensor<double> y, dx;
      ffn.forward(x, y);
      if (act == FfnActivation::SwiGLU) {
        auto w1 = arena.value("ffn.fc1.weight"), w2 = arena.value("ffn.fc2.weight");
        for (index_t i = 0; i < n; ++i)
          for (index_t c = 0; c < d; ++c) {
            double s = bias ? arena.value("ffn.fc2.bias")(c) : 0.0;
            for (index_t h = 0; h < f; ++h) {
              double gate = bias ? arena.value("ffn.fc1.bias")(h) : 0.0;
              double up = bias ? arena.value("ffn.fc1.bias")(f + h) : 0.0;
              for (index_t q = 0; q < d; ++q) {
                gate += w1(h, q) * x(i, q);
                up += w1(f + h, q) * x(i, q);
              }
              s += w2(c, h) * naive_silu(gate) * up;
            }
            CHECK(y(i, c) == doctest::Approx(s).epsilon(1e-12));
          }
      }
      arena.zero_grad();
      ffn.backward(w, dx);
      check_gradient("dx", x, dx, loss);
      for (const auto& info : arena.params()) {
        Tensor<double> v = arena.value(info.name);
        check_gradient(info.name, v, arena.grad(info.name), loss);
      }
    }
}

TEST_CASE("FeedForward and the expert bank refuse an unknown activation") {
  ParameterArena<double> arena;
  FeedForward<double> ffn;
  CHECK_THROWS_WITH_AS(ffn.declare(arena, "ffn.", 4, 3, GeluForm::Tanh,
                                   static_cast<FfnActivation>(5)),
                       doctest::Contains("unknown FfnActivation 5"), Error);
  ExpertBank<double> bank;
  CHECK_THROWS_WITH_AS(bank.declare(arena, "e.", 2, 4, 3, static_cast<FfnActivation>(5)),
                       doctest::Contains("unknown FfnActivation 5"), Error);
}
