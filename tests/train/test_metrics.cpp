// Routing metrics against naive loops and hand-made examples (fluctuation, entropy, expert load,
// selection change); the routing report on hand-made routing histories; the seeded text attack;
// CsvLog (header once, append, full precision, quoting); bad input.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "graphmoe/train/metrics.hpp"
#include "graphmoe/train/routing_report.hpp"
#include "graphmoe/train/text_attack.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

using Idx = Tensor<std::int32_t, cpu>;

Idx idx(index_t n, index_t k, const std::vector<std::int32_t>& v) { return Idx::from({n, k}, v); }

// k distinct experts in [0, E) per token
Idx random_routing(index_t n, index_t k, index_t e, Rng& rng) {
  Idx out({n, k});
  for (index_t i = 0; i < n; ++i) {
    std::set<std::int32_t> used;
    for (index_t j = 0; j < k; ++j) {
      std::int32_t x;
      do x = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
      while (used.count(x));
      used.insert(x);
      out(i, j) = x;
    }
  }
  return out;
}

// softmax rows of random logits
template <class T>
Tensor<T, cpu> random_probs(index_t n, index_t e, Rng& rng, double scale) {
  Tensor<T, cpu> p({n, e});
  for (index_t i = 0; i < n; ++i) {
    std::vector<double> z(static_cast<std::size_t>(e));
    double s = 0;
    for (auto& x : z) s += (x = std::exp(scale * rng.normal()));
    for (index_t j = 0; j < e; ++j) p(i, j) = static_cast<T>(z[static_cast<std::size_t>(j)] / s);
  }
  return p;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh path in the temporary directory, unique per test and process.
std::string temp_path(const std::string& tag) {
  auto p = std::filesystem::temp_directory_path() /
           ("graphmoe_test_metrics_" + tag + "_" + std::to_string(::getpid()) + ".csv");
  std::filesystem::remove(p);
  return p.string();
}

}  // namespace

TEST_CASE("routing_fluctuation: identical, permuted, disjoint and mixed routings") {
  auto a = idx(3, 2, {0, 1, 2, 3, 4, 5});
  Fluctuation same = routing_fluctuation(a, a);
  CHECK(same.changed_tokens == 0.0);
  CHECK(same.switch_fraction == 0.0);
  // the order of a token's experts does not matter
  Fluctuation perm = routing_fluctuation(a, idx(3, 2, {1, 0, 3, 2, 5, 4}));
  CHECK(perm.changed_tokens == 0.0);
  CHECK(perm.switch_fraction == 0.0);
  Fluctuation disjoint = routing_fluctuation(a, idx(3, 2, {2, 3, 0, 1, 6, 7}));
  CHECK(disjoint.changed_tokens == 1.0);
  CHECK(disjoint.switch_fraction == 1.0);
  // token 0 same set, token 1 one slot changed, token 2 both, token 3 same:
  // changed = 2/4, switch = (0 + 1/2 + 1 + 0) / 4
  auto x = idx(4, 2, {0, 1, 2, 3, 4, 5, 0, 1});
  auto y = idx(4, 2, {1, 0, 2, 6, 7, 8, 0, 1});
  Fluctuation mixed = routing_fluctuation(x, y);
  CHECK(mixed.changed_tokens == 0.5);
  CHECK(mixed.switch_fraction == 0.375);
  Fluctuation back = routing_fluctuation(y, x);
  CHECK(back.changed_tokens == 0.5);
  CHECK(back.switch_fraction == 0.375);
  // k = 1: the paper's top-1 case
  Fluctuation top1 = routing_fluctuation(idx(5, 1, {0, 1, 2, 3, 4}), idx(5, 1, {0, 1, 3, 3, 0}));
  CHECK(top1.changed_tokens == 0.4);
  CHECK(top1.switch_fraction == 0.4);
  CHECK(top1.top1_changed == 0.4);
  // top-1 reads slot 0: a swapped pair keeps the set but changes the first choice
  CHECK(perm.top1_changed == 1.0);
  CHECK(same.top1_changed == 0.0);
  // x vs y: token 0 (0 vs 1) and token 2 (4 vs 7) change their first expert
  CHECK(mixed.top1_changed == 0.5);
}

