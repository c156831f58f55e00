// AdamW and SGD against scalar re-implementations over several steps (weight-decay exclusion,
// bias correction, non-trainable parameters, checkpoint state); AdamW on a quadratic;
// clip_grad_norm values, scaling and NaN; bitwise determinism over thread counts; the learning-rate
// schedule; bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numbers>
#include <string>
#include <vector>

#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/schedule.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// Parameters of every kind: a matrix spanning two update chunks, small matrices, a bias, a
// rank-0 scalar, a norm gain and a frozen (non-trainable) buffer between them.
template <class T>
ParameterArena<T, cpu> make_arena(std::uint64_t seed) {
  ParameterArena<T, cpu> arena;
  arena.add("emb", {40, 300});  // 12000 elements: two chunks of kOptimChunk
  arena.add("w", {3, 5});
  arena.add("b", {5});
  arena.add("frozen", {4, 2}, /*trainable=*/false);
  arena.add("temp", {});
  arena.add("ln.gain", {7});
  arena.add("w3", {2, 3, 4});
  arena.allocate();
  Rng rng(seed);
  for (index_t i = 0; i < arena.size(); ++i) {
    auto v = arena.value(i);
    auto r = random_tensor<T>(v.shape(), rng);
    v.copy_from(r);
  }
  return arena;
}

template <class T>
void random_grads(ParameterArena<T, cpu>& arena, Rng& rng) {
  for (index_t i = 0; i < arena.size(); ++i) {
    auto g = arena.grad(i);
    g.copy_from(random_tensor<T>(g.shape(), rng));
  }
}

// Per-parameter copies of an arena's values, in double.
struct NaiveState {
  std::vector<std::vector<double>> p, s1, s2;  // values, first and second state
};

template <class T>
NaiveState naive_from(const ParameterArena<T, cpu>& arena) {
  NaiveState st;
  for (index_t i = 0; i < arena.size(); ++i) {
    auto v = arena.value(i);
    std::vector<double> p(v.data(), v.data() + v.numel());
    st.p.push_back(p);
    st.s1.emplace_back(p.size(), 0.0);
    st.s2.emplace_back(p.size(), 0.0);
  }
  return st;
}

// Scalar AdamW, exactly as written in the paper (Loshchilov & Hutter, Algorithm 2, with the
// learning rate multiplying the decay term too).
template <class T>
void naive_adamw(NaiveState& st, const ParameterArena<T, cpu>& arena, const AdamWConfig& c,
                 double lr, std::int64_t t, const std::vector<bool>& decay) {
  for (index_t i = 0; i < arena.size(); ++i) {
    if (!arena.params()[static_cast<std::size_t>(i)].trainable) continue;
    auto g = arena.grad(i);
    auto& p = st.p[static_cast<std::size_t>(i)];
    auto& m = st.s1[static_cast<std::size_t>(i)];
    auto& v = st.s2[static_cast<std::size_t>(i)];
    for (std::size_t j = 0; j < p.size(); ++j) {
      const double gj = static_cast<double>(g.data()[j]);
      m[j] = c.beta1 * m[j] + (1 - c.beta1) * gj;
      v[j] = c.beta2 * v[j] + (1 - c.beta2) * gj * gj;
      const double mhat = m[j] / (1 - std::pow(c.beta1, static_cast<double>(t)));
      const double vhat = v[j] / (1 - std::pow(c.beta2, static_cast<double>(t)));
      const double wd = decay[static_cast<std::size_t>(i)] ? c.weight_decay : 0.0;
      p[j] = p[j] - lr * (mhat / (std::sqrt(vhat) + c.eps) + wd * p[j]);
    }
  }
}

// Scalar SGD as torch.optim.SGD (dampening 0).
template <class T>
void naive_sgd(NaiveState& st, const ParameterArena<T, cpu>& arena, const SGDConfig& c, double lr,
               const std::vector<bool>& decay) {
  for (index_t i = 0; i < arena.size(); ++i) {
    if (!arena.params()[static_cast<std::size_t>(i)].trainable) continue;
    auto g = arena.grad(i);
    auto& p = st.p[static_cast<std::size_t>(i)];
    auto& buf = st.s1[static_cast<std::size_t>(i)];
    for (std::size_t j = 0; j < p.size(); ++j) {
      double d = static_cast<double>(g.data()[j]);
      if (decay[static_cast<std::size_t>(i)]) d += c.weight_decay * p[j];
      if (c.momentum > 0) {
        buf[j] = c.momentum * buf[j] + d;
        d = c.nesterov ? d + c.momentum * buf[j] : buf[j];
      }
      p[j] -= lr * d;
    }
  }
}

