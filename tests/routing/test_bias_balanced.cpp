// The routers of DeepSeek-V3-style MoE: the sigmoid scorer, TopK's gate options (norm_topk_prob,
// routed_scaling_factor), group-limited routing and auxiliary-loss-free bias balancing, against
// naive loop-by-loop evaluations, with finite-difference gradient checks in double, and the
// after-step lifecycle (loads counted in training forwards only, summed over ranks).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "graphmoe/core/communicator.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gates.hpp"
#include "graphmoe/routing/router.hpp"
#include "routing/router_fixtures.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// DeepSeek-V3's selection written out: the k largest of (p + b) within the topk_group groups of
// largest top-2 sum; values p there, gates renormalised (or not) times the scale.
struct RefSelection {
  std::vector<std::vector<int>> idx;
  std::vector<std::vector<double>> gates;
};
RefSelection reference_selection(const Tensor<double>& p, const std::vector<double>& bias,
                                 index_t k, const TokenChoiceOptions& o) {
  const index_t n = p.rows(), e = p.cols(), size = e / o.n_group;
  RefSelection out;
  for (index_t i = 0; i < n; ++i) {
    std::vector<double> q(static_cast<std::size_t>(e));
    for (index_t c = 0; c < e; ++c) q[c] = p(i, c) + (bias.empty() ? 0.0 : bias[c]);
    std::vector<std::pair<double, int>> groups;
    for (index_t g = 0; g < o.n_group; ++g) {
      std::vector<double> v(q.begin() + g * size, q.begin() + (g + 1) * size);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({size == 1 ? v[0] : v[0] + v[1], static_cast<int>(g)});
    }
    std::stable_sort(groups.begin(), groups.end(),
                     [](auto a, auto b) { return a.first > b.first; });
    std::vector<bool> allowed(static_cast<std::size_t>(e), false);
    for (index_t g = 0; g < o.topk_group; ++g)
      for (index_t c = 0; c < size; ++c) allowed[groups[g].second * size + c] = true;
    std::vector<int> order;
    for (index_t c = 0; c < e; ++c)
      if (allowed[c]) order.push_back(static_cast<int>(c));
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return q[a] > q[b]; });
    order.resize(static_cast<std::size_t>(k));
    double s = 0;
    for (int c : order) s += p(i, c);
    std::vector<double> g;
    for (int c : order) g.push_back((o.norm_topk_prob ? p(i, c) / s : p(i, c)) * o.routed_scaling_factor);
    out.idx.push_back(order);
    out.gates.push_back(g);
  }
  return out;
}

template <class Policy>
RouterConfig deepseek_config(index_t e, index_t k) {
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  auto& o = cfg.options<TopK>();  // the token choice BiasBalancedTopK shares with TopK
  o.norm_topk_prob = true;
  o.routed_scaling_factor = 2.5;
  o.n_group = 4;
  o.topk_group = 2;
  cfg.options<BiasBalancedTopK>().bias_update_rate = 0.01;
  test::set_scorer_init_std(cfg, 0.7);
  return cfg;
}

// A host communicator of `size` ranks whose other ranks all hold `others` in every all-reduce
// (of doubles): the sum is data + (size - 1) * others.
class FakeWorld final : public dist::Communicator {
 public:
  FakeWorld(int size, std::vector<double> others) : size_(size), others_(std::move(others)) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  dist::MemorySpace memory_space() const override { return dist::MemorySpace::Host; }
  index_t max_count() const override { return 1 << 20; }
  void barrier() override {}
  int reduces = 0;

 protected:
  void all_reduce_sum_impl(void* data, index_t count, dist::ElementType type) override {
    REQUIRE(type == dist::ElementType::F64);
    REQUIRE(count == static_cast<index_t>(others_.size()));
    auto* d = static_cast<double*>(data);
    for (index_t i = 0; i < count; ++i) d[i] += (size_ - 1) * others_[static_cast<std::size_t>(i)];
    ++reduces;
  }
  void broadcast_impl(void*, index_t, dist::ElementType, int) override {}
  void all_to_all_v_impl(const void*, const index_t*, const index_t*, void*, const index_t*,
                         const index_t*, dist::ElementType) override {}
  void min_over_ranks(std::span<std::int64_t>) override {}

 private:
  int size_;
  std::vector<double> others_;
};

}  // namespace

