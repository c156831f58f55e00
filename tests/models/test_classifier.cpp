// SequenceClassifier: gradient check, padding invariance, initialisation from an LM checkpoint
// (train/pretrained.hpp) and through load_backbone, bad input.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "graphmoe/models/sequence_classifier.hpp"
#include "graphmoe/train/pretrained.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
TransformerLMConfig tiny() {
  TransformerLMConfig c;
  c.vocab_size = 9;
  c.max_seq_len = 6;
  c.d_model = 4;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 3;
  c.router.num_experts = 3;
  c.router.k = 2;
  test::set_scorer_init_std(c.router, 0.5);
  c.router.options<Similarity>().tau = 2.0;
  c.init_std = 0.4;
  return c;
}
}  // namespace

TEST_CASE_TEMPLATE("SequenceClassifier gradient check (mean pooling over real tokens)", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  SequenceClassifier<Policy, double> m(tiny(), 3, 1);
  auto ids = Tensor<std::int32_t>::from({2, 5}, {1, 4, 2, 0, 0, 3, 3, 8, 7, 1});
  auto lengths = Tensor<std::int32_t>::from({2}, {3, 5});
  auto labels = Tensor<std::int32_t>::from({2}, {2, 0});
  auto loss = [&] { return m.forward(ids, lengths, labels).total(); };
  loss();
  m.arena().zero_grad();
  m.backward();
  for (const auto& info : m.arena().params()) {
    if (!info.trainable) continue;
    Tensor<double> v = m.arena().value(info.name);
    check_gradient(info.name, v, m.arena().grad(info.name), loss);
  }
}

TEST_CASE("SequenceClassifier: padding after a sequence does not change its prediction") {
  SequenceClassifier<SimilarityRouter, double> m(tiny(), 2, 2);
  auto a = Tensor<std::int32_t>::from({1, 6}, {5, 2, 7, 0, 0, 0});
  auto b = Tensor<std::int32_t>::from({1, 6}, {5, 2, 7, 8, 1, 3});
  auto len = Tensor<std::int32_t>::from({1}, {3});
  Tensor<std::int32_t> none;
  m.forward(a, len, none);
  const auto la = m.logits().clone();
  m.forward(b, len, none);
  CHECK(max_rel_diff(m.logits(), la) < 1e-12);
}

TEST_CASE("SequenceClassifier initialised from a saved LM checkpoint") {
  TransformerLM<AttentionRouter, float> lm(tiny(), 7);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("graphmoe_cls_" + std::to_string(getpid()) + ".safetensors")).string();
  std::vector<TensorRef> refs;
  append_arena(refs, lm.arena(), "model.");
  save_safetensors(path, refs, {});
  SequenceClassifier<AttentionRouter, float> cls(tiny(), 4, 99);
  const auto f = load_safetensors(path);
  load_pretrained(cls, f, "model.");
  for (const auto& info : lm.arena().params())
    CHECK(max_rel_diff(cls.arena().value(info.name), lm.arena().value(info.name)) == 0.0);
  CHECK(cls.arena().contains("cls_head.weight"));
  // a checkpoint of another shape is refused by name
  auto other = tiny();
  other.d_ff = 5;
  SequenceClassifier<AttentionRouter, float> wrong(other, 4);
  CHECK_THROWS_WITH_AS(load_pretrained(wrong, f, "model."), doctest::Contains("has shape"), Error);
  CHECK_THROWS_WITH_AS(load_pretrained(cls, f, "nope."), doctest::Contains("has no tensor 'nope."), Error);
  std::filesystem::remove(path);
}