// max over the trainable parameters of |arena - naive| / (1 + |naive|)
template <class T>
double max_err(const ParameterArena<T, cpu>& arena, const NaiveState& st) {
  double e = 0;
  for (index_t i = 0; i < arena.size(); ++i) {
    auto v = arena.value(i);
    for (index_t j = 0; j < v.numel(); ++j) {
      const double ref = st.p[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)];
      e = std::max(e, std::abs(static_cast<double>(v.data()[j]) - ref) / (1 + std::abs(ref)));
    }
  }
  return e;
}

template <class T>
std::vector<bool> rank_rule(const ParameterArena<T, cpu>& arena) {
  std::vector<bool> d;
  for (const auto& p : arena.params()) d.push_back(p.shape.rank() >= 2);
  return d;
}

template <class T>
bool bitwise_equal(const Tensor<T, cpu>& a, const Tensor<T, cpu>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

const double kLrs[] = {1e-2, 3e-3, 5e-2, 1e-3, 2e-2, 7e-3};

}  // namespace

TEST_CASE("adamw: matches a scalar re-implementation over several steps (double)") {
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;  // large enough that the decay term shows
  for (bool custom : {false, true}) {
    CAPTURE(custom);
    auto arena = make_arena<double>(1);
    AdamW<double> opt(arena, cfg);
    std::vector<bool> decay = rank_rule(arena);
    if (custom) {
      // decay everything but "w" and "emb": biases and gains now decay, the marked ones do not
      opt.set_no_decay([](const std::string& n) { return n == "w" || n == "emb"; });
      for (index_t i = 0; i < arena.size(); ++i) {
        const auto& n = arena.params()[static_cast<std::size_t>(i)].name;
        decay[static_cast<std::size_t>(i)] = !(n == "w" || n == "emb");
      }
    }
    for (index_t i = 0; i < arena.size(); ++i)
      CHECK(opt.decays(i) == decay[static_cast<std::size_t>(i)]);
    auto naive = naive_from(arena);
    Rng rng(2);
    std::int64_t t = 0;
    for (double lr : kLrs) {
      random_grads(arena, rng);
      opt.step(arena, lr);
      naive_adamw(naive, arena, cfg, lr, ++t, decay);
      CHECK(opt.steps() == t);
      CHECK(max_err(arena, naive) <= 1e-12);
    }
    // the state views hold m and v
    auto state = opt.state(arena);
    for (const auto& [name, tensor] : state) {
      const bool is_m = name.rfind("adamw.m.", 0) == 0;
      const index_t id = arena.find(name.substr(8));
      const auto& ref = (is_m ? naive.s1 : naive.s2)[static_cast<std::size_t>(id)];
      for (index_t j = 0; j < tensor.numel(); ++j)
        CHECK(tensor.data()[j] ==
              doctest::Approx(ref[static_cast<std::size_t>(j)]).epsilon(1e-12));
    }
  }
}

TEST_CASE("adamw: weight decay follows the default rule (rank >= 2 decays, biases and gains not)") {
  // Zero gradients: the Adam term is exactly 0 and only the decay moves a parameter.
  auto arena = make_arena<double>(3);
  AdamWConfig cfg;
  cfg.weight_decay = 0.5;
  AdamW<double> opt(arena, cfg);
  auto before = arena.values().clone();
  opt.step(arena, 0.1);
  for (const auto& p : arena.params()) {
    CAPTURE(p.name);
    auto v0 = before.slice(p.offset, p.offset + p.shape.numel());
    auto v1 = arena.value(p.name);
    for (index_t j = 0; j < v1.numel(); ++j) {
      const double expected =
          p.trainable && p.shape.rank() >= 2 ? v0.data()[j] * (1 - 0.1 * 0.5) : v0.data()[j];
      CHECK(v1.data()[j] == doctest::Approx(expected).epsilon(1e-15));
    }
  }
}

