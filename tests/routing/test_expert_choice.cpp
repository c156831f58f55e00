// The ExpertChoice selector (Zhou et al. 2022): the selection against a naive loop (ties, capacity,
// grouping by sequence), the gradient of the selector alone, the MoE layer's output against a
// dense evaluation, and bad input. (The MoE layer's gradient check with expert choice on every
// token graph is in layers/test_moe.cpp with the other routers; VisionMoE's in models/test_vision.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "graphmoe/layers/moe.hpp"
#include "layers/moe_fixture.hpp"
#include "routing/router_fixtures.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// Naive expert choice: for each sequence and expert, sort the sequence's tokens by (p desc, token
// asc) and take the first c. Returns chosen[t][e].
std::vector<std::vector<bool>> naive_choice(const Tensor<double>& p, index_t seq_len, index_t c) {
  const index_t n = p.rows(), e = p.cols();
  std::vector<std::vector<bool>> chosen(static_cast<std::size_t>(n),
                                        std::vector<bool>(static_cast<std::size_t>(e), false));
  for (index_t b = 0; b < n / seq_len; ++b)
    for (index_t x = 0; x < e; ++x) {
      std::vector<index_t> toks;
      for (index_t i = 0; i < seq_len; ++i) toks.push_back(b * seq_len + i);
      std::stable_sort(toks.begin(), toks.end(),
                       [&](index_t s, index_t t) { return p(s, x) > p(t, x); });
      for (index_t i = 0; i < c; ++i) chosen[static_cast<std::size_t>(toks[static_cast<std::size_t>(i)])][static_cast<std::size_t>(x)] = true;
    }
  return chosen;
}

RouterConfig ec_config(index_t e, index_t k, double cf = 0.0) {
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  cfg.capacity_factor = cf;
  return cfg;
}

// Checks one selection against the naive loop.
void check_against_naive(const Tensor<double>& p, index_t seq_len, index_t k, double cf) {
  const index_t n = p.rows(), e = p.cols();
  SelectorImpl<ExpertChoice, double> sel;
  sel.configure(ec_config(e, k, cf));
  Selection<double> s;
  sel.select(p, k, seq_len, s);
  const double f = cf > 0 ? cf : 1.0;
  const index_t c = std::min<index_t>(
      seq_len, static_cast<index_t>(std::ceil(f * static_cast<double>(seq_len * k) / static_cast<double>(e))));
  CHECK(sel.capacity(seq_len, k, e) == c);
  const auto chosen = naive_choice(p, seq_len, c);
  index_t m_ref = 0, total = 0;
  for (index_t t = 0; t < n; ++t) {
    index_t cnt = 0;
    for (index_t x = 0; x < e; ++x) cnt += chosen[static_cast<std::size_t>(t)][static_cast<std::size_t>(x)];
    m_ref = std::max(m_ref, cnt);
    total += cnt;
  }
  REQUIRE(s.indices.rows() == n);
  REQUIRE(s.indices.cols() == std::max<index_t>(m_ref, 1));
  const index_t m = s.indices.cols();
  CHECK(dropped_count(s) == n * m - total);
  CHECK(s.may_drop == (total < n * m));
  CHECK(total == (n / seq_len) * e * c);  // every expert took exactly c tokens of each sequence
  for (index_t t = 0; t < n; ++t) {
    // the token's experts by descending p, ties to the lower expert
    std::vector<index_t> ref;
    for (index_t x = 0; x < e; ++x)
      if (chosen[static_cast<std::size_t>(t)][static_cast<std::size_t>(x)]) ref.push_back(x);
    std::stable_sort(ref.begin(), ref.end(), [&](index_t a, index_t b) { return p(t, a) > p(t, b); });
    for (index_t j = 0; j < m; ++j) {
      CAPTURE(t);
      CAPTURE(j);
      if (j < static_cast<index_t>(ref.size())) {
        const index_t x = ref[static_cast<std::size_t>(j)];
        CHECK(s.indices(t, j) == x);
        CHECK(s.keep(t, j) == 1);
        CHECK(s.values(t, j) == p(t, x));
        CHECK(s.gates(t, j) == p(t, x));  // the paper's gate: the score itself
      } else {
        CHECK(s.indices(t, j) == -1);
        CHECK(s.keep(t, j) == 0);
        CHECK(s.gates(t, j) == 0.0);
      }
    }
  }
}

}  // namespace

