// Cross-backend tests of the models and the training step: TransformerLM (LM and classification
// heads), VisionMoE and AdamW, each instantiated with graphmoe::cpu (the reference) and
// graphmoe::cuda from the same seed (the device arena is initialised from the same host random
// stream, so the parameters are equal), run on the same batch; losses, logits, every parameter
// gradient and the parameters after optimizer steps are compared.
//
//   tolerance   float 1e-4, double 1e-10 (normwise per tensor; losses relative)
//
// The mixed-precision LM (compute type __nv_bfloat16, train_lm --precision bf16) is compared with
// the fp32 CUDA LM instead, with tolerances derived from bf16's unit roundoff (MixedTolerance);
// and with its compute mirror (layers/compute_mirror.hpp) against itself without one: bit for bit,
// over AdamW steps and across a checkpoint load that leaves the mirror stale.
//
// Without a CUDA device every case passes with "skipped: no CUDA device" (compiled by nvcc in CI,
// run in full by scripts/gpu-check.sh).
#include <doctest/doctest.h>

#include <functional>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/cuda.cuh"
#include "graphmoe/train/training_state.hpp"
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
                 bool arena_scale = false, double tol_factor = 1) {
  check_arenas(what, host, dev, grads, tol_factor * model_tolerance<T>(), slack, arena_scale);
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

// experts_layout Padded: with a capacity (factor 0.75, so that some assignments are dropped) and
// the load-balancing loss (its value and gradient on the device).
template <class Policy, class T>
void compare_lm(MoELayout layout, ExpertLayout experts_layout = ExpertLayout::Compact,
                const std::function<void(TransformerLMConfig&)>& modify = {},
                double tol_factor = 1) {
  TransformerLMConfig cfg = tiny_lm(layout);
  if (modify) modify(cfg);
  cfg.expert_layout = experts_layout;
  if (experts_layout == ExpertLayout::Padded) {
    cfg.router.capacity_factor = 0.75;
    cfg.router.load_balance_coef = 0.01;
  }
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
    check_arena("LM", host.arena(), dev.arena(), true, 0, false, tol_factor);
    const double hn = clip_grad_norm(host.arena(), 1.0);
    const double dn = clip_grad_norm(dev.arena(), 1.0);
    CHECK(dn == doctest::Approx(hn).epsilon(model_tolerance<T>()));
    host_opt.step(host.arena());
    dev_opt.step(dev.arena());
    host.after_optimizer_step();  // bias balancing (nothing for the other routers)
    dev.after_optimizer_step();
    // Relative to the arena's largest value: Adam divides by sqrt(v), so a gradient entry near 0
    // (an expert bias column that sums to almost nothing) turns the backends' different float
    // round-off into update differences of order lr, large beside a parameter that is itself of
    // order lr (biases start at 0) but not beside the model's weights. The gradients are compared
    // per parameter above, the AdamW math bit for bit in test_host_optim. k_proj.bias: its
    // round-off gradients take AdamW steps of up to lr on each backend.
    check_arena("after AdamW", host.arena(), dev.arena(), false, 2 * oc.lr * (step + 1), true,
                tol_factor);
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

// RMSNorm, RoPE (both layouts), grouped-query and multi-query attention, QK-norm over rows and
// heads, bias-free projections, shared experts (gated and not), fine-grained experts, a dense first
// block; the sigmoid bias-balanced router beside the paper's three. Variant 2 is variant 0 with
// heads twice d_model / num_heads wide (head_dim), with the routers whose graph reads the heads.
TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM with the modern blocks, each router kind", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const test::KeyBiasTrained key_bias;  // RoPE and QK-norm give the key bias a gradient
  for (int variant : {0, 1, 2}) {
    CAPTURE(variant);
    const bool v0 = variant != 1;
    const auto modern = [variant, v0](TransformerLMConfig& c) {
      c.num_heads = 4;
      if (variant == 2) c.attention.head_dim = 2 * (c.d_model / c.num_heads);
      c.norm = NormKind::RMSNorm;
      c.attention.rope_theta = v0 ? 10000.0 : 500.0;
      c.attention.rope_layout = v0 ? RopeLayout::HalfSplit : RopeLayout::Interleaved;
      c.attention.num_kv_heads = v0 ? 2 : 1;
      c.attention.qk_norm = v0 ? QKNorm::Full : QKNorm::PerHead;
      c.attention.qkv_bias = variant == 1;
      c.attention.out_bias = false;
      c.tie_embeddings = variant == 1;
      c.expert_d_ff = 8;
      c.shared_d_ff = 12;
      c.shared_expert_gate = v0;
      c.first_k_dense = v0 ? 1 : 0;
      c.num_layers = 3;
      c.activation = v0 ? FfnActivation::SwiGLU : FfnActivation::Gelu;
      c.ffn_bias = variant == 1;
      c.router.options<graphmoe::BiasBalancedTopK>().bias_update_rate = 0.01;
      c.router.options<graphmoe::TopK>().routed_scaling_factor = 2.0;
    };
    // float: 3x the plain model's tolerance (the norms and rotations add rounding steps; the
    // largest error measured under the emulation was 1.4e-4 relative, an expert's w2 gradient)
    const double f = std::is_same_v<T, float> ? 3.0 : 1.0;
    if (variant != 2) compare_lm<SoftmaxRouter, T>(MoELayout::Switch, ExpertLayout::Compact, modern, f);
    if (variant != 2) compare_lm<SimilarityRouter, T>(MoELayout::Switch, ExpertLayout::Compact, modern, f);
    compare_lm<AttentionRouter, T>(MoELayout::Switch, ExpertLayout::Compact, modern, f);
    if (variant != 2)
      compare_lm<SimilaritySigmoidBiasRouter, T>(MoELayout::Switch, ExpertLayout::Compact, modern, f);
  }
}

// Multi-head latent attention (DeepSeek-V3's, with a query latent and values narrower than the
// query heads) in the modern blocks, with the routers that read no attention.
TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM with multi-head latent attention", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const auto mla = [](TransformerLMConfig& c) {
    c.num_heads = 4;
    c.norm = NormKind::RMSNorm;
    c.attention.rope_theta = 10000.0;
    c.attention.rope_layout = RopeLayout::Interleaved;
    c.attention.qkv_bias = false;
    c.attention.out_bias = false;
    c.attention.kv_lora_rank = 6;
    c.attention.q_lora_rank = 5;
    c.attention.qk_nope_head_dim = 3;
    c.attention.qk_rope_head_dim = 2;
    c.attention.v_head_dim = 4;
    c.tie_embeddings = false;
    c.activation = FfnActivation::SwiGLU;
    c.ffn_bias = false;
  };
  const double f = std::is_same_v<T, float> ? 3.0 : 1.0;
  compare_lm<SoftmaxRouter, T>(MoELayout::Switch, ExpertLayout::Compact, mla, f);
  compare_lm<SimilarityRouter, T>(MoELayout::Switch, ExpertLayout::Compact, mla, f);
}

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM, GLaM and dense layouts", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_lm<SimilarityRouter, T>(MoELayout::GLaM);
  compare_lm<SoftmaxRouter, T>(MoELayout::Dense);
}

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM with the padded expert layout and a capacity", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // float: 3x the model tolerance. The CPU side's sgemm is OpenBLAS's kernel for the machine's
  // core, so the two backends' round-off differs by machine: 2.4e-4 relative at most measured on
  // an Intel Xeon (an expert's w1 gradient after one AdamW step; the same on the tree before the
  // modern blocks), under 1e-4 on an AMD EPYC.
  const double f = std::is_same_v<T, float> ? 3.0 : 1.0;
  compare_lm<SoftmaxRouter, T>(MoELayout::Switch, ExpertLayout::Padded, {}, f);
  compare_lm<SimilarityRouter, T>(MoELayout::Switch, ExpertLayout::Padded, {}, f);
}