TEST_CASE("adamw: bias correction (first step moves by lr * g / (|g| + eps), resumed step count)") {
  auto arena = make_arena<double>(4);
  AdamWConfig cfg;
  cfg.weight_decay = 0;
  AdamW<double> opt(arena, cfg);
  Rng rng(5);
  random_grads(arena, rng);
  auto before = arena.values().clone();
  const double lr = 0.01;
  opt.step(arena, lr);
  for (const auto& p : arena.params()) {
    if (!p.trainable) continue;
    for (index_t j = p.offset; j < p.offset + p.shape.numel(); ++j) {
      const double g = arena.grads().data()[j];
      const double moved = before.data()[j] - arena.values().data()[j];
      // without bias correction the step would be lr * 0.1 g / (sqrt(0.001) |g|) ~ 3.2 lr
      CHECK(moved == doctest::Approx(lr * g / (std::abs(g) + cfg.eps)).epsilon(1e-12));
    }
  }
  // A resumed optimizer at step 1000 corrects with t = 1001.
  auto arena2 = make_arena<double>(4);
  AdamW<double> resumed(arena2, cfg);
  resumed.set_steps(1000);
  auto naive = naive_from(arena2);
  random_grads(arena2, rng);
  resumed.step(arena2, lr);
  naive_adamw(naive, arena2, cfg, lr, 1001, rank_rule(arena2));
  CHECK(resumed.steps() == 1001);
  CHECK(max_err(arena2, naive) <= 1e-12);
}

TEST_CASE("adamw: float matches the double re-implementation to float precision") {
  auto arena = make_arena<float>(6);
  AdamWConfig cfg;
  AdamW<float> opt(arena, cfg);
  auto naive = naive_from(arena);
  Rng rng(7);
  std::int64_t t = 0;
  for (double lr : kLrs) {
    random_grads(arena, rng);
    opt.step(arena, lr);
    naive_adamw(naive, arena, cfg, lr, ++t, rank_rule(arena));
  }
  const double err = max_err(arena, naive);
  CHECK(err <= 1e-5);
  CHECK(err > 0);  // float really is float
}

TEST_CASE("adamw and sgd: non-trainable parameters and the padding are never touched") {
  auto arena = make_arena<double>(8);
  AdamW<double> adam(arena, AdamWConfig{});
  SGDConfig scfg;
  scfg.momentum = 0.9;
  scfg.weight_decay = 0.1;
  SGD<double> sgd(arena, scfg);
  auto frozen = arena.value("frozen").clone();
  Rng rng(9);
  for (int s = 0; s < 3; ++s) {
    random_grads(arena, rng);
    adam.step(arena, 0.1);
    sgd.step(arena, 0.1);
  }
  CHECK(bitwise_equal(arena.value("frozen"), frozen));
  // padding of the values stays zero
  const auto& ps = arena.params();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const index_t end = i + 1 < ps.size() ? ps[i + 1].offset : arena.values().numel();
    for (index_t j = ps[i].offset + ps[i].shape.numel(); j < end; ++j)
      CHECK(arena.values().data()[j] == 0.0);
  }
  // the frozen buffer has no state
  for (const auto& [name, t] : adam.state(arena)) CHECK(name.find("frozen") == std::string::npos);
  CHECK(adam.state(arena).size() == 2 * (ps.size() - 1));
  CHECK(sgd.state(arena).size() == ps.size() - 1);
}

TEST_CASE("adamw: state views restore a checkpoint bitwise") {
  auto a = make_arena<double>(10);
  auto b = make_arena<double>(10);
  AdamW<double> opt_a(a, AdamWConfig{});
  Rng rng(11);
  for (int s = 0; s < 3; ++s) {
    random_grads(a, rng);
    opt_a.step(a, 0.01);
  }
  // "save" a, "load" into b
  Tensor<double, cpu>(b.values()).copy_from(a.values());
  AdamW<double> opt_b(b, AdamWConfig{});
  auto sa = opt_a.state(a);
  auto sb = opt_b.state(b);
  REQUIRE(sa.size() == sb.size());
  for (std::size_t i = 0; i < sa.size(); ++i) {
    CHECK(sa[i].first == sb[i].first);
    CHECK(sa[i].second.shape() == sb[i].second.shape());
    sb[i].second.copy_from(sa[i].second);
  }
  CHECK(sa[0].first == "adamw.m.emb");
  CHECK(sa[1].first == "adamw.v.emb");
  CHECK(sa[1].second.shape() == Shape{40, 300});
  opt_b.set_steps(opt_a.steps());
  random_grads(a, rng);
  Tensor<double, cpu>(b.grads()).copy_from(a.grads());
  opt_a.step(a, 0.01);
  opt_b.step(b, 0.01);
  CHECK(bitwise_equal(a.values(), b.values()));
}

