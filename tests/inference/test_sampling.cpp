// Sampler (graphmoe/inference/sampling.hpp): top-k and top-p never emit a token outside their
// set, the temperature's greedy limit, the seed's determinism, empirical frequencies against an
// independently computed softmax, bad options and bad logits.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "graphmoe/inference/sampling.hpp"

using namespace graphmoe;

namespace {

// V logits drawn from N(0, scale^2) with the library's generator.
std::vector<float> random_logits(std::size_t v, std::uint64_t seed, double scale = 2.0) {
  Rng rng(seed);
  std::vector<float> l(v);
  for (float& x : l) x = static_cast<float>(scale * rng.normal());
  return l;
}

// softmax(l / temperature) in long double, written independently of the sampler.
std::vector<double> reference_softmax(const std::vector<float>& l, double temperature) {
  long double mx = -std::numeric_limits<long double>::infinity();
  for (float x : l) mx = std::max(mx, static_cast<long double>(x));
  std::vector<long double> e(l.size());
  long double z = 0;
  for (std::size_t i = 0; i < l.size(); ++i) {
    e[i] = std::exp((static_cast<long double>(l[i]) - mx) / temperature);
    z += e[i];
  }
  std::vector<double> p(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) p[i] = static_cast<double>(e[i] / z);
  return p;
}

// The ids of the k largest logits (distinct logits: no tie to break).
std::set<std::int32_t> top_k_set(const std::vector<float>& l, std::size_t k) {
  std::vector<std::int32_t> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) { return l[a] > l[b]; });
  return {ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k)};
}

// The smallest set of the most probable tokens whose mass under p is >= top_p.
std::set<std::int32_t> top_p_set(const std::vector<double>& p, double top_p) {
  std::vector<std::int32_t> ids(p.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) { return p[a] > p[b]; });
  std::set<std::int32_t> s;
  double mass = 0;
  for (std::int32_t i : ids) {
    s.insert(i);
    mass += p[static_cast<std::size_t>(i)];
    if (mass >= top_p) break;
  }
  return s;
}

SamplingOptions sampling(double temperature, index_t top_k, double top_p, std::uint64_t seed) {
  SamplingOptions o;
  o.temperature = temperature;
  o.top_k = top_k;
  o.top_p = top_p;
  o.seed = seed;
  return o;
}

}  // namespace

TEST_CASE("Sampler: top-k never emits a token outside the k largest logits") {
  const std::vector<float> l = random_logits(50, 11);
  for (index_t k : {1, 3, 7}) {
    for (double temperature : {0.5, 1.0, 4.0}) {
      CAPTURE(k);
      CAPTURE(temperature);
      const std::set<std::int32_t> allowed = top_k_set(l, static_cast<std::size_t>(k));
      Sampler s(sampling(temperature, k, 1.0, 5));
      std::set<std::int32_t> seen;
      for (int i = 0; i < 3000; ++i) {
        const std::int32_t id = s.sample(l);
        CHECK(allowed.count(id) == 1);
        seen.insert(id);
      }
      // every one of the k is reachable (its renormalised mass is at least a few percent here)
      CHECK(seen == allowed);
    }
  }
  // equal logits at the boundary: the smaller ids are kept
  const std::vector<float> ties = {1.0f, 3.0f, 3.0f, 3.0f, 0.0f};
  Sampler s(sampling(1.0, 2, 1.0, 9));
  std::set<std::int32_t> seen;
  for (int i = 0; i < 500; ++i) seen.insert(s.sample(ties));
  CHECK(seen == std::set<std::int32_t>{1, 2});
  // k beyond the vocabulary keeps all of it
  Sampler all(sampling(1.0, 1000, 1.0, 9));
  const std::vector<double> d = all.distribution(ties);
  CHECK(std::count_if(d.begin(), d.end(), [](double x) { return x > 0; }) == 5);
}

