// Finite-difference gradient checks (double) of every scorer, token graph, selector, auxiliary
// loss and whole router, with and without the detach option.
#include <doctest/doctest.h>

#include "graphmoe/routing/router.hpp"
#include "graphmoe/testing/router_gradcheck.hpp"
#include "routing/router_fixtures.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// Checks d loss / d (every trainable parameter of the arena) against the arena's gradients, after
// `run_backward` has filled them (from zero).
void check_arena(ParameterArena<double>& arena, const std::function<double()>& loss) {
  for (const auto& info : arena.params()) {
    if (!info.trainable) continue;
    Tensor<double> v = arena.value(info.name);
    check_gradient(info.name, v, arena.grad(info.name), loss);
  }
}

template <class Policy>
RouterConfig small_config(index_t e, index_t k) {
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  cfg.options<ScheduledTopK>().k_min = 1;
  cfg.options<ScheduledTopK>().k_max = k;
  cfg.options<ScheduledTopK>().schedule_steps = 10;
  test::set_scorer_init_std(cfg, 0.5);
  return cfg;
}

}  // namespace

TEST_CASE_TEMPLATE("scorer gradient check", Policy, LinearScorer, CosineScorer, FrozenRandomScorer,
                   SigmoidScorer) {
  for (bool learnable : {false, true}) {
    if (learnable && !std::is_same_v<Policy, CosineScorer>) continue;
    CAPTURE(learnable);
    Rng rng(21);
    const index_t n = 6, d = 5, e = 4;
    RouterConfig cfg = small_config<Policy>(e, 2);
    cfg.options<CosineScorer>().dim = 3;
    cfg.options<CosineScorer>().learnable_temperature = learnable;
    ParameterArena<double> arena;
    ScorerImpl<Policy, double> sc;
    sc.declare(arena, "s.", d, cfg);
    arena.allocate();
    sc.bind(arena);
    sc.init(rng);
    auto u = random_normal<double>({n, d}, rng);
    auto w = random_normal<double>({n, e}, rng);
    auto loss = [&] {
      Tensor<double> g;
      sc.forward(u, g);
      return weighted_sum(g, w);
    };
    Tensor<double> g;
    sc.forward(u, g);
    Tensor<double> du(u.shape());
    sc.backward(u, w, du);
    check_gradient("du", u, du, loss);
    check_arena(arena, loss);
    if constexpr (ScorerMapsScores<Policy, double, cpu>) {  // the scorer's own map to r
      auto loss_r = [&] {
        Tensor<double> g2, r2;
        sc.forward(u, g2);
        sc.scores(g2, r2);
        return weighted_sum(r2, w);
      };
      Tensor<double> r, dgamma;
      sc.scores(g, r);
      sc.scores_backward(g, r, w, dgamma);
      Tensor<double> du2(u.shape());
      arena.zero_grad();
      sc.backward(u, dgamma, du2);
      check_gradient("du (through r)", u, du2, loss_r);
      check_arena(arena, loss_r);
    }
    if (std::is_same_v<Policy, FrozenRandomScorer>) {
      CHECK(!arena.params()[0].trainable);
      CHECK(as_vector(arena.grads()).cwiseAbs().maxCoeff() == 0.0);  // never updated
    }
  }
}