// TransformerLM::forward defers the content checks of the whole forward (a GPU reads them with
// the loss); the error is still the first the CPU meets, word for word, and the model trains on
// once the bad value is gone.
TEST_CASE("cuda vs cpu: TransformerLM's deferred checks throw the CPU's first error") {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const ExpertLayout el : {ExpertLayout::Compact, ExpertLayout::Padded}) {
    CAPTURE(expert_layout_name(el));
    TransformerLMConfig cfg = tiny_lm(MoELayout::Switch);
    cfg.expert_layout = el;
    cfg.router.capacity_factor = 1.0;
    TransformerLM<SimilarityRouter, float, cpu> host(cfg, 21);
    TransformerLM<SimilarityRouter, float, graphmoe::cuda> dev(cfg, 21);
    Rng data(6);
    const Tensor<std::int32_t, cpu> ids = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    const Tensor<std::int32_t, cpu> targets = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    const auto d_ids = to_device(ids), d_targets = to_device(targets);
    // a NaN in block 1's router weight: block 0 runs clean, block 1's router meets it
    const std::string name = "blocks.1.moe.router.weight";
    Tensor<float, cpu> w = host.arena().value(name);
    const Tensor<float, cpu> saved = w.clone();
    w.data()[3] = std::numeric_limits<float>::quiet_NaN();
    copy_from_host(dev.arena().value(name), w);
    const std::string cpu_error = test::error_of([&] { (void)host.forward(ids, targets); });
    CHECK(!cpu_error.empty());
    CHECK(test::error_of([&] { (void)dev.forward(d_ids, d_targets); }) == cpu_error);
    // the failed forward ran to the end of its scope on the GPU: a backward asks for a new one
    for (const std::string& e : {test::error_of([&] { host.backward(); }),
                                 test::error_of([&] { dev.backward(); })})
      CHECK(e.find("call forward with targets first") != std::string::npos);
    copy_from_host(host.arena().value(name), saved);
    copy_from_host(dev.arena().value(name), saved);
    const double hl = host.forward(ids, targets).total();
    const double dl = dev.forward(d_ids, d_targets).total();
    CHECK(dl == doctest::Approx(hl).epsilon(model_tolerance<float>()));
  }
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
  // the forward runs in one deferred-check scope (the labels' check read with the loss): the
  // error stays the CPU's, a backward after it asks for a new forward, and the next one works
  const Tensor<std::int32_t, cpu> bad_labels = Tensor<std::int32_t, cpu>::from(Shape{3}, {2, 5, 1});
  const std::string cpu_error =
      test::error_of([&] { (void)host.forward_classify(ids, lengths, bad_labels); });
  CHECK(cpu_error.find("row 1") != std::string::npos);
  CHECK(test::error_of([&] {
          (void)dev.forward_classify(to_device(ids), lengths, to_device(bad_labels));
        }) == cpu_error);
  for (const std::string& e : {test::error_of([&] { host.backward_classify(); }),
                               test::error_of([&] { dev.backward_classify(); })})
    CHECK(e.find("call forward_classify with labels first") != std::string::npos);
  CHECK(dev.forward_classify(to_device(ids), lengths, to_device(labels)).total() ==
        doctest::Approx(static_cast<double>(dl)).epsilon(1e-12));
}

namespace {

// Mixed precision end to end: TransformerLM<Policy, float, cuda, __nv_bfloat16> (every GEMM on
// bf16 operands with fp32 accumulation: projections, experts, LM head) against the fp32 CUDA LM
// from the same seed (bit-identical parameters), on the same batch. Errors are normwise, as
// elsewhere in this file; what each is held to is derived in mixed_tolerance below.
struct MixedErrors {
  double loss = 0, logits = 0, grad = 0, grad_arena = 0;
  std::string worst_grad;
};

// bf16's unit roundoff: 8 significant bits, round to nearest, u = 2^-8.
constexpr double kBf16Unit = 1.0 / 256;

template <class Policy>
MixedErrors compare_mixed_lm(MoELayout layout) {
  using Mixed = TransformerLM<Policy, float, graphmoe::cuda, __nv_bfloat16>;
  static_assert(std::is_same_v<typename Mixed::compute_type, __nv_bfloat16>);
  const TransformerLMConfig cfg = tiny_lm(layout);
  TransformerLM<Policy, float, graphmoe::cuda> ref(cfg, 21);
  Mixed mixed(cfg, 21);
  const auto& ra = ref.arena();
  const auto& ma = mixed.arena();
  REQUIRE(ra.size() == ma.size());
  for (index_t i = 0; i < ra.size(); ++i)  // the same master weights, bit for bit
    REQUIRE(test::max_abs_difference(to_host(ra.value(i)), to_host(ma.value(i))) == 0);
  Rng data(5);
  const Tensor<std::int32_t, cpu> ids = random_ids(Shape{2, 12}, cfg.vocab_size, data);
  const Tensor<std::int32_t, cpu> targets = random_ids(Shape{2, 12}, cfg.vocab_size, data);
  ref.arena().zero_grad();
  mixed.arena().zero_grad();
  const double rl = ref.forward(to_device(ids), to_device(targets)).total();
  const double ml = mixed.forward(to_device(ids), to_device(targets)).total();
  MixedErrors e;
  e.loss = std::abs(ml - rl) / std::abs(rl);
  e.logits = test::normwise_error(to_host(ref.logits()), to_host(mixed.logits()));
  // the same experts: a flipped near-tie would be a discrete change, not a rounding error
  for (index_t l = 0; l < cfg.num_layers; ++l)
    if (ref.block(l).is_moe())
      test::check_equal("routing of block " + std::to_string(l),
                  to_host(ref.block(l).moe().routing().selection.indices),
                  mixed.block(l).moe().routing().selection.indices);
  ref.backward();
  mixed.backward();
  double scale = 0;
  for (index_t i = 0; i < ra.size(); ++i) scale = std::max(scale, test::max_abs(to_host(ra.grad(i))));
  for (index_t i = 0; i < ra.size(); ++i) {
    const std::string name = ra.params()[static_cast<std::size_t>(i)].name;
    const Tensor<float, cpu> rg = to_host(ra.grad(i)), mg = to_host(ma.grad(i));
    const double diff = test::max_abs_difference(rg, mg);
    e.grad_arena = std::max(e.grad_arena, diff / scale);
    if (test::has_zero_gradient(name)) continue;  // round-off on both sides (check_arenas)
    const double err = test::normwise_error(rg, mg);
    if (test::verbose())
      std::printf("  bf16 LM d%-30s error %.3e (arena scale %.3e)\n", name.c_str(), err,
                  diff / scale);
    if (err > e.grad) {
      e.grad = err;
      e.worst_grad = name;
    }
  }
  return e;
}

// The tolerances, from u = 2^-8. One GEMM on operands rounded once each: every product a_k b_k
// becomes a_k b_k (1 + d_k), |d_k| <= 2u + u^2, so |error| <= 2.01 u sum_k |a_k b_k|, and the
// entry is off by at most about 2u of its own size where the sum does not cancel. The logits see
// the roundings of 9 GEMMs in series (per block: q/k/v then out_proj, w1 then w2; then the head),
// each branch added to the residual stream (no amplification: LayerNorm rescales both sides
// alike), hence forward <= 9 x 2u = 18u = 7.0e-2 in the worst case of aligned errors. The
// roundings are independent, |d_k| uniform in [0, u]: they add in quadrature, and 18u / sqrt(9)
// = 6u = 2.3e-2 bounds the logits with room for the largest of the 888 entries. The loss is the
// logits' mean log-sum-exp minus the target logit (1-Lipschitz in the max norm per row), relative
// to a loss of log(37) = 3.6 with logits of max size ~2: 6u as well. Backward doubles the chain
// (each forward GEMM has two backward GEMMs on rounded dy, x and W): 2 x 6u = 12u = 4.7e-2 for a
// parameter's gradient relative to its own largest entry, and relative to the arena's largest
// gradient for every parameter (k_proj.bias included, whose gradient is round-off on both sides,
// as in check_arenas). Measured (emulation, both cases): loss 1.3e-4, logits 4.6e-3 (1.2u),
// gradients 1.5e-2 (3.9u, blocks.0.attn.q_proj.weight), arena scale 5.0e-3.
struct MixedTolerance {
  double loss = 6 * kBf16Unit, logits = 6 * kBf16Unit, grad = 12 * kBf16Unit;
};

}  // namespace

