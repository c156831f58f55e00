// SamplingOptions' penalties, min-p and banned tokens (graphmoe/inference/sampling.hpp), each
// against a naive evaluation written here; StopStrings (graphmoe/inference/generate.hpp) over
// pieces of text a stop string spans.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "graphmoe/inference/generate.hpp"
#include "graphmoe/inference/sampling.hpp"

using namespace graphmoe;

namespace {

std::vector<float> random_logits(std::size_t v, std::uint64_t seed, double scale = 2.0) {
  Rng rng(seed);
  std::vector<float> l(v);
  for (float& x : l) x = static_cast<float>(scale * rng.normal());
  return l;
}

// The penalised logits, naively: one pass per token id over the window of the history.
std::vector<double> naive_penalised(const std::vector<float>& l, const std::vector<std::int32_t>& history,
                                    const SamplingOptions& o) {
  std::vector<double> out(l.begin(), l.end());
  if (o.repeat_last_n == 0) return out;
  const std::size_t n = o.repeat_last_n < 0 ? history.size()
                                            : std::min(history.size(), static_cast<std::size_t>(o.repeat_last_n));
  for (std::size_t id = 0; id < l.size(); ++id) {
    int count = 0;
    for (std::size_t j = history.size() - n; j < history.size(); ++j) count += history[j] == static_cast<std::int32_t>(id);
    if (count == 0) continue;
    double x = out[id];
    if (x > 0) x /= o.repeat_penalty;
    else x *= o.repeat_penalty;
    out[id] = x - count * o.frequency_penalty - o.presence_penalty;
  }
  return out;
}

std::vector<double> softmax(const std::vector<double>& l, double temperature, const std::set<std::int32_t>& banned = {}) {
  long double mx = -std::numeric_limits<long double>::infinity();
  for (std::size_t i = 0; i < l.size(); ++i)
    if (!banned.count(static_cast<std::int32_t>(i))) mx = std::max(mx, static_cast<long double>(l[i]));
  std::vector<long double> e(l.size(), 0.0L);
  long double z = 0;
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (banned.count(static_cast<std::int32_t>(i))) continue;
    e[i] = std::exp((static_cast<long double>(l[i]) - mx) / temperature);
    z += e[i];
  }
  std::vector<double> p(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) p[i] = static_cast<double>(e[i] / z);
  return p;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-12) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(tol));
  }
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace

TEST_CASE("SamplingOptions: the repeat penalty divides positive logits and multiplies negative ones, of the tokens in its window") {
  // by hand: ids 0 (logit 2) and 1 (logit -2) were seen, id 2 (logit 0.5) was not
  SamplingOptions o;
  o.repeat_penalty = 2.0;
  const std::vector<float> l = {2.0f, -2.0f, 0.5f};
  const std::vector<std::int32_t> h = {1, 0};
  check_close(Sampler(o).distribution(l, h), softmax({1.0, -4.0, 0.5}, 1.0));
  // against the naive evaluation: several windows and penalties, a temperature
  const std::vector<float> r = random_logits(40, 3);
  std::vector<std::int32_t> hist;
  Rng rng(9);
  for (int i = 0; i < 30; ++i) hist.push_back(static_cast<std::int32_t>(rng.next_u32() % 12));
  for (index_t n : {index_t{-1}, index_t{1}, index_t{5}, index_t{64}}) {
    for (double rp : {0.5, 1.3, 3.0}) {
      CAPTURE(n);
      CAPTURE(rp);
      SamplingOptions p;
      p.repeat_penalty = rp;
      p.repeat_last_n = n;
      p.temperature = 0.7;
      const std::vector<double> want = softmax(naive_penalised(r, hist, p), 0.7);
      check_close(Sampler(p).distribution(r, hist), want);
      // and the penalty did something
      CHECK(max_abs_diff(want, softmax(std::vector<double>(r.begin(), r.end()), 0.7)) > 1e-5);
    }
  }
  // a window of 0 disables it; no history changes nothing
  SamplingOptions off;
  off.repeat_penalty = 3.0;
  off.repeat_last_n = 0;
  check_close(Sampler(off).distribution(r, hist), softmax(std::vector<double>(r.begin(), r.end()), 1.0));
  off.repeat_last_n = 64;
  check_close(Sampler(off).distribution(r, {}), softmax(std::vector<double>(r.begin(), r.end()), 1.0));
}