TEST_CASE_TEMPLATE("sigmoid_forward / sigmoid_backward: the logistic function and its derivative",
                   T, float, double) {
  Rng rng(3);
  Tensor<T> x = random_normal<T>({7, 5}, rng, 6.0), y, dx;
  x.data()[0] = T(-800);  // exp(800) overflows: the stable form gives 0, not NaN
  x.data()[1] = T(800);
  sigmoid_forward(x, y);
  for (index_t i = 0; i < x.numel(); ++i)
    CHECK(static_cast<double>(y.data()[i]) ==
          doctest::Approx(sigmoid_ref(static_cast<double>(x.data()[i]))).epsilon(1e-6));
  CHECK(y.data()[0] == T(0));
  CHECK(y.data()[1] == T(1));
  Tensor<T> dy = random_normal<T>({7, 5}, rng);
  sigmoid_backward(y, dy, dx);
  for (index_t i = 0; i < x.numel(); ++i) {
    const double v = static_cast<double>(y.data()[i]);
    CHECK(static_cast<double>(dx.data()[i]) ==
          doctest::Approx(static_cast<double>(dy.data()[i]) * v * (1 - v)).epsilon(1e-6));
  }
  if constexpr (std::is_same_v<T, double>) {
    Tensor<double> xs = random_normal<double>({3, 4}, rng, 2.0), ys, dxs;
    Tensor<double> w = random_normal<double>({3, 4}, rng);
    sigmoid_forward(xs, ys);
    sigmoid_backward(ys, w, dxs);
    check_gradient("sigmoid dx", xs, dxs, [&] {
      Tensor<double> o;
      sigmoid_forward(xs, o);
      return weighted_sum(o, w);
    });
  }
  Tensor<T> bad({2, 2});
  CHECK_THROWS_WITH_AS(sigmoid_backward(y, bad, dx), doctest::Contains("sigmoid_backward"), Error);
}

TEST_CASE("renormalized_gates with GateScaling: naive values and finite-difference gradients") {
  Rng rng(5);
  const index_t n = 6, e = 7, k = 3;
  Tensor<double> p = random_probs<double>(n, e, rng);
  Tensor<double> values;
  Tensor<std::int32_t> indices;
  topk_forward(p, k, values, indices);
  Tensor<std::uint8_t> keep({n, k});
  for (index_t a = 0; a < keep.numel(); ++a) keep.data()[a] = a % 4 == 1 ? 0 : 1;  // some drops
  for (bool normalize : {true, false}) {
    for (double scale : {1.0, 2.5}) {
      CAPTURE(normalize);
      CAPTURE(scale);
      const GateScaling sc{normalize, scale};
      Tensor<double> gates;
      renormalized_gates(values, keep, gates, sc);
      for (index_t i = 0; i < n; ++i) {
        double s = 0;
        for (index_t j = 0; j < k; ++j) s += values(i, j);
        for (index_t j = 0; j < k; ++j) {
          const double want = keep(i, j) ? (normalize ? values(i, j) / s : values(i, j)) * scale : 0;
          CHECK(gates(i, j) == doctest::Approx(want).epsilon(1e-14));
        }
      }
      // d/dp of sum w * gates, the values gathered from p at fixed indices
      Tensor<double> w = random_normal<double>({n, k}, rng), dp;
      renormalized_gates_backward(values, indices, keep, gates, w, e, dp, sc);
      check_gradient("dp", p, dp, [&] {
        Tensor<double> v, g;
        gather_columns(p, indices, v);
        renormalized_gates(v, keep, g, sc);
        return weighted_sum(g, w);
      });
    }
  }
  Tensor<double> gates;
  CHECK_THROWS_WITH_AS(renormalized_gates(values, keep, gates, GateScaling{true, 0.0}),
                       doctest::Contains("routed_scaling_factor"), Error);
}