TEST_CASE("SequenceClassifier::load_backbone takes the tensors from a callback (no file)") {
  TransformerLM<SimilarityRouter, double> lm(tiny(), 5);
  SequenceClassifier<SimilarityRouter, double> cls(tiny(), 3, 11);
  const Tensor<double> head = cls.arena().value("cls_head.weight").clone();
  std::vector<std::string> asked;
  cls.load_backbone([&](const std::string& name, const Shape& shape) {
    asked.push_back(name);
    CHECK(shape == lm.arena().value(name).shape());
    return lm.arena().value(name);
  });
  CHECK(asked.size() == lm.arena().params().size());  // every backbone parameter, once
  for (const auto& name : asked) {
    CHECK(SequenceClassifier<SimilarityRouter, double>::is_backbone_parameter(name));
    CHECK(max_rel_diff(cls.arena().value(name), lm.arena().value(name)) == 0.0);
  }
  CHECK(max_rel_diff(cls.arena().value("cls_head.weight"), head) == 0.0);  // head untouched
  CHECK_FALSE(SequenceClassifier<SimilarityRouter, double>::is_backbone_parameter("cls_head.bias"));
  // a tensor of the wrong shape is refused by name
  CHECK_THROWS_WITH_AS(cls.load_backbone([](const std::string&, const Shape&) {
                         return Tensor<double>(Shape{1});
                       }),
                       doctest::Contains("has shape"), Error);
}

TEST_CASE("SequenceClassifier bad input") {
  CHECK_THROWS_WITH_AS((SequenceClassifier<SoftmaxRouter, float>(tiny(), 1)), doctest::Contains("num_classes must be >= 2"), Error);
  SequenceClassifier<SoftmaxRouter, float> m(tiny(), 2);
  auto ids = Tensor<std::int32_t>::from({1, 3}, {1, 2, 3});
  Tensor<std::int32_t> none;
  CHECK_THROWS_WITH_AS(m.forward(ids, Tensor<std::int32_t>::from({1}, {4}), none), doctest::Contains("length 4 of sequence 0 out of [1, 3]"), Error);
  CHECK_THROWS_WITH_AS(m.forward(ids, Tensor<std::int32_t>::from({2}, {1, 1}), none), doctest::Contains("lengths"), Error);
  CHECK_THROWS_WITH_AS(m.backward(), doctest::Contains("call forward_classify with labels first"), Error);
  // after a forward that finished, one that throws (an id out of the vocabulary) leaves the
  // backward asking for a new forward
  auto labels = Tensor<std::int32_t>::from({1}, {1});
  auto lengths = Tensor<std::int32_t>::from({1}, {3});
  (void)m.forward(ids, lengths, labels);
  auto bad_ids = Tensor<std::int32_t>::from({1, 3}, {1, 2, 99});
  CHECK_THROWS_WITH_AS(m.forward(bad_ids, lengths, labels), doctest::Contains("99"), Error);
  CHECK_THROWS_WITH_AS(m.backward(), doctest::Contains("call forward_classify with labels first"), Error);
}

TEST_CASE("SequenceClassifier lifecycle: declared under a prefix, load_backbone reads its own parameters by their LM names") {
  TransformerLM<SoftmaxRouter, double> lm(tiny(), 5);
  ParameterArena<double> arena;
  TransformerLM<SoftmaxRouter, double> other;  // another model in the same arena, declared first
  other.declare(arena, "", tiny());
  SequenceClassifier<SoftmaxRouter, double> cls;
  cls.declare(arena, "cls.", tiny(), 3);
  arena.allocate();
  other.bind(arena);
  cls.bind(arena);
  Rng rng(11);
  other.init(rng);
  cls.init(rng);
  const Tensor<double> other_tok = arena.value("tok_emb.weight").clone();
  std::vector<std::string> asked;
  cls.load_backbone([&](const std::string& name, const Shape&) {
    asked.push_back(name);
    return lm.arena().value(name);  // throws for a name the LM does not have
  });
  CHECK(asked.size() == lm.arena().params().size());
  for (const auto& name : asked)
    CHECK(max_rel_diff(arena.value("cls." + name), lm.arena().value(name)) == 0.0);
  CHECK(max_rel_diff(arena.value("tok_emb.weight"), other_tok) == 0.0);  // the other model untouched
  CHECK(arena.contains("cls.cls_head.weight"));
  CHECK(&cls.arena() == &arena);
}
