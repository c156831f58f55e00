// TransformerLM: whole-model gradient check (2 layers, each router), causality of the logits with
// every router, layouts, bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "graphmoe/models/transformer_lm.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
TransformerLMConfig tiny_config() {
  TransformerLMConfig c;
  c.vocab_size = 7;
  c.max_seq_len = 6;
  c.d_model = 4;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 3;
  c.router.num_experts = 3;
  c.router.k = 2;
  c.router.allow_unused_options = true;  // one config for every router
  c.router.options<ScheduledTopK>().k_min = 1;
  c.router.options<ScheduledTopK>().k_max = 2;
  c.router.options<ScheduledTopK>().schedule_steps = 1;
  c.router.options<CosineScorer>().dim = 3;
  test::set_scorer_init_std(c.router, 0.5);
  c.router.load_balance_coef = 0.05;
  c.router.z_loss_coef = 0.01;
  c.router.options<Similarity>().tau = 2.0;
  c.init_std = 0.4;
  return c;
}

Tensor<std::int32_t> random_ids(index_t b, index_t t, index_t vocab, Rng& rng) {
  Tensor<std::int32_t> x({b, t});
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return x;
}
}  // namespace

TEST_CASE_TEMPLATE("TransformerLM gradient check of the whole tiny model (2 layers)", Policy, SoftmaxRouter,
                   SimilarityRouter, AttentionRouter, XMoERouter, SMoEDropoutRouter,
                   AttentionXMoERouter) {
  for (bool tied : {true, false}) {
    CAPTURE(tied);
    auto cfg = tiny_config();
    cfg.tie_embeddings = tied;
    cfg.layout = tied ? MoELayout::Switch : MoELayout::GLaM;
    TransformerLM<Policy, double> lm(cfg, 3);
    lm.set_step(1);
    Rng rng(4);
    auto ids = random_ids(2, 5, cfg.vocab_size, rng);
    auto targets = random_ids(2, 5, cfg.vocab_size, rng);
    targets(1, 2) = TransformerLM<Policy, double>::kIgnoreIndex;
    auto loss = [&] { return lm.forward(ids, targets).total(); };
    const double l0 = loss();
    CHECK(std::isfinite(l0));
    lm.arena().zero_grad();
    lm.backward();
    for (const auto& info : lm.arena().params()) {
      if (!info.trainable) continue;
      Tensor<double> v = lm.arena().value(info.name);
      check_gradient(info.name, v, lm.arena().grad(info.name), loss);
    }
  }
}

TEST_CASE_TEMPLATE("TransformerLM forward returns the loss broken down, backward differentiates its total", Policy,
                   SoftmaxRouter, SimilarityRouter) {
  auto cfg = tiny_config();  // load_balance_coef 0.05, z_loss_coef 0.01
  auto plain = cfg;
  plain.router.load_balance_coef = 0;
  plain.router.z_loss_coef = 0;
  TransformerLM<Policy, double> lm(cfg, 3), ce_only(plain, 3);  // the same weights
  Rng rng(8);
  auto ids = random_ids(2, 5, cfg.vocab_size, rng);
  auto targets = random_ids(2, 5, cfg.vocab_size, rng);
  const Loss l = lm.forward(ids, targets);
  const Loss l0 = ce_only.forward(ids, targets);
  // task: the cross-entropy alone, the same with or without auxiliary losses, and by a loop
  double ce = 0;
  const index_t v = cfg.vocab_size;
  for (index_t i = 0; i < ids.numel(); ++i) {
    const double* z = lm.logits().data() + i * v;
    double m = z[0], se = 0;
    for (index_t c = 1; c < v; ++c) m = std::max(m, z[c]);
    for (index_t c = 0; c < v; ++c) se += std::exp(z[c] - m);
    ce += (m + std::log(se) - z[targets.data()[i]]) / static_cast<double>(ids.numel());
  }
  CHECK(l.task == doctest::Approx(ce).epsilon(1e-12));
  CHECK(l0.task == doctest::Approx(l.task).epsilon(1e-12));
  CHECK(l0.aux() == 0);
  // the auxiliary terms: coefficient x each MoE layer's unscaled value, summed over layers
  double lb = 0, zl = 0;
  for (index_t i = 0; i < lm.num_layers(); ++i) {
    lb += 0.05 * lm.block(i).moe().routing().load_balance_loss;
    zl += 0.01 * lm.block(i).moe().routing().z_loss;
  }
  CHECK(l.load_balance > 0);
  CHECK(l.z_loss > 0);
  CHECK(l.load_balance == doctest::Approx(lb).epsilon(1e-12));
  CHECK(l.z_loss == doctest::Approx(zl).epsilon(1e-12));
  CHECK(l.total() == doctest::Approx(l.task + lb + zl).epsilon(1e-12));
  // backward is the gradient of total(): the gradients differ from the cross-entropy-only model's
  lm.arena().zero_grad();
  lm.backward();
  ce_only.arena().zero_grad();
  ce_only.backward();
  const Tensor<double> g = lm.arena().grad("blocks.0.moe.router.weight");
  const Tensor<double> g0 = ce_only.arena().grad("blocks.0.moe.router.weight");
  CHECK(test::max_rel_diff(g, g0) > 1e-8);
  // without targets: the auxiliary terms, no task loss
  const Loss nl = lm.forward(ids, Tensor<std::int32_t>());
  CHECK(nl.task == 0);
  CHECK(nl.load_balance == doctest::Approx(l.load_balance).epsilon(1e-12));
}