TEST_CASE("cuda bf16 vs cuda fp32: TransformerLM loss, logits and gradients (mixed precision)") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const MixedTolerance tol;
  auto check = [&](const char* what, const MixedErrors& e) {
    CAPTURE(what);
    std::printf("  bf16 LM %-24s loss %.2e, logits %.2e, gradients %.2e (%s), arena-scale %.2e\n",
                what, e.loss, e.logits, e.grad, e.worst_grad.c_str(), e.grad_arena);
    CHECK(e.loss <= tol.loss);
    CHECK(e.logits <= tol.logits);
    CHECK_MESSAGE(e.grad <= tol.grad, "worst gradient: d", e.worst_grad);
    CHECK(e.grad_arena <= tol.grad);
    // the products did run on bf16 operands: the fp32 model against itself is bit-identical (0),
    // the bf16 one is off by about u
    CHECK(e.logits >= kBf16Unit / 64);
    CHECK(e.grad_arena >= kBf16Unit / 64);
  };
  check("softmax, Switch", compare_mixed_lm<SoftmaxRouter>(MoELayout::Switch));
  check("similarity, GLaM", compare_mixed_lm<SimilarityRouter>(MoELayout::GLaM));
}

// The padded layout's expert GEMMs are one strided-batched bf16 call per product (no pointer
// arrays): the same bf16 operands as the compact layout's grouped GEMMs, summed in fp32, so loss,
// logits and gradients agree to fp32 rounding, far below bf16's unit.
TEST_CASE("cuda bf16: the padded expert layout computes what the compact one does") {
  SKIP_WITHOUT_CUDA_DEVICE();
  TransformerLMConfig cfg = tiny_lm(MoELayout::Switch);
  cfg.router.capacity_factor = 0.75;
  TransformerLMConfig pcfg = cfg;
  pcfg.expert_layout = ExpertLayout::Padded;
  TransformerLM<SoftmaxRouter, float, graphmoe::cuda, __nv_bfloat16> compact(cfg, 21), padded(pcfg, 21);
  Rng data(7);
  const auto ids = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  const auto targets = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  compact.arena().zero_grad();
  padded.arena().zero_grad();
  const double lc = compact.forward(ids, targets).total();
  const double lp = padded.forward(ids, targets).total();
  CHECK(lp == doctest::Approx(lc).epsilon(1e-5));
  REQUIRE(dropped_count(padded.block(0).moe().routing().selection) > 0);
  compact.backward();
  padded.backward();
  const auto gc = to_host(compact.arena().grads()), gp = to_host(padded.arena().grads());
  double worst = 0, scale = 0;
  for (index_t i = 0; i < gc.numel(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(gc.data()[i] - gp.data()[i])));
    scale = std::max(scale, std::abs(static_cast<double>(gc.data()[i])));
  }
  CHECK(worst <= 1e-4 * scale);
}

TEST_CASE("cuda bf16: TransformerLM training steps decrease the loss, as in fp32") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const TransformerLMConfig cfg = tiny_lm(MoELayout::Switch);
  TransformerLM<SoftmaxRouter, float, graphmoe::cuda> ref(cfg, 21);
  TransformerLM<SoftmaxRouter, float, graphmoe::cuda, __nv_bfloat16> mixed(cfg, 21);
  AdamWConfig oc;
  oc.lr = 1e-2;
  AdamW<float, graphmoe::cuda> ref_opt(ref.arena(), oc);
  AdamW<float, graphmoe::cuda> mixed_opt(mixed.arena(), oc);
  Rng data(7);
  const Tensor<std::int32_t, graphmoe::cuda> ids = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  const Tensor<std::int32_t, graphmoe::cuda> targets =
      to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  std::vector<double> rl, ml;
  for (int step = 0; step < 8; ++step) {  // one batch, learnt by heart
    rl.push_back(ref.forward(ids, targets).total());
    ml.push_back(mixed.forward(ids, targets).total());
    ref.arena().zero_grad();
    mixed.arena().zero_grad();
    ref.backward();
    mixed.backward();
    clip_grad_norm(ref.arena(), 1.0);
    clip_grad_norm(mixed.arena(), 1.0);
    ref_opt.step(ref.arena());
    mixed_opt.step(mixed.arena());
  }
  for (std::size_t i = 0; i < ml.size(); ++i)
    std::printf("  bf16 LM training step %zu: loss %.5f (fp32 %.5f)\n", i, ml[i], rl[i]);
  // Both decrease at every step and the bf16 run follows the fp32 one: the first loss within the
  // forward's 6u (derived above); later ones drift, since Adam's normalised steps turn gradient
  // differences (<= 12u relative) into parameter differences of order lr that compound. That
  // drift has no first-order bound; it is held to the gradients' 12u (4.7%) per loss and 5% on the
  // whole decrease. Measured: 1.9% at step 7 (1.714 vs 1.683), decrease 0.987 of fp32's.
  for (std::size_t i = 1; i < ml.size(); ++i) {
    CAPTURE(i);
    CHECK(ml[i] < ml[i - 1]);
    CHECK(rl[i] < rl[i - 1]);
  }
  CHECK(ml.back() < 0.5 * ml.front());
  CHECK(std::abs(ml[0] - rl[0]) <= 6 * kBf16Unit * rl[0]);
  for (std::size_t i = 0; i < ml.size(); ++i) {
    CAPTURE(i);
    CHECK(std::abs(ml[i] - rl[i]) <= 12 * kBf16Unit * rl[i]);
  }
  const double decrease = (ml.front() - ml.back()) / (rl.front() - rl.back());
  CHECK(decrease == doctest::Approx(1.0).epsilon(0.05));
}