TEST_CASE("SamplingOptions: frequency and presence penalties subtract count x f and p from the logits of the tokens in the window") {
  const std::vector<float> l = {1.0f, 1.0f, 1.0f, 1.0f};
  const std::vector<std::int32_t> h = {0, 0, 0, 1, 3, 3};
  SamplingOptions f;
  f.frequency_penalty = 0.5;
  check_close(Sampler(f).distribution(l, h), softmax({-0.5, 0.5, 1.0, 0.0}, 1.0));
  SamplingOptions p;
  p.presence_penalty = 0.5;
  check_close(Sampler(p).distribution(l, h), softmax({0.5, 0.5, 1.0, 0.5}, 1.0));
  // the window: the last 2 tokens hold id 3 twice only
  p.repeat_last_n = 2;
  check_close(Sampler(p).distribution(l, h), softmax({1.0, 1.0, 1.0, 0.5}, 1.0));

  const std::vector<float> r = random_logits(30, 5);
  std::vector<std::int32_t> hist;
  Rng rng(2);
  for (int i = 0; i < 50; ++i) hist.push_back(static_cast<std::int32_t>(rng.next_u32() % 10));
  for (double fp : {-0.4, 0.0, 0.3}) {
    for (double pp : {-0.2, 0.0, 1.1}) {
      for (index_t n : {index_t{-1}, index_t{7}}) {
        CAPTURE(fp);
        CAPTURE(pp);
        CAPTURE(n);
        SamplingOptions o;
        o.frequency_penalty = fp;
        o.presence_penalty = pp;
        o.repeat_penalty = 1.2;
        o.repeat_last_n = n;
        o.temperature = 1.4;
        check_close(Sampler(o).distribution(r, hist), softmax(naive_penalised(r, hist, o), 1.4));
      }
    }
  }
  // sample() reads the history too: greedy picks the unpenalised runner-up
  SamplingOptions g;
  g.greedy = true;
  g.presence_penalty = 1.0;
  Sampler gs(g);
  CHECK(gs.sample(std::vector<float>{1.0f, 0.5f}) == 0);
  CHECK(gs.sample(std::vector<float>{1.0f, 0.5f}, std::vector<std::int32_t>{0}) == 1);
}

TEST_CASE("SamplingOptions: min-p never emits a token below min_p x the most probable one's probability") {
  const std::vector<float> l = random_logits(60, 17);
  for (double min_p : {0.05, 0.2, 0.6, 1.0}) {
    for (double t : {0.6, 1.0, 2.5}) {
      CAPTURE(min_p);
      CAPTURE(t);
      const std::vector<double> p = softmax(std::vector<double>(l.begin(), l.end()), t);
      const double pmax = *std::max_element(p.begin(), p.end());
      std::set<std::int32_t> keep;
      double mass = 0;
      for (std::size_t i = 0; i < p.size(); ++i)
        if (p[i] >= min_p * pmax) {
          keep.insert(static_cast<std::int32_t>(i));
          mass += p[i];
        }
      REQUIRE(keep.size() < l.size());  // the cut removes something
      SamplingOptions o;
      o.min_p = min_p;
      o.temperature = t;
      o.seed = 4;
      Sampler s(o);
      std::vector<double> want(p.size(), 0.0);
      for (std::int32_t i : keep) want[static_cast<std::size_t>(i)] = p[static_cast<std::size_t>(i)] / mass;
      check_close(s.distribution(l), want, 1e-10);
      for (int d = 0; d < 2000; ++d) {
        const std::int32_t id = s.sample(l);
        if (!keep.count(id)) {
          CAPTURE(id);
          FAIL("min-p drew an excluded token");
        }
      }
    }
  }
}

TEST_CASE("SamplingOptions: banned tokens are never drawn, greedy included, and a row of banned tokens is refused") {
  const std::vector<float> l = random_logits(20, 8);
  const auto top = static_cast<std::int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  SamplingOptions o;
  o.banned = {top, 3, 3};  // a repeated id is one ban
  o.seed = 1;
  o.top_k = 5;
  const std::set<std::int32_t> banned = {top, 3};
  Sampler s(o);
  const std::vector<double> d = s.distribution(l);
  CHECK(d[static_cast<std::size_t>(top)] == 0.0);
  CHECK(d[3] == 0.0);
  for (int i = 0; i < 3000; ++i) {
    const std::int32_t id = s.sample(l);
    if (banned.count(id)) FAIL("a banned token was drawn: ", id);
  }
  // without top_k: the softmax over the others
  SamplingOptions plain;
  plain.banned = {top, 3};
  check_close(Sampler(plain).distribution(l), softmax(std::vector<double>(l.begin(), l.end()), 1.0, banned));
  SamplingOptions g = plain;
  g.greedy = true;
  Sampler gs(g);
  const std::int32_t second = gs.sample(l);
  CHECK(second != top);
  CHECK(second != 3);
  std::vector<float> rest = l;
  rest[static_cast<std::size_t>(top)] = rest[3] = -1e30f;
  CHECK(second == static_cast<std::int32_t>(std::max_element(rest.begin(), rest.end()) - rest.begin()));

  SamplingOptions all;
  all.banned = {0, 1};
  CHECK_THROWS_WITH_AS(Sampler(all).sample(std::vector<float>{1.0f, 2.0f}),
                       doctest::Contains("every one of the 2 token ids is banned"), Error);
  all.banned = {5};
  CHECK_THROWS_WITH_AS(Sampler(all).sample(std::vector<float>{1.0f, 2.0f}),
                       doctest::Contains("banned token id 5 is not in the row of 2 logits"), Error);
  all.banned = {-1};
  CHECK_THROWS_WITH_AS(Sampler{all}, doctest::Contains("banned token id -1 is negative"), Error);
}