TEST_CASE("adamw: minimises an ill-conditioned quadratic") {
  ParameterArena<double, cpu> arena;
  arena.add("x", {4});
  arena.allocate();
  const double a[] = {1, 10, 0.1, 100}, c[] = {1.5, -2, 0.5, 3};
  auto x = arena.value("x");
  auto g = arena.grad("x");
  auto loss = [&] {
    double l = 0;
    for (int i = 0; i < 4; ++i) l += 0.5 * a[i] * (x(i) - c[i]) * (x(i) - c[i]);
    return l;
  };
  const double l0 = loss();
  AdamWConfig cfg;
  AdamW<double> opt(arena, cfg);  // rank-1 parameter: no weight decay by default
  LRSchedule sched{.base_lr = 0.05, .min_lr = 0, .warmup_steps = 10, .total_steps = 3000};
  for (std::int64_t s = 0; s < 3000; ++s) {
    for (int i = 0; i < 4; ++i) g(i) = a[i] * (x(i) - c[i]);
    opt.step(arena, sched.at(s));
  }
  CHECK(loss() < 1e-8 * l0);
  for (int i = 0; i < 4; ++i) CHECK(x(i) == doctest::Approx(c[i]).epsilon(1e-4));
}

TEST_CASE("sgd: matches a scalar re-implementation (plain, momentum, nesterov, weight decay)") {
  struct Case {
    double momentum, wd;
    bool nesterov, custom;
  };
  const Case cases[] = {{0.0, 0.0, false, false}, {0.0, 0.05, false, false},
                        {0.9, 0.05, false, false}, {0.9, 0.05, true, false},
                        {0.5, 0.1, true, true}};
  for (const Case& k : cases) {
    CAPTURE(k.momentum);
    CAPTURE(k.wd);
    CAPTURE(k.nesterov);
    CAPTURE(k.custom);
    auto arena = make_arena<double>(12);
    SGDConfig cfg;
    cfg.momentum = k.momentum;
    cfg.weight_decay = k.wd;
    cfg.nesterov = k.nesterov;
    SGD<double> opt(arena, cfg);
    std::vector<bool> decay = rank_rule(arena);
    if (k.custom) {
      opt.set_no_decay([](const std::string& n) { return n == "emb"; });
      for (index_t i = 0; i < arena.size(); ++i)
        decay[static_cast<std::size_t>(i)] =
            arena.params()[static_cast<std::size_t>(i)].name != "emb";
    }
    auto naive = naive_from(arena);
    Rng rng(13);
    for (double lr : kLrs) {
      random_grads(arena, rng);
      opt.step(arena, lr * 10);
      naive_sgd(naive, arena, cfg, lr * 10, decay);
      CHECK(max_err(arena, naive) <= 1e-12);
    }
    CHECK(opt.steps() == 6);
    auto state = opt.state(arena);
    if (k.momentum == 0) {
      CHECK(state.empty());
    } else {
      REQUIRE(state.size() == arena.params().size() - 1);
      CHECK(state[1].first == "sgd.momentum.w");
      auto ref = naive.s1[1];
      for (index_t j = 0; j < state[1].second.numel(); ++j)
        CHECK(state[1].second.data()[j] ==
              doctest::Approx(ref[static_cast<std::size_t>(j)]).epsilon(1e-12));
    }
  }
}

TEST_CASE("sgd: step(arena) uses the configured learning rate") {
  auto a = make_arena<double>(14);
  auto b = make_arena<double>(14);
  SGDConfig cfg;
  cfg.lr = 0.3;
  SGD<double> oa(a, cfg), ob(b, cfg);
  Rng rng(15);
  random_grads(a, rng);
  Tensor<double, cpu>(b.grads()).copy_from(a.grads());
  oa.step(a);
  ob.step(b, 0.3);
  CHECK(bitwise_equal(a.values(), b.values()));
}