TEST_CASE("Sampler: top-p never emits a token outside the smallest set whose mass is >= p") {
  const std::vector<float> l = random_logits(20, 21, 1.5);
  for (double temperature : {1.0, 2.0}) {
    const std::vector<double> p = reference_softmax(l, temperature);
    for (double top_p : {0.2, 0.5, 0.8, 0.95}) {
      CAPTURE(temperature);
      CAPTURE(top_p);
      const std::set<std::int32_t> allowed = top_p_set(p, top_p);
      // the set is a strict subset, so the test can fail (and is not the whole vocabulary)
      REQUIRE(allowed.size() < l.size());
      Sampler s(sampling(temperature, 0, top_p, 6));
      std::set<std::int32_t> seen;
      for (int i = 0; i < 3000; ++i) {
        const std::int32_t id = s.sample(l);
        CHECK(allowed.count(id) == 1);
        seen.insert(id);
      }
      CHECK(seen == allowed);
      // the distribution is p renormalised over the set
      double mass = 0;
      for (std::int32_t i : allowed) mass += p[static_cast<std::size_t>(i)];
      const std::vector<double> d = s.distribution(l);
      for (std::size_t i = 0; i < l.size(); ++i) {
        CAPTURE(i);
        const double want = allowed.count(static_cast<std::int32_t>(i)) ? p[i] / mass : 0.0;
        CHECK(d[i] == doctest::Approx(want).epsilon(1e-12));
      }
    }
  }
  // top-k then top-p: p applies to the mass top-k kept. Logits ln(4), ln(3), ln(2), ln(1):
  // top_k = 3 keeps 4/9, 3/9, 2/9; top_p = 0.7 then needs 4/9 + 3/9 = 7/9 >= 0.7 -> {0, 1}
  // (over the whole vocabulary 4/10 + 3/10 = 0.7 would also be two, so use 0.75: 7/9 >= 0.75
  // but 7/10 < 0.75)
  const std::vector<float> q = {std::log(4.0f), std::log(3.0f), std::log(2.0f), 0.0f};
  Sampler kp(sampling(1.0, 3, 0.75, 2));
  const std::vector<double> d = kp.distribution(q);
  CHECK(d[0] == doctest::Approx(4.0 / 7.0));
  CHECK(d[1] == doctest::Approx(3.0 / 7.0));
  CHECK(d[2] == 0.0);
  CHECK(d[3] == 0.0);
}

TEST_CASE("Sampler: a small temperature approaches greedy, and greedy is the arg max and draws nothing") {
  const std::vector<float> l = {0.3f, 1.9f, -2.0f, 1.8f, 0.0f};  // arg max 1, by a margin of 0.1
  Sampler cold(sampling(1e-3, 0, 1.0, 3));  // p(3) / p(1) = exp(-0.1 / 1e-3) = e^-100
  for (int i = 0; i < 2000; ++i) CHECK(cold.sample(l) == 1);
  // at temperature 1 the runner-up (p(3) / p(1) = e^-0.1) is drawn: the check above can fail
  Sampler warm(sampling(1.0, 0, 1.0, 3));
  int runner_up = 0;
  for (int i = 0; i < 2000; ++i) runner_up += warm.sample(l) == 3;
  CHECK(runner_up > 300);

  SamplingOptions g = sampling(1.0, 0, 1.0, 3);
  g.greedy = true;
  Sampler greedy(g);
  CHECK(greedy.sample(l) == 1);
  CHECK(greedy.position() == 0);  // no random word read
  const std::vector<double> tie = {2.0, 5.0, 5.0, 1.0};
  CHECK(greedy.sample(tie) == 1);  // the smallest id among equal maxima
  const std::vector<double> d = greedy.distribution(tie);
  CHECK(d == std::vector<double>{0.0, 1.0, 0.0, 0.0});
}

TEST_CASE("Sampler: the same seed gives the same tokens, another seed others") {
  const std::vector<float> l = random_logits(10, 31, 0.5);
  auto draws = [&](std::uint64_t seed, index_t top_k, double top_p) {
    Sampler s(sampling(1.3, top_k, top_p, seed));
    std::vector<std::int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(l));
    CHECK(s.position() == 400);  // two words per draw
    return out;
  };
  CHECK(draws(7, 0, 1.0) == draws(7, 0, 1.0));
  CHECK(draws(7, 4, 0.9) == draws(7, 4, 0.9));
  CHECK(draws(7, 0, 1.0) != draws(8, 0, 1.0));
  // float and double rows of the same values draw the same tokens
  std::vector<double> ld(l.begin(), l.end());
  Sampler a(sampling(1.3, 0, 1.0, 7)), b(sampling(1.3, 0, 1.0, 7));
  for (int i = 0; i < 200; ++i) CHECK(a.sample(l) == b.sample(ld));
}