TEST_CASE("group_limited_mask, gather_columns, accumulate_expert_counts: naive evaluations and errors") {
  // 2 tokens, 6 experts in 3 groups of 2: group scores (top-2 sums) decide
  Tensor<double> x({2, 6});
  const double rows[2][6] = {{0.1, 0.9, 0.5, 0.45, 0.2, 0.3}, {1.0, -5.0, 0.3, 0.3, 0.4, 0.1}};
  for (index_t i = 0; i < 2; ++i)
    for (index_t c = 0; c < 6; ++c) x(i, c) = rows[i][c];
  Tensor<double> m;
  group_limited_mask(x, 3, 1, m);
  // row 0: groups 1.0, 0.95, 0.5 -> group 0; row 1: -4.0, 0.6, 0.5 -> group 1
  const double ninf = -std::numeric_limits<double>::infinity();
  const double want1[2][6] = {{0.1, 0.9, ninf, ninf, ninf, ninf}, {ninf, ninf, 0.3, 0.3, ninf, ninf}};
  for (index_t i = 0; i < 2; ++i)
    for (index_t c = 0; c < 6; ++c) CHECK(m(i, c) == want1[i][c]);
  group_limited_mask(x, 3, 2, m);
  CHECK(m(0, 2) == 0.5);  // row 0: groups 0 and 1
  CHECK(m(0, 4) == ninf);
  CHECK(m(1, 0) == ninf);  // row 1: groups 1 and 2
  CHECK(m(1, 4) == 0.4);
  // random rows against the reference selection's groups
  Rng rng(8);
  Tensor<double> r = random_normal<double>({20, 12}, rng);
  m = Tensor<double>();
  group_limited_mask(r, 4, 2, m);
  TokenChoiceOptions o;
  o.n_group = 4;
  o.topk_group = 2;
  const RefSelection ref = reference_selection(r, {}, 6, o);  // k = 6: every allowed expert
  for (index_t i = 0; i < 20; ++i) {
    std::vector<int> kept;
    for (index_t c = 0; c < 12; ++c)
      if (m(i, c) != ninf) kept.push_back(static_cast<int>(c));
    std::vector<int> want = ref.idx[static_cast<std::size_t>(i)];
    std::sort(want.begin(), want.end());
    CHECK(kept == want);
  }
  Tensor<double> m2;
  CHECK_THROWS_WITH_AS(group_limited_mask(x, 4, 1, m2), doctest::Contains("divide E = 6"), Error);
  CHECK_THROWS_WITH_AS(group_limited_mask(x, 3, 4, m2), doctest::Contains("topk_group"), Error);

  Tensor<std::int32_t> idx({2, 2});
  idx(0, 0) = 5;
  idx(0, 1) = 0;
  idx(1, 0) = 2;
  idx(1, 1) = 2;
  Tensor<double> g;
  gather_columns(x, idx, g);
  CHECK(g(0, 0) == 0.3);
  CHECK(g(0, 1) == 0.1);
  CHECK(g(1, 1) == 0.3);
  Tensor<std::uint8_t> keep({2, 2});
  keep.data()[0] = 1;
  keep.data()[1] = 0;
  keep.data()[2] = 1;
  keep.data()[3] = 1;
  Tensor<std::int32_t> counts({6});
  accumulate_expert_counts(idx, keep, counts);
  accumulate_expert_counts(idx, keep, counts);
  const std::int32_t want_counts[6] = {0, 0, 4, 0, 0, 2};
  for (index_t c = 0; c < 6; ++c) CHECK(counts(c) == want_counts[c]);
  idx(1, 0) = 6;
  CHECK_THROWS_WITH_AS(gather_columns(x, idx, g), doctest::Contains("expert id 6"), Error);
  CHECK_THROWS_WITH_AS(accumulate_expert_counts(idx, keep, counts),
                       doctest::Contains("expert id 6 at slot 2"), Error);
}