TEST_CASE("similarity graph gradient check: causal, non-causal, across row blocks, detached") {
  struct Case { index_t len, d; bool causal, detach, recompute; };
  for (Case cs : {Case{6, 4, false, false, false}, Case{6, 4, true, false, false},
                  Case{135, 2, true, false, false}, Case{135, 2, false, false, true},
                  Case{70, 2, true, false, true}, Case{6, 4, false, true, false},
                  Case{6, 4, true, true, true}}) {
    CAPTURE(cs.recompute);
    CAPTURE(cs.len);
    CAPTURE(cs.causal);
    CAPTURE(cs.detach);
    Rng rng(22);
    const index_t nb = 2, e = 3;
    auto u = random_normal<double>({nb * cs.len, cs.d}, rng, 0.8);
    auto r = random_probs<double>(nb * cs.len, e, rng);
    auto w = random_normal<double>({nb * cs.len, e}, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.options<Similarity>().tau = 0.7;
    cfg.causal = cs.causal;
    test::set_graph_detach(cfg, cs.detach);
    cfg.options<Similarity>().memory = cs.recompute ? GraphMemory::Recompute : GraphMemory::Store;
    GraphImpl<Similarity, double> g;
    g.configure(cs.d, cfg);
    GraphContext<double> ctx{cs.len, nullptr};
    auto loss = [&] {
      Tensor<double> p;
      g.forward(u, r, ctx, p);
      return weighted_sum(p, w);
    };
    Tensor<double> p, dr, du(u.shape());
    g.forward(u, r, ctx, p);
    g.backward(u, r, p, w, ctx, dr, du);
    check_gradient("dr", r, dr, loss);
    if (cs.detach) {
      CHECK(as_vector(du).cwiseAbs().maxCoeff() == 0.0);
    } else {
      check_gradient("du", u, du, loss);
    }
  }
}

TEST_CASE("similarity graph gradient check: exclude_self, a learned temperature, a projection") {
  struct Case { index_t len; bool causal, recompute, exclude, learned, projection = false; };
  for (Case cs : {Case{6, false, false, true, false}, Case{6, true, false, true, false},
                  Case{70, true, true, true, false}, Case{6, false, false, false, true},
                  Case{70, true, true, false, true}, Case{6, true, false, true, true},
                  Case{70, false, true, true, true}, Case{6, false, false, false, false, true},
                  Case{6, true, false, false, true, true}, Case{70, true, true, true, false, true},
                  Case{70, false, true, false, true, true}}) {
    CAPTURE(cs.len);
    CAPTURE(cs.causal);
    CAPTURE(cs.recompute);
    CAPTURE(cs.exclude);
    CAPTURE(cs.learned);
    CAPTURE(cs.projection);
    Rng rng(23);
    const index_t nb = 2, e = 3, d = 3;
    auto u = random_normal<double>({nb * cs.len, d}, rng, 0.8);
    auto r = random_probs<double>(nb * cs.len, e, rng);
    auto w = random_normal<double>({nb * cs.len, e}, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.options<Similarity>().tau = 0.7;
    cfg.causal = cs.causal;
    cfg.options<Similarity>().memory = cs.recompute ? GraphMemory::Recompute : GraphMemory::Store;
    cfg.options<Similarity>().exclude_self = cs.exclude;
    cfg.options<Similarity>().tau_mode = cs.learned ? TauMode::Learned : TauMode::Fixed;
    cfg.options<Similarity>().projection = cs.projection;
    ParameterArena<double> arena;
    GraphImpl<Similarity, double> g;
    g.declare(arena, "graph.", d, cfg);
    arena.allocate();
    g.bind(arena);
    g.init(rng);
    CHECK(arena.size() == (cs.learned ? 1 : 0) + (cs.projection ? 1 : 0));
    // away from the identity, so that a transposed W_s in backward would show
    if (cs.projection) arena.value("graph.w_s").copy_from(random_normal<double>({d, d}, rng, 0.6));
    GraphContext<double> ctx{cs.len, nullptr};
    auto loss = [&] {
      Tensor<double> p;
      g.forward(u, r, ctx, p);
      return weighted_sum(p, w);
    };
    Tensor<double> p, dr, du(u.shape());
    g.forward(u, r, ctx, p);
    arena.zero_grad();
    g.backward(u, r, p, w, ctx, dr, du);
    check_gradient("dr", r, dr, loss);
    check_gradient("du", u, du, loss);
    if (cs.learned) CHECK(std::abs(arena.grad("graph.log_tau")(0)) > 1e-6);
    if (cs.projection) CHECK(as_vector(arena.grad("graph.w_s")).cwiseAbs().maxCoeff() > 1e-6);
    if (cs.learned || cs.projection) check_arena(arena, loss);
  }
}

namespace {

// Finite differences of the gradients the Attention graph's backward accumulated into the cache:
// dprobs at the positive probabilities (the zero ones are outside the domain of log A) that
// `skip` does not leave out, then dv, dw_o, db_o and dout. loss() runs the graph's forward.
template <class Loss, class Skip>
void check_attention_cache_gradients(AttentionCache<double>& cache, const Loss& loss, Skip skip) {
  Tensor<double> probs = cache.probs;
  auto dprobs = cache.dprobs.clone();
  const Tensor<double> mask = probs.clone();
  GradcheckOptions opt;
  opt.h = 1e-7;  // some probabilities are small: a smaller step keeps log A smooth
  opt.skip = [&](index_t i) { return mask.data()[i] == 0.0 || skip(i); };
  check_gradient("dprobs", probs, dprobs, loss, opt);
  check_gradient("dv", cache.v, cache.dv, loss);
  check_gradient("dw_o", cache.w_o, cache.dw_o, loss);
  check_gradient("db_o", cache.b_o, cache.db_o, loss);
  check_gradient("dout", cache.out, cache.dout, loss);
}

}  // namespace

TEST_CASE("attention graph gradient check: into r, the attention probabilities, values, output map and output") {
  for (bool causal : {false, true}) {
    for (HeadChoice hc : {HeadChoice::PerSequence, HeadChoice::PerSequenceCausal}) {
      for (bool detach : {false, true}) {
       for (GraphMemory memory : {GraphMemory::Store, GraphMemory::Recompute}) {
        CAPTURE(causal);
        CAPTURE(detach);
        CAPTURE(static_cast<int>(memory));
        Rng rng(23);
        const index_t nb = 2, len = 5, heads = 2, d = 4, e = 3;
        auto cache = random_attention_cache<double>(nb, len, heads, d, causal, rng);
        auto u = random_normal<double>({nb * len, d}, rng);
        auto r = random_probs<double>(nb * len, e, rng);
        auto w = random_normal<double>({nb * len, e}, rng);
        RouterConfig cfg;
        cfg.num_experts = e;
        cfg.options<Attention>().sigma = 1.7;
        cfg.options<Attention>().head_choice = hc;
        cfg.options<Attention>().memory = memory;
        test::set_graph_detach(cfg, detach);
        GraphImpl<Attention, double> g;
        g.configure(d, cfg);
        GraphContext<double> ctx{len, &cache};
        auto loss = [&] {
          Tensor<double> p;
          g.forward(u, r, ctx, p);
          return weighted_sum(p, w);
        };
        Tensor<double> p, dr, du(u.shape());
        g.forward(u, r, ctx, p);
        zero_sinks(cache);
        g.backward(u, r, p, w, ctx, dr, du);
        check_gradient("dr", r, dr, loss);
        CHECK(as_vector(du).cwiseAbs().maxCoeff() == 0.0);  // u enters only through r
        if (detach) {
          CHECK(as_vector(cache.dprobs).cwiseAbs().maxCoeff() == 0.0);
          CHECK(as_vector(cache.dv).cwiseAbs().maxCoeff() == 0.0);
          continue;
        }
        // Masked (zero) probabilities are outside the domain of log A: their analytic gradient is
        // 0 and they are not perturbed; every positive entry is checked.
        for (index_t i = 0; i < cache.probs.numel(); ++i)
          if (cache.probs.data()[i] == 0.0) CHECK(cache.dprobs.data()[i] == 0.0);
        check_attention_cache_gradients(cache, loss, [](index_t) { return false; });
       }
      }
    }
  }
}

TEST_CASE("attention graph gradient check: A^p recomputed across row blocks, two heads in one block") {
  Rng rng(29);
  const index_t nb = 1, len = 67, heads = 2, d = 4, e = 3;
  auto cache = random_attention_cache<double>(nb, len, heads, d, /*causal=*/true, rng);
  set_head_switch_at_60(cache, nb, len);
  auto r = random_probs<double>(nb * len, e, rng);
  auto u = random_normal<double>({nb * len, d}, rng);
  auto w = random_normal<double>({nb * len, e}, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.causal = true;  // HeadChoice::PerSequenceCausal
  cfg.options<Attention>().sigma = 1.7;
  cfg.options<Attention>().memory = GraphMemory::Recompute;
  GraphImpl<Attention, double> g;
  g.configure(d, cfg);
  GraphContext<double> ctx{len, &cache};
  auto loss = [&] {
    Tensor<double> p;
    g.forward(u, r, ctx, p);
    return weighted_sum(p, w);
  };
  Tensor<double> p, dr, du(u.shape());
  g.forward(u, r, ctx, p);
  REQUIRE(!g.stores());
  REQUIRE(g.heads()[0] == 0);
  REQUIRE(g.heads()[63] == 1);
  zero_sinks(cache);
  g.backward(u, r, p, w, ctx, dr, du);
  check_gradient("dr", r, dr, loss);
  // every positive probability of rows 55..66 (both heads' rows around the switch, the second
  // block), and every 7th elsewhere
  check_attention_cache_gradients(cache, loss, [&](index_t i) {
    const index_t row = (i / len) % len;
    return row < 55 && i % 7 != 0;
  });
}

namespace {

// max |a - b| / max(1, max |a|)
template <class T>
double rel_diff(const Tensor<T>& a, const Tensor<T>& b) {
  REQUIRE(a.shape() == b.shape());
  double scale = 1, worst = 0;
  for (index_t i = 0; i < a.numel(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(a.data()[i])));
    worst = std::max(worst, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
  }
  return worst / scale;
}

// Stored and recomputed graphs differ by the rounding of exp(l - lse) against e / sum.
template <class T>
constexpr double kPathTol = std::is_same_v<T, double> ? 1e-11 : 1e-4;

}  // namespace

TEST_CASE_TEMPLATE("similarity graph: stored and recomputed S agree, forward and backward", T, float,
                   double) {
  struct Case { bool exclude, learned, projection, detach; };
  for (bool causal : {false, true}) {
    for (index_t len : {1, 63, 65, 130}) {
      for (Case cs : {Case{false, false, false, false}, Case{true, false, false, false},
                      Case{false, true, false, false}, Case{false, false, true, false},
                      Case{false, false, false, true}}) {
        CAPTURE(causal);
        CAPTURE(len);
        CAPTURE(cs.exclude);
        CAPTURE(cs.learned);
        CAPTURE(cs.projection);
        CAPTURE(cs.detach);
        Rng rng(41);
        const index_t nb = 2, d = 5, e = 4, n = nb * len;
        const auto u = random_normal<T>({n, d}, rng, 0.8);
        const auto r = random_probs<T>(n, e, rng);
        const auto dp = random_normal<T>({n, e}, rng);
        const auto w_s = random_normal<T>({d, d}, rng, 0.5);
        struct Out {
          Tensor<T> p, dr, du, entropy, self, grads;
          bool stores = false;
        };
        auto run = [&](GraphMemory memory) {
          RouterConfig cfg;
          cfg.num_experts = e;
          cfg.causal = causal;
          auto& o = cfg.options<Similarity>();
          o.tau = 0.8;
          o.exclude_self = cs.exclude;
          o.tau_mode = cs.learned ? TauMode::Learned : TauMode::Fixed;
          o.projection = cs.projection;
          o.detach = cs.detach;
          o.memory = memory;
          ParameterArena<T> arena;
          GraphImpl<Similarity, T> g;
          g.declare(arena, "graph.", d, cfg);
          arena.allocate();
          g.bind(arena);
          Rng init(5);
          g.init(init);
          if (cs.projection) arena.value("graph.w_s").copy_from(w_s);
          Out out;
          g.forward(u, r, {len, nullptr}, out.p);
          out.stores = g.stores();
          arena.zero_grad();
          out.du = Tensor<T>(u.shape());
          g.backward(u, r, out.p, dp, {len, nullptr}, out.dr, out.du);
          out.entropy = g.row_entropy().clone();
          out.self = g.self_weight().clone();
          if (arena.size() > 0) out.grads = arena.grads().clone();
          return out;
        };
        const Out st = run(GraphMemory::Store), re = run(GraphMemory::Recompute);
        CHECK(st.stores);
        CHECK(!re.stores);
        CHECK(rel_diff(st.p, re.p) <= kPathTol<T>);
        CHECK(rel_diff(st.entropy, re.entropy) <= kPathTol<T>);
        CHECK(rel_diff(st.self, re.self) <= kPathTol<T>);
        CHECK(rel_diff(st.dr, re.dr) <= kPathTol<T>);
        CHECK(rel_diff(st.du, re.du) <= kPathTol<T>);
        CHECK(rel_diff(st.grads, re.grads) <= kPathTol<T>);
      }
    }
  }
}

TEST_CASE_TEMPLATE("attention graph: stored and recomputed A^p agree, forward and backward", T, float,
                   double) {
  for (bool causal : {false, true}) {
    for (HeadChoice hc : {HeadChoice::PerSequence, HeadChoice::PerSequenceCausal}) {
      if (causal && hc == HeadChoice::PerSequence) continue;  // refused
      for (index_t len : {1, 63, 65, 130}) {
        for (bool detach : {false, true}) {
          CAPTURE(causal);
          CAPTURE(static_cast<int>(hc));
          CAPTURE(len);
          CAPTURE(detach);
          Rng rng(43);
          const index_t nb = 2, heads = 3, d = 6, e = 4, n = nb * len;
          auto cache = random_attention_cache<T>(nb, len, heads, d, causal, rng);
          if (hc == HeadChoice::PerSequenceCausal) set_head_switch_at_60(cache, nb, len);
          const auto u = random_normal<T>({n, d}, rng);
          const auto r = random_probs<T>(n, e, rng);
          const auto dp = random_normal<T>({n, e}, rng);
          struct Out {
            Tensor<T> p, dr, self, dprobs, dv, dw_o, db_o, dout;
            std::vector<double> entropy;
            std::vector<int> heads;
            bool stores = false;
          };
          auto run = [&](GraphMemory memory) {
            RouterConfig cfg;
            cfg.num_experts = e;
            cfg.causal = causal;
            cfg.options<Attention>().sigma = 1.3;
            cfg.options<Attention>().head_choice = hc;
            cfg.options<Attention>().detach = detach;
            cfg.options<Attention>().memory = memory;
            GraphImpl<Attention, T> g;
            g.configure(d, cfg);
            zero_sinks(cache);
            Out out;
            Tensor<T> du(u.shape());
            g.forward(u, r, {len, &cache}, out.p);
            out.stores = g.stores();
            g.backward(u, r, out.p, dp, {len, &cache}, out.dr, du);
            out.self = g.self_weight().clone();
            out.entropy = g.row_entropy();
            out.heads = g.heads();
            out.dprobs = cache.dprobs.clone();
            out.dv = cache.dv.clone();
            out.dw_o = cache.dw_o.clone();
            out.db_o = cache.db_o.clone();
            out.dout = cache.dout.clone();
            return out;
          };
          const Out st = run(GraphMemory::Store), re = run(GraphMemory::Recompute);
          CHECK(st.stores);
          CHECK(!re.stores);
          if (hc == HeadChoice::PerSequenceCausal && len >= 63) CHECK(st.heads[59] != st.heads[60]);
          CHECK(st.heads == re.heads);
          CHECK(rel_diff(st.p, re.p) <= kPathTol<T>);
          double worst_entropy = 0;
          for (std::size_t i = 0; i < st.entropy.size(); ++i)
            worst_entropy = std::max(worst_entropy, std::abs(st.entropy[i] - re.entropy[i]));
          CHECK(worst_entropy <= kPathTol<T>);
          CHECK(rel_diff(st.self, re.self) <= kPathTol<T>);
          CHECK(rel_diff(st.dr, re.dr) <= kPathTol<T>);
          CHECK(rel_diff(st.dprobs, re.dprobs) <= kPathTol<T>);
          CHECK(rel_diff(st.dv, re.dv) <= kPathTol<T>);
          CHECK(rel_diff(st.dw_o, re.dw_o) <= kPathTol<T>);
          CHECK(rel_diff(st.db_o, re.db_o) <= kPathTol<T>);
          CHECK(rel_diff(st.dout, re.dout) <= kPathTol<T>);
          if (detach) CHECK(as_vector(re.dv).cwiseAbs().maxCoeff() == T(0));
        }
      }
    }
  }
}

TEST_CASE("selector gradient check: renormalised top-k, with and without capacity drops") {
  for (double cf : {0.0, 0.4}) {
    CAPTURE(cf);
    Rng rng(24);
    const index_t n = 10, e = 5, k = 2;
    auto p = random_probs<double>(n, e, rng);
    auto w = random_normal<double>({n, k}, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.k = k;
    cfg.capacity_factor = cf;
    SelectorImpl<TopK, double> sel;
    sel.configure(cfg);
    Selection<double> s;
    sel.select(p, k, s);
    if (cf > 0) CHECK(dropped_count(s) > 0);
    auto loss = [&] {
      Selection<double> t;
      sel.select(p, k, t);
      return weighted_sum(t.gates, w);
    };
    Tensor<double> dp;
    sel.backward(p, s, w, dp);
    check_gradient("dp", p, dp, loss);
  }
}

TEST_CASE("auxiliary losses gradient check: load balancing on p, z-loss on gamma") {
  Rng rng(25);
  const index_t n = 8, e = 4, k = 2;
  auto p = random_probs<double>(n, e, rng);
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < n * k; ++i) idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(e));
  Tensor<double> dp(p.shape());
  const double lb = load_balance_loss<double>(p, idx, 0.3, &dp);
  // naive: E * sum_e f_e P_e
  double ref = 0;
  for (index_t x = 0; x < e; ++x) {
    double f = 0, pm = 0;
    for (index_t s = 0; s < n * k; ++s) f += idx.data()[s] == x ? 1.0 / static_cast<double>(n * k) : 0.0;
    for (index_t i = 0; i < n; ++i) pm += p(i, x) / static_cast<double>(n);
    ref += f * pm;
  }
  CHECK(lb == doctest::Approx(static_cast<double>(e) * ref).epsilon(1e-12));
  check_gradient("load balance dp", p, dp, [&] { return 0.3 * load_balance_loss<double>(p, idx, 0, nullptr); });

  auto gamma = random_normal<double>({n, e}, rng, 2.0);
  Tensor<double> dg(gamma.shape());
  const double z = z_loss<double>(gamma, 0.7, &dg);
  double zref = 0;
  for (index_t i = 0; i < n; ++i) {
    double s = 0;
    for (index_t x = 0; x < e; ++x) s += std::exp(gamma(i, x));
    zref += std::log(s) * std::log(s) / static_cast<double>(n);
  }
  CHECK(z == doctest::Approx(zref).epsilon(1e-12));
  check_gradient("z-loss dgamma", gamma, dg, [&] { return 0.7 * z_loss<double>(gamma, 0, nullptr); });
}

TEST_CASE_TEMPLATE("whole router gradient check (gates + load balancing + z-loss)", Policy, SoftmaxRouter,
                   SimilarityRouter, AttentionRouter, XMoERouter, SimilarityXMoERouter,
                   SMoEDropoutRouter, AttentionSMoEDropoutRouter, SigmoidBiasRouter,
                   SimilaritySigmoidBiasRouter, AttentionSigmoidBiasRouter) {
  for (bool detach : {false, true}) {
    if (detach && std::is_same_v<typename Policy::graph, Independent>) continue;
    CAPTURE(detach);
    Rng rng(26);
    const index_t nb = 2, len = 5, d = 4, e = 4, k = 2;
    RouterConfig cfg = small_config<Policy>(e, k);
    cfg.options<CosineScorer>().dim = 3;
    cfg.causal = true;
    test::set_graph_detach(cfg, detach);
    cfg.load_balance_coef = 0.1;
    cfg.z_loss_coef = 0.01;
    ParameterArena<double> arena;
    RouterImpl<Policy, double> router;
    router.declare(arena, "router.", d, cfg);
    arena.allocate();
    router.bind(arena);
    router.init(rng);
    router.set_step(10);  // ScheduledTopK: k = k_max = 2
    auto cache = random_attention_cache<double>(nb, len, 2, d, true, rng);
    GraphContext<double> ctx{len, Policy::needs_attention ? &cache : nullptr};
    auto u = random_normal<double>({nb * len, d}, rng);
    auto w = random_normal<double>({nb * len, k}, rng);
    auto loss = [&] {
      RouterOutput<double> o;
      router.forward(u, ctx, o);
      return weighted_sum(o.selection.gates, w) + cfg.load_balance_coef * o.load_balance_loss +
             cfg.z_loss_coef * o.z_loss;
    };
    RouterOutput<double> out;
    router.forward(u, ctx, out);
    CHECK(out.load_balance_loss > 0);
    CHECK(out.z_loss > 0);
    Tensor<double> du(u.shape());
    arena.zero_grad();
    zero_sinks(cache);
    router.backward(u, ctx, out, w, du);
    REQUIRE(router.current_k() == k);
    // A detached similarity graph drops the path u -> S on purpose, so finite differences in u
    // (which see it) differ; the parameters never reach S, so their gradients stay exact.
    if (!(detach && std::is_same_v<typename Policy::graph, Similarity>)) check_gradient("du", u, du, loss);
    check_arena(arena, loss);
    if (Policy::needs_attention && !detach) {
      check_gradient("dv", cache.v, cache.dv, loss);
      check_gradient("dout", cache.out, cache.dout, loss);
    }
  }
}

// DeepSeek-V3's sequence-wise balance loss (ops/aux_losses.hpp seq_aux_loss): the op's gradient
// on unnormalised positive scores (where the per-token normalisation matters), then whole routers
// with only that auxiliary term on, its coefficient large enough that a wrong gradient shows.
TEST_CASE("sequence-wise balance loss: the op's gradient on unnormalised scores") {
  Rng rng(41);
  const index_t nb = 3, len = 4, e = 5, k = 2, n = nb * len;
  Tensor<double> p({n, e});
  for (index_t i = 0; i < p.numel(); ++i) p.data()[i] = 0.05 + rng.uniform();
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < n * k; ++i) idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(e));
  Tensor<double> dp(p.shape());
  const double v = seq_aux_loss<double>(p, idx, len, 0.7, &dp);
  CHECK(v > 0);
  check_gradient("seq aux dp", p, dp, [&] { return 0.7 * seq_aux_loss<double>(p, idx, len, 0, nullptr); });
  // one sequence of all n rows differs from three of len (f is per sequence)
  CHECK(seq_aux_loss<double>(p, idx, n, 0, nullptr) != doctest::Approx(v).epsilon(1e-9));
  // scaling a token's scores changes nothing (p' is normalised per token)
  Tensor<double> q = p.clone();
  for (index_t x = 0; x < e; ++x) q(2, x) *= 3.0;
  CHECK(seq_aux_loss<double>(q, idx, len, 0, nullptr) == doctest::Approx(v).epsilon(1e-12));
}