TEST_CASE("TransformerLM gradient check with the Similarity graph's parameters (learned tau, W_s)") {
  auto cfg = tiny_config();
  cfg.router.options<Similarity>().tau_mode = TauMode::Learned;
  cfg.router.options<Similarity>().projection = true;
  cfg.router.options<Similarity>().exclude_self = true;
  TransformerLM<SimilarityRouter, double> lm(cfg, 3);
  // one log_tau and one (D, D) W_s per MoE layer, in the arena (so in checkpoints)
  index_t graph_params = 0;
  for (const auto& info : lm.arena().params())
    if (info.name.find("graph.") != std::string::npos) ++graph_params;
  CHECK(graph_params == 2 * cfg.num_layers);
  Rng rng(8);
  for (const auto& info : lm.arena().params())
    if (info.name.find("graph.w_s") != std::string::npos) {
      CHECK(info.shape == (Shape{cfg.d_model, cfg.d_model}));
      lm.arena().value(info.name).copy_from(random_normal<double>({cfg.d_model, cfg.d_model}, rng, 0.7));
    }
  auto ids = random_ids(2, 5, cfg.vocab_size, rng);
  auto targets = random_ids(2, 5, cfg.vocab_size, rng);
  auto loss = [&] { return lm.forward(ids, targets).total(); };
  CHECK(std::isfinite(loss()));
  lm.arena().zero_grad();
  lm.backward();
  for (const auto& info : lm.arena().params()) {
    if (!info.trainable) continue;
    Tensor<double> v = lm.arena().value(info.name);
    check_gradient(info.name, v, lm.arena().grad(info.name), loss);
  }
}

TEST_CASE_TEMPLATE("TransformerLM causality: changing token j > i changes no logit at position i", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter, SimilarityXMoERouter,
                   AttentionSMoEDropoutRouter) {
  auto cfg = tiny_config();
  cfg.vocab_size = 11;
  cfg.max_seq_len = 9;
  cfg.d_model = 8;
  cfg.router.num_experts = 4;
  TransformerLM<Policy, double> lm(cfg, 5);
  Rng rng(6);
  auto ids = random_ids(2, 9, cfg.vocab_size, rng);
  Tensor<std::int32_t> none;
  lm.forward(ids, none);
  const auto base = lm.logits().clone();
  for (index_t j : {2, 5, 8}) {
    auto changed = ids.clone();
    changed(0, j) = (changed(0, j) + 3) % static_cast<std::int32_t>(cfg.vocab_size);
    lm.forward(changed, none);
    const auto& lg = lm.logits();
    double before = 0, at = 0;
    for (index_t i = 0; i < 9; ++i)
      for (index_t v = 0; v < cfg.vocab_size; ++v) {
        const double diff = std::abs(lg(0, i, v) - base(0, i, v));
        if (i < j) before = std::max(before, diff);
        if (i == j) at = std::max(at, diff);
      }
    CHECK(before < 1e-12);
    CHECK(at > 1e-6);  // the test can fail: position j itself does change
    // the other sequence in the batch is untouched
    CHECK(max_rel_diff(lg[1], base[1]) < 1e-12);
  }
}

