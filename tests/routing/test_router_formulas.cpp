// The routers against direct, loop-by-loop evaluations of the paper's formulas, and the
// properties the paper states (Proposition 1, Appendix C.3, tau -> 0), plus bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <type_traits>
#include <vector>

#include "graphmoe/routing/router.hpp"
#include "routing/router_fixtures.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// Definition 2: S[i,j] = exp(u_i . u_j / tau) / sum_j' exp(u_i . u_j' / tau) within a sequence
// (j, j' <= i when causal);  p_i = sum_j S[i,j] r_j.
std::vector<std::vector<double>> naive_similarity(const Tensor<double>& u, const Tensor<double>& r,
                                                  index_t len, double tau, bool causal,
                                                  std::vector<double>* entropy = nullptr,
                                                  bool exclude_self = false,
                                                  const Tensor<double>* w_s = nullptr) {
  const index_t n = u.rows(), d = u.cols(), e = r.cols();
  std::vector<std::vector<double>> p(static_cast<std::size_t>(n), std::vector<double>(static_cast<std::size_t>(e), 0.0));
  for (index_t i = 0; i < n; ++i) {
    const index_t s0 = i / len * len;
    const index_t jend = causal ? i + 1 : s0 + len;
    std::vector<long double> w;
    long double z = 0;
    for (index_t j = s0; j < jend; ++j) {
      long double dot = 0;
      // u_i W_s u_j^T (W_s = I when not given)
      for (index_t c = 0; c < d; ++c)
        if (w_s == nullptr) {
          dot += static_cast<long double>(u(i, c)) * u(j, c);
        } else {
          for (index_t c2 = 0; c2 < d; ++c2)
            dot += static_cast<long double>(u(i, c)) * (*w_s)(c, c2) * u(j, c2);
        }
      // exclude_self: S[i,i] = 0 unless i has no other entry in its row
      const bool drop = exclude_self && j == i && jend - s0 > 1;
      w.push_back(drop ? 0.0L : std::exp(dot / tau));
      z += w.back();
    }
    double h = 0;
    for (index_t j = s0; j < jend; ++j) {
      const long double s = w[static_cast<std::size_t>(j - s0)] / z;
      if (s > 0) h -= static_cast<double>(s * std::log(s));
      for (index_t c = 0; c < e; ++c) p[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)] += static_cast<double>(s * r(j, c));
    }
    if (entropy) entropy->push_back(h);
  }
  return p;
}

// Lemma 1 with H^p one-hot at head h: A^p[i,j] = A_h[i,j] N(a_i | m_hj, sigma^2 I) / sum_j', with
// the full Gaussian density (normalising constant and |a_i|^2 included) in long double, and
// m_hj = H W_o,h v_hj + b_o.
std::vector<std::vector<long double>> naive_posterior(const AttentionCache<double>& c, index_t b,
                                                      index_t h, index_t len, double sigma) {
  const index_t nh = c.num_heads, dm = c.out.cols(), dh = c.v.cols() / nh;
  std::vector<std::vector<long double>> m(static_cast<std::size_t>(len), std::vector<long double>(static_cast<std::size_t>(dm)));
  for (index_t j = 0; j < len; ++j)
    for (index_t o = 0; o < dm; ++o) {
      long double s = c.b_o(o);
      for (index_t q = 0; q < dh; ++q) s += static_cast<long double>(nh) * c.w_o(o, h * dh + q) * c.v(b * len + j, h * dh + q);
      m[static_cast<std::size_t>(j)][static_cast<std::size_t>(o)] = s;
    }
  std::vector<std::vector<long double>> post(static_cast<std::size_t>(len), std::vector<long double>(static_cast<std::size_t>(len), 0.0L));
  const long double norm = std::pow(2.0L * 3.14159265358979323846L * sigma * sigma, -0.5L * dm);
  for (index_t i = 0; i < len; ++i) {
    std::vector<long double> logw(static_cast<std::size_t>(len));
    long double mx = -INFINITY;
    for (index_t j = 0; j < len; ++j) {
      long double d2 = 0;
      for (index_t o = 0; o < dm; ++o) {
        const long double diff = c.out(b * len + i, o) - m[static_cast<std::size_t>(j)][static_cast<std::size_t>(o)];
        d2 += diff * diff;
      }
      const long double a = c.probs(b, h, i, j);
      // log(A * N(.)) = log A + log(norm) - d2 / (2 sigma^2)
      logw[static_cast<std::size_t>(j)] = a > 0 ? std::log(a) + std::log(norm) - d2 / (2.0L * sigma * sigma) : -INFINITY;
      mx = std::max(mx, logw[static_cast<std::size_t>(j)]);
    }
    long double z = 0;
    for (index_t j = 0; j < len; ++j) z += std::exp(logw[static_cast<std::size_t>(j)] - mx);
    for (index_t j = 0; j < len; ++j) post[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] = std::exp(logw[static_cast<std::size_t>(j)] - mx) / z;
  }
  return post;
}

// Eq. 12: h* = argmin_h mean_i H(A_h[i,:]) over rows [0, upto].
int naive_best_head(const AttentionCache<double>& c, index_t b, index_t len, index_t upto) {
  int best = 0;
  double best_v = 1e300;
  for (index_t h = 0; h < c.num_heads; ++h) {
    double s = 0;
    for (index_t i = 0; i <= upto; ++i) s += entropy_of(&c.probs(b, h, i, 0), len);
    if (s / static_cast<double>(upto + 1) < best_v) {
      best_v = s / static_cast<double>(upto + 1);
      best = static_cast<int>(h);
    }
  }
  return best;
}

}  // namespace