TEST_CASE_TEMPLATE("whole router gradient check with the sequence-wise balance loss", Policy,
                   SoftmaxRouter, SimilarityRouter, SigmoidBiasRouter) {
  RouterConfig cfg = small_config<Policy>(4, 2);
  cfg.causal = true;
  cfg.seq_aux_loss_coef = 1.5;
  const auto results = testing::check_router_gradients<Policy>(cfg, 12, 4, 4, 27);
  REQUIRE(!results.empty());
  for (const auto& r : results) {
    CAPTURE(r.str());
    CHECK(r.ok());
  }
  // the term is on: the router reports it, and its gradient moves du
  RouterConfig off = cfg;
  off.seq_aux_loss_coef = 0;
  ParameterArena<double> a1, a2;
  RouterImpl<Policy, double> on_r, off_r;
  on_r.declare(a1, "router.", 4, cfg);
  off_r.declare(a2, "router.", 4, off);
  a1.allocate();
  a2.allocate();
  on_r.bind(a1);
  off_r.bind(a2);
  Rng r1(5), r2(5);
  on_r.init(r1);
  off_r.init(r2);
  Rng rng(6);
  auto u = random_normal<double>({12, 4}, rng);
  auto w = random_normal<double>({12, 2}, rng);
  GraphContext<double> ctx{4, nullptr};
  RouterOutput<double> o1, o2;
  on_r.forward(u, ctx, o1);
  off_r.forward(u, ctx, o2);
  CHECK(o1.seq_aux_loss > 0);
  CHECK(o2.seq_aux_loss == 0);
  Tensor<double> du1(u.shape()), du2(u.shape());
  on_r.backward(u, ctx, o1, w, du1);
  off_r.backward(u, ctx, o2, w, du2);
  double diff = 0;
  for (index_t i = 0; i < du1.numel(); ++i) diff = std::max(diff, std::abs(du1.data()[i] - du2.data()[i]));
  CHECK(diff > 1e-6);
}