TEST_CASE("clip_grad_norm: exact norm, scaling of trainable gradients only") {
  ParameterArena<double, cpu> arena;
  arena.add("a", {2});
  arena.add("frozen", {1}, false);
  arena.add("b", {1, 1});
  arena.allocate();
  auto reset = [&] {
    arena.grad("a")(0) = 3;
    arena.grad("a")(1) = 4;
    arena.grad("frozen")(0) = 100;
    arena.grad("b")(0, 0) = 12;
  };
  reset();
  CHECK(clip_grad_norm(arena, 0.0) == 13.0);  // measure only
  CHECK(arena.grad("a")(1) == 4.0);
  CHECK(clip_grad_norm(arena, -1.0) == 13.0);
  CHECK(clip_grad_norm(arena, 13.0) == 13.0);  // not above the limit: unchanged
  CHECK(arena.grad("b")(0, 0) == 12.0);
  CHECK(clip_grad_norm(arena, 20.0) == 13.0);
  CHECK(arena.grad("a")(0) == 3.0);

  CHECK(clip_grad_norm(arena, 6.5) == 13.0);  // returns the norm before clipping
  CHECK(arena.grad("a")(0) == 1.5);
  CHECK(arena.grad("a")(1) == 2.0);
  CHECK(arena.grad("b")(0, 0) == 6.0);
  CHECK(arena.grad("frozen")(0) == 100.0);
  CHECK(clip_grad_norm(arena, 0.0) == 6.5);
}

TEST_CASE_TEMPLATE("clip_grad_norm: matches a naive sum over a large arena", T, float, double) {
  auto arena = make_arena<T>(16);
  Rng rng(17);
  random_grads(arena, rng);
  double ss = 0;
  for (const auto& p : arena.params()) {
    if (!p.trainable) continue;
    auto g = arena.grad(p.name);
    for (index_t j = 0; j < g.numel(); ++j)
      ss += static_cast<double>(g.data()[j]) * static_cast<double>(g.data()[j]);
  }
  const double norm = clip_grad_norm(arena, 1.0);
  CHECK(norm == doctest::Approx(std::sqrt(ss)).epsilon(1e-12));
  CHECK(norm > 1.0);
  const double after = clip_grad_norm(arena, 0.0);
  CHECK(after == doctest::Approx(1.0).epsilon(std::is_same_v<T, float> ? 1e-6 : 1e-12));
}