TEST_CASE("TransformerLM layouts and the paper's medium configuration") {
  auto m = TransformerLMConfig::paper_medium(1000);
  CHECK(m.d_model == 352);
  CHECK(m.num_heads == 8);
  CHECK(m.router.num_experts == 16);
  CHECK(m.max_seq_len == 512);
  m.validate();
  m.layout = MoELayout::GLaM;
  CHECK(!m.is_moe_layer(0));
  CHECK(m.is_moe_layer(1));
  CHECK(!m.is_moe_layer(4));
  CHECK(m.is_moe_layer(5));
  m.layout = MoELayout::Switch;
  for (index_t i = 0; i < 6; ++i) CHECK(m.is_moe_layer(i));
  auto cfg = tiny_config();
  cfg.layout = MoELayout::GLaM;
  TransformerLM<SimilarityRouter, float> lm(cfg);
  CHECK(lm.arena().contains("blocks.1.moe.router.weight"));
  CHECK(lm.arena().contains("blocks.0.ffn.fc1.weight"));
  CHECK(!lm.arena().contains("blocks.0.moe.router.weight"));
  CHECK(!lm.arena().contains("lm_head.weight"));
}

TEST_CASE("TransformerLM bad input") {
  auto cfg = tiny_config();
  TransformerLM<SoftmaxRouter, float> lm(cfg);
  Rng rng(1);
  auto long_ids = random_ids(1, 7, cfg.vocab_size, rng);
  Tensor<std::int32_t> none;
  CHECK_THROWS_WITH_AS(lm.forward(long_ids, none), doctest::Contains("sequence length 7 out of [1, max_seq_len = 6]"), Error);
  auto ids = random_ids(1, 4, cfg.vocab_size, rng);
  ids(0, 2) = 99;
  CHECK_THROWS_WITH_AS(lm.forward(ids, none), doctest::Contains("99"), Error);
  CHECK_THROWS_WITH_AS(lm.backward(), doctest::Contains("call forward with targets first"), Error);
  // a forward that throws after one that finished leaves backward() asking for a new forward
  // (not differentiating what the failed one left in the caches), wherever it fails
  auto good = random_ids(1, 4, cfg.vocab_size, rng);
  auto targets = random_ids(1, 4, cfg.vocab_size, rng);
  auto bad_targets = targets.clone();  // a handle would share the storage
  bad_targets(0, 1) = 99;
  const std::vector<std::function<void()>> failing = {
      [&] { (void)lm.forward(ids, targets); },                                    // an id
      [&] { (void)lm.forward(good, bad_targets); },                               // a target
      [&] { (void)lm.forward(good, random_ids(1, 3, cfg.vocab_size, rng)); },     // a shape
      [&] { (void)lm.forward(long_ids, random_ids(1, 7, cfg.vocab_size, rng)); }};  // a length
  for (const auto& fail : failing) {
    const double loss = lm.forward(good, targets).total();
    CHECK_THROWS_AS(fail(), Error);
    CHECK_THROWS_WITH_AS(lm.backward(), doctest::Contains("call forward with targets first"), Error);
    CHECK(lm.last_loss().task == 0.0);
    CHECK(lm.forward(good, targets).total() == loss);  // and the next forward works
    lm.backward();
  }
  // a forward without targets after one with them: nothing to differentiate either
  (void)lm.forward(good, none);
  CHECK_THROWS_WITH_AS(lm.backward(), doctest::Contains("call forward with targets first"), Error);
  auto bad = tiny_config();
  bad.num_heads = 3;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, float>(bad)), doctest::Contains("num_heads = 3 must divide d_model = 4"), Error);
  bad = tiny_config();
  bad.router.k = 4;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, float>(bad)), doctest::Contains("k = 4"), Error);
  // The LM rejects a non-causal graph or h* choice instead of overriding them.
  CHECK(tiny_config().router.causal);
  bad = tiny_config();
  bad.router.causal = false;
  CHECK_THROWS_WITH_AS((TransformerLM<SimilarityRouter, float>(bad)), doctest::Contains("router.causal is false, but the LM is causal"), Error);
  bad = tiny_config();
  bad.router.options<Attention>().head_choice = HeadChoice::PerSequence;
  CHECK_THROWS_WITH_AS((TransformerLM<AttentionRouter, float>(bad)), doctest::Contains("use HeadChoice::PerSequenceCausal"), Error);
  // unset, the Attention graph's head choice follows the router's causality; set, it is kept
  CHECK(!tiny_config().router.options<Attention>().head_choice.has_value());
  CHECK(tiny_config().router.options<Attention>().head_choice_for(true) == HeadChoice::PerSequenceCausal);
  CHECK(tiny_config().router.options<Attention>().head_choice_for(false) == HeadChoice::PerSequence);
}

