// The extension API from a user's side (routing/concepts.hpp, docs/extending.md): the optional
// lifecycle of every policy kind (declare / configure, bind, init, set_mode), the router's checks
// of each policy's output shape naming the policy, options for policies the router does not use
// or set after declare, the public gradient checker (graphmoe/testing/router_gradcheck.hpp) and
// GRAPHMOE_USER_CHECK. Policies are written outside namespace graphmoe, as a user would.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/testing/router_gradcheck.hpp"
#include "support/errors.hpp"

namespace user {

using graphmoe::index_t;
using graphmoe::Tensor;

// Calls seen by the policies below (one test at a time).
struct Calls {
  int declare = 0, bind = 0, init = 0, train = 0, eval = 0;
};
inline Calls calls;

// A selector with a parameter: top-k of p + b, b (E) a learned per-expert bias ("<prefix>bias"),
// gates from p as TopK's (the bias only steers the choice, as DeepSeek-V3's balancing bias does).
// It takes every hook of the lifecycle, and counts them.
template <class T, class B>
class BiasedTopKImpl {
 public:
  void declare(graphmoe::ParameterArena<T, B>& arena, const std::string& prefix, index_t,
               const graphmoe::RouterConfig& cfg) {
    ++calls.declare;
    id_ = arena.add(prefix + "bias", graphmoe::Shape{cfg.num_experts}, /*trainable=*/false);
    inner_.configure(cfg);
  }
  void bind(const graphmoe::ParameterArena<T, B>& arena) {
    ++calls.bind;
    bias_ = arena.value(id_);
  }
  void init(graphmoe::Rng&) { ++calls.init; }
  void set_mode(graphmoe::Mode m) { ++(m == graphmoe::Mode::Train ? calls.train : calls.eval); }
  void select(const Tensor<T, B>& p, index_t k, graphmoe::Selection<T, B>& sel) {
    inner_.select(p, k, sel);  // a zero bias: TopK itself
  }
  void backward(const Tensor<T, B>& p, const graphmoe::Selection<T, B>& sel,
                const Tensor<T, B>& dgates, Tensor<T, B>& dp) {
    inner_.backward(p, sel, dgates, dp);
  }
  index_t current_k() const { return inner_.current_k(); }
  void set_step(std::int64_t s) { inner_.set_step(s); }

 private:
  graphmoe::SelectorImpl<graphmoe::TopK, T, B> inner_;
  index_t id_ = -1;
  Tensor<T, B> bias_;
};
struct BiasedTopK {
  static constexpr const char* name = "biased-topk";
  template <class T, class B>
  using impl = BiasedTopKImpl<T, B>;
};

// A scorer without parameters and without any lifecycle hook: gamma = the first E columns of u.
template <class T, class B>
class SliceScorerImpl {
 public:
  index_t extra_columns = 0;  // > 0: returns too many columns (a bug the router must name)
  bool wrong_gradient = false;
  void forward(const Tensor<T, B>& u, Tensor<T, B>& gamma) {
    const index_t e = 3 + extra_columns;
    gamma = Tensor<T, B>(graphmoe::Shape{u.rows(), e});
    for (index_t i = 0; i < u.rows(); ++i)
      for (index_t c = 0; c < e; ++c) gamma(i, c) = u(i, c % u.cols());
  }
  void backward(const Tensor<T, B>& u, const Tensor<T, B>& dgamma, Tensor<T, B>& du) {
    for (index_t i = 0; i < u.rows(); ++i)
      for (index_t c = 0; c < dgamma.cols(); ++c)
        du(i, c % u.cols()) += (wrong_gradient ? T(2) : T(1)) * dgamma(i, c);
  }
};
struct SliceScorer {
  static constexpr const char* name = "slice";
  template <class T, class B>
  using impl = SliceScorerImpl<T, B>;
};

// A graph that forgets to fill p.
template <class T, class B>
class LazyGraphImpl {
 public:
  void forward(const Tensor<T, B>&, const Tensor<T, B>&, const graphmoe::GraphContext<T, B>&,
               Tensor<T, B>& p) {
    p = Tensor<T, B>();
  }
  void backward(const Tensor<T, B>&, const Tensor<T, B>&, const Tensor<T, B>&,
                const Tensor<T, B>&, const graphmoe::GraphContext<T, B>&, Tensor<T, B>&,
                Tensor<T, B>&) {}
  double mean_entropy() const { return 0; }
};
struct LazyGraph {
  static constexpr const char* name = "lazy";
  template <class T, class B>
  using impl = LazyGraphImpl<T, B>;
};

}  // namespace user

