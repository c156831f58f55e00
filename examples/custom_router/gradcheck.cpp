// custom_router/gradcheck: checks the three user policies (noisy_scorer.hpp, knn_graph.hpp,
// top_p_selector.hpp) in double precision, the way graphmoe checks its own:
//   1. the graphmoe concepts accept them (static_assert, at compile time);
//   2. each forward against a naive loop;
//   3. central-difference gradients of each policy alone, of an MoELayer routed by
//      Router<NoisyScorer, KnnGraph<3>, TopP>, and of a tiny TransformerLM with that router
//      (every trainable parameter). The scorer's noise is frozen (resample = false) for 3.
// An entry passes when |analytic - numeric| <= 1e-6 + 1e-6 max(|analytic|, |numeric|), h = 1e-6.
//   4. the whole router through graphmoe's public router checker
//      (graphmoe::testing::check_router_gradients, which sets Mode::Eval: the scorer's noise off).
// Prints the worst error of every check; the exit status is 1 when any check fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <graphmoe/graphmoe.hpp>
#include <graphmoe/testing/router_gradcheck.hpp>

#include "knn_graph.hpp"
#include "noisy_scorer.hpp"
#include "top_p_selector.hpp"

using namespace graphmoe;
using custom_router::KnnGraph;
using custom_router::NoisyScorer;
using custom_router::TopP;

// ---- 1. the concepts ----------------------------------------------------------------------------
static_assert(ScorerPolicy<NoisyScorer, double> && ScorerPolicy<NoisyScorer, float>);
static_assert(TokenGraphPolicy<KnnGraph<3>, double> && TokenGraphPolicy<KnnGraph<4>, float>);
static_assert(SelectorPolicy<TopP, double> && SelectorPolicy<TopP, float>);
// the wrong kind is rejected
static_assert(!ScorerPolicy<KnnGraph<3>, double> && !TokenGraphPolicy<TopP, double> &&
              !SelectorPolicy<NoisyScorer, double>);

using CustomRouter = Router<NoisyScorer, KnnGraph<3>, TopP>;
static_assert(!CustomRouter::needs_attention);