// The mirror holds exactly convert(w) of the current weights, so reading it instead of converting
// changes no bit: losses, gradients and weights over AdamW steps (the fused step writing the
// mirror) equal the converting model's. GLaM: a dense FFN and an expert bank; tied embeddings:
// the head reads the token embedding's slice. Then a checkpoint load writes the weights behind the
// mirror's back (load_training_state marks the arena written): the next forward refreshes it, and
// the model computes what the loaded weights give.
TEST_CASE("cuda bf16: TransformerLM with its compute mirror is bit for bit the converting one") {
  SKIP_WITHOUT_CUDA_DEVICE();
  using Mixed = TransformerLM<SoftmaxRouter, float, graphmoe::cuda, __nv_bfloat16>;
  const TransformerLMConfig cfg = tiny_lm(MoELayout::GLaM);
  Mixed with(cfg, 21), without(cfg, 21);
  REQUIRE(with.compute_mirror() != nullptr);
  without.set_compute_mirror(false);
  CHECK(without.compute_mirror() == nullptr);
  AdamWConfig oc;
  oc.lr = 1e-2;
  AdamW<float, graphmoe::cuda> with_opt(with.arena(), oc), without_opt(without.arena(), oc);
  Rng data(8);
  const Tensor<std::int32_t, graphmoe::cuda> ids = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  const Tensor<std::int32_t, graphmoe::cuda> targets =
      to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  auto train_step = [&](Mixed& lm, AdamW<float, graphmoe::cuda>& opt) {
    const double loss = lm.forward(ids, targets).total();
    lm.arena().zero_grad();
    lm.backward();
    clip_grad_norm(lm.arena(), 1.0);
    opt.step(lm.arena(), oc.lr, lm.compute_mirror());  // nullptr: the plain step
    return loss;
  };
  for (int step = 0; step < 4; ++step) {
    CAPTURE(step);
    CHECK(train_step(with, with_opt) == train_step(without, without_opt));
    CHECK(with.compute_mirror()->current());
    test::check_equal("gradients", to_host(without.arena().grads()), with.arena().grads());
    test::check_equal("weights", to_host(without.arena().values()), with.arena().values());
    test::check_equal("logits", to_host(without.logits()), with.logits());
  }
  // the mirror is exactly the conversion of the current weights
  test::check_equal("mirror", to_host(converted<float>(converted<__nv_bfloat16>(with.arena().values()))),
                    converted<float>(with.compute_mirror()->values()));

  // one more step of `without` only, saved and loaded into `with`: its mirror is stale until the
  // next forward, which must see the loaded weights
  train_step(without, without_opt);
  const std::string path =
      (std::filesystem::temp_directory_path() / "graphmoe_test_compute_mirror.safetensors").string();
  save_training_state(path, without.arena(), without_opt, {});
  load_training_state(load_safetensors(path), with.arena(), with_opt);
  std::filesystem::remove(path);
  CHECK(!with.compute_mirror()->current());
  CHECK(with.forward(ids, targets).total() == without.forward(ids, targets).total());
  CHECK(with.compute_mirror()->current());
  test::check_equal("logits after the load", to_host(without.logits()), with.logits());
  CHECK(train_step(with, with_opt) == train_step(without, without_opt));
  test::check_equal("weights after the load", to_host(without.arena().values()), with.arena().values());
}

#if defined(GRAPHMOE_CUDA_EMULATION)
namespace {

// What one training step of train_lm (forward with targets, zero_grad, backward, clip_grad_norm,
// AdamW) asks of the device, counted by the emulation after two warm-up steps.
struct StepCensus {
  graphmoe_cuda_emulation::Counters c;
  std::map<std::string, unsigned long long> kernels;
};

graphmoe_cuda_emulation::Counters operator-(const graphmoe_cuda_emulation::Counters& a,
                                            const graphmoe_cuda_emulation::Counters& b) {
  graphmoe_cuda_emulation::Counters d;
  d.kernel_launches = a.kernel_launches - b.kernel_launches;
  d.cublas_calls = a.cublas_calls - b.cublas_calls;
  d.copies_to_host = a.copies_to_host - b.copies_to_host;
  d.async_copies_to_host = a.async_copies_to_host - b.async_copies_to_host;
  d.copies_to_device = a.copies_to_device - b.copies_to_device;
  d.copies_on_device = a.copies_on_device - b.copies_on_device;
  d.memsets = a.memsets - b.memsets;
  d.device_allocations = a.device_allocations - b.device_allocations;
  d.synchronizations = a.synchronizations - b.synchronizations;
  return d;
}

// With ExpertLayout::Padded the routers get a capacity (factor 1.25) to pad to.
template <class Policy, class C = float>
StepCensus lm_step_census(index_t layers, index_t experts, MoELayout layout = MoELayout::Switch,
                          ExpertLayout experts_layout = ExpertLayout::Compact,
                          double load_balance = 0, double z_loss = 0) {
  TransformerLMConfig cfg = tiny_lm(layout);
  cfg.num_layers = layers;
  cfg.router.num_experts = experts;
  cfg.router.load_balance_coef = load_balance;
  cfg.router.z_loss_coef = z_loss;
  cfg.expert_layout = experts_layout;
  if (experts_layout == ExpertLayout::Padded) cfg.router.capacity_factor = 1.25;
  TransformerLM<Policy, float, graphmoe::cuda, C> lm(cfg, 3);
  AdamWConfig oc;
  AdamW<float, graphmoe::cuda> opt(lm.arena(), oc);
  Rng data(1);
  const auto ids = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  const auto targets = to_device(random_ids(Shape{2, 12}, cfg.vocab_size, data));
  auto step = [&] {
    (void)lm.forward(ids, targets).total();
    lm.arena().zero_grad();
    lm.backward();
    (void)clip_grad_norm(lm.arena(), 1.0);
    if constexpr (std::is_same_v<C, float>)
      opt.step(lm.arena(), 1e-3);
    else
      opt.step(lm.arena(), 1e-3, lm.compute_mirror());
  };
  step();
  step();
  const auto before = graphmoe_cuda_emulation::counters();
  const auto kernels_before = graphmoe_cuda_emulation::launches_by_kernel();
  step();
  StepCensus out{graphmoe_cuda_emulation::counters() - before, {}};
  for (const auto& [name, n] : graphmoe_cuda_emulation::launches_by_kernel()) {
    const auto it = kernels_before.find(name);
    const unsigned long long d = n - (it == kernels_before.end() ? 0 : it->second);
    if (d > 0) out.kernels[name] = d;
  }
  return out;
}

void print_census(const char* what, const StepCensus& s) {
  std::printf("  LM step census, %s: %llu launches, %llu cuBLAS calls, %llu copies to the host "
              "(+ %llu asynchronous), %llu to the device, %llu on it, %llu memsets, "
              "%llu allocations, %llu syncs\n",
              what, s.c.kernel_launches, s.c.cublas_calls, s.c.copies_to_host,
              s.c.async_copies_to_host, s.c.copies_to_device, s.c.copies_on_device, s.c.memsets, s.c.device_allocations,
              s.c.synchronizations);
  if (std::getenv("GRAPHMOE_LAUNCH_CENSUS") == nullptr) return;
  std::vector<std::pair<unsigned long long, std::string>> rows;
  for (const auto& [name, n] : s.kernels) rows.emplace_back(n, name);
  std::sort(rows.rbegin(), rows.rend());
  for (const auto& [n, name] : rows) std::printf("    %5llu  %s\n", n, name.c_str());
}

}  // namespace