TEST_CASE("Sampler: empirical frequencies of 4,000 draws match the softmax") {
  // Each token's count is Binomial(N, p_i): its frequency has standard deviation
  // sqrt(p_i (1 - p_i) / N), at most 0.0079 for N = 4,000. A bound of 5 such deviations (+1e-9)
  // is passed by a correct sampler with probability > 1 - 6e-7 per token (and the seed is fixed,
  // so the outcome is reproducible), while a sampler off by a temperature of 1 vs 2 here, or one
  // that drops the top-k renormalisation, misses by 0.05 or more on some token.
  const std::vector<float> l = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.5f};
  const int n = 4000;
  struct Case {
    double temperature;
    index_t top_k;
  };
  for (const Case c : {Case{1.0, 0}, Case{2.0, 0}, Case{0.7, 0}, Case{1.0, 3}}) {
    CAPTURE(c.temperature);
    CAPTURE(c.top_k);
    std::vector<double> p = reference_softmax(l, c.temperature);
    if (c.top_k > 0) {  // renormalise over the k largest
      const std::set<std::int32_t> keep = top_k_set(l, static_cast<std::size_t>(c.top_k));
      double mass = 0;
      for (std::size_t i = 0; i < p.size(); ++i) {
        if (!keep.count(static_cast<std::int32_t>(i))) p[i] = 0;
        mass += p[i];
      }
      for (double& x : p) x /= mass;
    }
    Sampler s(sampling(c.temperature, c.top_k, 1.0, 42));
    std::vector<int> count(l.size(), 0);
    for (int i = 0; i < n; ++i) ++count[static_cast<std::size_t>(s.sample(l))];
    for (std::size_t i = 0; i < l.size(); ++i) {
      CAPTURE(i);
      const double f = static_cast<double>(count[i]) / n;
      const double sd = std::sqrt(p[i] * (1 - p[i]) / n);
      CHECK(std::abs(f - p[i]) <= 5 * sd + 1e-9);
    }
  }
}

TEST_CASE("Sampler: bad options and bad logits are refused with a clear error") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (double t : {0.0, -1.0, nan, inf}) {
    CAPTURE(t);
    CHECK_THROWS_WITH_AS(Sampler(sampling(t, 0, 1.0, 0)),
                         doctest::Contains("temperature must be finite and > 0"), Error);
  }
  CHECK_THROWS_WITH_AS(Sampler(sampling(0.0, 0, 1.0, 0)),
                       doctest::Contains("set SamplingOptions::greedy"), Error);
  for (double p : {0.0, -0.1, 1.5, nan}) {
    CAPTURE(p);
    CHECK_THROWS_WITH_AS(Sampler(sampling(1.0, 0, p, 0)),
                         doctest::Contains("top_p must be in (0, 1]"), Error);
  }
  CHECK_THROWS_WITH_AS(Sampler(sampling(1.0, -1, 1.0, 0)),
                       doctest::Contains("top_k must be >= 0 (0 keeps every token), got -1"), Error);
  SamplingOptions g = sampling(-2.0, 0, 1.0, 0);
  g.greedy = true;  // greedy still validates the others
  CHECK_THROWS_AS(Sampler{g}, Error);

  Sampler s(sampling(1.0, 0, 1.0, 0));
  CHECK_THROWS_WITH_AS(s.sample(std::vector<float>{}), doctest::Contains("the row of logits is empty"),
                       Error);
  const float fnan = std::numeric_limits<float>::quiet_NaN();
  const float finf = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH_AS(s.sample(std::vector<float>{0.5f, fnan, 1.0f}),
                       doctest::Contains("logit 1 of 3 is nan"), Error);
  CHECK_THROWS_WITH_AS(s.sample(std::vector<float>{0.5f, 1.0f, finf}),
                       doctest::Contains("logit 2 of 3 is inf"), Error);
  CHECK_THROWS_WITH_AS(s.distribution(std::vector<double>{-inf, 1.0}),
                       doctest::Contains("logit 0 of 2 is -inf"), Error);
  SamplingOptions gg;
  gg.greedy = true;
  Sampler greedy(gg);
  CHECK_THROWS_WITH_AS(greedy.sample(std::vector<double>{1.0, nan}),
                       doctest::Contains("not finite and cannot be sampled"), Error);
  CHECK(s.position() == 0);  // a refused row draws nothing
}