TEST_CASE("clip_grad_norm: NaN or Inf gradient is an error") {
  auto arena = make_arena<double>(18);
  Rng rng(19);
  random_grads(arena, rng);
  arena.grad("w")(1, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(clip_grad_norm(arena, 1.0), doctest::Contains("gradient norm is nan"),
                       Error);
  CHECK_THROWS_WITH_AS(clip_grad_norm(arena, 0.0), doctest::Contains("gradient norm is nan"),
                       Error);
  arena.grad("w")(1, 2) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(clip_grad_norm(arena, 1.0), doctest::Contains("gradient norm is inf"),
                       Error);
  // a NaN in a frozen buffer's gradient is not part of the norm
  arena.grad("w")(1, 2) = 0;
  arena.grad("frozen")(0, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK(std::isfinite(clip_grad_norm(arena, 1.0)));
}

TEST_CASE("optimizers: bitwise the same parameters at 1 and 2 threads") {
  auto run = [](int threads) {
    set_num_threads(threads);
    ParameterArena<float, cpu> arena;
    arena.add("emb", {100, 500});  // 50000 elements: 7 chunks
    arena.add("w", {64, 33});
    arena.add("b", {33});
    arena.add("frozen", {10}, false);
    arena.add("w2", {33, 129});
    arena.allocate();
    Rng rng(20);
    for (index_t i = 0; i < arena.size(); ++i)
      arena.value(i).copy_from(random_tensor<float>(arena.value(i).shape(), rng));
    AdamW<float> adam(arena, AdamWConfig{});
    SGDConfig scfg;
    scfg.momentum = 0.9;
    scfg.nesterov = true;
    scfg.weight_decay = 1e-3;
    SGD<float> sgd(arena, scfg);
    std::vector<double> norms;
    for (int s = 0; s < 4; ++s) {
      random_grads(arena, rng);
      norms.push_back(clip_grad_norm(arena, 10.0));
      adam.step(arena, 1e-2);
      sgd.step(arena, 1e-2);
    }
    set_num_threads(1);
    return std::make_pair(arena.values().clone(), norms);
  };
  auto [v1, n1] = run(1);
  auto [v2, n2] = run(2);
  auto [v1b, n1b] = run(1);
  CHECK(bitwise_equal(v1, v1b));
  CHECK(bitwise_equal(v1, v2));
  CHECK(n1 == n2);
  CHECK(n1[0] > 10.0);  // the clipping did act
}

TEST_CASE("clip_grad_norm: bitwise the same norm at 1, 2 and 3 threads") {
  // Gradients of very different magnitudes per parameter, so that summing the squares in another
  // order (e.g. per-thread partial sums) changes the last bits.
  ParameterArena<double, cpu> arena;
  for (int i = 0; i < 12; ++i) arena.add(std::to_string(i) + ".g", {17 + 1000 * i});
  arena.allocate();
  Rng rng(22);
  int differing_orders = 0;
  for (int trial = 0; trial < 20; ++trial) {
    for (index_t i = 0; i < arena.size(); ++i) {
      auto g = arena.grad(i);
      const double scale = std::pow(10.0, rng.uniform(-4, 4));
      for (index_t j = 0; j < g.numel(); ++j) g.data()[j] = scale * rng.uniform(-1, 1);
    }
    double norms[3];
    for (int t = 1; t <= 3; ++t) {
      set_num_threads(t);
      norms[t - 1] = clip_grad_norm(arena, 0.0);
    }
    set_num_threads(1);
    CHECK(norms[0] == norms[1]);
    CHECK(norms[0] == norms[2]);
    // the check has teeth: a naive in-order sum and a reversed sum differ for some trials
    double fwd = 0, bwd = 0;
    for (index_t j = 0; j < arena.grads().numel(); ++j) {
      const index_t n = arena.grads().numel();
      const double a = arena.grads().data()[j], b = arena.grads().data()[n - 1 - j];
      fwd += a * a;
      bwd += b * b;
    }
    differing_orders += fwd != bwd ? 1 : 0;
  }
  CHECK(differing_orders > 0);
}

TEST_CASE("schedule: warmup, cosine decay and the end") {
  LRSchedule s{.base_lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110};
  CHECK(s.at(0) == doctest::Approx(0.1).epsilon(1e-15));
  CHECK(s.at(4) == doctest::Approx(0.5).epsilon(1e-15));
  CHECK(s.at(9) == 1.0);
  CHECK(s.at(10) == 1.0);
  CHECK(s.at(60) == doctest::Approx(0.55).epsilon(1e-15));
  CHECK(s.at(109) == doctest::Approx(0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.99)))
                         .epsilon(1e-15));
  CHECK(s.at(110) == 0.1);
  CHECK(s.at(100000) == 0.1);
  for (std::int64_t t = 10; t < 110; ++t) CHECK(s.at(t + 1) <= s.at(t));
  for (std::int64_t t = 0; t < 9; ++t) CHECK(s.at(t + 1) > s.at(t));

  LRSchedule cosine{.base_lr = 2.0, .warmup_steps = 0, .total_steps = 4};
  CHECK(cosine.at(0) == 2.0);
  CHECK(cosine.at(2) == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(cosine.at(4) == 0.0);

  LRSchedule warm{.base_lr = 1.0, .min_lr = 0.5, .warmup_steps = 4, .total_steps = 4};
  CHECK(warm.at(0) == 0.25);
  CHECK(warm.at(3) == 1.0);
  CHECK(warm.at(4) == 0.5);
}

TEST_CASE("schedule: bad input") {
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = 1, .total_steps = 0}.at(0)),
                       doctest::Contains("total_steps must be >= 1"), Error);
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = 1, .warmup_steps = 11, .total_steps = 10}.at(0)),
                       doctest::Contains("warmup_steps must be in [0, total_steps = 10]"), Error);
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = 1, .warmup_steps = -1, .total_steps = 10}.at(0)),
                       doctest::Contains("warmup_steps"), Error);
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = -1, .total_steps = 10}.at(0)),
                       doctest::Contains("base_lr must be finite and >= 0"), Error);
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = 1, .min_lr = 2, .total_steps = 10}.at(0)),
                       doctest::Contains("min_lr must be in [0, base_lr"), Error);
  CHECK_THROWS_WITH_AS(
      (LRSchedule{.base_lr = std::numeric_limits<double>::quiet_NaN(), .total_steps = 10}.at(0)),
      doctest::Contains("base_lr"), Error);
  CHECK_THROWS_WITH_AS((LRSchedule{.base_lr = 1, .total_steps = 10}.at(-1)),
                       doctest::Contains("step must be >= 0"), Error);
}