// The launch census (the medium LM is launch-bound on the GPU): what one
// training step issues, and how it scales. A step in steady state allocates nothing (the caching
// allocator serves every tensor: the precondition of capturing it in a CUDA graph); its launches,
// cuBLAS calls and copies do not grow with the experts and grow linearly with the blocks. Run with
// GRAPHMOE_LAUNCH_CENSUS=1 for the launches by kernel (docs/benchmarks.md, "Launch census").
TEST_CASE("emulation: an LM training step's launches, copies and allocations (census)") {
  using Counters = graphmoe_cuda_emulation::Counters;
  auto same = [](const Counters& a, const Counters& b) {
    return a.kernel_launches == b.kernel_launches && a.cublas_calls == b.cublas_calls &&
           a.copies_to_host == b.copies_to_host && a.copies_to_device == b.copies_to_device &&
           a.copies_on_device == b.copies_on_device && a.memsets == b.memsets;
  };
  auto linear = [](unsigned long long a2, unsigned long long a4, unsigned long long a6) {
    return a6 - a4 == a4 - a2;
  };
  auto check_scaling = [&](const char* what, auto census) {
    CAPTURE(what);
    const StepCensus l2 = census(2, 4), l4 = census(4, 4), l6 = census(6, 4), l6e = census(6, 16);
    print_census(what, l6e);
    for (const StepCensus* s : {&l2, &l4, &l6, &l6e}) CHECK(s->c.device_allocations == 0);
    CHECK(same(l6.c, l6e.c));
    CHECK(linear(l2.c.kernel_launches, l4.c.kernel_launches, l6.c.kernel_launches));
    CHECK(linear(l2.c.cublas_calls, l4.c.cublas_calls, l6.c.cublas_calls));
    CHECK(linear(l2.c.copies_to_host, l4.c.copies_to_host, l6.c.copies_to_host));
    // one wait per MoE block: the dispatch plan's expert offsets, which bring the router's
    // deferred content checks with them (core/deferred_check.hpp); none in the backward (the
    // cross-entropy's backward takes the forward's count of targets)
    CHECK(l4.c.copies_to_host - l2.c.copies_to_host == 2);
    CHECK(l4.c.async_copies_to_host - l2.c.async_copies_to_host == 2);
    // memsets per block: the selection's keep mask, nothing else (outputs on the GPU are not
    // zero-filled: every op writes its output in full; the deferred checks' flags are one memset
    // for the whole forward, TransformerLM::forward's scope)
    CHECK(l4.c.memsets - l2.c.memsets == 2 * 1);
    // no device-to-device copies: the residuals are written in one pass (add), and the
    // Independent graph's p is r itself
    CHECK(l6e.c.copies_on_device == 0);
    return l6e;
  };
  const StepCensus soft = check_scaling(
      "softmax, 6 blocks, E = 16", [](index_t l, index_t e) { return lm_step_census<SoftmaxRouter>(l, e); });
  const StepCensus sim = check_scaling(
      "similarity, 6 blocks, E = 16", [](index_t l, index_t e) { return lm_step_census<SimilarityRouter>(l, e); });
  const StepCensus mixed = check_scaling("softmax bf16, 6 blocks, E = 16", [](index_t l, index_t e) {
    return lm_step_census<SoftmaxRouter, __nv_bfloat16>(l, e);
  });
  // the graph adds launches, not host round trips (its mean entropy is computed on request:
  // RouterImpl::graph_entropy)
  CHECK(sim.c.kernel_launches > soft.c.kernel_launches);
  CHECK(sim.c.copies_to_host == soft.c.copies_to_host);
  // The padded expert layout: no wait inside the blocks at all (the plan's offsets are known on
  // the host, the capacity mask runs on the device, the routers' checks are read with the loss:
  // TransformerLM::forward's deferred scope); the same launches per block as compact + 1 (the
  // capacity mask), not growing with E either.
  auto padded = [](index_t l, index_t e) {
    return lm_step_census<SoftmaxRouter>(l, e, MoELayout::Switch, ExpertLayout::Padded);
  };
  const StepCensus p2 = padded(2, 4), p4 = padded(4, 4), p6 = padded(6, 4), p6e = padded(6, 16);
  print_census("softmax, padded experts (capacity factor 1.25), 6 blocks, E = 16", p6e);
  for (const StepCensus* s : {&p2, &p4, &p6, &p6e}) CHECK(s->c.device_allocations == 0);
  CHECK(same(p6.c, p6e.c));
  CHECK(p4.c.copies_to_host == p2.c.copies_to_host);
  CHECK(p4.c.async_copies_to_host == p2.c.async_copies_to_host);
  CHECK(p6e.c.copies_to_host + 6 == soft.c.copies_to_host);  // the compact plan's offsets
  // two waits a step: the end of the forward's scope (one asynchronous copy that brings the loss,
  // the count of targets, the checks and the routers' values, then one synchronisation; the
  // backward reads the count on the device) and the gradient norm (a copy to pageable memory)
  CHECK(p6e.c.async_copies_to_host == 1);
  CHECK(p6e.c.copies_to_host == 1);
  CHECK(p6e.c.synchronizations == 2);
  CHECK(p6e.c.copies_on_device == 0);
  // no memset per block either (the capacity mask writes keep in full), and no pointer arrays to
  // upload (the expert GEMMs are strided-batched over E equal problems)
  CHECK(p4.c.memsets == p2.c.memsets);
  CHECK(p4.c.copies_to_device == p2.c.copies_to_device);
  // nothing uploaded at all: clip_grad_norm's chunk table is built once per arena
  CHECK(p6e.c.copies_to_device == 0);
  // with the load-balancing loss (the main job's --load-balance 0.01): its value is a deferred
  // value read with the loss, its gradient computed on the device: still 2 waits a step
  auto balanced = [](index_t l, index_t e) {
    return lm_step_census<SoftmaxRouter>(l, e, MoELayout::Switch, ExpertLayout::Padded, 0.01);
  };
  const StepCensus b2 = balanced(2, 4), b4 = balanced(4, 4), b6e = balanced(6, 16);
  print_census("softmax, padded experts, load balancing 0.01, 6 blocks, E = 16", b6e);
  CHECK(b6e.c.copies_to_host == 1);
  CHECK(b6e.c.synchronizations == 2);
  CHECK(b4.c.copies_to_host == b2.c.copies_to_host);
  CHECK(b4.c.copies_to_device == b2.c.copies_to_device);
  CHECK(b6e.c.device_allocations == 0);
  // and with the z-loss (ST-MoE): its value a deferred value, its gradient on the device (it
  // used to copy gamma to the host twice per block and upload its gradient)
  auto z = [](index_t l, index_t e) {
    return lm_step_census<SoftmaxRouter>(l, e, MoELayout::Switch, ExpertLayout::Padded, 0.01, 1e-3);
  };
  const StepCensus z2 = z(2, 4), z4 = z(4, 4), z6e = z(6, 16);
  print_census("softmax, padded experts, load balancing 0.01, z-loss 0.001, 6 blocks, E = 16", z6e);
  CHECK(z6e.c.copies_to_host == 1);
  CHECK(z6e.c.synchronizations == 2);
  CHECK(z4.c.copies_to_host == z2.c.copies_to_host);
  CHECK(z4.c.copies_to_device == z2.c.copies_to_device);
  CHECK(z4.c.kernel_launches - z2.c.kernel_launches == b4.c.kernel_launches - b2.c.kernel_launches + 2 * 2);
  CHECK(z6e.c.device_allocations == 0);
  // the Attention graph too: h* stays on the device, every head's pass runs, the all-zero-row
  // flag is deferred (it used to cost 2 waits per block)
  auto attention = [](index_t l, index_t e) {
    return lm_step_census<AttentionRouter>(l, e, MoELayout::Switch, ExpertLayout::Padded, 0.01);
  };
  const StepCensus a2 = attention(2, 4), a4 = attention(4, 4), a6e = attention(6, 16);
  print_census("attention, padded experts, load balancing 0.01, 6 blocks, E = 16", a6e);
  CHECK(a6e.c.copies_to_host == 1);
  CHECK(a6e.c.synchronizations == 2);
  CHECK(a4.c.copies_to_host == a2.c.copies_to_host);
  CHECK(a6e.c.device_allocations == 0);
  // its scratch is not zero-filled (every entry is written first) and da is not copied before
  // the graph's dout is added: per block only the three gradient sinks the graph accumulates into
  // (dprobs, dv, dout) are memsets
  CHECK(a4.c.memsets - a2.c.memsets == 2 * 3);
  CHECK(a6e.c.copies_on_device == 0);
  // every GEMM weight of the bf16 model is read from its compute mirror: the conversions left
  // are activations' (8 per block: the attention input once for q, k and v, the output
  // projection's input, four output gradients, the experts' input and output gradient; 2 for the
  // head), not 2 per weight per step
  const auto conv = mixed.kernels.find("graphmoe::detail::convert_kernel<float, __nv_bfloat16>");
  const unsigned long long conversions = conv == mixed.kernels.end() ? 0 : conv->second;
  CHECK(conversions <= 8 * 6 + 2);
}
#endif  // GRAPHMOE_CUDA_EMULATION