TEST_CASE("similarity graph: matches Definition 2 evaluated loop by loop") {
  Rng rng(11);
  for (bool causal : {false, true}) {
    for (index_t len : {7, 150}) {  // 150 spans three row blocks of 64
      CAPTURE(causal);
      CAPTURE(len);
      const index_t nb = 2, d = 5, e = 4;
      auto u = random_normal<double>({nb * len, d}, rng, 0.7);
      auto r = random_probs<double>(nb * len, e, rng);
      RouterConfig cfg;
      cfg.num_experts = e;
      cfg.options<Similarity>().tau = 1.3;
      cfg.causal = causal;
      cfg.options<Similarity>().memory = len > 100 ? GraphMemory::Recompute : GraphMemory::Store;
      GraphImpl<Similarity, double> g;
      g.configure(d, cfg);
      Tensor<double> p;
      g.forward(u, r, {len, nullptr}, p);
      std::vector<double> ent;
      auto ref = naive_similarity(u, r, len, 1.3, causal, &ent);
      double worst = 0, ent_mean = 0;
      for (index_t i = 0; i < nb * len; ++i) {
        ent_mean += ent[static_cast<std::size_t>(i)] / static_cast<double>(nb * len);
        for (index_t c = 0; c < e; ++c)
          worst = std::max(worst, std::abs(p(i, c) - ref[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]));
      }
      CHECK(worst < 1e-12);
      CHECK(g.mean_entropy() == doctest::Approx(ent_mean).epsilon(1e-10));
    }
  }
}

TEST_CASE("similarity graph: similarity_projection matches Definition 2 with W_s") {
  Rng rng(31);
  for (bool causal : {false, true}) {
    for (index_t len : {1, 7, 150}) {
      for (bool recompute : {false, true}) {
        CAPTURE(causal);
        CAPTURE(len);
        CAPTURE(recompute);
        const index_t nb = 2, d = 5, e = 4;
        auto u = random_normal<double>({nb * len, d}, rng, 0.7);
        auto r = random_probs<double>(nb * len, e, rng);
        RouterConfig cfg;
        cfg.num_experts = e;
        cfg.options<Similarity>().tau = 0.9;
        cfg.causal = causal;
        cfg.options<Similarity>().memory = recompute ? GraphMemory::Recompute : GraphMemory::Store;
        cfg.options<Similarity>().projection = true;
        ParameterArena<double> arena;
        GraphImpl<Similarity, double> g;
        g.declare(arena, "graph.", d, cfg);
        arena.allocate();
        g.bind(arena);
        g.init(rng);
        REQUIRE(arena.contains("graph.w_s"));
        CHECK(arena.value("graph.w_s").shape() == (Shape{d, d}));
        Tensor<double> p;
        // initialised to the identity: the paper's graph
        g.forward(u, r, {len, nullptr}, p);
        auto plain = naive_similarity(u, r, len, 0.9, causal);
        double worst = 0;
        for (index_t i = 0; i < nb * len; ++i)
          for (index_t c = 0; c < e; ++c)
            worst = std::max(worst, std::abs(p(i, c) - plain[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]));
        CHECK(worst < 1e-12);
        // a general (non-symmetric) W_s
        auto w = random_normal<double>({d, d}, rng, 0.5);
        arena.value("graph.w_s").copy_from(w);
        g.forward(u, r, {len, nullptr}, p);
        std::vector<double> ent;
        auto ref = naive_similarity(u, r, len, 0.9, causal, &ent, false, &w);
        worst = 0;
        double ent_mean = 0;
        for (index_t i = 0; i < nb * len; ++i) {
          ent_mean += ent[static_cast<std::size_t>(i)] / static_cast<double>(nb * len);
          for (index_t c = 0; c < e; ++c)
            worst = std::max(worst, std::abs(p(i, c) - ref[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]));
        }
        CHECK(worst < 1e-12);
        CHECK(g.mean_entropy() == doctest::Approx(ent_mean).epsilon(1e-10));
      }
    }
  }
  // configure alone has no W_s: a clear error; tokens of another width too
  RouterConfig cfg;
  cfg.num_experts = 3;
  cfg.options<Similarity>().projection = true;
  auto u = random_normal<double>({4, 3}, rng);
  auto r = random_probs<double>(4, 3, rng);
  Tensor<double> p;
  GraphImpl<Similarity, double> bare;
  bare.configure(3, cfg);
  CHECK_THROWS_WITH_AS(bare.forward(u, r, {4, nullptr}, p), doctest::Contains("declare and bind"), Error);
  ParameterArena<double> arena;
  GraphImpl<Similarity, double> g;
  g.declare(arena, "graph.", 5, cfg);
  arena.allocate();
  g.bind(arena);
  g.init(rng);
  CHECK_THROWS_WITH_AS(g.forward(u, r, {4, nullptr}, p), doctest::Contains("W_s was declared for D = 5"), Error);
}

