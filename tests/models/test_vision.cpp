// VisionMoE: whole-model gradient check (each graph), layouts, patch order, bad input.
#include <doctest/doctest.h>

#include "graphmoe/models/vision_moe.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
VisionMoEConfig tiny() {
  VisionMoEConfig c;
  c.image_height = 4;
  c.image_width = 6;
  c.channels = 2;
  c.patch = 2;
  c.num_classes = 3;
  c.d_model = 4;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 3;
  c.moe_last = 1;
  c.router.num_experts = 3;
  c.router.k = 2;
  test::set_scorer_init_std(c.router, 0.5);
  c.router.options<Similarity>().tau = 2.0;
  c.router.load_balance_coef = 0.05;
  c.init_std = 0.4;
  return c;
}

// The logits of image 1 alone equal its logits in a batch of three.
template <class Policy>
void check_batch_independent(const VisionMoEConfig& cfg, std::uint64_t seed) {
  VisionMoE<Policy, double> m(cfg, 4);
  Rng rng(seed);
  auto images = random_tensor<double>({3, 4, 6, 2}, rng, 0.0, 1.0);
  Tensor<std::int32_t> none;
  m.forward(images, none);
  const auto all = m.logits().clone();
  m.forward(images.slice(1, 2).clone(), none);
  CHECK(max_rel_diff(m.logits(), all.slice(1, 2).clone()) < 1e-12);
}
}  // namespace

TEST_CASE_TEMPLATE("VisionMoE gradient check of the whole tiny model", Policy, SoftmaxRouter,
                   SimilarityRouter, AttentionRouter, XMoERouter, SimilarityExpertChoiceRouter) {
  for (VisionLayout layout : {VisionLayout::Last, VisionLayout::Alternating}) {
    auto cfg = tiny();
    cfg.layout = layout;
    // expert choice balances by construction and refuses the load-balancing loss
    if (selector_chooses_across_tokens<typename Policy::selector>()) cfg.router.load_balance_coef = 0;
    VisionMoE<Policy, double> m(cfg, 2);
    Rng rng(3);
    auto images = random_tensor<double>({2, 4, 6, 2}, rng, 0.0, 1.0);
    Tensor<std::int32_t> labels = Tensor<std::int32_t>::from({2}, {2, 0});
    auto loss = [&] { return m.forward(images, labels).total(); };
    loss();
    m.arena().zero_grad();
    m.backward();
    for (const auto& info : m.arena().params()) {
      if (!info.trainable) continue;
      Tensor<double> v = m.arena().value(info.name);
      check_gradient(info.name, v, m.arena().grad(info.name), loss);
    }
  }
}

TEST_CASE("VisionMoE layouts, and the prediction does not depend on the other images in the batch") {
  auto cfg = tiny();
  cfg.num_layers = 4;
  cfg.moe_last = 2;
  CHECK(!cfg.is_moe_layer(1));
  CHECK(cfg.is_moe_layer(2));
  CHECK(cfg.is_moe_layer(3));
  cfg.layout = VisionLayout::Alternating;
  CHECK(!cfg.is_moe_layer(0));
  CHECK(cfg.is_moe_layer(1));
  CHECK(!cfg.is_moe_layer(2));
  check_batch_independent<AttentionRouter>(cfg, 5);
}

TEST_CASE("VisionMoE with expert choice: an image's prediction does not depend on the batch") {
  auto cfg = tiny();
  cfg.router.load_balance_coef = 0;
  check_batch_independent<SimilarityExpertChoiceRouter>(cfg, 6);
}

TEST_CASE("VisionMoE bad input") {
  auto cfg = tiny();
  auto causal = tiny();
  causal.router.causal = true;
  CHECK_THROWS_WITH_AS((VisionMoE<SimilarityRouter, float>(causal)), doctest::Contains("set router.causal = false"), Error);
  causal = tiny();
  causal.router.options<Attention>().head_choice = HeadChoice::PerSequenceCausal;  // h* per prefix: an allowed choice
  VisionMoE<AttentionRouter, float> prefix(causal);
  VisionMoE<SoftmaxRouter, float> m(cfg);
  Tensor<std::int32_t> none;
  Tensor<float> wrong({2, 5, 6, 2});
  CHECK_THROWS_WITH_AS(m.forward(wrong, none), doctest::Contains("images have shape (2, 5, 6, 2)"), Error);
  Tensor<float> nan_img({1, 4, 6, 2});
  nan_img.data()[7] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH_AS(m.forward(nan_img, none), doctest::Contains("holds nan"), Error);
  Tensor<float> ok({2, 4, 6, 2});
  auto bad_labels = Tensor<std::int32_t>::from({2}, {0, 3});
  CHECK_THROWS_AS(m.forward(ok, bad_labels), Error);
  // a forward that throws after one that finished leaves backward() asking for a new forward
  auto labels = Tensor<std::int32_t>::from({2}, {0, 2});
  for (const Tensor<float>* images : {&ok, &nan_img}) {
    const double loss = m.forward(ok, labels).total();
    CHECK_THROWS_AS(m.forward(*images, images == &ok ? bad_labels : labels), Error);
    CHECK_THROWS_WITH_AS(m.backward(), doctest::Contains("call forward with labels first"), Error);
    CHECK(m.forward(ok, labels).total() == loss);
    m.backward();
  }
  (void)m.forward(ok, none);  // without labels: nothing to differentiate
  CHECK_THROWS_WITH_AS(m.backward(), doctest::Contains("call forward with labels first"), Error);
  auto bad = tiny();
  bad.patch = 4;
  CHECK_THROWS_WITH_AS((VisionMoE<SoftmaxRouter, float>(bad)), doctest::Contains("must divide the image size"), Error);
}

TEST_CASE("VisionMoE lifecycle: declare / allocate / bind / init in a shared arena equals the owning constructor") {
  const auto cfg = tiny();
  VisionMoE<SimilarityRouter, double> owning(cfg, 6);
  ParameterArena<double> arena;
  const index_t before = arena.add("other.weight", Shape{3});
  VisionMoE<SimilarityRouter, double> m;
  Rng rng(2);
  const auto images = random_tensor<double>({2, 4, 6, 2}, rng, 0.0, 1.0);
  const auto labels = Tensor<std::int32_t>::from({2}, {0, 2});
  CHECK_THROWS_WITH_AS(m.forward(images, labels), doctest::Contains("before bind()"), Error);
  m.declare(arena, "vit.", cfg);
  arena.allocate();
  CHECK_THROWS_WITH_AS(m.arena(), doctest::Contains("before bind()"), Error);
  m.bind(arena);
  Rng init_rng(6);
  m.init(init_rng);
  CHECK(arena.size() == owning.arena().size() + 1);
  for (const auto& info : owning.arena().params())
    CHECK(max_rel_diff(arena.value("vit." + info.name), owning.arena().value(info.name)) == 0.0);
  CHECK(m.forward(images, labels).total() == owning.forward(images, labels).total());
  arena.zero_grad();
  m.backward();
  CHECK(max_rel_diff(arena.grad(before), Tensor<double>(Shape{3})) == 0.0);  // not the model's
  CHECK_THROWS_WITH_AS(m.declare(arena, "x.", cfg), doctest::Contains("already declared"), Error);
}