TEST_CASE_TEMPLATE("TransformerLM lifecycle: declare in a shared arena, allocate, bind, init equals the owning constructor",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  auto cfg = tiny_config();
  cfg.tie_embeddings = false;
  TransformerLM<Policy, double> owning(cfg, 17);
  // two models and a layer in one arena: a "student" with the owning model's seed, a "teacher"
  ParameterArena<double> arena;
  Linear<double> probe;
  probe.declare(arena, "probe.", cfg.d_model, 2);
  TransformerLM<Policy, double> student, teacher;
  CHECK_FALSE(student.bound());
  student.declare(arena, "student.", cfg);
  teacher.declare(arena, "teacher.", cfg);
  arena.allocate();
  student.bind(arena);
  teacher.bind(arena);
  probe.bind(arena);
  Rng rng(17), other(99);
  student.init(rng);
  teacher.init(other);
  CHECK(student.bound());
  CHECK(&student.arena() == &arena);
  CHECK(student.prefix() == "student.");
  // the student's parameters are the owning model's, under its prefix and in one id range
  const auto [first, end] = student.parameter_ids();
  CHECK(end - first == owning.arena().size());
  CHECK(arena.size() == 2 * owning.arena().size() + 2);
  for (const auto& info : owning.arena().params()) {
    CAPTURE(info.name);
    const index_t id = arena.find("student." + info.name);
    CHECK(first <= id);
    CHECK(id < end);
    CHECK(max_rel_diff(arena.value(id), owning.arena().value(info.name)) == 0.0);
    CHECK(arena.contains("teacher." + info.name));
  }
  CHECK(max_rel_diff(arena.value("teacher.tok_emb.weight"), arena.value("student.tok_emb.weight")) > 0.1);
  // the same forward and gradients; the teacher's gradients stay zero
  Rng drng(5);
  const auto ids = random_ids(2, 5, cfg.vocab_size, drng);
  const auto targets = random_ids(2, 5, cfg.vocab_size, drng);
  const double l_own = owning.forward(ids, targets).total();
  const double l_student = student.forward(ids, targets).total();
  CHECK(l_student == l_own);
  owning.arena().zero_grad();
  arena.zero_grad();
  owning.backward();
  student.backward();
  for (const auto& info : owning.arena().params()) {
    CAPTURE(info.name);
    CHECK(max_rel_diff(arena.grad("student." + info.name), owning.arena().grad(info.name)) == 0.0);
    CHECK(max_rel_diff(arena.grad("teacher." + info.name), Tensor<double>(info.shape)) == 0.0);
  }
}

TEST_CASE("TransformerLM lifecycle: every step out of order raises graphmoe::Error naming it") {
  const auto cfg = tiny_config();
  Rng rng(1);
  const auto ids = random_ids(1, 3, cfg.vocab_size, rng);
  const Tensor<std::int32_t> none;
  const auto before_bind = doctest::Contains("before bind()");
  TransformerLM<SoftmaxRouter, float> lm;  // nothing declared
  CHECK_THROWS_WITH_AS(lm.forward(ids, none), before_bind, Error);
  CHECK_THROWS_WITH_AS(lm.forward_classify(ids, Tensor<std::int32_t>::from({1}, {3}), none), before_bind, Error);
  CHECK_THROWS_WITH_AS(lm.arena(), before_bind, Error);
  CHECK_THROWS_WITH_AS(lm.init(rng), before_bind, Error);
  CHECK_THROWS_WITH_AS(lm.backward(), doctest::Contains("call forward with targets first"), Error);
  ParameterArena<float> arena, other;
  CHECK_THROWS_WITH_AS(lm.bind(arena), doctest::Contains("bind() before declare()"), Error);
  lm.declare(arena, "", cfg);
  CHECK_THROWS_WITH_AS(lm.declare(arena, "again.", cfg), doctest::Contains("already declared"), Error);
  CHECK_THROWS_WITH_AS(lm.forward(ids, none), before_bind, Error);
  CHECK_THROWS_WITH_AS(lm.bind(arena), doctest::Contains("before the arena's allocate()"), Error);
  other.allocate();
  CHECK_THROWS_WITH_AS(lm.bind(other), doctest::Contains("another arena"), Error);
  arena.allocate();
  lm.bind(arena);
  lm.init(rng);
  CHECK(std::isfinite(lm.forward(ids, ids).total()));
  // a bad config leaves the model undeclared (declare can be called again with a good one)
  auto bad = tiny_config();
  bad.num_heads = 3;
  TransformerLM<SoftmaxRouter, float> late;
  ParameterArena<float> a2;
  CHECK_THROWS_WITH_AS(late.declare(a2, "", bad), doctest::Contains("num_heads = 3"), Error);
  CHECK(a2.size() == 0);
  late.declare(a2, "", cfg);
  CHECK(a2.size() == lm.arena().size());
}