TEST_CASE("similarity graph: exclude_self matches Definition 2 without the diagonal") {
  Rng rng(12);
  for (bool causal : {false, true}) {
    for (index_t len : {1, 7, 150}) {
      for (bool recompute : {false, true}) {
        CAPTURE(causal);
        CAPTURE(len);
        CAPTURE(recompute);
        const index_t nb = 2, d = 5, e = 4;
        auto u = random_normal<double>({nb * len, d}, rng, 0.7);
        auto r = random_probs<double>(nb * len, e, rng);
        RouterConfig cfg;
        cfg.num_experts = e;
        cfg.options<Similarity>().tau = 0.9;
        cfg.causal = causal;
        cfg.options<Similarity>().memory = recompute ? GraphMemory::Recompute : GraphMemory::Store;
        cfg.options<Similarity>().exclude_self = true;
        GraphImpl<Similarity, double> g;
        g.configure(d, cfg);
        Tensor<double> p;
        g.forward(u, r, {len, nullptr}, p);
        std::vector<double> ent;
        auto ref = naive_similarity(u, r, len, 0.9, causal, &ent, true);
        double worst = 0, ent_mean = 0, self = 0;
        for (index_t i = 0; i < nb * len; ++i) {
          ent_mean += ent[static_cast<std::size_t>(i)] / static_cast<double>(nb * len);
          // only a row without another entry keeps its self-weight (1)
          const bool alone = len == 1 || (causal && i % len == 0);
          self += alone ? 1.0 / static_cast<double>(nb * len) : 0.0;
          for (index_t c = 0; c < e; ++c)
            worst = std::max(worst, std::abs(p(i, c) - ref[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]));
        }
        CHECK(worst < 1e-12);
        CHECK(g.mean_entropy() == doctest::Approx(ent_mean).epsilon(1e-10));
        CHECK(g.mean_self_weight() == doctest::Approx(self).epsilon(1e-12));
        // without the option, the self-weight is the diagonal of Definition 2's S
        cfg.options<Similarity>().exclude_self = false;
        GraphImpl<Similarity, double> plain;
        plain.configure(d, cfg);
        plain.forward(u, r, {len, nullptr}, p);
        if (len > 1) CHECK(plain.mean_self_weight() > self);
      }
    }
  }
}