// ---- CUDA graphs (backend/cuda/graph.cuh) ----------------------------------------------------

namespace {

// A padded MoE layer (capacity 1.25, load balancing and z-loss on) with its arena, inputs and
// outputs: one training step's forward and backward, the unit the CUDA graph tests capture.
struct MoEStep {
  MoEConfig cfg;
  ParameterArena<float, graphmoe::cuda> arena;
  MoELayer<SoftmaxRouter, float, graphmoe::cuda> layer;
  GraphContext<float, graphmoe::cuda> ctx{10, nullptr};
  Tensor<float, graphmoe::cuda> u, dy, y, du;

  explicit MoEStep(ExpertLayout layout = ExpertLayout::Padded) {
    cfg.d_model = 16;
    cfg.d_ff = 24;
    cfg.router.num_experts = 4;
    cfg.router.k = 2;
    cfg.router.capacity_factor = 1.25;
    cfg.router.load_balance_coef = 0.01;
    cfg.router.z_loss_coef = 1e-3;
    cfg.layout = layout;
    layer.declare(arena, "moe.", cfg);
    arena.allocate();
    layer.bind(arena);
    Rng r(7);
    layer.init(r);
    set_inputs(0);
  }
  // New input values, written into the tensors in place (what a captured step reads).
  void set_inputs(std::uint64_t seed) {
    Rng data(100 + seed);
    to_device(random_tensor<float>(Shape{20, cfg.d_model}, data), u);
    to_device(random_tensor<float>(Shape{20, cfg.d_model}, data), dy);
  }
  void run() {
    arena.zero_grad();
    layer.forward(u, ctx, y);
    layer.backward(dy, du);
  }
};

}  // namespace