TEST_CASE("ExpertChoice: the selection equals a naive loop (capacity, several sequences, k, f)") {
  Rng rng(1);
  struct Case {
    index_t nseq, len, e, k;
    double cf;
  };
  for (const Case c : {Case{1, 8, 4, 1, 0.0}, Case{3, 7, 5, 2, 0.0}, Case{2, 16, 8, 2, 1.5},
                       Case{2, 5, 3, 3, 0.0}, Case{1, 6, 4, 1, 0.3}, Case{2, 4, 2, 2, 4.0}}) {
    CAPTURE(c.nseq);
    CAPTURE(c.len);
    CAPTURE(c.e);
    CAPTURE(c.k);
    CAPTURE(c.cf);
    auto p = random_probs<double>(c.nseq * c.len, c.e, rng);
    check_against_naive(p, c.len, c.k, c.cf);
  }
}

TEST_CASE("ExpertChoice: ties go to the lower token (per expert) and the lower expert (per token)") {
  // Every score equal: expert x takes the first c tokens; each token's experts in expert order.
  const index_t n = 6, e = 3;
  Tensor<double> p({n, e});
  for (index_t a = 0; a < n * e; ++a) p.data()[a] = 1.0 / 3;
  check_against_naive(p, n, 1, 0.0);  // c = 2: tokens 0 and 1 get all three experts
  SelectorImpl<ExpertChoice, double> sel;
  sel.configure(ec_config(e, 1));
  Selection<double> s;
  sel.select(p, 1, n, s);
  REQUIRE(s.indices.cols() == 3);
  for (index_t j = 0; j < 3; ++j) {
    CHECK(s.indices(0, j) == j);
    CHECK(s.indices(1, j) == j);
    CHECK(s.keep(2, j) == 0);
  }
  // Quantised scores with many partial ties.
  Rng rng(2);
  auto q = random_probs<double>(12, 4, rng);
  for (index_t a = 0; a < q.numel(); ++a) q.data()[a] = std::round(q.data()[a] * 4) / 4;
  check_against_naive(q, 6, 2, 0.0);
}

TEST_CASE("ExpertChoice: a sequence's selection does not depend on the other sequences") {
  Rng rng(3);
  const index_t len = 8, e = 4;
  auto p = random_probs<double>(2 * len, e, rng);
  SelectorImpl<ExpertChoice, double> sel;
  sel.configure(ec_config(e, 2));
  Selection<double> both, first;
  sel.select(p, 2, len, both);
  sel.select(p.slice(0, len).clone(), 2, len, first);
  // the same experts for the first sequence's tokens (the padding width may differ)
  for (index_t t = 0; t < len; ++t) {
    std::set<int> a, b;
    for (index_t j = 0; j < both.indices.cols(); ++j)
      if (both.keep(t, j)) a.insert(both.indices(t, j));
    for (index_t j = 0; j < first.indices.cols(); ++j)
      if (first.keep(t, j)) b.insert(first.indices(t, j));
    CHECK(a == b);
  }
}

TEST_CASE("ExpertChoice: gradient check of the gates (dp at the kept slots)") {
  for (double cf : {0.0, 2.0}) {
    CAPTURE(cf);
    Rng rng(4);
    const index_t len = 6, e = 4, k = 2;
    auto p = random_probs<double>(2 * len, e, rng);
    SelectorImpl<ExpertChoice, double> sel;
    sel.configure(ec_config(e, k, cf));
    Selection<double> s;
    sel.select(p, k, len, s);
    auto w = random_normal<double>(s.gates.shape(), rng);
    auto loss = [&] {
      Selection<double> t;
      sel.select(p, k, len, t);
      REQUIRE(t.gates.shape() == w.shape());
      return weighted_sum(t.gates, w);
    };
    Tensor<double> dp;
    sel.backward(p, s, w, dp);
    check_gradient("dp", p, dp, loss);
  }
}