using namespace graphmoe;

using BiasedRouter = Router<LinearScorer, Similarity, user::BiasedTopK>;
using SliceRouter = Router<user::SliceScorer, Independent, TopK>;
using LazyRouter = Router<LinearScorer, user::LazyGraph, TopK>;

// No hook is required: a scorer with none is a scorer, a selector with declare instead of
// configure is a selector.
static_assert(ScorerPolicy<user::SliceScorer, double> && SelectorPolicy<user::BiasedTopK, double>);
static_assert(TokenGraphPolicy<user::LazyGraph, double>);
static_assert(PolicyHasMode<user::BiasedTopK, double, cpu> &&
              !PolicyHasMode<user::SliceScorer, double, cpu>);

namespace {
// f throws a graphmoe::Error whose message starts with `start`.
template <class F>
void check_throws_with(F&& f, const std::string& start) {
  const std::string what = test::error_of(f);
  CAPTURE(what);
  CHECK(what.rfind(start, 0) == 0);
}

RouterConfig small_config() {
  RouterConfig cfg;
  cfg.num_experts = 3;
  cfg.k = 2;
  return cfg;
}
}  // namespace

TEST_CASE("extension API: every hook of a selector runs, and the mode reaches it from the model") {
  user::calls = {};
  TransformerLMConfig mc;
  mc.vocab_size = 11;
  mc.max_seq_len = 8;
  mc.d_model = 4;
  mc.num_layers = 2;
  mc.num_heads = 2;
  mc.d_ff = 3;
  mc.router = small_config();
  mc.router.causal = true;
  TransformerLM<BiasedRouter, double> lm(mc, 3);
  CHECK(user::calls.declare == 2);  // one MoE layer per block
  CHECK(user::calls.bind == 2);
  CHECK(user::calls.init == 2);
  std::string names;
  for (const auto& p : lm.arena().params()) names += p.name + " ";
  CAPTURE(names);
  CHECK(names.find("router.selector.bias") != std::string::npos);
  CHECK(lm.mode() == Mode::Train);
  lm.set_mode(Mode::Eval);
  CHECK(user::calls.eval == 2);
  CHECK(lm.mode() == Mode::Eval);
  CHECK(lm.block(0).moe().router().mode() == Mode::Eval);
  lm.set_mode(Mode::Train);
  CHECK(user::calls.train == 2);
}

TEST_CASE("extension API: the router names the policy whose output has the wrong shape") {
  ParameterArena<double, cpu> arena;
  RouterImpl<SliceRouter, double, cpu> router;
  router.declare(arena, "r.", 4, small_config());
  arena.allocate();
  router.bind(arena);
  Tensor<double, cpu> u(Shape{6, 4});
  GraphContext<double, cpu> ctx;
  ctx.seq_len = 3;
  RouterOutput<double, cpu> out;
  router.forward(u, ctx, out);  // the right shape passes
  router.scorer().extra_columns = 1;
  check_throws_with(
      [&] { router.forward(u, ctx, out); },
      "graphmoe::Router: the scorer 'slice' returned gamma of shape (6, 4); expected (6, 3)");

  ParameterArena<double, cpu> arena2;
  RouterImpl<LazyRouter, double, cpu> lazy;
  lazy.declare(arena2, "r.", 4, small_config());
  arena2.allocate();
  lazy.bind(arena2);
  check_throws_with([&] { lazy.forward(u, ctx, out); },
                          "graphmoe::Router: the token graph 'lazy' left p empty; expected (6, 3)");
}