TEST_CASE("SamplingOptions: bad penalties, min-p, windows and histories are refused naming the field") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  auto refused = [](auto edit, const char* message) {
    SamplingOptions o;
    edit(o);
    CHECK_THROWS_WITH_AS(Sampler{o}, doctest::Contains(message), Error);
  };
  for (double v : {-0.1, 1.5, nan})
    refused([&](SamplingOptions& o) { o.min_p = v; }, "min_p must be in [0, 1]");
  for (double v : {0.0, -1.0, nan, inf})
    refused([&](SamplingOptions& o) { o.repeat_penalty = v; }, "repeat_penalty must be finite and > 0");
  for (double v : {nan, inf, -inf}) {
    refused([&](SamplingOptions& o) { o.frequency_penalty = v; }, "frequency_penalty must be finite");
    refused([&](SamplingOptions& o) { o.presence_penalty = v; }, "presence_penalty must be finite");
  }
  refused([](SamplingOptions& o) { o.repeat_last_n = -2; }, "repeat_last_n must be >= -1");
  SamplingOptions o;
  o.repeat_penalty = 1e-300;  // 3e38 / 1e-300 overflows
  CHECK_THROWS_WITH_AS(Sampler(o).sample(std::vector<float>{3e38f, 1.0f}, std::vector<std::int32_t>{0}),
                       doctest::Contains("the penalties made logit 0 non-finite"), Error);
  SamplingOptions h;
  h.presence_penalty = 0.5;
  CHECK_THROWS_WITH_AS(Sampler(h).sample(std::vector<float>{1.0f, 2.0f}, std::vector<std::int32_t>{0, 7}),
                       doctest::Contains("history token 1 is id 7, not in the row of 2 logits"), Error);
}

TEST_CASE("StopStrings: a stop string spanning pieces stops at the piece that completes it, keeping the text up to its end") {
  // " the| ca|t sa|t on": "cat s" ends 3 bytes into the third piece
  StopStrings s({"cat s"});
  CHECK(s.feed(" the") == 4);
  CHECK(s.feed(" ca") == 3);
  CHECK(!s.stopped());
  CHECK(s.feed("t sa") == 3);
  CHECK(s.stopped());
  CHECK(s.matched() == "cat s");
  CHECK(s.feed("t on") == 0);
  // over three pieces; the earliest end wins among several strings
  StopStrings three({"t on", "he cat sa"});
  CHECK(three.feed(" the") == 4);
  CHECK(three.feed(" ca") == 3);
  CHECK(three.feed("t sa") == 4);
  CHECK(three.matched() == "he cat sa");
  StopStrings earliest({"at sat", "cat"});
  earliest.feed(" the ca");
  CHECK(earliest.feed("t sat") == 1);
  CHECK(earliest.matched() == "cat");
  // a long stream before the match: the tail kept between pieces is enough
  StopStrings longrun({"yxab"});
  for (int i = 0; i < 200; ++i) CHECK(longrun.feed(i % 2 ? "x" : "y") == 1);
  CHECK(!longrun.stopped());
  CHECK(longrun.feed("ab!") == 2);  // "...yx" + "ab"
  // never matched: every byte kept; a match inside one piece
  StopStrings none({"zz"});
  CHECK(none.feed("z") == 1);
  CHECK(none.feed("az") == 2);
  CHECK(!none.stopped());
  StopStrings inside({"b"});
  CHECK(inside.feed("abc") == 2);
  CHECK_THROWS_WITH_AS(StopStrings({"ok", ""}), doctest::Contains("a stop string is empty"), Error);
}