// A replay computes what the eager step computes, for new inputs written in place, with the
// deferred values (the auxiliary losses) delivered after each replay.
TEST_CASE("cuda graph: a captured MoE layer step (padded experts) replays like the eager one") {
  SKIP_WITHOUT_CUDA_DEVICE();
  MoEStep graphed, eager;
  graphed.run();  // warm-up: the outputs exist, the allocator's cache holds the step's sizes
  CudaGraph g;
  CHECK_FALSE(g.captured());
  g.capture([&] { graphed.run(); });
  REQUIRE(g.captured());
  CHECK(g.deferred_slots() > 0);  // the router's checks and the two losses' values
  for (std::uint64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    graphed.set_inputs(step);
    eager.set_inputs(step);
    g.replay();
    eager.run();
    check_close("replayed y", to_host(eager.y), graphed.y, 1e-6);
    check_close("replayed du", to_host(eager.du), graphed.du, 1e-6);
    check_close("replayed gradients", to_host(eager.arena.grads()), graphed.arena.grads(), 1e-6);
    const Loss le = eager.layer.losses(), lg = graphed.layer.losses();
    CHECK(le.load_balance > 0);
    CHECK(lg.load_balance == doctest::Approx(le.load_balance).epsilon(1e-6));
    CHECK(lg.z_loss == doctest::Approx(le.z_loss).epsilon(1e-6));
  }
  CHECK(g.replays() == 3);
#if defined(GRAPHMOE_CUDA_EMULATION)
  // a replay is one graph launch and one wait; it runs the eager step's kernels and GEMMs
  const auto before = graphmoe_cuda_emulation::counters();
  g.replay();
  const auto mid = graphmoe_cuda_emulation::counters();
  eager.run();
  const auto after = graphmoe_cuda_emulation::counters();
  CHECK(mid.graph_launches - before.graph_launches == 1);
  CHECK(mid.synchronizations - before.synchronizations == 1);
  CHECK(mid.copies_to_host == before.copies_to_host);
  CHECK(mid.async_copies_to_host - before.async_copies_to_host == 1);
  CHECK(mid.device_allocations == before.device_allocations);
  CHECK(mid.kernel_launches - before.kernel_launches == after.kernel_launches - mid.kernel_launches);
  CHECK(mid.cublas_calls - before.cublas_calls == after.cublas_calls - mid.cublas_calls);
#endif
}

// A replay whose work trips a content check throws the eager step's error, and the next replay
// with good inputs runs normally.
TEST_CASE("cuda graph: a replay throws the eager step's first check error") {
  SKIP_WITHOUT_CUDA_DEVICE();
  MoEStep graphed, eager;
  graphed.run();
  CudaGraph g;
  g.capture([&] { graphed.run(); });
  Rng data(5);
  Tensor<float, cpu> bad = random_tensor<float>(Shape{20, graphed.cfg.d_model}, data);
  bad.data()[3 * graphed.cfg.d_model + 2] = std::numeric_limits<float>::quiet_NaN();
  to_device(bad, graphed.u);
  const std::string eager_error = test::error_of([&] {
    to_device(bad, eager.u);
    eager.run();
  });
  CAPTURE(eager_error);
  CHECK(eager_error.find("nan") != std::string::npos);
  CHECK(test::error_of([&] { g.replay(); }) == eager_error);
  graphed.set_inputs(9);
  eager.set_inputs(9);
  g.replay();
  eager.run();
  check_close("y after a failed replay", to_host(eager.y), graphed.y, 1e-6);
}

// What a graph cannot hold is refused at capture, naming the problem; the stream and the
// allocator stay usable, and a block the capture freed is not handed out while the graph lives.
TEST_CASE("cuda graph: capture refuses reads, synchronisations and the compact layout") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng data(3);
  const auto x = to_device(random_tensor<float>(Shape{4, 5}, data));
  CudaGraph g;
  CHECK(test::error_of([&] { g.replay(); }).find("nothing captured") != std::string::npos);
  const std::string read_error = test::error_of([&] {
    g.capture([&] {
      Tensor<float, graphmoe::cuda> y;
      add(x, x, y);
      (void)to_host(y);  // a read back: not capturable
    });
  });
  CHECK(read_error.find("CudaGraph::capture") != std::string::npos);
  CHECK(read_error.find("capturing") != std::string::npos);
  CHECK_FALSE(g.captured());
  // a refused call whose error the captured work ignored: the capture is invalidated, and
  // capture() says so once
  const std::string ignored_error = test::error_of([&] {
    g.capture([&] {
      (void)cudaStreamSynchronize(cuda_stream());
      (void)cudaGetLastError();
    });
  });
  CHECK(ignored_error.find("cannot hold") != std::string::npos);
  CHECK(ignored_error.find("CudaGraph::capture") == ignored_error.rfind("CudaGraph::capture"));
  CHECK_FALSE(g.captured());
  // the stream works as before
  Tensor<float, graphmoe::cuda> y;
  add(x, x, y);
  Tensor<float, cpu> twice = to_host(x);
  for (index_t i = 0; i < twice.numel(); ++i) twice.data()[i] *= 2;
  check_close("2x after a failed capture", twice, y, 0.0);
  MoEStep compact(ExpertLayout::Compact);
  compact.run();
  CHECK(test::error_of([&] { g.capture([&] { compact.run(); }); }).find("ExpertLayout::Padded") !=
        std::string::npos);
  CHECK(test::error_of([&] {
          with_deferred_checks(graphmoe::cuda{}, [&] { g.capture([&] {}); });
        }).find("with_deferred_checks") != std::string::npos);
  // a scratch block freed inside the capture stays the graph's
  const float* scratch = nullptr;
  g.capture([&] {
    auto t = Tensor<float, graphmoe::cuda>::uninitialized(Shape{1000});
    scratch = t.data();
    add(x, x, y);
  });
  REQUIRE(g.captured());
  const auto again = Tensor<float, graphmoe::cuda>::uninitialized(Shape{1000});
  CHECK(again.data() != scratch);
  g.replay();
  g.reset();
  CHECK_FALSE(g.captured());
  // so does a block from before the capture that the captured work freed (it may have read it)
  auto old_tensor = Tensor<float, graphmoe::cuda>::uninitialized(Shape{3000});
  const float* old_block = old_tensor.data();
  g.capture([&] {
    add(x, x, y);
    old_tensor = Tensor<float, graphmoe::cuda>();
  });
  const auto fresh = Tensor<float, graphmoe::cuda>::uninitialized(Shape{3000});
  CHECK(fresh.data() != old_block);
  g.replay();
  // and a block from before the capture freed after it, while the graph lives (the captured work
  // may hold its address): held back until no graph may touch it, here two graphs
  auto before = Tensor<float, graphmoe::cuda>::uninitialized(Shape{5000});
  const float* before_block = before.data();
  auto sum = Tensor<float, graphmoe::cuda>::uninitialized(Shape{5000});
  g.capture([&] { add(before, before, sum); });
  CudaGraph second;
  second.capture([&] { add(x, x, y); });
  const std::size_t held0 = cuda_memory_stats().bytes_held_for_graphs;
  before = Tensor<float, graphmoe::cuda>();
  CHECK(cuda_memory_stats().bytes_held_for_graphs >= held0 + 5000 * sizeof(float));
  const auto other = Tensor<float, graphmoe::cuda>::uninitialized(Shape{5000});
  CHECK(other.data() != before_block);
  g.replay();
  g.reset();  // the second graph may still hold it
  const auto other2 = Tensor<float, graphmoe::cuda>::uninitialized(Shape{5000});
  CHECK(other2.data() != before_block);
  second.reset();  // now no graph does: it is handed out again
  CHECK(cuda_memory_stats().bytes_held_for_graphs == 0);
  const auto reused = Tensor<float, graphmoe::cuda>::uninitialized(Shape{5000});
  CHECK(reused.data() == before_block);
}

