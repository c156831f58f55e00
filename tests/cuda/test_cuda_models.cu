// Cross-backend tests of the models and the training step: TransformerLM (LM and classification
// heads), VisionMoE and AdamW, each instantiated with graphmoe::cpu (the reference) and
// graphmoe::cuda from the same seed (the device arena is initialised from the same host random
// stream, so the parameters are equal), run on the same batch; losses, logits, every parameter
// gradient and the parameters after optimizer steps are compared.
//
//   tolerance   float 1e-4, double 1e-10 (normwise per tensor; losses relative)
//
// Without a CUDA device every case passes with "skipped: no CUDA device" (compiled by nvcc in CI,
// run in full by scripts/gpu-check.sh).
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "graphmoe/cuda.cuh"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

namespace graphmoe {
using test::check_arenas;
using test::check_close;
using test::random_tensor;

namespace {

template <class T>
double model_tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

template <class T>
void check_arena(const std::string& what, const ParameterArena<T, cpu>& host,
                 const ParameterArena<T, graphmoe::cuda>& dev, bool grads, double slack = 0,
                 bool arena_scale = false) {
  check_arenas(what, host, dev, grads, model_tolerance<T>(), slack, arena_scale);
}

TransformerLMConfig tiny_lm(MoELayout layout) {
  TransformerLMConfig c;
  c.vocab_size = 37;
  c.max_seq_len = 16;
  c.d_model = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 24;
  c.layout = layout;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.allow_unused_options = true;  // one config for several routers
  c.router.options<graphmoe::Similarity>().tau = 2.0;
  c.init_std = 0.2;
  return c;
}

Tensor<std::int32_t, cpu> random_ids(const Shape& shape, index_t vocab, Rng& rng) {
  Tensor<std::int32_t, cpu> t(shape);
  for (index_t i = 0; i < t.numel(); ++i)
    t.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return t;
}

template <class Policy, class T>
void compare_lm(MoELayout layout) {
  const TransformerLMConfig cfg = tiny_lm(layout);
  TransformerLM<Policy, T, cpu> host(cfg, 21);
  TransformerLM<Policy, T, graphmoe::cuda> dev(cfg, 21);
  check_arena("initial", host.arena(), dev.arena(), false);
  AdamWConfig oc;
  oc.lr = 1e-2;
  AdamW<T, cpu> host_opt(host.arena(), oc);
  AdamW<T, graphmoe::cuda> dev_opt(dev.arena(), oc);
  Rng data(5);
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    const Tensor<std::int32_t, cpu> ids = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    Tensor<std::int32_t, cpu> targets = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    targets.data()[3] = TransformerLM<Policy, T, cpu>::kIgnoreIndex;
    host.arena().zero_grad();
    dev.arena().zero_grad();
    const T hl = static_cast<T>(host.forward(ids, targets).total());
    const T dl = static_cast<T>(dev.forward(to_device(ids), to_device(targets)).total());
    CHECK(static_cast<double>(dl) ==
          doctest::Approx(static_cast<double>(hl)).epsilon(model_tolerance<T>()));
    check_close("LM logits", host.logits(), dev.logits(), model_tolerance<T>());
    host.backward();
    dev.backward();
    check_arena("LM", host.arena(), dev.arena(), true);
    const double hn = clip_grad_norm(host.arena(), 1.0);
    const double dn = clip_grad_norm(dev.arena(), 1.0);
    CHECK(dn == doctest::Approx(hn).epsilon(model_tolerance<T>()));
    host_opt.step(host.arena());
    dev_opt.step(dev.arena());
    // Relative to the arena's largest value: Adam divides by sqrt(v), so a gradient entry near 0
    // (an expert bias column that sums to almost nothing) turns the backends' different float
    // round-off into update differences of order lr, large beside a parameter that is itself of
    // order lr (biases start at 0) but not beside the model's weights. The gradients are compared
    // per parameter above, the AdamW math bit for bit in test_host_optim. k_proj.bias: its
    // round-off gradients take AdamW steps of up to lr on each backend.
    check_arena("after AdamW", host.arena(), dev.arena(), false, 2 * oc.lr * (step + 1), true);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM training steps, Switch layout, each graph", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_lm<SoftmaxRouter, T>(MoELayout::Switch);
  compare_lm<SimilarityRouter, T>(MoELayout::Switch);
  compare_lm<AttentionRouter, T>(MoELayout::Switch);
}

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM, GLaM and dense layouts", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_lm<SimilarityRouter, T>(MoELayout::GLaM);
  compare_lm<SoftmaxRouter, T>(MoELayout::Dense);
}

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM classification head", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  TransformerLMConfig cfg = tiny_lm(MoELayout::Switch);
  cfg.num_classes = 3;
  TransformerLM<SimilarityRouter, T, cpu> host(cfg, 4);
  TransformerLM<SimilarityRouter, T, graphmoe::cuda> dev(cfg, 4);
  Rng data(8);
  const Tensor<std::int32_t, cpu> ids = random_ids(Shape{3, 10}, cfg.vocab_size, data);
  const Tensor<std::int32_t, cpu> lengths = Tensor<std::int32_t, cpu>::from(Shape{3}, {10, 4, 1});
  const Tensor<std::int32_t, cpu> labels = Tensor<std::int32_t, cpu>::from(Shape{3}, {2, 0, 1});
  const T hl = static_cast<T>(host.forward_classify(ids, lengths, labels).total());
  const T dl = static_cast<T>(dev.forward_classify(to_device(ids), lengths, to_device(labels)).total());
  CHECK(static_cast<double>(dl) ==
        doctest::Approx(static_cast<double>(hl)).epsilon(model_tolerance<T>()));
  check_close("class logits", host.class_logits(), dev.class_logits(), model_tolerance<T>());
  host.backward_classify();
  dev.backward_classify();
  check_arena("classifier", host.arena(), dev.arena(), true);
}

TEST_CASE_TEMPLATE("cuda vs cpu: VisionMoE forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  VisionMoEConfig cfg;
  cfg.image_height = 8;
  cfg.image_width = 8;
  cfg.channels = 2;
  cfg.patch = 4;
  cfg.num_classes = 5;
  cfg.d_model = 16;
  cfg.num_layers = 2;
  cfg.num_heads = 2;
  cfg.d_ff = 24;
  cfg.moe_last = 1;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.init_std = 0.2;
  VisionMoE<SimilarityRouter, T, cpu> host(cfg, 6);
  VisionMoE<SimilarityRouter, T, graphmoe::cuda> dev(cfg, 6);
  Rng data(10);
  const Tensor<T, cpu> images = random_tensor<T>(Shape{3, 8, 8, 2}, data, 0.0, 1.0);
  const Tensor<std::int32_t, cpu> labels = Tensor<std::int32_t, cpu>::from(Shape{3}, {4, 0, 2});
  const T hl = static_cast<T>(host.forward(images, labels).total());
  const T dl = static_cast<T>(dev.forward(to_device(images), to_device(labels)).total());
  CHECK(static_cast<double>(dl) ==
        doctest::Approx(static_cast<double>(hl)).epsilon(model_tolerance<T>()));
  check_close("vision logits", host.logits(), dev.logits(), model_tolerance<T>());
  host.backward();
  dev.backward();
  check_arena("vision", host.arena(), dev.arena(), true);
}

}  // namespace graphmoe