TEST_CASE("similarity graph: a learned temperature is exp(log_tau), read at every forward") {
  Rng rng(13);
  const index_t len = 9, nb = 2, d = 4, e = 3;
  auto u = random_normal<double>({nb * len, d}, rng, 0.7);
  auto r = random_probs<double>(nb * len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<Similarity>().tau = 2.5;
  cfg.options<Similarity>().tau_mode = TauMode::Learned;
  ParameterArena<double> arena;
  GraphImpl<Similarity, double> g;
  g.declare(arena, "graph.", d, cfg);
  arena.allocate();
  g.bind(arena);
  g.init(rng);
  REQUIRE(arena.contains("graph.log_tau"));
  CHECK(arena.value("graph.log_tau")(0) == doctest::Approx(std::log(2.5)));
  Tensor<double> p;
  g.forward(u, r, {len, nullptr}, p);
  CHECK(g.tau() == doctest::Approx(2.5));
  arena.value("graph.log_tau")(0) = std::log(0.6);
  g.forward(u, r, {len, nullptr}, p);
  CHECK(g.tau() == doctest::Approx(0.6));
  auto ref = naive_similarity(u, r, len, 0.6, false);
  double worst = 0;
  for (index_t i = 0; i < nb * len; ++i)
    for (index_t c = 0; c < e; ++c)
      worst = std::max(worst, std::abs(p(i, c) - ref[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]));
  CHECK(worst < 1e-12);
  // configure alone cannot learn: a clear error, not a silent fixed tau
  GraphImpl<Similarity, double> bare;
  bare.configure(d, cfg);
  CHECK_THROWS_WITH_AS(bare.forward(u, r, {len, nullptr}, p), doctest::Contains("declare and bind"), Error);
  // a router declares it under "<prefix>graph.log_tau"
  ParameterArena<double> ra;
  RouterImpl<SimilarityRouter, double> router;
  router.declare(ra, "router.", d, cfg);
  ra.allocate();
  router.bind(ra);
  router.init(rng);
  CHECK(ra.contains("router.graph.log_tau"));
  CHECK(ra.value("router.graph.log_tau")(0) == doctest::Approx(std::log(2.5)));
}

TEST_CASE("similarity graph: tau scaled with the width uses tau * sqrt(D)") {
  Rng rng(12);
  const index_t len = 6, d = 9, e = 3;
  auto u = random_normal<double>({len, d}, rng);
  auto r = random_probs<double>(len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<Similarity>().tau = 0.5;
  cfg.options<Similarity>().tau_mode = TauMode::ScaledSqrtD;
  GraphImpl<Similarity, double> g;
  g.configure(d, cfg);
  CHECK(g.tau() == doctest::Approx(1.5));
  Tensor<double> p;
  g.forward(u, r, {len, nullptr}, p);
  auto ref = naive_similarity(u, r, len, 1.5, false);
  for (index_t i = 0; i < len; ++i)
    for (index_t c = 0; c < e; ++c) CHECK(p(i, c) == doctest::Approx(ref[static_cast<std::size_t>(i)][static_cast<std::size_t>(c)]).epsilon(1e-12));
}

// Eigen's packet exp alone gives about 1e-39 (float) / 1e-308 (double) far below its range, where
// exp is 0: a subnormal weight in S that slowed every product on it several times (the decode
// rows, docs/benchmarks.md "Decoding"). S, its entropy and the self weight follow std::exp.
TEST_CASE_TEMPLATE("similarity graph: a weight far below its row's maximum is exactly 0", T, float,
                   double) {
  const T big = std::is_same_v<T, float> ? T(30) : T(60);
  // causal, tau = 1, d = 1: row 1's logits are -big^2 and big^2 (row 2's all 0: S[2] uniform)
  auto u = Tensor<T>::from({3, 1}, {-big, big, T(0)});
  auto r = Tensor<T>::from({3, 2}, {T(0.25), T(0.75), T(0.5), T(0.5), T(0.125), T(0.875)});
  for (GraphMemory memory : {GraphMemory::Store, GraphMemory::Recompute}) {
    RouterConfig cfg;
    cfg.num_experts = 2;
    cfg.causal = true;
    cfg.options<Similarity>().tau = 1.0;
    cfg.options<Similarity>().memory = memory;
    GraphImpl<Similarity, T> g;
    g.configure(1, cfg);
    Tensor<T> p;
    g.forward(u, r, {3, nullptr}, p);
    CHECK(p(1, 0) == T(0.5));  // S[1] = (0, 1): r_1 exactly
    CHECK(p(1, 1) == T(0.5));
    CHECK(g.row_entropy()(1) == T(0));
    CHECK(g.self_weight()(1) == T(1));
    // the backward (S recomputed under Recompute): dr_0 = sum_i S[i, 0] dp_i = dp_0 (dp_2 = 0)
    Tensor<T> dp = Tensor<T>::from({3, 2}, {T(1), T(2), T(3), T(4), T(0), T(0)}), dr,
        du(Shape{3, 1});
    g.backward(u, r, p, dp, {3, nullptr}, dr, du);
    CHECK(dr(0, 0) == T(1));
    CHECK(dr(0, 1) == T(2));
  }
}

TEST_CASE("attention graph: matches Lemma 1 / Eq. 13 with the full Gaussian likelihood") {
  Rng rng(13);
  for (bool causal : {false, true}) {
   for (index_t len : {6, 130}) {  // 130: three row blocks, causal ones cut at the block's end
    for (GraphMemory memory : {GraphMemory::Store, GraphMemory::Recompute}) {
    CAPTURE(causal);
    CAPTURE(len);
    CAPTURE(static_cast<int>(memory));
    const index_t nb = 2, heads = 3, d = 6, e = 4;
    const double sigma = 2.5;
    auto cache = random_attention_cache<double>(nb, len, heads, d, causal, rng);
    auto u = random_normal<double>({nb * len, d}, rng);
    auto r = random_probs<double>(nb * len, e, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.options<Attention>().sigma = sigma;
    cfg.options<Attention>().memory = memory;
    GraphImpl<Attention, double> g;
    g.configure(d, cfg);
    Tensor<double> p;
    g.forward(u, r, {len, &cache}, p);
    REQUIRE(g.stores() == (memory == GraphMemory::Store));
    for (index_t b = 0; b < nb; ++b) {
      const int hstar = naive_best_head(cache, b, len, len - 1);
      auto post = naive_posterior(cache, b, hstar, len, sigma);
      for (index_t i = 0; i < len; ++i) {
        CHECK(g.heads()[static_cast<std::size_t>(b * len + i)] == hstar);
        for (index_t c = 0; c < e; ++c) {
          long double ref = 0;
          for (index_t j = 0; j < len; ++j) ref += post[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] * r(b * len + j, c);
          CHECK(p(b * len + i, c) == doctest::Approx(static_cast<double>(ref)).epsilon(1e-9));
        }
        if (causal && g.stores())
          for (index_t j = i + 1; j < len; ++j) CHECK(g.posterior()(b * len + i, j) == 0.0);
      }
    }
    }
   }
  }
}

TEST_CASE("attention graph: priors at or below the floor count as zero, so float gradients stay finite") {
  // A sharp head gives denormal probabilities; where the Gaussian factor favours such a column,
  // A^p is not small there and dL / A overflowed a float (NaN gradients in a trained LM). Below the
  // floor: weight 0 and no gradient; above it: the formula.
  Rng rng(31);
  const index_t nb = 1, len = 6, heads = 2, d = 4, e = 3, dh = d / heads;
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    auto c = random_attention_cache<float>(nb, len, heads, d, causal, rng, 4.0);
    // head 1 uniform, so that head 0 (random, sharper) is h*
    for (index_t i = 0; i < len; ++i)
      for (index_t j = 0; j < len; ++j)
        c.probs(0, 1, i, j) = !causal || j <= i ? 1.0f / static_cast<float>(causal ? i + 1 : len) : 0.0f;
    // token 5's attention output equals the Gaussian mean of column 1 (m_1 = H W_o,0 v_1 + b_o), so
    // with a small sigma the posterior of row 5 wants column 1, whose prior is denormal
    c.probs(0, 0, 5, 1) = 1e-40f;
    for (index_t o = 0; o < d; ++o) {
      float m = c.b_o(o);
      for (index_t q = 0; q < dh; ++q) m += static_cast<float>(heads) * c.w_o(o, q) * c.v(1, q);
      c.out(5, o) = m;
    }
    auto r = random_probs<float>(nb * len, e, rng);
    auto u = random_normal<float>({nb * len, d}, rng, 1.0);
    auto dp = random_normal<float>({nb * len, e}, rng, 1.0);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = causal;
    cfg.options<Attention>().sigma = 0.05;
    GraphImpl<Attention, float> g;
    g.configure(d, cfg);
    GraphContext<float> ctx{len, &c};
    Tensor<float> p, dr, du(u.shape());
    g.forward(u, r, ctx, p);
    REQUIRE(g.heads()[5] == 0);
    CHECK(g.posterior()(5, 1) == 0.0f);
    double row = 0;
    for (index_t j = 0; j < len; ++j) row += g.posterior()(5, j);
    CHECK(row == doctest::Approx(1.0).epsilon(1e-5));
    zero_sinks(c);
    g.backward(u, r, p, dp, ctx, dr, du);
    for (const Tensor<float>* t : {&p, &dr, &c.dprobs, &c.dv, &c.dw_o, &c.db_o, &c.dout})
      for (index_t i = 0; i < t->numel(); ++i) REQUIRE(std::isfinite(t->data()[i]));
    CHECK(c.dprobs(0, 0, 5, 1) == 0.0f);
  }
}

TEST_CASE("attention graph: h* is the head of lowest mean attention entropy (Eq. 12), per sequence or causal prefix") {
  Rng rng(14);
  const index_t nb = 3, len = 8, heads = 4, d = 4, e = 3;
  // Heads with very different sharpness so that the choice differs between sequences.
  auto cache = random_attention_cache<double>(nb, len, heads, d, true, rng, 3.0);
  auto u = random_normal<double>({nb * len, d}, rng);
  auto r = random_probs<double>(nb * len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  std::set<int> chosen;
  for (HeadChoice hc : {HeadChoice::PerSequence, HeadChoice::PerSequenceCausal}) {
    cfg.options<Attention>().head_choice = hc;
    GraphImpl<Attention, double> g;
    g.configure(d, cfg);
    Tensor<double> p;
    g.forward(u, r, {len, &cache}, p);
    for (index_t b = 0; b < nb; ++b)
      for (index_t i = 0; i < len; ++i) {
        const int want = naive_best_head(cache, b, len, hc == HeadChoice::PerSequence ? len - 1 : i);
        CHECK(g.heads()[static_cast<std::size_t>(b * len + i)] == want);
        chosen.insert(want);
      }
  }
  CHECK(chosen.size() >= 2);  // the test data exercises more than one head
}

TEST_CASE("Appendix C.3: Renormalize(TopK0(r)) equals Softmax(TopKinf(gamma))") {
  Rng rng(15);
  const index_t n = 20, e = 8, k = 3;
  auto gamma = random_normal<double>({n, e}, rng, 2.0);
  Tensor<double> r;
  softmax_forward(gamma, r);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  SelectorImpl<TopK, double> sel;
  sel.configure(cfg);
  Selection<double> s;
  sel.select(r, k, s);
  for (index_t i = 0; i < n; ++i) {
    // TopK^inf: -inf outside the k largest gamma, then softmax
    std::vector<index_t> order(static_cast<std::size_t>(e));
    for (index_t c = 0; c < e; ++c) order[static_cast<std::size_t>(c)] = c;
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return gamma(i, a) > gamma(i, b); });
    double z = 0;
    for (index_t j = 0; j < k; ++j) z += std::exp(gamma(i, order[static_cast<std::size_t>(j)]));
    for (index_t j = 0; j < k; ++j) {
      CHECK(s.indices(i, j) == order[static_cast<std::size_t>(j)]);
      CHECK(s.gates(i, j) == doctest::Approx(std::exp(gamma(i, order[static_cast<std::size_t>(j)])) / z).epsilon(1e-12));
    }
  }
}

TEST_CASE("selector: gates sum to 1 over k distinct experts, capacity drops overflow in token order") {
  Rng rng(16);
  const index_t n = 40, e = 6, k = 2;
  auto p = random_probs<double>(n, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = k;
  SelectorImpl<TopK, double> sel;
  sel.configure(cfg);
  Selection<double> s;
  sel.select(p, k, s);
  CHECK(dropped_count(s) == 0);
  CHECK(!s.may_drop);
  for (index_t i = 0; i < n; ++i) {
    CHECK(s.indices(i, 0) != s.indices(i, 1));
    CHECK(s.gates(i, 0) + s.gates(i, 1) == doctest::Approx(1.0));
    CHECK(s.values(i, 0) >= s.values(i, 1));
  }
  cfg.capacity_factor = 0.5;  // capacity ceil(0.5 * 80 / 6) = 7 slots per expert
  sel.configure(cfg);
  sel.select(p, k, s);
  std::vector<int> load(static_cast<std::size_t>(e), 0);
  index_t dropped = 0;
  for (index_t i = 0; i < n * k; ++i) {
    const int x = s.indices.data()[i];
    if (s.keep.data()[i]) {
      ++load[static_cast<std::size_t>(x)];
      CHECK(load[static_cast<std::size_t>(x)] <= 7);
    } else {
      ++dropped;
      CHECK(load[static_cast<std::size_t>(x)] == 7);  // dropped only once the expert is full
      CHECK(s.gates.data()[i] == 0.0);
    }
  }
  CHECK(dropped == dropped_count(s));
  CHECK(s.may_drop);
  index_t kept = 0;
  for (int l : load) kept += l;
  CHECK(dropped == n * k - kept);
  CHECK(dropped > 0);
}

TEST_CASE("ScheduledTopK: linear k schedule from k_min to k_max, and the dense override") {
  RouterConfig cfg;
  cfg.num_experts = 16;
  cfg.options<ScheduledTopK>().k_min = 2;
  cfg.options<ScheduledTopK>().k_max = 8;
  cfg.options<ScheduledTopK>().schedule_steps = 60;
  using S = SelectorImpl<ScheduledTopK, float>;
  const auto& o = cfg.options<ScheduledTopK>();
  CHECK(S::k_at(o, 0) == 2);
  CHECK(S::k_at(o, 5) == 2);    // 6 * 5 / 60 = 0.5 rounds half to even (Python's round) -> 0
  CHECK(S::k_at(o, 15) == 4);   // 1.5 -> 2
  CHECK(S::k_at(o, 30) == 5);
  CHECK(S::k_at(o, 60) == 8);
  CHECK(S::k_at(o, 1000) == 8);
  S s;
  s.configure(cfg);
  s.set_step(30);
  CHECK(s.current_k() == 5);
  s.set_k_override(16);
  CHECK(s.current_k() == 16);
  s.set_k_override(0);
  CHECK(s.current_k() == 5);
}

// The paper's claim (Appendix E.5) holds when all tokens have the same norm, as after a layer norm:
// then u_i . u_j < |u_i|^2 for j != i (Cauchy-Schwarz). With unequal norms S tends to the one-hot
// of argmax_j u_i . u_j instead, which need not be i; the second half checks that.
TEST_CASE("tau -> 0: S becomes the identity and the Similarity router equals the softmax router") {
  Rng rng(17);
  const index_t nb = 2, len = 10, d = 8, e = 6;
  auto u = random_normal<double>({nb * len, d}, rng);
  for (index_t i = 0; i < u.rows(); ++i) {  // rows of norm sqrt(d), as layer-normed tokens
    double nrm = 0;
    for (index_t c = 0; c < d; ++c) nrm += u(i, c) * u(i, c);
    for (index_t c = 0; c < d; ++c) u(i, c) *= std::sqrt(static_cast<double>(d) / nrm);
  }
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = 2;
  cfg.allow_unused_options = true;  // one config for the softmax and the Similarity router
  cfg.options<Similarity>().tau = 1e-3;
  ParameterArena<double> arena;
  RouterImpl<SoftmaxRouter, double> soft;
  RouterImpl<SimilarityRouter, double> sim;
  soft.declare(arena, "a.", d, cfg);
  sim.declare(arena, "b.", d, cfg);
  arena.allocate();
  soft.bind(arena);
  sim.bind(arena);
  Rng init(5);
  soft.init(init);
  arena.value("b.weight").copy_from(arena.value("a.weight"));
  arena.value("b.bias").copy_from(arena.value("a.bias"));
  RouterOutput<double> o1, o2;
  soft.forward(u, {len, nullptr}, o1);
  sim.forward(u, {len, nullptr}, o2);
  CHECK(max_rel_diff(o2.r, o1.r) < 1e-15);
  CHECK(max_rel_diff(o2.p, o1.p) < 1e-12);
  CHECK(sim.graph_entropy() < 1e-12);
  for (index_t i = 0; i < o1.selection.indices.numel(); ++i)
    CHECK(o1.selection.indices.data()[i] == o2.selection.indices.data()[i]);

  // Unequal norms: a token with a much larger norm along u_0 captures row 0.
  auto v = u.clone();
  for (index_t c = 0; c < d; ++c) v(1, c) = 3.0 * v(0, c);
  RouterOutput<double> o3;
  sim.forward(v, {len, nullptr}, o3);
  for (index_t c = 0; c < e; ++c) CHECK(o3.p(0, c) == doctest::Approx(o3.r(1, c)).epsilon(1e-9));
}

TEST_CASE("Proposition 1: H(p_i) <= sum_j s_ij H(r_j) + H(s_i) on random inputs") {
  Rng rng(18);
  for (int trial = 0; trial < 5; ++trial) {
    const index_t len = 12, d = 4, e = 8;
    auto u = random_normal<double>({len, d}, rng, 0.8);
    auto r = random_probs<double>(len, e, rng, 1.0 + trial);
    RouterConfig cfg;
    cfg.num_experts = e;
    GraphImpl<Similarity, double> g;
    g.configure(d, cfg);
    Tensor<double> p;
    g.forward(u, r, {len, nullptr}, p);
    // S rows recomputed from Definition 2 to form the bound.
    for (index_t i = 0; i < len; ++i) {
      std::vector<double> s(static_cast<std::size_t>(len));
      double z = 0;
      for (index_t j = 0; j < len; ++j) {
        double dot = 0;
        for (index_t c = 0; c < d; ++c) dot += u(i, c) * u(j, c);
        s[static_cast<std::size_t>(j)] = std::exp(dot);
        z += s[static_cast<std::size_t>(j)];
      }
      double bound = 0;
      for (index_t j = 0; j < len; ++j) {
        s[static_cast<std::size_t>(j)] /= z;
        bound += s[static_cast<std::size_t>(j)] * entropy_of(&r(j, 0), e);
      }
      bound += entropy_of(s.data(), len);
      CHECK(entropy_of(&p(i, 0), e) <= bound + 1e-12);
    }
  }
}

TEST_CASE("router: bad input") {
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.k = 5;
  CHECK_THROWS_WITH_AS(cfg.validate(), doctest::Contains("k = 5 must be in [1, num_experts = 4]"), Error);
  cfg.k = 2;
  cfg.allow_unused_options = true;  // one config for routers with and without each graph
  cfg.options<Similarity>().tau = 0;
  CHECK_NOTHROW(cfg.validate());  // the common fields only
  CHECK_THROWS_WITH_AS((cfg.validate_for<LinearScorer, Similarity, TopK>()),
                       doctest::Contains("Similarity::Options: tau must be > 0"), Error);
  CHECK_NOTHROW((cfg.validate_for<LinearScorer, Independent, TopK>()));  // no Similarity graph
  cfg.options<Similarity>().tau = 1;
  cfg.options<Attention>().sigma = -1;
  CHECK_THROWS_WITH_AS((cfg.validate_for<LinearScorer, Attention, TopK>()),
                       doctest::Contains("Attention::Options: sigma must be > 0"), Error);
  {
    ParameterArena<float> a;
    RouterImpl<AttentionRouter, float> r;
    CHECK_THROWS_WITH_AS(r.declare(a, "a.", 3, cfg), doctest::Contains("sigma must be > 0"), Error);
  }
  cfg.options<Attention>().sigma = 1;

  ParameterArena<float> arena;
  RouterImpl<SimilarityRouter, float> sim;
  RouterImpl<AttentionRouter, float> att;
  sim.declare(arena, "s.", 3, cfg);
  att.declare(arena, "a.", 3, cfg);
  arena.allocate();
  sim.bind(arena);
  att.bind(arena);
  Rng rng(1);
  sim.init(rng);
  att.init(rng);
  auto u = random_normal<float>({4, 3}, rng);
  RouterOutput<float> out;
  u(2, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(sim.forward(u, {4, nullptr}, out), doctest::Contains("u of shape (4, 3) holds nan"), Error);
  u(2, 1) = 0;
  CHECK_THROWS_WITH_AS(att.forward(u, {4, nullptr}, out), doctest::Contains("needs the attention layer's cache"), Error);
  CHECK_THROWS_WITH_AS(sim.forward(u, {3, nullptr}, out), doctest::Contains("seq_len = 3 does not divide"), Error);
  auto wrong = random_normal<float>({4, 5}, rng);
  CHECK_THROWS_WITH_AS(sim.forward(wrong, {4, nullptr}, out), doctest::Contains("expected (N, 3)"), Error);
  AttentionCache<float> bad = random_attention_cache<float>(1, 4, 2, 3, false, rng);
  bad.probs = Tensor<float>({1, 2, 4, 3});
  CHECK_THROWS_WITH_AS(att.forward(u, {4, &bad}, out), doctest::Contains("attention probs have shape (1, 2, 4, 3)"), Error);
}

TEST_CASE("token graphs: GraphMemory's size rule, and both graphs follow it") {
  CHECK(Similarity::Options{}.memory == GraphMemory::Auto);
  CHECK(Attention::Options{}.memory == GraphMemory::Auto);
  CHECK(graph_stores(GraphMemory::Auto, 1));
  CHECK(graph_stores(GraphMemory::Auto, kGraphStoreMaxLen));
  CHECK(!graph_stores(GraphMemory::Auto, kGraphStoreMaxLen + 1));
  CHECK(graph_stores(GraphMemory::Store, kGraphStoreMaxLen * 64));
  CHECK(!graph_stores(GraphMemory::Recompute, 1));
  CHECK_THROWS_WITH_AS(graph_stores(static_cast<GraphMemory>(7), 4),
                       doctest::Contains("7 is not a GraphMemory"), Error);
  CHECK_THROWS_WITH_AS(graph_stores(GraphMemory::Auto, 0),
                       doctest::Contains("sequence length must be >= 1, got 0"), Error);
  RouterConfig bad;
  bad.options<Similarity>().memory = static_cast<GraphMemory>(-1);
  CHECK_THROWS_WITH_AS((bad.validate_for<LinearScorer, Similarity, TopK>()),
                       doctest::Contains("-1 is not a GraphMemory"), Error);
  bad.options<Attention>().memory = static_cast<GraphMemory>(3);
  CHECK_THROWS_WITH_AS((bad.validate_for<LinearScorer, Attention, TopK>()),
                       doctest::Contains("3 is not a GraphMemory"), Error);
  // Auto (the default) at the threshold and one token past it, in both graphs
  Rng rng(17);
  const index_t d = 2, e = 2;
  for (index_t len : {kGraphStoreMaxLen, kGraphStoreMaxLen + 1}) {
    CAPTURE(len);
    const bool stores = len <= kGraphStoreMaxLen;
    auto u = random_normal<double>({len, d}, rng);
    auto r = random_probs<double>(len, e, rng);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = true;
    Tensor<double> p;
    GraphImpl<Similarity, double> sim;
    sim.configure(d, cfg);
    sim.forward(u, r, {len, nullptr}, p);
    CHECK(sim.stores() == stores);
    auto cache = random_attention_cache<double>(1, len, 1, d, true, rng);
    GraphImpl<Attention, double> att;
    att.configure(d, cfg);
    CHECK(att.posterior().empty());  // no forward yet
    att.forward(u, r, {len, &cache}, p);
    CHECK(att.stores() == stores);
    if (stores) {
      CHECK(att.posterior().shape() == (Shape{len, len}));
    } else {
      CHECK_THROWS_WITH_AS(att.posterior(), doctest::Contains("did not keep A^p"), Error);
    }
    // a backward needs the forward of the same tokens
    Tensor<double> dr, du(u.shape());
    auto u2 = random_normal<double>({2 * len, d}, rng);
    auto r2 = random_probs<double>(2 * len, e, rng);
    CHECK_THROWS_WITH_AS(sim.backward(u2, r2, r2, r2, {len, nullptr}, dr, du),
                         doctest::Contains("no forward of these"), Error);
    CHECK_THROWS_WITH_AS(att.backward(u, r, p, p, {len - 1, &cache}, dr, du),
                         doctest::Contains("does not divide"), Error);
  }
}

TEST_CASE("RouterConfig: each policy's options, by the policy's type") {
  RouterConfig cfg;
  const RouterConfig& ccfg = cfg;
  // unset: the policy's defaults, and nothing stored
  CHECK(ccfg.options<Similarity>().tau == 1.0);
  CHECK(ccfg.options<Attention>().sigma == 1.0);
  CHECK(ccfg.options<CosineScorer>().dim == 16);
  CHECK(ccfg.options<ScheduledTopK>().k_max == 2);
  CHECK(!cfg.has_options<Similarity>());
  static_assert(std::is_same_v<policy_options_t<Independent>, NoOptions>);
  static_assert(std::is_same_v<policy_options_t<TopK>, TokenChoiceOptions>);
  static_assert(std::is_same_v<policy_options_t<Similarity>, Similarity::Options>);
  // set: kept per policy; a reference stays valid while other policies' options are added
  Similarity::Options& sim = cfg.options<Similarity>();
  sim.tau = 0.25;
  cfg.options<Attention>().sigma = 3;
  cfg.options<LinearScorer>().bias = false;
  cfg.set_options<ScheduledTopK>({.k_min = 1, .k_max = 3, .schedule_steps = 7});
  sim.exclude_self = true;
  CHECK(cfg.has_options<Similarity>());
  CHECK(ccfg.options<Similarity>().tau == 0.25);
  CHECK(ccfg.options<Similarity>().exclude_self);
  CHECK(ccfg.options<Attention>().sigma == 3);
  CHECK(!ccfg.options<LinearScorer>().bias);
  CHECK(ccfg.options<FrozenRandomScorer>().init_std == 0.02);  // a different policy: its defaults
  CHECK(ccfg.options<ScheduledTopK>().schedule_steps == 7);
  // a copy is independent
  RouterConfig copy = cfg;
  copy.options<Similarity>().tau = 4;
  CHECK(cfg.options<Similarity>().tau == 0.25);
  CHECK(copy.options<Similarity>().tau == 4);
  CHECK(copy.options<Attention>().sigma == 3);
  // the implementations read them
  GraphImpl<Similarity, double> g;
  g.configure(4, cfg);
  CHECK(g.tau() == 0.25);
  // cross-checks with the common fields happen where both are known
  cfg.num_experts = 2;
  SelectorImpl<ScheduledTopK, double> s;
  CHECK_THROWS_WITH_AS(s.configure(cfg), doctest::Contains("k_max = 3 exceeds num_experts = 2"), Error);
  RouterConfig causal;
  causal.causal = true;
  causal.options<Attention>().head_choice = HeadChoice::PerSequence;
  GraphImpl<Attention, double> a;
  CHECK_THROWS_WITH_AS(a.configure(4, causal), doctest::Contains("but the router is causal"), Error);
  causal.options<Attention>().head_choice.reset();
  CHECK_NOTHROW(a.configure(4, causal));
}

TEST_CASE("attention graph: the attention layer's row entropies give the same h* and p as probs") {
  Rng rng(19);
  const index_t nb = 3, len = 8, heads = 4, d = 4, e = 3;
  auto cache = random_attention_cache<double>(nb, len, heads, d, true, rng, 3.0);
  auto u = random_normal<double>({nb * len, d}, rng);
  auto r = random_probs<double>(nb * len, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.options<Attention>().head_choice = HeadChoice::PerSequenceCausal;
  GraphImpl<Attention, double> g;
  g.configure(d, cfg);
  Tensor<double> p1, p2;
  g.forward(u, r, {len, &cache}, p1);
  const auto heads1 = g.heads();
  cache.row_entropy = Tensor<double>({nb, heads, len});
  for (index_t b = 0; b < nb; ++b)
    for (index_t h = 0; h < heads; ++h)
      for (index_t i = 0; i < len; ++i) cache.row_entropy(b, h, i) = entropy_of(&cache.probs(b, h, i, 0), len);
  g.forward(u, r, {len, &cache}, p2);
  CHECK(g.heads() == heads1);
  CHECK(max_rel_diff(p2, p1) == 0.0);
  // and they are really used: reversed entropies pick other heads
  for (index_t i = 0; i < cache.row_entropy.numel(); ++i) cache.row_entropy.data()[i] *= -1;
  g.forward(u, r, {len, &cache}, p2);
  CHECK(g.heads() != heads1);
  cache.row_entropy = Tensor<double>({nb, heads, len + 1});
  CHECK_THROWS_WITH_AS(g.forward(u, r, {len, &cache}, p2), doctest::Contains("row_entropy has shape"), Error);
}
