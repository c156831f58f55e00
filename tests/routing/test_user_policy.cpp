// A policy written outside namespace graphmoe, the way a user would (routing/concepts.hpp): a
// token graph that averages the scores of a token's prefix (p_i = mean_{j <= i} r_j within its
// sequence), plugged into Router, MoELayer and checked like the built-in graphs: forward against a
// loop, finite-difference gradients, the concepts accepting it and rejecting incomplete policies.
#include <doctest/doctest.h>

#include <cmath>

#include "graphmoe/layers/moe.hpp"
#include "routing/router_fixtures.hpp"
#include "support/router_options.hpp"

namespace user {

using graphmoe::index_t;

template <class T, class B>
class PrefixMeanImpl {
 public:
  void configure(index_t, const graphmoe::RouterConfig&) {}
  void forward(const graphmoe::Tensor<T, B>& u, const graphmoe::Tensor<T, B>& r,
               const graphmoe::GraphContext<T, B>& ctx, graphmoe::Tensor<T, B>& p) {
    (void)u;
    const index_t n = r.rows(), e = r.cols(), len = ctx.seq_len;
    p = graphmoe::Tensor<T, B>(r.shape());
    entropy_ = 0;
    for (index_t i = 0; i < n; ++i) {
      const index_t s0 = i / len * len, cnt = i - s0 + 1;
      for (index_t j = s0; j <= i; ++j)
        for (index_t c = 0; c < e; ++c) p(i, c) += r(j, c) / static_cast<T>(cnt);
      entropy_ += std::log(static_cast<double>(cnt)) / static_cast<double>(n);
    }
  }
  void backward(const graphmoe::Tensor<T, B>&, const graphmoe::Tensor<T, B>& r,
                const graphmoe::Tensor<T, B>&, const graphmoe::Tensor<T, B>& dp,
                const graphmoe::GraphContext<T, B>& ctx, graphmoe::Tensor<T, B>& dr,
                graphmoe::Tensor<T, B>&) {
    const index_t n = r.rows(), e = r.cols(), len = ctx.seq_len;
    dr = graphmoe::Tensor<T, B>(r.shape());
    for (index_t i = 0; i < n; ++i) {
      const index_t s0 = i / len * len, cnt = i - s0 + 1;
      for (index_t j = s0; j <= i; ++j)
        for (index_t c = 0; c < e; ++c) dr(j, c) += dp(i, c) / static_cast<T>(cnt);
    }
  }
  double mean_entropy() const { return entropy_; }

 private:
  double entropy_ = 0;
};

struct PrefixMean {
  static constexpr const char* name = "prefix-mean";
  template <class T, class B>
  using impl = PrefixMeanImpl<T, B>;
};

// Incomplete ones: the concepts must reject them.
template <class T, class B>
class NoEntropyImpl : public PrefixMeanImpl<T, B> {
 public:
  double mean_entropy() = delete;
};
struct NoEntropy {
  static constexpr const char* name = "no-entropy";
  template <class T, class B>
  using impl = NoEntropyImpl<T, B>;
};
struct NoImpl {
  static constexpr const char* name = "no-impl";
};
struct NoName {
  template <class T, class B>
  using impl = PrefixMeanImpl<T, B>;
};

}  // namespace user

using namespace graphmoe;
using namespace graphmoe::test;

using PrefixMeanRouter = Router<LinearScorer, user::PrefixMean, TopK>;

// The concepts, both ways (a concept that accepted everything would fail here).
static_assert(ScorerPolicy<LinearScorer, double> && ScorerPolicy<CosineScorer, float> &&
              ScorerPolicy<FrozenRandomScorer, double>);
static_assert(TokenGraphPolicy<Independent, double> && TokenGraphPolicy<Similarity, double> &&
              TokenGraphPolicy<Attention, float>);
static_assert(SelectorPolicy<TopK, double> && SelectorPolicy<ScheduledTopK, float>);
static_assert(TokenGraphPolicy<user::PrefixMean, double>);
static_assert(!TokenGraphPolicy<user::NoEntropy, double>);
static_assert(!TokenGraphPolicy<user::NoImpl, double>);
static_assert(!TokenGraphPolicy<user::NoName, double>);
static_assert(!ScorerPolicy<user::PrefixMean, double> && !SelectorPolicy<user::PrefixMean, double>);
static_assert(!TokenGraphPolicy<TopK, double> && !SelectorPolicy<LinearScorer, double>);
// capability traits are the policy's
static_assert(AttentionRouter::needs_attention && !SimilarityRouter::needs_attention &&
              !PrefixMeanRouter::needs_attention);

TEST_CASE("user token graph: forward through Router matches the prefix mean") {
  Rng rng(3);
  const index_t nb = 2, len = 5, d = 4, e = 3;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.k = 2;
  cfg.options<LinearScorer>().init_std = 0.5;
  ParameterArena<double> arena;
  RouterImpl<PrefixMeanRouter, double> router;
  router.declare(arena, "router.", d, cfg);
  arena.allocate();
  router.bind(arena);
  router.init(rng);
  auto u = random_normal<double>({nb * len, d}, rng);
  RouterOutput<double> out;
  router.forward(u, {len, nullptr}, out);
  double worst = 0, entropy = 0;
  for (index_t i = 0; i < nb * len; ++i) {
    const index_t s0 = i / len * len;
    entropy += std::log(static_cast<double>(i - s0 + 1)) / static_cast<double>(nb * len);
    for (index_t c = 0; c < e; ++c) {
      double m = 0;
      for (index_t j = s0; j <= i; ++j) m += out.r(j, c);
      worst = std::max(worst, std::abs(out.p(i, c) - m / static_cast<double>(i - s0 + 1)));
    }
  }
  CHECK(worst < 1e-14);
  CHECK(router.graph_entropy() == doctest::Approx(entropy));
  // the selection is top-k of p, not of r (the graph changed something)
  CHECK(out.selection.indices.shape() == (Shape{nb * len, 2}));
  CHECK(PrefixMeanRouter::name() == "linear/prefix-mean/topk");
}

TEST_CASE("user token graph: MoE layer gradient check") {
  MoEConfig cfg;
  cfg.d_model = 4;
  cfg.d_ff = 3;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.router.options<LinearScorer>().init_std = 0.5;
  cfg.router.load_balance_coef = 0.05;
  cfg.init_std = 0.5;
  ParameterArena<double> arena;
  MoELayer<PrefixMeanRouter, double> layer;
  layer.declare(arena, "moe.", cfg);
  arena.allocate();
  layer.bind(arena);
  Rng rng(41);
  layer.init(rng);
  const index_t nb = 2, len = 4, d = cfg.d_model;
  GraphContext<double> ctx{len, nullptr};
  auto u = random_normal<double>({nb * len, d}, rng);
  auto w = random_normal<double>({nb * len, d}, rng);
  auto loss = [&] {
    Tensor<double> y;
    layer.forward(u, ctx, y);
    return weighted_sum(y, w) + 0.05 * layer.routing().load_balance_loss;
  };
  Tensor<double> y, du;
  layer.forward(u, ctx, y);
  arena.zero_grad();
  layer.backward(w, du);
  check_gradient("du", u, du, loss);
  for (const auto& info : arena.params()) {
    if (!info.trainable) continue;
    Tensor<double> v = arena.value(info.name);
    check_gradient(info.name, v, arena.grad(info.name), loss);
  }
}