TEST_CASE("MoE layer with expert choice: y_t is the p-weighted sum of the experts that took t") {
  MoEFixture<ExpertChoiceRouter> fx(5, 4, 4, 1);  // k = 1: c = ceil(8 / 4) = 2 tokens per expert
  test::set_scorer_init_std(fx.cfg.router, 0.8);
  fx.build(6);
  auto& layer = fx.layer;
  auto& arena = fx.arena;
  Rng rng(6);
  const index_t len = 8, n = 2 * len, d = 5;
  auto u = random_normal<double>({n, d}, rng);
  Tensor<double> y;
  layer.forward(u, {len, nullptr}, y);
  const auto& route = layer.routing();
  const auto& sel = route.selection;
  const index_t m = sel.indices.cols();
  for (index_t e = 0; e < 4; ++e) CHECK(layer.plan().count(e) == 2 * 2);
  auto w1 = arena.value("moe.experts.w1"), b1 = arena.value("moe.experts.b1");
  auto w2 = arena.value("moe.experts.w2"), b2 = arena.value("moe.experts.b2");
  index_t unrouted = 0;
  for (index_t i = 0; i < n; ++i) {
    std::vector<double> ref(static_cast<std::size_t>(d), 0.0);
    bool any = false;
    for (index_t j = 0; j < m; ++j) {
      if (!sel.keep(i, j)) continue;
      any = true;
      const index_t e = sel.indices(i, j);
      std::vector<double> hid(4);
      for (index_t f = 0; f < 4; ++f) {
        double s = b1(e, f);
        for (index_t c = 0; c < d; ++c) s += w1(e, f, c) * u(i, c);
        hid[static_cast<std::size_t>(f)] =
            0.5 * s * (1 + std::tanh(std::sqrt(2 / M_PI) * (s + 0.044715 * s * s * s)));
      }
      for (index_t c = 0; c < d; ++c) {
        double s = b2(e, c);
        for (index_t f = 0; f < 4; ++f) s += w2(e, c, f) * hid[static_cast<std::size_t>(f)];
        ref[static_cast<std::size_t>(c)] += route.p(i, e) * s;
      }
    }
    unrouted += any ? 0 : 1;
    for (index_t c = 0; c < d; ++c)
      CHECK(y(i, c) == doctest::Approx(ref[static_cast<std::size_t>(c)]).epsilon(1e-12));
  }
  MESSAGE("tokens no expert took: ", unrouted, " of ", n);
}

TEST_CASE("ExpertChoice: bad input and bad configuration") {
  SelectorImpl<ExpertChoice, double> sel;
  RouterConfig lb = ec_config(4, 2);
  lb.load_balance_coef = 0.01;
  CHECK_THROWS_WITH_AS(sel.configure(lb), doctest::Contains("set load_balance_coef = 0"), Error);
  sel.configure(ec_config(4, 2));
  Rng rng(7);
  auto p = random_probs<double>(10, 4, rng);
  Selection<double> s;
  CHECK_THROWS_WITH_AS(sel.select(p, 2, 4, s), doctest::Contains("seq_len = 4 does not divide the 10 tokens"), Error);
  CHECK_THROWS_WITH_AS(sel.select(p, 5, 5, s), doctest::Contains("k = 5 must be in [1, E = 4]"), Error);
  CHECK_THROWS_WITH_AS(sel.select(Tensor<double>(), 2, 5, s), doctest::Contains("non-empty (N, E)"), Error);
  p(3, 2) = std::nan("");
  CHECK_THROWS_WITH_AS(sel.select(p, 2, 5, s), doctest::Contains("at token 3, expert 2"), Error);
  p(3, 2) = 0.25;
  sel.select(p, 2, 5, s);
  Tensor<double> dp, bad({10, 3});
  CHECK_THROWS_WITH_AS(sel.backward(p, s, bad, dp), doctest::Contains("dgates"), Error);
  // The router passes the sequence length from the graph context.
  MoEFixture<ExpertChoiceRouter> fx;
  fx.build(8);
  Rng r2(8);
  Tensor<double> y;
  CHECK_THROWS_WITH_AS(fx.layer.forward(random_normal<double>({9, 4}, r2), {4, nullptr}, y),
                       doctest::Contains("does not divide the 9 tokens"), Error);
}