// The language model's training step in a graph: forward (its loss, the routers' checks and
// auxiliary losses deferred), zero_grad and backward captured once; each replay takes the batch
// written into the captured ids and targets. Clipping and AdamW run outside (the optimizer's step
// count and learning rate change every step). Three routers: the Attention graph keeps h* on the
// device, the Similarity graph is one fused pass.
TEST_CASE_TEMPLATE("cuda graph: a captured TransformerLM training step replays like the eager one",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
  TransformerLMConfig cfg = tiny_lm(MoELayout::Switch);
  cfg.num_layers = 2;
  cfg.router.num_experts = 4;
  cfg.router.capacity_factor = 1.25;
  cfg.router.load_balance_coef = 0.01;
  cfg.router.z_loss_coef = 1e-3;
  cfg.expert_layout = ExpertLayout::Padded;
  TransformerLM<Policy, float, graphmoe::cuda> graphed(cfg, 3), eager(cfg, 3);
  AdamWConfig oc;
  AdamW<float, graphmoe::cuda> opt_g(graphed.arena(), oc), opt_e(eager.arena(), oc);
  Rng data(1);
  auto batch = [&](Tensor<std::int32_t, graphmoe::cuda>& ids, Tensor<std::int32_t, graphmoe::cuda>& tg) {
    Tensor<std::int32_t, cpu> h_ids = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    Tensor<std::int32_t, cpu> h_tg = random_ids(Shape{2, 12}, cfg.vocab_size, data);
    h_tg.data()[5] = TransformerLM<Policy, float, graphmoe::cuda>::kIgnoreIndex;  // ignored: the count is not the row count
    to_device(h_ids, ids);
    to_device(h_tg, tg);
  };
  Tensor<std::int32_t, graphmoe::cuda> ids, targets, eids, etargets;
  batch(ids, targets);
  auto run = [](auto& lm, const auto& i, const auto& t) {
    (void)lm.forward(i, t);
    lm.arena().zero_grad();
    lm.backward();
  };
  run(graphed, ids, targets);  // warm-up: the model's buffers exist, the cache holds the sizes
  const std::size_t held_without_graph = cuda_memory_stats().bytes_held_for_graphs;
  CudaGraph g;
  g.capture([&] { run(graphed, ids, targets); });
  for (int step = 1; step <= 3; ++step) {
    CAPTURE(step);
    batch(ids, targets);
    eids = Tensor<std::int32_t, graphmoe::cuda>();
    etargets = Tensor<std::int32_t, graphmoe::cuda>();
    to_device(to_host(ids), eids);
    to_device(to_host(targets), etargets);
    g.replay();
    run(eager, eids, etargets);
    const Loss lg = graphed.last_loss(), le = eager.last_loss();
    CHECK(le.task > 0);
    CHECK(lg.task == doctest::Approx(le.task).epsilon(1e-6));
    CHECK(lg.load_balance == doctest::Approx(le.load_balance).epsilon(1e-6));
    CHECK(lg.z_loss == doctest::Approx(le.z_loss).epsilon(1e-6));
    check_close("replayed gradients", to_host(eager.arena().grads()), graphed.arena().grads(), 1e-5);
    const double ng = clip_grad_norm(graphed.arena(), 1.0), ne = clip_grad_norm(eager.arena(), 1.0);
    CHECK(ng == doctest::Approx(ne).epsilon(1e-5));
    opt_g.step(graphed.arena(), 1e-2);
    opt_e.step(eager.arena(), 1e-2);
  }
  check_close("parameters after 3 steps", to_host(eager.arena().values()), graphed.arena().values(),
              1e-5);
#if defined(GRAPHMOE_CUDA_EMULATION)
  const auto before = graphmoe_cuda_emulation::counters();
  g.replay();
  const auto after = graphmoe_cuda_emulation::counters();
  CHECK(after.graph_launches - before.graph_launches == 1);
  CHECK(after.synchronizations - before.synchronizations == 1);  // the replay's one wait
  CHECK(after.copies_to_host == before.copies_to_host);
  CHECK(after.device_allocations == before.device_allocations);
#endif
  // The model run eagerly at another shape between replays (an evaluation batch) reallocates
  // its buffers from the warm-up step, which the graph holds: the freed ones are held back from
  // reuse (the eager run at that shape and the next allocations get other memory), and the next
  // replay still computes the captured step, equal to the eager model's on the same batch.
  {
    Tensor<std::int32_t, graphmoe::cuda> other_ids, other_targets;
    to_device(random_ids(Shape{3, 7}, cfg.vocab_size, data), other_ids);
    to_device(random_ids(Shape{3, 7}, cfg.vocab_size, data), other_targets);
    const std::size_t held_before = cuda_memory_stats().bytes_held_for_graphs;
    run(graphed, other_ids, other_targets);
    CHECK(cuda_memory_stats().bytes_held_for_graphs > held_before);
    const double other_loss = graphed.last_loss().task;
    batch(ids, targets);
    to_device(to_host(ids), eids);
    to_device(to_host(targets), etargets);
    g.replay();
    run(eager, eids, etargets);
    CHECK(graphed.last_loss().task == doctest::Approx(eager.last_loss().task).epsilon(1e-6));
    CHECK(graphed.last_loss().task != doctest::Approx(other_loss).epsilon(1e-6));
    check_close("replayed gradients after a run at another shape", to_host(eager.arena().grads()),
                graphed.arena().grads(), 1e-5);
  }
  g.reset();  // the held blocks are free again
  CHECK(cuda_memory_stats().bytes_held_for_graphs == held_without_graph);
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
  // the forward's checks are deferred to one read (the images', the routers', the loss's): the
  // errors stay the CPU's, the first in program order
  Tensor<T, cpu> bad_images = images.clone();
  bad_images.data()[7] = std::numeric_limits<T>::quiet_NaN();
  const std::string cpu_error = test::error_of([&] { (void)host.forward(bad_images, labels); });
  CHECK(cpu_error.find("images") != std::string::npos);
  CHECK(test::error_of([&] { (void)dev.forward(to_device(bad_images), to_device(labels)); }) ==
        cpu_error);
  const Tensor<std::int32_t, cpu> bad_labels = Tensor<std::int32_t, cpu>::from(Shape{3}, {4, 9, 2});
  const std::string label_error = test::error_of([&] { (void)host.forward(images, bad_labels); });
  CHECK(label_error.find("target of row 1 is 9") != std::string::npos);
  CHECK(test::error_of([&] { (void)dev.forward(to_device(images), to_device(bad_labels)); }) ==
        label_error);
  // a backward after a failed forward asks for a new one, on both backends
  for (const std::string& e : {test::error_of([&] { host.backward(); }),
                               test::error_of([&] { dev.backward(); })})
    CHECK(e.find("call forward with labels first") != std::string::npos);
  // and a good forward after them computes the loss again
  CHECK(dev.forward(to_device(images), to_device(labels)).total() ==
        doctest::Approx(static_cast<double>(dl)).epsilon(1e-12));
}

}  // namespace graphmoe