namespace {

int g_failures = 0;

void report(const std::string& what, bool ok, const std::string& detail) {
  std::printf("%-44s %s  %s\n", what.c_str(), ok ? "ok  " : "FAIL", detail.c_str());
  if (!ok) ++g_failures;
}

std::string fmt(const char* f, double a, double b = 0, double c = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

// ---- graphmoe's public finite-difference checker (graphmoe/testing/gradcheck.hpp), reported here
// Central differences in every entry of x; `loss` recomputes the forward from x's contents.
void check_gradient(const std::string& name, Tensor<double>& x, const Tensor<double>& analytic,
                    const std::function<double()>& loss) {
  if (analytic.shape() != x.shape()) {
    report("grad " + name, false, "gradient shape " + analytic.shape().str() + " != " + x.shape().str());
    return;
  }
  const testing::GradcheckResult r = testing::check_gradient(name, x, analytic, loss);
  for (const auto& f : r.first_failures) std::printf("    %s\n", f.c_str());
  report("grad " + name, r.ok(),
         fmt("%4.0f entries, worst err/bound %.3f", static_cast<double>(r.checked), r.worst));
}

Tensor<double> random_normal(const Shape& shape, Rng& rng, double stddev = 1.0) {
  Tensor<double> t(shape);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = rng.normal(0.0, stddev);
  return t;
}
double weighted_sum(const Tensor<double>& y, const Tensor<double>& w) {
  double s = 0;
  for (index_t i = 0; i < y.numel(); ++i) s += y.data()[i] * w.data()[i];
  return s;
}
double max_abs_diff(const Tensor<double>& a, const Tensor<double>& b) {
  if (a.shape() != b.shape()) return INFINITY;
  double m = 0;
  for (index_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.data()[i] - b.data()[i]));
  return m;
}
// rows of softmax(scale * z), z ~ N(0, 1)
Tensor<double> random_distributions(index_t n, index_t e, double scale, Rng& rng) {
  Tensor<double> p = random_normal({n, e}, rng, scale);
  for (index_t i = 0; i < n; ++i) {
    double mx = -INFINITY, z = 0;
    for (index_t c = 0; c < e; ++c) mx = std::max(mx, p(i, c));
    for (index_t c = 0; c < e; ++c) z += (p(i, c) = std::exp(p(i, c) - mx));
    for (index_t c = 0; c < e; ++c) p(i, c) /= z;
  }
  return p;
}

// ---- the scorer ---------------------------------------------------------------------------------
void check_scorer() {
  const index_t n = 6, d = 4, e = 5;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<NoisyScorer>().init_std = 0.7;
  ParameterArena<double> arena;
  NoisyScorer::impl<double, cpu> s;
  s.declare(arena, "scorer.", d, cfg);
  arena.allocate();
  s.bind(arena);
  Rng rng(11);
  s.init(rng);
  Tensor<double> u = random_normal({n, d}, rng), w = random_normal({n, e}, rng);

  // forward against a loop: gamma_ie = sum_c u_ic Wg_ec + eps_ie softplus(sum_c u_ic Wn_ec)
  Tensor<double> gamma;
  s.forward(u, gamma);
  const Tensor<double> eps1 = s.noise().clone();
  Tensor<double> naive({n, e});
  for (index_t i = 0; i < n; ++i)
    for (index_t c = 0; c < e; ++c) {
      double hg = 0, hn = 0;
      for (index_t q = 0; q < d; ++q) {
        hg += u(i, q) * s.w_gate()(c, q);
        hn += u(i, q) * s.w_noise()(c, q);
      }
      naive(i, c) = hg + eps1(i, c) * std::log(1.0 + std::exp(hn));
    }
  report("scorer forward vs loop", max_abs_diff(gamma, naive) < 1e-12,
         fmt("max |diff| %.2e", max_abs_diff(gamma, naive)));
  // noise: resampled by default, frozen with resample = false, absent with noisy = false
  Tensor<double> g2, g3, g4;
  s.forward(u, g2);
  const bool fresh = max_abs_diff(s.noise(), eps1) > 0.1;
  s.resample = false;
  s.forward(u, g3);
  Tensor<double> g3b;
  s.forward(u, g3b);
  const bool frozen = max_abs_diff(g3, g3b) == 0.0;
  s.noisy = false;
  s.forward(u, g4);
  double no_noise = 0;
  for (index_t i = 0; i < n; ++i)
    for (index_t c = 0; c < e; ++c) {
      double hg = 0;
      for (index_t q = 0; q < d; ++q) hg += u(i, q) * s.w_gate()(c, q);
      no_noise = std::max(no_noise, std::abs(g4(i, c) - hg));
    }
  s.noisy = true;
  report("scorer noise resampled / frozen / off", fresh && frozen && no_noise < 1e-12,
         fmt("resampled %.0f, frozen %.0f, noisy=false max |diff| %.2e", fresh, frozen, no_noise));

  // gradients (noise frozen: s.resample is false)
  auto loss = [&] {
    Tensor<double> g;
    s.forward(u, g);
    return weighted_sum(g, w);
  };
  arena.zero_grad();
  Tensor<double> du({n, d});
  s.forward(u, gamma);
  s.backward(u, w, du);
  // du is accumulated: a second backward onto it doubles it
  Tensor<double> du2 = du.clone();
  arena.zero_grad();
  s.backward(u, w, du2);
  Tensor<double> twice = du.clone();
  for (index_t i = 0; i < twice.numel(); ++i) twice.data()[i] *= 2;
  report("scorer du accumulates (+=)", max_abs_diff(du2, twice) < 1e-12, "");
  check_gradient("scorer du", u, du, loss);
  for (const char* name : {"scorer.w_gate", "scorer.w_noise"}) {
    Tensor<double> v = arena.value(name);
    check_gradient(std::string("scorer ") + name, v, arena.grad(name), loss);
  }
}

// ---- the graph ----------------------------------------------------------------------------------
void check_graph(bool causal) {
  constexpr int K = 3;
  const index_t nb = 2, len = 6, n = nb * len, d = 4, e = 3;
  const std::string tag = causal ? "graph (causal)" : "graph";
  RouterConfig cfg;
  cfg.causal = causal;
  KnnGraph<K>::impl<double, cpu> g;
  g.configure(d, cfg);
  Rng rng(causal ? 23 : 22);
  Tensor<double> u = random_normal({n, d}, rng), r = random_distributions(n, e, 1.0, rng);
  Tensor<double> w = random_normal({n, e}, rng);
  const GraphContext<double> ctx{len, nullptr};
  Tensor<double> p;
  g.forward(u, r, ctx, p);

  // forward against a loop: every l_ij, a full sort, softmax over the first K
  Tensor<double> naive({n, e});
  double entropy = 0;
  for (index_t i = 0; i < n; ++i) {
    const index_t s0 = i / len * len, s1 = causal ? i + 1 : s0 + len;
    std::vector<std::pair<double, index_t>> l;
    for (index_t j = s0; j < s1; ++j) {
      double dot = 0;
      for (index_t c = 0; c < d; ++c) dot += u(i, c) * u(j, c);
      l.emplace_back(-dot / std::sqrt(static_cast<double>(d)), j);  // ascending = most similar first
    }
    std::sort(l.begin(), l.end());
    const std::size_t m = std::min<std::size_t>(K, l.size());
    double z = 0;
    for (std::size_t q = 0; q < m; ++q) z += std::exp(-l[q].first);
    for (std::size_t q = 0; q < m; ++q) {
      const double wij = std::exp(-l[q].first) / z;
      entropy -= wij * std::log(wij) / static_cast<double>(n);
      for (index_t c = 0; c < e; ++c) naive(i, c) += wij * r(l[q].second, c);
    }
  }
  report(tag + " forward vs loop",
         max_abs_diff(p, naive) < 1e-12 && std::abs(g.mean_entropy() - entropy) < 1e-12,
         fmt("max |diff| %.2e, entropy %.6f vs %.6f", max_abs_diff(p, naive), g.mean_entropy(),
             entropy));

  auto loss = [&] {
    Tensor<double> q;
    g.forward(u, r, ctx, q);
    return weighted_sum(q, w);
  };
  Tensor<double> dr, du({n, d});
  g.forward(u, r, ctx, p);
  g.backward(u, r, p, w, ctx, dr, du);
  check_gradient(tag + " dr", r, dr, loss);
  check_gradient(tag + " du", u, du, loss);

  // the policy's own option: detach = true leaves du alone and dr as it was
  RouterConfig dcfg = cfg;
  dcfg.options<KnnGraph<K>>().detach = true;
  KnnGraph<K>::impl<double, cpu> gd;
  gd.configure(d, dcfg);
  Tensor<double> pd, drd, dud({n, d});
  gd.forward(u, r, ctx, pd);
  gd.backward(u, r, pd, w, ctx, drd, dud);
  double du_max = 0;
  for (index_t i = 0; i < dud.numel(); ++i) du_max = std::max(du_max, std::abs(dud.data()[i]));
  report(tag + " KnnGraph::Options::detach", du_max == 0 && max_abs_diff(drd, dr) == 0,
         fmt("max |du| %.2e, dr diff %.2e", du_max, max_abs_diff(drd, dr)));
}

// ---- the selector -------------------------------------------------------------------------------
void check_selector() {
  const index_t n = 40, e = 6, k = 3;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  TopP::impl<double, cpu> s;
  s.configure(cfg);
  report("TopP::Options default threshold", s.threshold() == 0.6, fmt("%g", s.threshold()));
  {  // the policy's own options: set, read back, and refused out of range
    RouterConfig other = cfg;
    other.options<TopP>().threshold = 0.9;
    TopP::impl<double, cpu> s9;
    s9.configure(other);
    report("TopP::Options threshold set", s9.threshold() == 0.9 && cfg.options<TopP>().threshold == 0.6,
           fmt("set %g, other config %g", s9.threshold(), cfg.options<TopP>().threshold));
    other.options<TopP>().threshold = 1.5;
    bool refused = false;
    try {
      s9.configure(other);
    } catch (const graphmoe::Error& err) {
      refused = std::string(err.what()).find("threshold must be in (0, 1]") != std::string::npos;
    }
    report("TopP::Options threshold 1.5 refused", refused, "");
  }
  Rng rng(31);
  // a spread of confidences: some rows reach 0.6 with one expert, some need three, some never do
  Tensor<double> p = random_distributions(n, e, 2.0, rng);
  Tensor<double> w = random_normal({n, k}, rng);
  Selection<double> sel;
  s.select(p, s.current_k(), sel);

  // forward against a loop: a full sort of each row
  double worst = 0;
  bool same = true;
  index_t dropped = 0, kept_one = 0, kept_all = 0;
  for (index_t i = 0; i < n; ++i) {
    std::vector<std::pair<double, index_t>> v;
    for (index_t c = 0; c < e; ++c) v.emplace_back(-p(i, c), c);
    std::sort(v.begin(), v.end());
    double cum = 0, sum = 0;
    index_t m = 0;
    while (m < k && cum < s.threshold()) cum += -v[static_cast<std::size_t>(m++)].first;
    for (index_t l = 0; l < m; ++l) sum += -v[static_cast<std::size_t>(l)].first;
    dropped += k - m;
    kept_one += m == 1;
    kept_all += m == k;
    for (index_t l = 0; l < k; ++l) {
      const auto [negp, c] = v[static_cast<std::size_t>(l)];
      same = same && sel.indices(i, l) == c && sel.keep(i, l) == (l < m ? 1 : 0) &&
             sel.values(i, l) == -negp;
      worst = std::max(worst, std::abs(sel.gates(i, l) - (l < m ? -negp / sum : 0.0)));
    }
  }
  report("selector forward vs loop", same && worst < 1e-14 && graphmoe::dropped_count(sel) == dropped,
         fmt("gates max |diff| %.2e; %.0f dropped assignments, ", worst,
             static_cast<double>(dropped)) +
             fmt("%.0f tokens on 1 expert, %.0f on all k", static_cast<double>(kept_one),
                 static_cast<double>(kept_all)));
  report("selector test covers both cases", kept_one > 0 && kept_all > 0 && kept_one + kept_all < n,
         "");

  auto loss = [&] {
    Selection<double> s2;
    s.select(p, s.current_k(), s2);
    return weighted_sum(s2.gates, w);
  };
  Tensor<double> dp;
  s.backward(p, sel, w, dp);
  check_gradient("selector dp", p, dp, loss);
}

// ---- an MoE layer with the custom router --------------------------------------------------------
void set_noise_frozen(MoELayer<CustomRouter, double>& layer, bool frozen) {
  layer.router().scorer().resample = !frozen;
}

void check_moe_layer() {
  MoEConfig cfg;
  cfg.d_model = 4;
  cfg.d_ff = 3;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.router.options<NoisyScorer>().init_std = 1.0;
  cfg.router.load_balance_coef = 0.05;
  cfg.init_std = 0.5;
  ParameterArena<double> arena;
  MoELayer<CustomRouter, double> layer;
  layer.declare(arena, "moe.", cfg);
  arena.allocate();
  layer.bind(arena);
  Rng rng(41);
  layer.init(rng);
  const index_t nb = 2, len = 5, d = cfg.d_model;
  const GraphContext<double> ctx{len, nullptr};
  Tensor<double> u = random_normal({nb * len, d}, rng), w = random_normal({nb * len, d}, rng);
  Tensor<double> y;
  layer.forward(u, ctx, y);  // draws the noise
  set_noise_frozen(layer, true);
  auto loss = [&] {
    Tensor<double> out;
    layer.forward(u, ctx, out);
    return weighted_sum(out, w) + 0.05 * layer.routing().load_balance_loss;
  };
  Tensor<double> du;
  layer.forward(u, ctx, y);
  const index_t dropped = graphmoe::dropped_count(layer.routing().selection);
  report("moe layer: router name", CustomRouter::name() == "noisy/knn/top-p",
         CustomRouter::name() + fmt(", %.0f of %.0f assignments dropped by top-p",
                                    static_cast<double>(dropped),
                                    static_cast<double>(nb * len * cfg.router.k)));
  arena.zero_grad();
  layer.backward(w, du);
  check_gradient("moe du", u, du, loss);
  for (const auto& info : arena.params()) {
    if (!info.trainable) continue;
    Tensor<double> v = arena.value(info.name);
    check_gradient(info.name, v, arena.grad(info.name), loss);
  }
}

// ---- a tiny TransformerLM with the custom router ------------------------------------------------
void check_lm() {
  TransformerLMConfig cfg;
  cfg.vocab_size = 11;
  cfg.max_seq_len = 6;
  cfg.d_model = 8;
  cfg.num_layers = 2;
  cfg.num_heads = 2;
  cfg.d_ff = 6;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.router.options<NoisyScorer>().init_std = 1.0;
  cfg.init_std = 0.3;
  TransformerLM<CustomRouter, double> lm(cfg, 5);
  const index_t b = 2, t = 6;
  Rng rng(7);
  Tensor<std::int32_t> ids({b, t}), targets({b, t});
  for (index_t i = 0; i < b * t; ++i) {
    ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(11));
    targets.data()[i] = static_cast<std::int32_t>(rng.uniform_int(11));
  }
  lm.forward(ids, targets);  // draws the noise
  for (index_t l = 0; l < lm.num_layers(); ++l) lm.block(l).moe().router().scorer().resample = false;
  auto loss = [&] { return lm.forward(ids, targets).total(); };
  const double l0 = loss();
  index_t dropped = 0;
  for (index_t l = 0; l < lm.num_layers(); ++l) dropped += graphmoe::dropped_count(lm.block(l).moe().routing().selection);
  report("lm: loss", std::isfinite(l0),
         fmt("loss %.6f, %.0f assignments dropped by top-p", l0, static_cast<double>(dropped)));
  lm.arena().zero_grad();
  lm.backward();
  index_t checked = 0;
  for (const auto& info : lm.arena().params()) {
    if (!info.trainable) continue;
    Tensor<double> v = lm.arena().value(info.name);
    check_gradient("lm " + info.name, v, lm.arena().grad(info.name), loss);
    ++checked;
  }
  std::printf("lm: %lld trainable parameters checked\n", static_cast<long long>(checked));
}

// ---- 4. the whole router through graphmoe's public router checker (Mode::Eval: no noise)
void check_router() {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.k = 2;
  cfg.options<TopP>().threshold = 0.9;
  for (const auto& r : testing::check_router_gradients<CustomRouter>(cfg, 12, 5, 6, 3))
    report("router (public checker) " + r.name, r.ok(),
           fmt("%4.0f entries, worst err/bound %.3f", static_cast<double>(r.checked), r.worst));
}

}  // namespace

int main() {
  try {
    check_scorer();
    check_graph(false);
    check_graph(true);
    check_selector();
    check_moe_layer();
    check_lm();
    check_router();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradcheck: error: %s\n", e.what());
    return 1;
  }
  if (g_failures > 0) {
    std::printf("gradcheck: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  std::printf("gradcheck: all checks passed\n");
  return 0;
}