TEST_CASE("routing_fluctuation: matches a naive loop on random routings") {
  Rng rng(1);
  for (index_t k : {1, 2, 4}) {
    CAPTURE(k);
    const index_t n = 257, e = 8;
    auto a = random_routing(n, k, e, rng);
    auto b = random_routing(n, k, e, rng);
    double changed = 0, sw = 0;
    for (index_t i = 0; i < n; ++i) {
      std::set<std::int32_t> sa, sb;
      for (index_t j = 0; j < k; ++j) {
        sa.insert(a(i, j));
        sb.insert(b(i, j));
      }
      changed += sa != sb ? 1 : 0;
      double miss = 0;
      for (index_t j = 0; j < k; ++j) miss += sb.count(a(i, j)) ? 0 : 1;
      sw += miss / static_cast<double>(k);
    }
    Fluctuation f = routing_fluctuation(a, b);
    CHECK(f.changed_tokens == doctest::Approx(changed / n).epsilon(1e-14));
    CHECK(f.switch_fraction == doctest::Approx(sw / n).epsilon(1e-14));
    CHECK(f.switch_fraction <= f.changed_tokens);
    CHECK(f.changed_tokens > 0);
    double top1 = 0;
    for (index_t i = 0; i < n; ++i) top1 += a(i, 0) != b(i, 0) ? 1 : 0;
    CHECK(f.top1_changed == doctest::Approx(top1 / n).epsilon(1e-14));
  }
}

TEST_CASE("selection_change: hand-made rows, ties, and a naive top-k") {
  // rows of r (E = 4); the selection says which experts p chose
  auto r = Tensor<double, cpu>::from({4, 4}, {0.4, 0.3, 0.2, 0.1,     // top-2 = {0, 1}
                                              0.1, 0.2, 0.3, 0.4,     // top-2 = {3, 2}
                                              0.25, 0.25, 0.25, 0.25, // tie: lower ids, {0, 1}
                                              0.5, 0.2, 0.2, 0.1});   // tie for 2nd: {0, 1}
  CHECK(selection_change(r, idx(4, 2, {1, 0, 2, 3, 0, 1, 0, 1})) == 0.0);
  CHECK(selection_change(r, idx(4, 2, {0, 2, 2, 3, 0, 1, 0, 1})) == 0.25);
  // the tied rows: {0, 2} is not what top-k of r picks ({0, 1}); nor is {2, 3} for row 2
  CHECK(selection_change(r, idx(4, 2, {0, 1, 2, 3, 2, 3, 0, 2})) == 0.5);
  CHECK(selection_change(r, idx(4, 1, {0, 3, 0, 0})) == 0.0);
  CHECK(selection_change(r, idx(4, 1, {1, 2, 1, 1})) == 1.0);
  // against a naive top-k (sort by descending value, then ascending id)
  Rng rng(3);
  const index_t n = 300, e = 8;
  for (index_t k : {1, 2, 3}) {
    CAPTURE(k);
    auto probs = random_probs<float>(n, e, rng, 1.0);
    auto sel = random_routing(n, k, e, rng);
    for (index_t i = 0; i < n; i += 3) {  // a third of the rows select the true top-k
      std::vector<index_t> ids(static_cast<std::size_t>(e));
      for (index_t j = 0; j < e; ++j) ids[static_cast<std::size_t>(j)] = j;
      std::stable_sort(ids.begin(), ids.end(), [&](index_t a, index_t b) { return probs(i, a) > probs(i, b); });
      for (index_t j = 0; j < k; ++j) sel(i, j) = static_cast<std::int32_t>(ids[static_cast<std::size_t>(k - 1 - j)]);
    }
    double changed = 0;
    for (index_t i = 0; i < n; ++i) {
      std::vector<index_t> ids(static_cast<std::size_t>(e));
      for (index_t j = 0; j < e; ++j) ids[static_cast<std::size_t>(j)] = j;
      std::stable_sort(ids.begin(), ids.end(), [&](index_t a, index_t b) { return probs(i, a) > probs(i, b); });
      std::set<std::int32_t> top, chosen;
      for (index_t j = 0; j < k; ++j) {
        top.insert(static_cast<std::int32_t>(ids[static_cast<std::size_t>(j)]));
        chosen.insert(sel(i, j));
      }
      changed += top != chosen ? 1 : 0;
    }
    CHECK(selection_change(probs, sel) == doctest::Approx(changed / n).epsilon(1e-14));
    CHECK(changed > 0);
    CHECK(changed < n);
  }
}

