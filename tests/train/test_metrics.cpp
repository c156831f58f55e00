// Routing metrics against naive loops and hand-made examples (fluctuation, entropy, expert load);
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
  }
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