TEST_CASE("optimizers: bad input") {
  auto arena = make_arena<double>(21);
  auto cfg_with = [](auto f) {
    AdamWConfig c;
    f(c);
    return c;
  };
  CHECK_THROWS_WITH_AS(AdamW<double>(arena, cfg_with([](AdamWConfig& c) { c.beta1 = 1.0; })),
                       doctest::Contains("beta1 must be in [0, 1)"), Error);
  CHECK_THROWS_WITH_AS(AdamW<double>(arena, cfg_with([](AdamWConfig& c) { c.beta2 = -0.1; })),
                       doctest::Contains("beta2 must be in [0, 1)"), Error);
  CHECK_THROWS_WITH_AS(AdamW<double>(arena, cfg_with([](AdamWConfig& c) { c.eps = 0; })),
                       doctest::Contains("eps must be finite and > 0"), Error);
  CHECK_THROWS_WITH_AS(AdamW<double>(arena, cfg_with([](AdamWConfig& c) { c.weight_decay = -1; })),
                       doctest::Contains("weight_decay"), Error);
  CHECK_THROWS_WITH_AS(AdamW<double>(arena, cfg_with([](AdamWConfig& c) { c.lr = -1; })),
                       doctest::Contains("learning rate must be finite and >= 0, got -1"), Error);

  AdamW<double> opt(arena, AdamWConfig{});
  auto before = arena.values().clone();
  CHECK_THROWS_WITH_AS(opt.step(arena, -1e-3), doctest::Contains("AdamW::step: learning rate"),
                       Error);
  CHECK_THROWS_WITH_AS(opt.step(arena, std::numeric_limits<double>::quiet_NaN()),
                       doctest::Contains("learning rate"), Error);
  CHECK(opt.steps() == 0);  // a refused step does not count
  CHECK(bitwise_equal(arena.values(), before));
  CHECK_THROWS_WITH_AS(opt.set_steps(-1), doctest::Contains("step count must be >= 0"), Error);
  CHECK_THROWS_WITH_AS(opt.decays(99), doctest::Contains("out of range"), Error);

  // another arena than the one the optimizer was built for
  ParameterArena<double, cpu> other;
  other.add("w", {3, 5});
  other.allocate();
  CHECK_THROWS_WITH_AS(opt.step(other, 0.1), doctest::Contains("is not the one the optimizer"),
                       Error);
  CHECK_THROWS_WITH_AS(opt.state(other), doctest::Contains("is not the one the optimizer"), Error);
  ParameterArena<double, cpu> same_size;  // same element count, other shapes
  same_size.add("a", {1});
  same_size.allocate();
  ParameterArena<double, cpu> one;
  one.add("a", {2});
  one.allocate();
  AdamW<double> small(same_size, AdamWConfig{});
  CHECK_THROWS_WITH_AS(small.step(one, 0.1), doctest::Contains("differs from the one"), Error);

  ParameterArena<double, cpu> unallocated;
  unallocated.add("w", {2, 2});
  CHECK_THROWS_WITH_AS(AdamW<double>(unallocated, AdamWConfig{}),
                       doctest::Contains("not allocated"), Error);
  CHECK_THROWS_WITH_AS(SGD<double>(unallocated, SGDConfig{}), doctest::Contains("not allocated"),
                       Error);
  CHECK_THROWS_WITH_AS(clip_grad_norm(unallocated, 1.0), doctest::Contains("not allocated"),
                       Error);
  CHECK_THROWS_WITH_AS(clip_grad_norm(arena, std::numeric_limits<double>::quiet_NaN()),
                       doctest::Contains("max_norm is nan"), Error);

  SGDConfig s;
  s.nesterov = true;
  CHECK_THROWS_WITH_AS(SGD<double>(arena, s), doctest::Contains("nesterov momentum requires"),
                       Error);
  s = SGDConfig{};
  s.momentum = 1.0;
  CHECK_THROWS_WITH_AS(SGD<double>(arena, s), doctest::Contains("momentum must be in [0, 1)"),
                       Error);
  s = SGDConfig{};
  s.weight_decay = -0.1;
  CHECK_THROWS_WITH_AS(SGD<double>(arena, s), doctest::Contains("weight_decay"), Error);
  SGD<double> sgd(arena, SGDConfig{});
  CHECK_THROWS_WITH_AS(sgd.step(arena, -0.1), doctest::Contains("SGD::step: learning rate"),
                       Error);
  CHECK_THROWS_WITH_AS(sgd.step(other, 0.1), doctest::Contains("is not the one the optimizer"),
                       Error);
}