TEST_CASE("extension API: options for a policy the router does not use are an error") {
  RouterConfig cfg = small_config();
  cfg.options<Similarity>().tau = 0.5;
  ParameterArena<double, cpu> arena;
  RouterImpl<SoftmaxRouter, double, cpu> router;
  check_throws_with(
      [&] { router.declare(arena, "r.", 4, cfg); },
      "graphmoe::RouterConfig: options were set for the policy 'similarity', which this router "
      "(linear/independent/topk) does not use");
  cfg.allow_unused_options = true;  // the explicit opt-out of a shared command line
  ParameterArena<double, cpu> arena2;
  RouterImpl<SoftmaxRouter, double, cpu> router2;
  router2.declare(arena2, "r.", 4, cfg);
  CHECK(arena2.size() == 2);
}

TEST_CASE("extension API: changing a config's options after a router declared with it throws") {
  RouterConfig cfg = small_config();
  cfg.options<Similarity>().tau = 0.5;
  ParameterArena<double, cpu> arena;
  RouterImpl<SimilarityRouter, double, cpu> router;
  router.declare(arena, "r.", 4, cfg);
  CHECK(cfg.declared());
  check_throws_with([&] { cfg.options<Similarity>().tau = 2.0; },
                          "graphmoe::RouterConfig: a router was already declared with this config");
  const RouterConfig& ccfg = cfg;
  CHECK(ccfg.options<Similarity>().tau == 0.5);  // reading stays allowed
  RouterConfig copy = cfg;                       // a copy is a new config
  CHECK(!copy.declared());
  copy.options<Similarity>().tau = 2.0;
  CHECK(copy.options<Similarity>().tau == 2.0);
}

TEST_CASE("extension API: the public gradient checker passes a right gradient and fails a wrong one") {
  RouterConfig cfg = small_config();
  cfg.options<Similarity>().tau = 2.0;
  cfg.load_balance_coef = 0.1;
  cfg.z_loss_coef = 0.01;
  const auto results = testing::check_router_gradients<SimilarityRouter>(cfg, 8, 5, 4, 11);
  REQUIRE(results.size() == 3);  // u, w and b of the linear scorer
  for (const auto& r : results) {
    CAPTURE(r.str());
    CHECK(r.ok());
    CHECK(r.checked > 0);
  }
  CHECK(results[0].name == "u");

  // A scorer whose backward doubles the gradient: the checker must say so, naming u.
  RouterConfig scfg = small_config();
  ParameterArena<double, cpu> arena;
  RouterImpl<SliceRouter, double, cpu> router;
  router.declare(arena, "r.", 4, scfg);
  arena.allocate();
  router.bind(arena);
  router.scorer().wrong_gradient = true;
  Tensor<double, cpu> u(Shape{6, 4});
  Rng rng(5);
  fill_normal(u, rng, 1.0);
  GraphContext<double, cpu> ctx;
  ctx.seq_len = 3;
  RouterOutput<double, cpu> out;
  router.forward(u, ctx, out);
  const Tensor<double, cpu> w = out.selection.gates.clone();
  Tensor<double, cpu> du(u.shape());
  router.backward(u, ctx, out, w, du);
  const auto bad = testing::check_gradient("u", u, du, [&] {
    RouterOutput<double, cpu> o;
    router.forward(u, ctx, o);
    double l = 0;
    for (index_t i = 0; i < w.numel(); ++i) l += w.data()[i] * o.selection.gates.data()[i];
    return l;
  });
  CHECK(!bad.ok());
  CHECK(bad.failures > 0);
  CHECK(bad.str().find("FAILED") != std::string::npos);
}

TEST_CASE("extension API: GRAPHMOE_USER_CHECK does not prefix the message as the library's") {
  check_throws_with([] { GRAPHMOE_USER_CHECK(1 + 1 == 3, "MyScorer", "width ", 3); },
                          "MyScorer: width 3");
  try {
    GRAPHMOE_USER_CHECK(false, "MyScorer", "x");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).rfind("graphmoe::", 0) != 0);
  }
}
