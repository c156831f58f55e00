// upcycle (models/upcycling.hpp): a model started from another's weights.
//   dense to MoE        Llama's blocks (SwiGLU, no biases) and GPT's (GELU, biases), every block or
//                       GLaM's every other: the upcycled model's logits equal the dense model's
//                       (double: 1e-13 relative; float: 1e-5), every expert a copy of the FFN, the
//                       routers as the MoE model drew them
//   MoE to graph-aware  a trained softmax MoE into BlendedSimilarityRouter / BlendedAttentionRouter:
//                       the logits bit for bit, the blend at 0, and after a training step a != 0
//   refusals            unnormalised gates, a routed scaling factor, a capacity, a shared expert,
//                       experts of another width, models of other sizes, a graph not carried: each
//                       names the problem and leaves the model as it was
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/models/upcycling.hpp"
#include "graphmoe/train/optim.hpp"

using namespace graphmoe;

namespace {

TransformerLMConfig small(TransformerLMConfig c) {
  c.vocab_size = 40;
  c.max_seq_len = 12;
  c.d_model = 16;
  c.num_layers = 3;
  c.num_heads = 4;
  c.d_ff = 24;
  c.expert_d_ff = 0;
  c.shared_d_ff = 0;
  c.shared_expert_gate = false;
  c.first_k_dense = 0;
  c.moe_every = 1;
  c.init_std = 0.2;
  return c;
}

TransformerLMConfig dense_of(TransformerLMConfig c) {
  c.layout = MoELayout::Dense;
  return c;
}

TransformerLMConfig moe_of(TransformerLMConfig c, MoELayout layout = MoELayout::Switch) {
  c.layout = layout;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.options<TopK>().norm_topk_prob = true;
  c.router.options<TopK>().routed_scaling_factor = 1.0;
  c.router.options<LinearScorer>().init_std = 0.5;  // a router far from uniform
  return c;
}

Tensor<std::int32_t> ids(index_t b, index_t t, index_t vocab) {
  Tensor<std::int32_t> x(Shape{b, t});
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<std::int32_t>((i * 7 + 3) % vocab);
  return x;
}

template <class LM>
std::vector<double> logits(LM& lm, const Tensor<std::int32_t>& x) {
  lm.forward(x, Tensor<std::int32_t>());
  const auto& l = lm.logits();
  return std::vector<double>(l.data(), l.data() + l.numel());
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(a[i] - b[i]));
    s = std::max(s, std::abs(b[i]));
  }
  return d / s;
}

// The parameters of `lm` as one vector (to check that a refused upcycle wrote nothing).
template <class LM>
std::vector<double> values(const LM& lm) {
  const auto& v = lm.arena().values();
  return std::vector<double>(v.data(), v.data() + v.numel());
}

}  // namespace

TEST_CASE_TEMPLATE("upcycle dense to MoE: the logits are the dense model's", T, double, float) {
  for (const char* arch : {"llama", "gpt"}) {
    for (const MoELayout layout : {MoELayout::Switch, MoELayout::GLaM}) {
      CAPTURE(arch);
      CAPTURE(static_cast<int>(layout));
      const TransformerLMConfig base = small(TransformerLMConfig::preset(arch, 40));
      TransformerLM<SoftmaxRouter, T> dense(dense_of(base), 1);
      TransformerLM<SoftmaxRouter, T> moe(moe_of(base, layout), 2);
      const auto x = ids(2, 12, 40);
      const std::vector<double> want = logits(dense, x);
      CHECK(rel_diff(logits(moe, x), want) > 0.01);  // a different model before
      upcycle(dense, moe);
      const double err = rel_diff(logits(moe, x), want);
      CHECK(err <= (std::is_same_v<T, double> ? 1e-13 : 1e-5));
      // every expert a copy of the dense FFN; the router's weights are the MoE model's own draw
      for (index_t l = 0; l < base.num_layers; ++l) {
        if (!moe.config().is_moe_layer(l)) continue;
        const std::string b = "blocks." + std::to_string(l) + ".";
        const Tensor<T> w1 = moe.arena().value(b + "moe.experts.w1");
        const Tensor<T> fc1 = dense.arena().value(b + "ffn.fc1.weight");
        for (index_t e = 0; e < 4; ++e)
          for (index_t i = 0; i < fc1.numel(); ++i)
            REQUIRE(w1.data()[e * fc1.numel() + i] == fc1.data()[i]);
        const Tensor<T> router = moe.arena().value(b + "moe.router.weight");
        double norm = 0;
        for (index_t i = 0; i < router.numel(); ++i) norm += std::abs(router.data()[i]);
        CHECK(norm > 0);
        // the router chooses different experts for different tokens (not a tie everywhere)
        const auto& idx = moe.block(l).moe().routing().selection.indices;
        bool varied = false;
        for (index_t t = 1; t < idx.dim(0); ++t) varied |= idx(t, 0) != idx(0, 0);
        CHECK(varied);
      }
    }
  }
}