TEST_CASE("selection_change: bad input") {
  auto r = Tensor<double, cpu>::from({2, 3}, {0.5, 0.3, 0.2, 0.1, 0.1, 0.8});
  CHECK_THROWS_WITH_AS(selection_change(r, idx(3, 1, {0, 1, 2})), doctest::Contains("same N"), Error);
  CHECK_THROWS_WITH_AS(selection_change(r, idx(2, 4, {0, 1, 2, 3, 0, 1, 2, 3})),
                       doctest::Contains("1 <= k <= E"), Error);
  CHECK_THROWS_WITH_AS(selection_change(r, idx(2, 1, {0, 3})), doctest::Contains("out of range"), Error);
  CHECK_THROWS_WITH_AS(selection_change(r, idx(2, 2, {0, 0, 1, 2})), doctest::Contains("twice"), Error);
  r(1, 1) = std::nan("");
  CHECK_THROWS_WITH_AS(selection_change(r, idx(2, 1, {0, 2})), doctest::Contains("scores row 1"), Error);
}

namespace {
// Hand-made routing histories: two MoE layers (blocks 1 and 3), E = 4, k = 2, two batches of 2 tokens.
Tensor<double, cpu> rows(index_t n, const std::vector<double>& v) { return Tensor<double, cpu>::from({n, 4}, v); }
}  // namespace