namespace {

// b_e += rate * sign(mean - load_e) written out, in double from the stored value, one rounding.
template <class T>
std::vector<T> reference_bias_update(const std::vector<T>& bias, const std::vector<std::int32_t>& loads,
                                     double rate) {
  double total = 0;
  for (std::int32_t l : loads) total += l;
  if (total <= 0) return bias;
  const double mean = total / static_cast<double>(loads.size());
  std::vector<T> out = bias;
  for (std::size_t x = 0; x < bias.size(); ++x) {
    const double step = loads[x] < mean ? rate : (loads[x] > mean ? -rate : 0.0);
    out[x] = static_cast<T>(static_cast<double>(bias[x]) + step);
  }
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("expert_bias_update: a naive evaluation, ties at the mean, zero loads, errors", T,
                   float, double) {
  Rng rng(17);
  const index_t e = 8;
  // ties at an integral mean (4: experts 2, 3, 6, 7 keep their bias), a fractional mean (0.375),
  // one expert with every token, and all zero (no token routed: nothing changes)
  const std::vector<std::vector<std::int32_t>> cases = {
      {3, 5, 4, 4, 0, 8, 4, 4}, {1, 2, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 96},
      {0, 0, 0, 0, 0, 0, 0, 0}};
  for (double rate : {1e-3, 0.05}) {
    for (const auto& loads : cases) {
      CAPTURE(rate);
      CAPTURE(loads[0]);
      CAPTURE(loads[1]);
      Tensor<T> bias({e});
      std::vector<T> before(static_cast<std::size_t>(e));
      for (index_t x = 0; x < e; ++x)  // values a float sum would round differently
        before[x] = bias(x) = static_cast<T>(0.1 * rng.normal() + 1e-4 * static_cast<double>(x));
      Tensor<std::int32_t> counts({e});
      for (index_t x = 0; x < e; ++x) counts(x) = loads[x];
      expert_bias_update(bias, counts, rate);
      const std::vector<T> want = reference_bias_update(before, loads, rate);
      for (index_t x = 0; x < e; ++x) {
        CAPTURE(x);
        CHECK(bias(x) == want[x]);  // bit for bit
      }
      if (loads == cases[0]) {
        for (index_t x : {2, 3, 6, 7}) CHECK(bias(x) == before[x]);  // at the mean
        CHECK(bias(4) == static_cast<T>(static_cast<double>(before[4]) + rate));
        CHECK(bias(5) == static_cast<T>(static_cast<double>(before[5]) - rate));
      }
      if (loads == cases[3])
        for (index_t x = 0; x < e; ++x) CHECK(bias(x) == before[x]);
      for (index_t x = 0; x < e; ++x) CHECK(counts(x) == loads[x]);  // the counts are read only
    }
  }
  Tensor<T> bias({e});
  Tensor<std::int32_t> counts({e}), short_counts({e - 1}), matrix({2, 4});
  CHECK_THROWS_WITH_AS(expert_bias_update(Tensor<T>(), counts, 0.1),
                       doctest::Contains("bias must be an allocated (E) vector, got an empty tensor"),
                       Error);
  CHECK_THROWS_WITH_AS(expert_bias_update(bias, short_counts, 0.1),
                       doctest::Contains("loads must be a (8) vector, one count per expert of the bias, got (7)"), Error);
  CHECK_THROWS_WITH_AS(expert_bias_update(bias, matrix, 0.1),
                       doctest::Contains("expert_bias_update: loads must be a (8) vector"), Error);
  CHECK_THROWS_WITH_AS(expert_bias_update(bias, Tensor<std::int32_t>(), 0.1),
                       doctest::Contains("got an empty tensor"), Error);
  CHECK_THROWS_WITH_AS(expert_bias_update(bias, counts, std::nan("")),
                       doctest::Contains("rate must be finite"), Error);
  CHECK_THROWS_WITH_AS(expert_bias_update(bias.view(Shape{2, 4}), matrix, 0.1),
                       doctest::Contains("bias must be an allocated (E) vector, got (2, 4)"), Error);
}

TEST_CASE_TEMPLATE("DeepSeek-V3 routing: sigmoid scores, biased group-limited top-k, scaled gates", Policy,
                   SigmoidBiasRouter, SimilaritySigmoidBiasRouter) {
  Rng rng(11);
  const index_t n = 24, d = 6, e = 8, k = 3;
  RouterConfig cfg = deepseek_config<Policy>(e, k);
  cfg.causal = true;
  ParameterArena<double> arena;
  RouterImpl<Policy, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  // the bias is an arena buffer, not trained, zero at init
  const auto& info = arena.params()[static_cast<std::size_t>(arena.find("router.selector.expert_bias"))];
  CHECK_FALSE(info.trainable);
  Tensor<double> bias = arena.value("router.selector.expert_bias");
  for (index_t c = 0; c < e; ++c) CHECK(bias(c) == 0.0);
  std::vector<double> b(static_cast<std::size_t>(e));
  for (index_t c = 0; c < e; ++c) b[c] = bias(c) = 0.05 * static_cast<double>((c * 5) % 7) - 0.15;

  Tensor<double> u = random_normal<double>({n, d}, rng);
  GraphContext<double> ctx{n / 2, nullptr};
  RouterOutput<double> out;
  router.forward(u, ctx, out);
  // r = sigmoid(u W^T)
  Tensor<double> w = arena.value("router.weight");
  for (index_t i = 0; i < n; ++i)
    for (index_t c = 0; c < e; ++c) {
      double g = 0;
      for (index_t j = 0; j < d; ++j) g += u(i, j) * w(c, j);
      CHECK(out.r(i, c) == doctest::Approx(sigmoid_ref(g)).epsilon(1e-13));
    }
  if constexpr (std::is_same_v<typename Policy::graph, Independent>)
    for (index_t a = 0; a < out.r.numel(); ++a) CHECK(out.p.data()[a] == out.r.data()[a]);
  // the selection from p (after the graph), by the written-out rule
  const auto& opts = router.config().template options<TopK>();
  const RefSelection ref = reference_selection(out.p, b, k, opts);
  for (index_t i = 0; i < n; ++i)
    for (index_t j = 0; j < k; ++j) {
      CHECK(out.selection.indices(i, j) == ref.idx[i][j]);
      CHECK(out.selection.gates(i, j) == doctest::Approx(ref.gates[i][j]).epsilon(1e-13));
      CHECK(out.selection.values(i, j) == out.p(i, out.selection.indices(i, j)));
    }
  // the bias changes the choice (for this seed, some token's set differs without it)
  const RefSelection unbiased = reference_selection(out.p, {}, k, opts);
  CHECK(unbiased.idx != ref.idx);
  // decoding routes the same way (dropless)
  Selection<double> dropless;
  router.selector().select_dropless(out.p, k, dropless);
  for (index_t a = 0; a < dropless.indices.numel(); ++a)
    CHECK(dropless.indices.data()[a] == out.selection.indices.data()[a]);
}

TEST_CASE_TEMPLATE("bias-balanced routers: finite-difference gradients with a non-zero bias", Policy,
                   SigmoidBiasRouter, SimilaritySigmoidBiasRouter, AttentionSigmoidBiasRouter) {
  for (bool normalize : {true, false}) {
    CAPTURE(normalize);
    Rng rng(21);
    const index_t nb = 2, len = 6, d = 4, e = 8, k = 2;
    RouterConfig cfg = deepseek_config<Policy>(e, k);
    cfg.options<TopK>().norm_topk_prob = normalize;
    cfg.causal = true;
    cfg.z_loss_coef = 0.01;
    cfg.load_balance_coef = 0.1;
    ParameterArena<double> arena;
    RouterImpl<Policy, double> router;
    router.declare(arena, "router.", d, cfg);
    arena.allocate();
    router.bind(arena);
    router.init(rng);
    router.set_mode(Mode::Eval);
    Tensor<double> bias = arena.value("router.selector.expert_bias");
    for (index_t c = 0; c < e; ++c) bias(c) = 0.03 * static_cast<double>(c % 3) - 0.02;
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
    Tensor<double> du(u.shape());
    arena.zero_grad();
    zero_sinks(cache);
    router.backward(u, ctx, out, w, du);
    check_gradient("du", u, du, loss);
    Tensor<double> wt = arena.value("router.weight");
    check_gradient("router.weight", wt, arena.grad("router.weight"), loss);
    if constexpr (Policy::needs_attention) {
      check_gradient("dv", cache.v, cache.dv, loss);
      check_gradient("dout", cache.out, cache.dout, loss);
    }
    // the bias has no gradient (a buffer): its gradient slot stays zero
    Tensor<double> db = arena.grad("router.selector.expert_bias");
    for (index_t c = 0; c < e; ++c) CHECK(db(c) == 0.0);
  }
}

TEST_CASE("bias balancing: loads from training forwards only, b += rate * sign(mean - load), summed over ranks") {
  Rng rng(31);
  const index_t n = 40, d = 5, e = 8, k = 2;
  RouterConfig cfg = deepseek_config<SigmoidBiasRouter>(e, k);
  cfg.options<TopK>().n_group = 1;
  cfg.options<TopK>().topk_group = 1;
  ParameterArena<double> arena;
  RouterImpl<SigmoidBiasRouter, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  static_assert(RouterImpl<SigmoidBiasRouter, double>::kCountsLoads);
  static_assert(!RouterImpl<SoftmaxRouter, double>::kCountsLoads);
  GraphContext<double> ctx{n, nullptr};
  const double rate = router.config().template options<BiasBalancedTopK>().bias_update_rate;

  std::vector<double> load(static_cast<std::size_t>(e), 0.0);
  auto count = [&](const RouterOutput<double>& o) {
    for (index_t a = 0; a < o.selection.indices.numel(); ++a) load[o.selection.indices.data()[a]] += 1;
  };
  // two micro-batches in training mode, one evaluation forward (not counted)
  router.set_mode(Mode::Train);
  for (int micro = 0; micro < 2; ++micro) {
    RouterOutput<double> o;
    router.forward(random_normal<double>({n, d}, rng), ctx, o);
    count(o);
  }
  router.set_mode(Mode::Eval);
  RouterOutput<double> ev;
  router.forward(random_normal<double>({n, d}, rng), ctx, ev);
  REQUIRE(std::accumulate(load.begin(), load.end(), 0.0) == 2 * n * k);

  const std::uint64_t version = arena.values_version();
  router.after_step(arena, nullptr);
  CHECK(arena.values_version() > version);
  Tensor<double> bias = arena.value("router.selector.expert_bias");
  const double mean = 2.0 * n * k / e;
  for (index_t c = 0; c < e; ++c) {
    const double want = load[c] < mean ? rate : (load[c] > mean ? -rate : 0.0);
    CHECK(bias(c) == want);
  }
  // the counts restarted: a step without training forwards changes nothing
  Tensor<double> before = bias.clone();
  router.after_step(arena, nullptr);
  for (index_t c = 0; c < e; ++c) CHECK(bias(c) == before(c));

  // two ranks: the other rank routed everything to expert 7, so every expert but 7 is below the
  // mean of the summed loads and gains rate, 7 loses it
  std::fill(load.begin(), load.end(), 0.0);
  router.set_mode(Mode::Train);
  RouterOutput<double> o;
  router.forward(random_normal<double>({n, d}, rng), ctx, o);
  count(o);
  std::vector<double> other(static_cast<std::size_t>(e), 0.0);
  other[7] = 10.0 * n * k;
  FakeWorld world(2, other);
  router.after_step(arena, &world);
  CHECK(world.reduces == 1);
  for (index_t c = 0; c < e; ++c)
    CHECK(bias(c) == doctest::Approx(before(c) + (c == 7 ? -rate : rate)).epsilon(1e-15));
}

namespace {

// A token graph (p = r) whose after_step hook keeps what RouterStep gave it.
template <class T, class B>
class RecordingGraphImpl : public GraphImpl<Independent, T, B> {
 public:
  void after_step(const RouterStep<T, B>& step) {
    loads = step.loads;
    counts = detail::host_values(step.load_counts).clone();
    ++calls;
  }
  std::vector<double> loads;
  Tensor<std::int32_t> counts;
  int calls = 0;
};
struct RecordingGraph {
  static constexpr const char* name = "recording";
  template <class T, class B>
  using impl = RecordingGraphImpl<T, B>;
};

}  // namespace

TEST_CASE("after_step: the step's summed loads as host doubles and as counts on the backend") {
  using Policy = Router<SigmoidScorer, RecordingGraph, BiasBalancedTopK>;
  Rng rng(37);
  const index_t n = 30, d = 5, e = 6, k = 2;
  RouterConfig cfg = deepseek_config<Policy>(e, k);
  cfg.options<TopK>().n_group = 1;
  cfg.options<TopK>().topk_group = 1;
  ParameterArena<double> arena;
  RouterImpl<Policy, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  const double rate = router.config().template options<BiasBalancedTopK>().bias_update_rate;
  GraphContext<double> ctx{n, nullptr};
  std::vector<std::int32_t> local(static_cast<std::size_t>(e), 0);
  auto train_forward = [&] {
    RouterOutput<double> o;
    router.forward(random_normal<double>({n, d}, rng), ctx, o);
    for (index_t a = 0; a < o.selection.indices.numel(); ++a) ++local[o.selection.indices.data()[a]];
  };
  train_forward();
  train_forward();
  router.after_step(arena, nullptr);
  const auto& seen = router.graph();
  CHECK(seen.calls == 1);
  REQUIRE(seen.counts.numel() == e);
  for (index_t x = 0; x < e; ++x) {
    CHECK(seen.counts(x) == local[x]);
    CHECK(seen.loads[x] == local[x]);
    CHECK(router.step_loads()(x) == 0);  // the count restarted
  }

  // three ranks, the two others each routed 7 tokens to every expert but 1 and 3: the counts the
  // policies get are the sums (the host vector summed, then written into the tensor)
  std::fill(local.begin(), local.end(), 0);
  train_forward();
  std::vector<double> other(static_cast<std::size_t>(e), 7.0);
  other[1] = other[3] = 0.0;
  FakeWorld world(3, other);
  Tensor<double> bias = arena.value("router.selector.expert_bias");
  const std::vector<double> before = bias.to_vector();
  router.after_step(arena, &world);
  CHECK(world.reduces == 1);
  CHECK(seen.calls == 2);
  std::vector<std::int32_t> summed(static_cast<std::size_t>(e));
  double total = 0;
  for (index_t x = 0; x < e; ++x) {
    summed[x] = local[x] + 2 * static_cast<std::int32_t>(other[x]);
    total += summed[x];
    CHECK(seen.counts(x) == summed[x]);
    CHECK(seen.loads[x] == summed[x]);
    CHECK(router.step_loads()(x) == 0);
  }
  CHECK(total == n * k + 2 * 4 * 7);
  // the bias moved by the summed counts (BiasBalancedTopK reads the tensor)
  const std::vector<double> want = reference_bias_update(before, summed, rate);
  for (index_t x = 0; x < e; ++x) CHECK(bias(x) == want[x]);
}

TEST_CASE("bias-balanced routing: bad options are refused by name") {
  ParameterArena<double> arena;
  RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.k = 5;
  cfg.options<TopK>().n_group = 4;
  cfg.options<TopK>().topk_group = 2;  // 2 groups of 2 experts: 4 < k
  RouterImpl<SigmoidBiasRouter, double> router;
  CHECK_THROWS_WITH_AS(router.declare(arena, "r.", 4, cfg), doctest::Contains("k = 5"), Error);
  RouterConfig c2;
  c2.num_experts = 8;
  c2.options<TopK>().n_group = 3;
  RouterImpl<SigmoidBiasRouter, double> r2;
  ParameterArena<double> a2, a3;
  CHECK_THROWS_WITH_AS(r2.declare(a2, "r.", 4, c2), doctest::Contains("does not divide"), Error);
  RouterConfig c3;
  c3.num_experts = 8;
  c3.options<BiasBalancedTopK>().bias_update_rate = -1;
  RouterImpl<SigmoidBiasRouter, double> r3;
  CHECK_THROWS_WITH_AS(r3.declare(a3, "r.", 4, c3), doctest::Contains("bias_update_rate"), Error);
  // TopK's options: OLMoE's gates (no renormalisation) on the softmax router
  RouterConfig c4;
  c4.num_experts = 6;
  c4.k = 2;
  c4.options<TopK>().norm_topk_prob = false;
  ParameterArena<double> a4;
  RouterImpl<SoftmaxRouter, double> r4;
  r4.declare(a4, "r.", 3, c4);
  a4.allocate();
  r4.bind(a4);
  Rng rng(2);
  r4.init(rng);
  RouterOutput<double> o;
  GraphContext<double> ctx{4, nullptr};
  r4.forward(random_normal<double>({4, 3}, rng), ctx, o);
  for (index_t a = 0; a < o.selection.gates.numel(); ++a)
    CHECK(o.selection.gates.data()[a] == o.selection.values.data()[a]);
  // TopK's options count as used by a bias-balanced router, which reads them (no
  // allow_unused_options needed); BiasBalancedTopK's own rate is unused by the softmax router
  RouterConfig c5;
  c5.num_experts = 8;
  c5.options<TopK>().n_group = 2;
  c5.options<BiasBalancedTopK>().bias_update_rate = 0.01;
  ParameterArena<double> a5, a6;
  RouterImpl<SigmoidBiasRouter, double> r5;
  CHECK_NOTHROW(r5.declare(a5, "r.", 4, c5));
  CHECK(r5.selector().choice().n_group == 2);
  RouterConfig c6;
  c6.num_experts = 8;
  c6.options<BiasBalancedTopK>().bias_update_rate = 0.01;
  RouterImpl<SoftmaxRouter, double> r6;
  CHECK_THROWS_WITH_AS(r6.declare(a6, "r.", 4, c6), doctest::Contains("bias-balanced-topk"), Error);
}

namespace {

// L_seq written out (DeepSeek-V3 eqs. 17-20): per sequence of len rows, f_i = E / (k len) *
// (slots routed to i), P_i = mean over its tokens of p_ti / sum_j p_tj; the mean over sequences
// of sum_i f_i P_i.
double reference_seq_aux(const Tensor<double>& p, const Tensor<std::int32_t>& idx, index_t len) {
  const index_t n = p.rows(), e = p.cols(), k = idx.cols(), nb = n / len;
  double total = 0;
  for (index_t b = 0; b < nb; ++b) {
    for (index_t i = 0; i < e; ++i) {
      double count = 0, pm = 0;
      for (index_t t = b * len; t < (b + 1) * len; ++t) {
        for (index_t s = 0; s < k; ++s) count += idx(t, s) == i ? 1.0 : 0.0;
        double sum = 0;
        for (index_t j = 0; j < e; ++j) sum += p(t, j);
        pm += p(t, i) / sum;
      }
      total += static_cast<double>(e) / static_cast<double>(k * len) * count * pm /
               static_cast<double>(len);
    }
  }
  return total / static_cast<double>(nb);
}

}  // namespace

TEST_CASE_TEMPLATE("sequence-wise balance loss: the router's value against a naive evaluation",
                   Policy, SoftmaxRouter, SigmoidBiasRouter, SimilaritySigmoidBiasRouter) {
  Rng rng(43);
  const index_t nb = 3, len = 7, d = 5, e = 8, k = 2;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  cfg.causal = true;
  cfg.seq_aux_loss_coef = 1e-4;
  test::set_scorer_init_std(cfg, 0.8);
  ParameterArena<double> arena;
  RouterImpl<Policy, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  auto u = random_normal<double>({nb * len, d}, rng);
  RouterOutput<double> out;
  router.forward(u, GraphContext<double>{len, nullptr}, out);
  const double ref = reference_seq_aux(out.p, out.selection.indices, len);
  CHECK(ref > 0);
  CHECK(out.seq_aux_loss == doctest::Approx(ref).epsilon(1e-12));
  CHECK(out.load_balance_loss == 0);  // its own coefficient is 0
  // the sigmoid scores do not sum to 1: without the per-token normalisation the value differs
  double unnormalised = 0;
  if constexpr (std::is_same_v<typename Policy::scorer, SigmoidScorer>) {
    const index_t n = nb * len;
    for (index_t b = 0; b < nb; ++b)
      for (index_t i = 0; i < e; ++i) {
        double count = 0, pm = 0;
        for (index_t t = b * len; t < (b + 1) * len; ++t) {
          for (index_t s = 0; s < k; ++s) count += out.selection.indices(t, s) == i ? 1.0 : 0.0;
          pm += out.p(t, i) / static_cast<double>(len);
        }
        unnormalised += static_cast<double>(e) / static_cast<double>(k * len) * count * pm;
      }
    unnormalised /= static_cast<double>(nb);
    CHECK(n == out.p.rows());
    CHECK(out.seq_aux_loss != doctest::Approx(unnormalised).epsilon(1e-3));
  }
  // seq_len = N: the batch is one sequence
  if constexpr (std::is_same_v<typename Policy::graph, Independent>) {
    RouterOutput<double> whole;
    router.forward(u, GraphContext<double>{nb * len, nullptr}, whole);
    CHECK(whole.seq_aux_loss != doctest::Approx(out.seq_aux_loss).epsilon(1e-9));
    CHECK(whole.seq_aux_loss ==
          doctest::Approx(reference_seq_aux(whole.p, whole.selection.indices, nb * len)).epsilon(1e-12));
  }
}

TEST_CASE("sequence-wise balance loss: errors") {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.k = 2;
  cfg.seq_aux_loss_coef = -1e-4;
  CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("seq_aux_loss_coef must be finite and >= 0"), Error);
  cfg.seq_aux_loss_coef = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("seq_aux_loss_coef"), Error);
  cfg.seq_aux_loss_coef = std::nan("");
  CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("seq_aux_loss_coef"), Error);
  cfg.seq_aux_loss_coef = 1e-4;
  ParameterArena<double> arena;
  RouterImpl<SigmoidBiasRouter, double> router;
  CHECK_THROWS_WITH_AS(([&] {
                         RouterConfig bad = cfg;
                         bad.seq_aux_loss_coef = -1;
                         router.declare(arena, "router.", 3, bad);
                       }()),
                       doctest::Contains("seq_aux_loss_coef"), Error);
  // expert choice balances by construction: refused, as the batch loss is
  RouterImpl<ExpertChoiceRouter, double> choice;
  ParameterArena<double> choice_arena;
  CHECK_THROWS_WITH_AS(choice.declare(choice_arena, "router.", 3, cfg),
                       doctest::Contains("set seq_aux_loss_coef = 0"), Error);

  Rng rng(47);
  Tensor<double> p({6, 4});
  for (index_t i = 0; i < p.numel(); ++i) p.data()[i] = 0.1 + rng.uniform();
  Tensor<std::int32_t> idx({6, 2});
  for (index_t i = 0; i < idx.numel(); ++i) idx.data()[i] = static_cast<std::int32_t>(i % 4);
  Tensor<double> zero = p.clone();
  for (index_t x = 0; x < 4; ++x) zero(3, x) = 0.0;
  CHECK_THROWS_WITH_AS(seq_aux_loss<double>(zero, idx, 3, 0, nullptr),
                       doctest::Contains("row 3 of p sums to 0"), Error);
  Tensor<double> nan = p.clone();
  nan(4, 1) = std::nan("");
  CHECK_THROWS_WITH_AS(seq_aux_loss<double>(nan, idx, 3, 0, nullptr),
                       doctest::Contains("row 4 of p sums to"), Error);
  // nothing written when it throws
  Tensor<double> dp(p.shape());
  CHECK_THROWS_AS(seq_aux_loss<double>(zero, idx, 3, 1.0, &dp), Error);
  for (index_t i = 0; i < dp.numel(); ++i) CHECK(dp.data()[i] == 0.0);
  Tensor<std::int32_t> bad_id = idx.clone();
  bad_id.data()[5] = 4;
  CHECK_THROWS_WITH_AS(seq_aux_loss<double>(p, bad_id, 3, 0, nullptr),
                       doctest::Contains("expert id 4 out of [0, 4)"), Error);
  CHECK_THROWS_WITH_AS(seq_aux_loss<double>(p, idx, 4, 0, nullptr),
                       doctest::Contains("seq_len = 4 must be >= 1 and divide the 6 rows"), Error);
  CHECK_THROWS_WITH_AS(seq_aux_loss<double>(p, idx, 0, 0, nullptr), doctest::Contains("seq_len"), Error);
}