TEST_CASE_TEMPLATE("graph upcycling: a softmax MoE into a Blended graph router, bit for bit at step 0",
                   Policy, BlendedSimilarityRouter, BlendedAttentionRouter) {
  const TransformerLMConfig cfg = moe_of(small(TransformerLMConfig::preset("olmoe", 40)));
  TransformerLM<SoftmaxRouter, double> moe(cfg, 3);
  TransformerLM<Policy, double> graph(cfg, 4);
  upcycle(moe, graph);
  const auto x = ids(2, 12, 40);
  const std::vector<double> want = logits(moe, x), got = logits(graph, x);
  for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(got[i] == want[i]);
  for (index_t l = 0; l < cfg.num_layers; ++l)
    CHECK(graph.arena().value("blocks." + std::to_string(l) + ".moe.router.graph.blend").data()[0] ==
          0.0);
  // one training step
  graph.arena().zero_grad();
  Tensor<std::int32_t> y = ids(2, 12, 40);
  for (index_t i = 0; i < y.numel(); ++i) y.data()[i] = (y.data()[i] + 1) % 40;
  graph.forward(x, y);
  graph.backward();
  AdamWConfig oc;
  oc.lr = 1e-2;
  AdamW<double> adam(graph.arena(), oc);
  adam.step(graph.arena());
  // a moves into (0, 1] where its gradient asked for the graph, and stays at 0 elsewhere
  bool moved = false;
  for (index_t l = 0; l < cfg.num_layers; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".moe.router.graph.blend";
    const double a = graph.arena().value(b).data()[0];
    CHECK(a >= 0.0);
    moved |= a > 0;
  }
  if (moved) CHECK(rel_diff(logits(graph, x), want) > 0);
}

TEST_CASE("upcycle: models it cannot make equal are refused, naming the problem, nothing written") {
  const TransformerLMConfig base = small(TransformerLMConfig::preset("llama", 40));
  TransformerLM<SoftmaxRouter, double> dense(dense_of(base), 1);
  auto refused = [&](TransformerLMConfig c, const char* message) {
    CAPTURE(message);
    TransformerLM<SoftmaxRouter, double> moe(c, 2);
    const std::vector<double> before = values(moe);
    CHECK_THROWS_WITH(upcycle(dense, moe), doctest::Contains(message));
    CHECK(values(moe) == before);
  };
  TransformerLMConfig c = moe_of(base);
  c.router.options<TopK>().norm_topk_prob = false;
  refused(c, "upcycle: block 0: the gates are not renormalised (norm_topk_prob = false)");
  c = moe_of(base);
  c.router.options<TopK>().routed_scaling_factor = 2.5;
  refused(c, "routed_scaling_factor is 2.5");
  c = moe_of(base);
  c.router.capacity_factor = 1.0;
  refused(c, "a capacity (capacity_factor 1) drops tokens");
  c = moe_of(base);
  c.shared_d_ff = 8;
  refused(c, "a shared expert (shared_d_ff 8)");
  c = moe_of(base);
  c.expert_d_ff = 8;
  refused(c, "the experts' width 8 differs from the dense FFN's d_ff 24");
  c = moe_of(base);
  c.d_model = 24;
  refused(c, "the models differ in d_model");
  c = moe_of(base);
  c.attention.rope_theta = 10.0;
  refused(c, "the models differ in attention.rope_theta");
  // a graph of the source is not dropped
  const TransformerLMConfig mc = moe_of(base);
  TransformerLM<SimilarityRouter, double> sim(mc, 5);
  TransformerLM<SoftmaxRouter, double> plain(mc, 6);
  CHECK_THROWS_WITH(upcycle(sim, plain),
                    doctest::Contains("routes through the token graph 'similarity'"));
  // dense to a selector that is not token-choice (SMoE-Dropout's ScheduledTopK): refused at run
  // time (every router of train_lm instantiates upcycle), nothing written
  {
    TransformerLM<SMoEDropoutRouter, double> dropout(mc, 8);
    const std::vector<double> before = values(dropout);
    CHECK_THROWS_WITH(upcycle(dense, dropout),
                      doctest::Contains("block 0 is dense in the model upcycled from: dense blocks "
                                        "become MoE only through a token-choice selector"));
    CHECK(values(dropout) == before);
  }
  // MoE to dense: refused
  TransformerLM<SoftmaxRouter, double> dense2(dense_of(base), 7);
  CHECK_THROWS_WITH(upcycle(plain, dense2), doctest::Contains("block 0 is MoE in the model "
                                                              "upcycled from but dense"));
}