TEST_CASE("routing_report: known answers on hand-made routing histories") {
  const auto uniform = rows(2, {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25});
  const auto peaked = rows(2, {1, 0, 0, 0, 0, 1, 0, 0});
  const auto half = rows(2, {0.5, 0.5, 0, 0, 0, 0, 0.5, 0.5});
  RoutingProbe model, earlier, base;
  // model: layer 1 r uniform, p = half; layer 3 r = p = peaked. Batches differ in selections.
  model.record(0, 1, uniform, half, idx(2, 2, {0, 1, 2, 3}), 0.5, 0.75);
  model.record(1, 3, peaked, peaked, idx(2, 2, {0, 1, 1, 0}), 0.0, 1.0);
  model.record(0, 1, uniform, half, idx(2, 2, {1, 0, 3, 2}), 1.5, 0.25);
  model.record(1, 3, peaked, peaked, idx(2, 2, {0, 2, 1, 3}), 0.0, 1.0);
  // earlier checkpoint: layer 1 token 0 swaps order (same set), token 2 changes a slot
  earlier.record(0, 1, uniform, uniform, idx(2, 2, {1, 0, 2, 3}), 0, 1);
  earlier.record(1, 3, peaked, peaked, idx(2, 2, {0, 1, 1, 0}), 0, 1);
  earlier.record(0, 1, uniform, uniform, idx(2, 2, {1, 0, 3, 0}), 0, 1);
  earlier.record(1, 3, peaked, peaked, idx(2, 2, {0, 2, 1, 3}), 0, 1);
  // baseline: r = p = half everywhere
  for (int b = 0; b < 2; ++b) {
    base.record(0, 1, half, half, idx(2, 2, {0, 1, 2, 3}), 0, 1);
    base.record(1, 3, half, half, idx(2, 2, {0, 1, 2, 3}), 0, 1);
  }
  const auto reps = routing_report(model, &earlier, &base);
  REQUIRE(reps.size() == 2);
  const LayerReport& a = reps[0];
  const LayerReport& b = reps[1];
  CHECK(a.layer == 1);
  CHECK(b.layer == 3);
  CHECK(a.tokens == 4);
  CHECK(a.entropy_r == doctest::Approx(std::log(4.0)));
  CHECK(a.entropy_p == doctest::Approx(std::log(2.0)));
  CHECK(a.entropy_r_ratio == doctest::Approx(2.0));  // log 4 / log 2
  CHECK(a.entropy_p_ratio == doctest::Approx(1.0));
  CHECK(a.graph_entropy == doctest::Approx(1.0));    // (0.5 * 2 + 1.5 * 2) / 4
  CHECK(a.self_weight == doctest::Approx(0.5));
  // r uniform: top-2 of r is {0, 1} for every token (ties to lower ids); tokens 1 and 3 chose else
  CHECK(a.graph_changed_selection == doctest::Approx(0.5));  // tokens 1 and 3
  CHECK(a.fluct_topk == doctest::Approx(0.25));      // token 3: {3, 2} vs {3, 0}
  CHECK(a.fluct_top1 == doctest::Approx(0.25));      // token 0: first choice 0 vs 1
  CHECK(a.load == std::vector<index_t>{2, 2, 2, 2});
  CHECK(a.max_load_share == doctest::Approx(0.25));
  CHECK(b.entropy_r == doctest::Approx(0.0));
  CHECK(b.entropy_p_ratio == doctest::Approx(0.0));
  CHECK(b.graph_entropy == 0.0);
  CHECK(b.self_weight == 1.0);
  CHECK(b.fluct_topk == 0.0);
  CHECK(b.fluct_top1 == 0.0);
  CHECK(b.load == std::vector<index_t>{3, 3, 1, 1});
  CHECK(b.max_load_share == doctest::Approx(3.0 / 8.0));
  // peaked r: token 0 picks 0 (1.0) then 1 (tie at 0, lower id): {0, 1} -> unchanged; token 1
  // {1, 0} unchanged; token 2 chose {0, 2}: changed; token 3 {1, 3}: changed
  CHECK(b.graph_changed_selection == doctest::Approx(0.5));
  // without compare / baseline: NaN
  const auto alone = routing_report(model);
  CHECK(std::isnan(alone[0].fluct_topk));
  CHECK(std::isnan(alone[0].entropy_p_ratio));
  // the CSV files
  const std::string dir = std::filesystem::temp_directory_path() / ("graphmoe_report_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_routing_report(dir + "/r.csv", reps);
  write_expert_load(dir + "/l.csv", reps);
  const std::string csv = read_all(dir + "/r.csv");
  CHECK(csv.rfind("layer,tokens,entropy_r,entropy_p,entropy_r_ratio,entropy_p_ratio,graph_entropy,"
                  "self_weight,graph_changed_selection,fluct_top1,fluct_topk,max_load_share\n1,4,", 0) == 0);
  const std::string load = read_all(dir + "/l.csv");
  CHECK(load.find("3,1,3,0.375\n") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("metrics that cannot be computed: n/a in summaries, an empty CSV field, never nan") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(metric_text(nan, 4) == "n/a");
  CHECK(metric_text(-nan, 3) == "n/a");
  CHECK(metric_text(0.25, 4) == "0.2500");
  CHECK(metric_text(-1.5, 1) == "-1.5");
  CHECK(metric_text(3.0, 0) == "3");
  CHECK(metric_text(std::numeric_limits<double>::infinity(), 3) == "inf");
  CHECK(metric_text(-std::numeric_limits<double>::max(), 17).size() > 300);
  CHECK_THROWS_WITH_AS(metric_text(1, -1), doctest::Contains("decimals must be in [0, 17]"), Error);
  CHECK_THROWS_WITH_AS(metric_text(1, 18), doctest::Contains("decimals must be in [0, 17]"), Error);

  const std::string path = temp_path("missing");
  {
    CsvLog log(path, {"step", "loss", "fluctuation", "tokens_per_s"});
    log.row_or_missing(std::vector<double>{1, 0.5, nan, std::numeric_limits<double>::infinity()});
    log.row_or_missing(std::vector<double>{2, 0.25, 0.125, 3});
    CHECK_THROWS_WITH_AS(log.row_or_missing(std::vector<double>{1}),
                         doctest::Contains("1 values given for 4 columns"), Error);
  }
  CHECK(read_all(path) == "step,loss,fluctuation,tokens_per_s\n1,0.5,,inf\n2,0.25,0.125,3\n");
  std::filesystem::remove(path);

  // a routing report without a compare or baseline model: the ratio and fluctuation fields empty
  RoutingProbe model;
  const auto u = rows(2, {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25});
  model.record(0, 1, u, u, idx(2, 2, {0, 1, 0, 1}), 0, 1);
  const std::string report = temp_path("report_missing");
  write_routing_report(report, routing_report(model));
  const std::string csv = read_all(report);
  CHECK(csv.find("nan") == std::string::npos);
  // layer, tokens, entropy_r, entropy_p, two empty ratios, graph entropy 0, self-weight 1,
  // changed 0, two empty fluctuations, max load share
  const std::string row = csv.substr(csv.find('\n') + 1);
  CHECK(row.rfind("1,2,", 0) == 0);
  CHECK(row.find(",,,0,1,0,,,0.5\n") != std::string::npos);
  std::filesystem::remove(report);
}

TEST_CASE("routing_report: mismatched models and bad records") {
  const auto u = rows(2, {0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25});
  RoutingProbe a, b, empty;
  a.record(0, 1, u, u, idx(2, 2, {0, 1, 0, 1}), 0, 1);
  b.record(0, 2, u, u, idx(2, 2, {0, 1, 0, 1}), 0, 1);
  CHECK_THROWS_WITH_AS(routing_report(empty), doctest::Contains("no recorded MoE layer"), Error);
  CHECK_THROWS_WITH_AS(routing_report(a, &b), doctest::Contains("compare model routes layer 2"), Error);
  CHECK_THROWS_WITH_AS(routing_report(a, nullptr, &empty), doctest::Contains("baseline model has 0 MoE layers"), Error);
  CHECK_THROWS_WITH_AS(a.record(2, 1, u, u, idx(2, 2, {0, 1, 0, 1}), 0, 1), doctest::Contains("skips past"), Error);
  CHECK_THROWS_WITH_AS(a.record(0, 4, u, u, idx(2, 2, {0, 1, 0, 1}), 0, 1), doctest::Contains("holds layer 1, not 4"), Error);
  CHECK_THROWS_WITH_AS(a.record(0, 1, u, u, idx(3, 2, {0, 1, 0, 1, 0, 1}), 0, 1), doctest::Contains("same N"), Error);
  CHECK_THROWS_WITH_AS(a.record(0, 1, u, u, idx(2, 2, {0, 1, 0, 1}), std::nan(""), 1), doctest::Contains("not finite"), Error);
}

TEST_CASE("attack_stream: seeded, exact count, kept tokens untouched, targets clean") {
  std::vector<std::int32_t> stream(1000);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = i % 10 == 9 ? 1 : static_cast<std::int32_t>(2 + i % 7);
  AttackStats st;
  const auto a = attack_stream(stream, 0.1, 42, 7, {1}, &st);
  CHECK(st.attackable == 900);
  CHECK(st.replaced == 90);
  std::size_t changed = 0;
  for (std::size_t i = 0; i < stream.size(); ++i) {
    if (a[i] != stream[i]) {
      ++changed;
      CHECK(a[i] == 42);
    }
    if (stream[i] == 1) CHECK(a[i] == 1);  // eos never replaced
  }
  CHECK(changed == 90);
  CHECK(attack_stream(stream, 0.1, 42, 7, {1}) == a);  // same seed, same attack
  const auto other = attack_stream(stream, 0.1, 42, 8, {1});
  CHECK(other != a);
  CHECK(attack_stream(stream, 0.0, 42, 7) == stream);
  const auto all = attack_stream(stream, 1.0, 42, 7, {1});
  for (std::size_t i = 0; i < stream.size(); ++i) CHECK(all[i] == (stream[i] == 1 ? 1 : 42));
  // uniform over positions: each tenth of the stream gets about a tenth of 300 replacements
  const auto many = attack_stream(stream, 1.0 / 3.0, 42, 11, {1}, &st);
  CHECK(st.replaced == 300);
  for (int part = 0; part < 10; ++part) {
    int c = 0;
    for (std::size_t i = part * 100; i < (part + 1) * 100u; ++i) c += many[i] != stream[i];
    CHECK(c > 10);
    CHECK(c < 50);
  }
  // attacked_batch: inputs from the attacked stream, targets from the clean one
  LMBatcher clean(stream, 4, 16), attacked(a, 4, 16);
  const LMBatch b = attacked_batch(clean, attacked, 2);
  const LMBatch cb = clean.batch(2), ab = attacked.batch(2);
  CHECK(std::equal(b.targets.data(), b.targets.data() + b.targets.numel(), cb.targets.data()));
  CHECK(std::equal(b.inputs.data(), b.inputs.data() + b.inputs.numel(), ab.inputs.data()));
  CHECK_FALSE(std::equal(b.inputs.data(), b.inputs.data() + b.inputs.numel(), cb.inputs.data()));
}

TEST_CASE("attack_stream: bad input") {
  const std::vector<std::int32_t> s = {1, 2, 3, 4};
  CHECK_THROWS_WITH_AS(attack_stream(s, 1.5, 0, 1), doctest::Contains("rate must be in [0, 1], got 1.5"), Error);
  CHECK_THROWS_WITH_AS(attack_stream(s, -0.1, 0, 1), doctest::Contains("rate"), Error);
  CHECK_THROWS_WITH_AS(attack_stream(s, std::nan(""), 0, 1), doctest::Contains("rate"), Error);
  CHECK_THROWS_WITH_AS(attack_stream(s, 0.5, -1, 1), doctest::Contains("word id must be >= 0"), Error);
  std::vector<std::int32_t> long_stream(200, 2);
  LMBatcher a(long_stream, 4, 8), b(std::vector<std::int32_t>(200, 2), 2, 8);
  CHECK_THROWS_WITH_AS(attacked_batch(a, b, 0), doctest::Contains("batchers differ"), Error);
}

TEST_CASE("routing_fluctuation: bad input") {
  auto a = idx(3, 2, {0, 1, 2, 3, 4, 5});
  CHECK_THROWS_WITH_AS(routing_fluctuation(a, idx(2, 2, {0, 1, 2, 3})),
                       doctest::Contains("different numbers of tokens (3 and 2)"), Error);
  CHECK_THROWS_WITH_AS(routing_fluctuation(a, idx(3, 1, {0, 1, 2})),
                       doctest::Contains("different numbers of experts (k = 2 and k = 1)"), Error);
  CHECK_THROWS_WITH_AS(routing_fluctuation(a, Idx::from({6}, {0, 1, 2, 3, 4, 5})),
                       doctest::Contains("shape (N, k)"), Error);
  CHECK_THROWS_WITH_AS(routing_fluctuation(a, idx(3, 2, {0, 1, 2, -3, 4, 5})),
                       doctest::Contains("negative expert id -3 at token 1"), Error);
  CHECK_THROWS_WITH_AS(routing_fluctuation(idx(3, 2, {0, 1, 2, 2, 4, 5}), a),
                       doctest::Contains("lists expert 2 twice for token 1"), Error);
  CHECK_THROWS_WITH_AS(routing_fluctuation(Idx({0, 2}), Idx({0, 2})),
                       doctest::Contains("no tokens"), Error);
}

TEST_CASE_TEMPLATE("mean_entropy: hand-made rows and a naive loop", T, float, double) {
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  // uniform over 4, one-hot (0 log 0 = 0), half-half
  auto p = Tensor<T, cpu>::from({3, 4}, {0.25, 0.25, 0.25, 0.25, 0, 1, 0, 0, 0.5, 0, 0.5, 0});
  const double expected = (std::log(4.0) + 0 + std::log(2.0)) / 3;
  CHECK(mean_entropy(p) == doctest::Approx(expected).epsilon(tol));
  CHECK(mean_normalized_entropy(p) == doctest::Approx(expected / std::log(4.0)).epsilon(tol));
  CHECK(mean_normalized_entropy(p.slice(0, 1)) == doctest::Approx(1.0).epsilon(tol));
  CHECK(mean_entropy(p.slice(1, 2)) == 0.0);

  Rng rng(2);
  auto q = random_probs<T>(50, 16, rng, 2.0);
  double h = 0;
  for (index_t i = 0; i < 50; ++i)
    for (index_t j = 0; j < 16; ++j) {
      const double x = static_cast<double>(q(i, j));
      h -= x * std::log(x);
    }
  CHECK(mean_entropy(q) == doctest::Approx(h / 50).epsilon(1e-12));
  CHECK(mean_normalized_entropy(q) == doctest::Approx(h / 50 / std::log(16.0)).epsilon(1e-12));
  // a (B, T, E) tensor: rows are the leading dimensions
  CHECK(mean_entropy(q.view({5, 10, 16})) == doctest::Approx(h / 50).epsilon(1e-12));
  // sharper rows have lower entropy
  auto sharp = random_probs<T>(50, 16, rng, 8.0);
  CHECK(mean_entropy(sharp) < mean_entropy(q));
}

TEST_CASE("mean_score_entropy: sigmoid scores normalised per row, probabilities as mean_entropy") {
  // sigmoid-like scores: each row divided by its sum, written out
  Rng rng(5);
  Tensor<double, cpu> s(Shape{20, 8});
  for (index_t a = 0; a < s.numel(); ++a) s.data()[a] = 1.0 / (1.0 + std::exp(-rng.normal()));
  double h = 0;
  for (index_t i = 0; i < 20; ++i) {
    double sum = 0;
    for (index_t j = 0; j < 8; ++j) sum += s(i, j);
    for (index_t j = 0; j < 8; ++j) h -= s(i, j) / sum * std::log(s(i, j) / sum);
  }
  CHECK(mean_score_entropy(s) == doctest::Approx(h / 20).epsilon(1e-13));
  // a scaled row has the same entropy
  Tensor<double, cpu> twice = s.clone();
  for (index_t a = 0; a < twice.numel(); ++a) twice.data()[a] *= 2;
  CHECK(mean_score_entropy(twice) == doctest::Approx(h / 20).epsilon(1e-13));
  // probabilities: exactly mean_entropy's value
  auto q = random_probs<double>(30, 8, rng, 2.0);
  CHECK(mean_score_entropy(q) == mean_entropy(q));
  // zero rows and negative scores are refused
  CHECK_THROWS_WITH_AS(mean_score_entropy(Tensor<double, cpu>::from({1, 2}, {0.0, 0.0})),
                       doctest::Contains("row 0 sums to 0"), Error);
  CHECK_THROWS_WITH_AS(mean_score_entropy(Tensor<double, cpu>::from({1, 2}, {2.0, -0.5})),
                       doctest::Contains("row 0 holds -0.5"), Error);
}

TEST_CASE("mean_entropy: bad input") {
  CHECK_THROWS_WITH_AS(mean_entropy(Tensor<double, cpu>::from({1, 3}, {0.5, 0.7, -0.2})),
                       doctest::Contains("row 0 holds -0.2 at expert 2"), Error);
  CHECK_THROWS_WITH_AS(mean_entropy(Tensor<double, cpu>::from({2, 2}, {0.5, 0.5, 0.3, 0.3})),
                       doctest::Contains("row 1 sums to 0.6, not 1"), Error);
  CHECK_THROWS_WITH_AS(
      mean_entropy(Tensor<float, cpu>::from({1, 2}, {std::numeric_limits<float>::quiet_NaN(), 1})),
      doctest::Contains("must be finite"), Error);
  CHECK_THROWS_WITH_AS(mean_entropy(Tensor<double, cpu>({0, 4})), doctest::Contains("non-empty"),
                       Error);
  CHECK_THROWS_WITH_AS(mean_normalized_entropy(Tensor<double, cpu>::from({2, 1}, {1, 1})),
                       doctest::Contains("needs at least 2 experts"), Error);
}

TEST_CASE("expert_load: counts per expert") {
  auto a = idx(4, 2, {0, 1, 2, 3, 0, 3, 1, 0});
  auto load = expert_load(a, 5);
  CHECK(load == std::vector<index_t>{3, 2, 1, 2, 0});
  Rng rng(3);
  auto r = random_routing(300, 2, 8, rng);
  auto l = expert_load(r, 8);
  index_t total = 0;
  for (index_t e = 0; e < 8; ++e) {
    index_t naive = 0;
    for (index_t i = 0; i < r.numel(); ++i) naive += r.data()[i] == e ? 1 : 0;
    CHECK(l[static_cast<std::size_t>(e)] == naive);
    total += naive;
  }
  CHECK(total == 600);
}

TEST_CASE("expert_load: bad input") {
  auto a = idx(2, 2, {0, 1, 2, 5});
  CHECK_THROWS_WITH_AS(expert_load(a, 5), doctest::Contains("expert id 5 at flat index 3"), Error);
  CHECK_THROWS_WITH_AS(expert_load(idx(1, 2, {0, -1}), 5), doctest::Contains("expert id -1"),
                       Error);
  CHECK_THROWS_WITH_AS(expert_load(a, 0), doctest::Contains("num_experts must be >= 1"), Error);
}

TEST_CASE("CsvLog: header once, rows flushed, append keeps the header") {
  const std::string path = temp_path("append");
  {
    CsvLog log(path, {"step", "loss", "fluctuation"});
    CHECK(read_all(path) == "step,loss,fluctuation\n");  // header written at once
    log.row(std::vector<double>{1, 2.5, 0.125});
    CHECK(read_all(path) == "step,loss,fluctuation\n1,2.5,0.125\n");  // flushed per row
    log.row(std::vector<double>{2, 2.25, 0});
  }
  {
    CsvLog log(path, {"step", "loss", "fluctuation"}, /*append=*/true);
    log.row(std::vector<double>{3, 2, 0.5});
  }
  CHECK(read_all(path) == "step,loss,fluctuation\n1,2.5,0.125\n2,2.25,0\n3,2,0.5\n");
  {
    CsvLog log(path, {"step", "loss", "fluctuation"});  // append = false truncates
    log.row(std::vector<double>{9, 9, 9});
  }
  CHECK(read_all(path) == "step,loss,fluctuation\n9,9,9\n");
  // append to a missing file writes the header
  const std::string fresh = temp_path("fresh");
  {
    CsvLog log(fresh, {"a"}, true);
    log.row(std::vector<double>{1});
  }
  CHECK(read_all(fresh) == "a\n1\n");
  std::filesystem::remove(path);
  std::filesystem::remove(fresh);
}

TEST_CASE("CsvLog: full precision, non-finite values, string rows with quoting") {
  const std::string path = temp_path("precision");
  const double third = 1.0 / 3.0, tiny = 1e-300, big = 123456789.123456789;
  {
    CsvLog log(path, {"router", "x,y", "z"});
    log.row(std::vector<double>{third, tiny, big});
    log.row(std::vector<double>{std::numeric_limits<double>::quiet_NaN(),
                                std::numeric_limits<double>::infinity(), -0.1});
    log.row(std::vector<std::string>{"Attention-Aware \"SMoE\"", "a,b", CsvLog::format(0.1)});
  }
  std::ifstream in(path);
  std::string header, l1, l2, l3, extra;
  std::getline(in, header);
  std::getline(in, l1);
  std::getline(in, l2);
  std::getline(in, l3);
  CHECK(header == "router,\"x,y\",z");
  std::vector<double> back;
  std::stringstream ss(l1);
  for (std::string f; std::getline(ss, f, ',');) back.push_back(std::stod(f));
  REQUIRE(back.size() == 3);
  CHECK(back[0] == third);  // bitwise round trip
  CHECK(back[1] == tiny);
  CHECK(back[2] == big);
  CHECK(l2 == "nan,inf,-0.1");
  CHECK(l3 == "\"Attention-Aware \"\"SMoE\"\"\",\"a,b\",0.1");
  CHECK_FALSE(std::getline(in, extra));
  std::filesystem::remove(path);
}

TEST_CASE("CsvLog: bad input") {
  const std::string path = temp_path("bad");
  CHECK_THROWS_WITH_AS(CsvLog(path, {}), doctest::Contains("no columns"), Error);
  {
    CsvLog log(path, {"a", "b"});
    CHECK_THROWS_WITH_AS(log.row(std::vector<double>{1, 2, 3}),
                         doctest::Contains("3 values given for 2 columns"), Error);
    CHECK_THROWS_WITH_AS(log.row(std::vector<std::string>{"x"}),
                         doctest::Contains("1 values given for 2 columns"), Error);
  }
  CHECK(read_all(path) == "a,b\n");  // refused rows are not written
  CHECK_THROWS_WITH_AS(CsvLog(path, {"a", "c"}, true),
                       doctest::Contains("has the header 'a,b', not 'a,c'"), Error);
  CHECK(read_all(path) == "a,b\n");  // and the file is left alone
  const std::string missing_dir =
      (std::filesystem::temp_directory_path() / "graphmoe_no_such_dir_xyz" / "m.csv").string();
  CHECK_THROWS_WITH_AS(CsvLog(missing_dir, {"a"}), doctest::Contains("cannot open"), Error);
  std::filesystem::remove(path);
}
