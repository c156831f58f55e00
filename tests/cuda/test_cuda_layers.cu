// Cross-backend tests of the layers, routers and the MoE layer: the same layer class instantiated
// with graphmoe::cpu (the reference) and graphmoe::cuda, the same parameters (the CPU arena's
// values copied to the device arena) and inputs; outputs, routing decisions, input gradients and
// every parameter gradient are compared. The FeedForward and the MoE layer run with GELU and with
// SwiGLU (fused gate | up first projection, with and without biases; fp32, fp64 and bf16 experts).
//
//   error metric   max_i |cuda_i - cpu_i| / max_i |cpu_i| per tensor (tests/cuda/cuda_test_support)
//   tolerance      composite layers (several ops and reductions in other orders, fused
//                  multiply-adds on the device): float 1e-4, double 1e-10; the routing decisions
//                  (top-k ids, capacity drops) exactly
//
// Without a CUDA device every case passes with "skipped: no CUDA device" (compiled by nvcc in CI,
// run in full by scripts/gpu-check.sh).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "graphmoe/cuda.cuh"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

namespace graphmoe {
using test::check_arenas;
using test::check_close;
using test::check_equal;
using test::error_of;
using test::random_tensor;

namespace {

template <class T>
double layer_tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

// Both arenas are declared by the same calls; the device one receives the CPU one's values.
template <class T>
void copy_parameters(const ParameterArena<T, cpu>& host, const ParameterArena<T, graphmoe::cuda>& dev) {
  REQUIRE(host.values().shape() == dev.values().shape());
  Tensor<T, graphmoe::cuda> v = dev.values();
  to_device(host.values(), v);
}

template <class T>
void check_gradients(const std::string& what, const ParameterArena<T, cpu>& host,
                     const ParameterArena<T, graphmoe::cuda>& dev,
                     double tol = layer_tolerance<T>()) {
  check_arenas(what, host, dev, true, tol);
}

// A layer pair: the same class on both backends, declared alike, the same initial values.
template <class HostLayer, class DevLayer, class T>
struct Pair {
  ParameterArena<T, cpu> host_arena;
  ParameterArena<T, graphmoe::cuda> dev_arena;
  HostLayer host;
  DevLayer dev;

  template <class Declare, class Init>
  Pair(Declare&& declare, Init&& init) {
    declare(host_arena, host);
    declare(dev_arena, dev);
    host_arena.allocate();
    dev_arena.allocate();
    host.bind(host_arena);
    dev.bind(dev_arena);
    init(host);
    copy_parameters(host_arena, dev_arena);
  }
};

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: Linear, LayerNorm and FeedForward layers", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng data(3);
  const Tensor<T, cpu> x = random_tensor<T>(Shape{2, 7, 12}, data);
  {
    Pair<Linear<T, cpu>, Linear<T, graphmoe::cuda>, T> p(
        [](auto& arena, auto& l) { l.declare(arena, "fc.", 12, 9); },
        [](auto& l) { Rng r(1); l.init(r, 0.3); });
    const Tensor<T, cpu> dy = random_tensor<T>(Shape{2, 7, 9}, data);
    Tensor<T, cpu> hy, hdx(x.shape());
    Tensor<T, graphmoe::cuda> dy_dev, ddx(x.shape());
    p.host.forward(x, hy);
    p.dev.forward(to_device(x), dy_dev);
    check_close("Linear y", hy, dy_dev, layer_tolerance<T>());
    p.host.backward(dy, &hdx);
    p.dev.backward(to_device(dy), &ddx);
    check_close("Linear dx", hdx, ddx, layer_tolerance<T>());
    check_gradients("Linear", p.host_arena, p.dev_arena);
  }
  {
    Pair<LayerNorm<T, cpu>, LayerNorm<T, graphmoe::cuda>, T> p(
        [](auto& arena, auto& l) { l.declare(arena, "ln.", 12); }, [](auto& l) { l.init(); });
    const Tensor<T, cpu> dy = random_tensor<T>(x.shape(), data);
    Tensor<T, cpu> hy, hdx;
    Tensor<T, graphmoe::cuda> yd, dxd;
    p.host.forward(x, hy);
    p.dev.forward(to_device(x), yd);
    check_close("LayerNorm y", hy, yd, layer_tolerance<T>());
    p.host.backward(dy, hdx);
    p.dev.backward(to_device(dy), dxd);
    check_close("LayerNorm dx", hdx, dxd, layer_tolerance<T>());
    check_gradients("LayerNorm", p.host_arena, p.dev_arena);
  }
  {
    Pair<FeedForward<T, cpu>, FeedForward<T, graphmoe::cuda>, T> p(
        [](auto& arena, auto& l) { l.declare(arena, "ffn.", 12, 20, GeluForm::Tanh); },
        [](auto& l) { Rng r(2); l.init(r, 0.2); });
    const Tensor<T, cpu> xf = x.view(Shape{14, 12});
    const Tensor<T, cpu> dy = random_tensor<T>(xf.shape(), data);
    Tensor<T, cpu> hy, hdx;
    Tensor<T, graphmoe::cuda> yd, dxd;
    p.host.forward(xf, hy);
    p.dev.forward(to_device(xf), yd);
    check_close("FeedForward y", hy, yd, layer_tolerance<T>());
    p.host.backward(dy, hdx);
    p.dev.backward(to_device(dy), dxd);
    check_close("FeedForward dx", hdx, dxd, layer_tolerance<T>());
    check_gradients("FeedForward", p.host_arena, p.dev_arena);
  }
  // SwiGLU: fc1 (2 d_ff, D), gate rows then up rows; with and without biases (random biases, so
  // that the adds are exercised)
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    Pair<FeedForward<T, cpu>, FeedForward<T, graphmoe::cuda>, T> p(
        [bias](auto& arena, auto& l) {
          l.declare(arena, "ffn.", 12, 20, GeluForm::Tanh, FfnActivation::SwiGLU, bias);
        },
        [](auto& l) { Rng r(2); l.init(r, 0.2); });
    REQUIRE(p.host_arena.value("ffn.fc1.weight").shape() == Shape{40, 12});
    if (bias) {
      Rng br(4);
      auto b = p.host_arena.value("ffn.fc1.bias");
      b.copy_from(random_tensor<T>(b.shape(), br));
      copy_parameters(p.host_arena, p.dev_arena);
    }
    const Tensor<T, cpu> xf = x.view(Shape{14, 12});
    const Tensor<T, cpu> dy = random_tensor<T>(xf.shape(), data);
    Tensor<T, cpu> hy, hdx;
    Tensor<T, graphmoe::cuda> yd, dxd;
    p.host.forward(xf, hy);
    p.dev.forward(to_device(xf), yd);
    check_close("SwiGLU FeedForward y", hy, yd, layer_tolerance<T>());
    p.host.backward(dy, hdx);
    p.dev.backward(to_device(dy), dxd);
    check_close("SwiGLU FeedForward dx", hdx, dxd, layer_tolerance<T>());
    check_gradients("SwiGLU FeedForward", p.host_arena, p.dev_arena);
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: MultiHeadAttention layer and its cache", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    Pair<MultiHeadAttention<T, cpu>, MultiHeadAttention<T, graphmoe::cuda>, T> p(
        [causal](auto& arena, auto& l) { l.declare(arena, "attn.", 16, 4, causal); },
        [](auto& l) { Rng r(5); l.init(r, 0.3); });
    Rng data(9);
    const Tensor<T, cpu> x = random_tensor<T>(Shape{2, 11, 16}, data);
    const Tensor<T, cpu> da = random_tensor<T>(x.shape(), data);
    Tensor<T, cpu> ha, hdx;
    Tensor<T, graphmoe::cuda> a_dev, dx_dev;
    p.host.forward(x, ha);
    p.dev.forward(to_device(x), a_dev);
    check_close("attention a", ha, a_dev, layer_tolerance<T>());
    check_close("attention probs", p.host.cache().probs, p.dev.cache().probs, layer_tolerance<T>());
    check_close("attention row entropy", p.host.cache().row_entropy, p.dev.cache().row_entropy,
                layer_tolerance<T>());
    p.host.backward(da, hdx);
    p.dev.backward(to_device(da), dx_dev);
    check_close("attention dx", hdx, dx_dev, layer_tolerance<T>());
    check_gradients("attention", p.host_arena, p.dev_arena);
  }
}

namespace {

// One MoE layer on both backends: routing, output, du and every gradient. C: the device experts'
// GEMM compute type; tol: the tolerance of the expert outputs and gradients; activation, bias and
// layout: MoEConfig's (SwiGLU experts get random biases, so that the bias adds are exercised).
template <class Policy, class T, class C = T>
void compare_moe(const RouterConfig& rc, index_t batch, index_t len,
                 double tol = layer_tolerance<T>(),
                 FfnActivation activation = FfnActivation::Gelu, bool bias = true,
                 ExpertLayout layout = ExpertLayout::Compact) {
  MoEConfig cfg;
  cfg.d_model = 24;
  cfg.d_ff = 20;
  cfg.router = rc;
  cfg.activation = activation;
  cfg.bias = bias;
  cfg.layout = layout;
  Pair<MoELayer<Policy, T, cpu>, MoELayer<Policy, T, graphmoe::cuda, C>, T> p(
      [&](auto& arena, auto& l) { l.declare(arena, "moe.", cfg); },
      [](auto& l) { Rng r(7); l.init(r); });
  if (activation == FfnActivation::SwiGLU) {
    REQUIRE(p.host_arena.value("moe.experts.w1").shape() == Shape{rc.num_experts, 40, 24});
    if (bias) {
      Rng br(8);
      for (const char* name : {"moe.experts.b1", "moe.experts.b2"}) {
        auto b = p.host_arena.value(name);
        b.copy_from(random_tensor<T>(b.shape(), br, -0.5, 0.5));
      }
      copy_parameters(p.host_arena, p.dev_arena);
    }
  }
  Rng data(11);
  const index_t n = batch * len;
  const Tensor<T, cpu> u = random_tensor<T>(Shape{n, cfg.d_model}, data);
  const Tensor<T, cpu> dy = random_tensor<T>(u.shape(), data);
  GraphContext<T, cpu> hctx{len, nullptr};
  GraphContext<T, graphmoe::cuda> dctx{len, nullptr};
  Tensor<T, cpu> hy, hdu;
  Tensor<T, graphmoe::cuda> yd, dud;
  p.host.forward(u, hctx, hy);
  p.dev.forward(to_device(u), dctx, yd);
  const auto& hr = p.host.routing();
  const auto& dr = p.dev.routing();
  check_close("router gamma", hr.gamma, dr.gamma, layer_tolerance<T>());
  check_close("router r", hr.r, dr.r, layer_tolerance<T>());
  check_close("router p", hr.p, dr.p, layer_tolerance<T>());
  check_equal("router indices", hr.selection.indices, dr.selection.indices);
  check_equal("router keep", hr.selection.keep, dr.selection.keep);
  CHECK(dropped_count(hr.selection) == dropped_count(dr.selection));
  CHECK(hr.selection.may_drop == dr.selection.may_drop);
  check_close("router gates", hr.selection.gates, dr.selection.gates, layer_tolerance<T>());
  CHECK(p.dev.router().graph_entropy() ==
        doctest::Approx(p.host.router().graph_entropy()).epsilon(1e-4));
  CHECK(dr.load_balance_loss == doctest::Approx(hr.load_balance_loss).epsilon(1e-4));
  CHECK(dr.seq_aux_loss == doctest::Approx(hr.seq_aux_loss).epsilon(1e-4));
  CHECK(dr.z_loss == doctest::Approx(hr.z_loss).epsilon(1e-4));
  check_close("MoE y", hy, yd, tol);
  p.host.backward(dy, hdu);
  p.dev.backward(to_device(dy), dud);
  check_close("MoE du", hdu, dud, tol);
  check_gradients("MoE", p.host_arena, p.dev_arena, tol);
}

RouterConfig small_router(index_t k = 2) {
  RouterConfig rc;
  rc.num_experts = 6;
  rc.k = k;
  return rc;
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with the softmax router (Switch)", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_moe<SoftmaxRouter, T>(small_router(), 2, 9);
  SUBCASE("with load-balancing and z losses") {
    RouterConfig rc = small_router();
    rc.load_balance_coef = 0.01;
    rc.z_loss_coef = 0.001;
    compare_moe<SoftmaxRouter, T>(rc, 2, 9);
  }
  SUBCASE("with the sequence-wise balance loss") {
    RouterConfig rc = small_router();
    rc.seq_aux_loss_coef = 0.05;
    compare_moe<SoftmaxRouter, T>(rc, 2, 9);
  }
  SUBCASE("with a capacity limit that drops assignments") {
    RouterConfig rc = small_router();
    rc.capacity_factor = 0.5;
    compare_moe<SoftmaxRouter, T>(rc, 2, 9);
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with the Similarity-Aware router", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    RouterConfig rc = small_router();
    rc.causal = causal;
    rc.options<graphmoe::Similarity>().tau = 2.0;
    compare_moe<SimilarityRouter, T>(rc, 3, 37);
  }
}

// Mixed precision: fp32 parameters, router and activations, expert GEMMs on 16-bit operands with
// fp32 accumulation, against the all-fp32 CPU layer. Each GEMM operand is rounded once (relative
// error <= 2^-8 for bf16, 2^-11 for half); a product of two rounded operands and the sums over
// K <= 24 terms of mixed signs stay within a few units of that, relative to the largest entry:
// tolerance 2e-2 (bf16) and 3e-3 (half). The routing runs in fp32 on both sides and must agree
// exactly.
TEST_CASE("cuda vs cpu: MoE layer with bf16 and fp16 expert compute (fp32 router)") {
  SKIP_WITHOUT_CUDA_DEVICE();
  RouterConfig rc = small_router();
  rc.causal = true;
  rc.options<graphmoe::Similarity>().tau = 2.0;
  compare_moe<SimilarityRouter, float, __nv_bfloat16>(rc, 3, 37, 2e-2);
  compare_moe<SoftmaxRouter, float, __nv_bfloat16>(small_router(), 2, 9, 2e-2);
  compare_moe<SimilarityRouter, float, __half>(rc, 3, 37, 3e-3);
}

// SwiGLU experts (w1 (E, 2F, D), gate rows then up rows), with and without biases: the fused
// bias + swiglu pass and its backward over all experts' rows against the CPU's per-expert loop;
// compact and padded layouts, capacity drops; bf16 expert compute (tolerance as above).
TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with SwiGLU experts", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    compare_moe<SoftmaxRouter, T>(small_router(), 2, 9, layer_tolerance<T>(),
                                  FfnActivation::SwiGLU, bias);
    RouterConfig rc = small_router();
    rc.capacity_factor = 0.5;
    compare_moe<SoftmaxRouter, T>(rc, 2, 9, layer_tolerance<T>(), FfnActivation::SwiGLU, bias);
    compare_moe<SoftmaxRouter, T>(rc, 2, 9, layer_tolerance<T>(), FfnActivation::SwiGLU, bias,
                                  ExpertLayout::Padded);
    rc.causal = true;
    rc.options<graphmoe::Similarity>().tau = 2.0;
    compare_moe<SimilarityRouter, T>(rc, 3, 37, layer_tolerance<T>(), FfnActivation::SwiGLU,
                                     bias);
  }
}

TEST_CASE("cuda vs cpu: MoE layer with SwiGLU experts in bf16 compute (fp32 router)") {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool bias : {true, false}) {
    CAPTURE(bias);
    compare_moe<SoftmaxRouter, float, __nv_bfloat16>(small_router(), 2, 9, 2e-2,
                                                     FfnActivation::SwiGLU, bias);
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with the X-MoE (cosine) routers", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool learnable : {false, true}) {
    CAPTURE(learnable);
    RouterConfig rc = small_router();
    rc.allow_unused_options = true;  // XMoERouter has no Similarity graph
    rc.options<graphmoe::CosineScorer>().dim = 8;
    rc.options<graphmoe::CosineScorer>().learnable_temperature = learnable;
    rc.options<graphmoe::Similarity>().tau = 2.0;
    compare_moe<XMoERouter, T>(rc, 2, 9);
    compare_moe<SimilarityXMoERouter, T>(rc, 2, 9);
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with the SMoE-Dropout router (frozen, scheduled k)", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  RouterConfig rc = small_router();
  rc.options<graphmoe::ScheduledTopK>().k_min = 1;
  rc.options<graphmoe::ScheduledTopK>().k_max = 4;
  rc.options<graphmoe::ScheduledTopK>().schedule_steps = 10;
  compare_moe<SMoEDropoutRouter, T>(rc, 2, 8);
  compare_moe<SimilaritySMoEDropoutRouter, T>(rc, 2, 8);
}

// DeepSeek-V3's routing: sigmoid scores (and gradient), the biased group-limited top-k with
// scaled gates, and the bias update after a step from loads counted on the device: the same
// selection and bias on both backends, exactly (counts are integers, and expert_bias_update
// computes in double on either backend).
TEST_CASE_TEMPLATE("cuda vs cpu: MoE layer with sigmoid scores and bias-balanced top-k", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool normalize : {true, false}) {
    CAPTURE(normalize);
    RouterConfig rc = small_router();
    rc.causal = true;
    rc.allow_unused_options = true;  // SigmoidBiasRouter has no Similarity graph
    rc.options<graphmoe::Similarity>().tau = 2.0;
    auto& o = rc.options<graphmoe::TopK>();  // BiasBalancedTopK's token choice
    o.norm_topk_prob = normalize;
    o.routed_scaling_factor = 2.5;
    o.n_group = 3;
    o.topk_group = 2;
    rc.options<graphmoe::BiasBalancedTopK>().bias_update_rate = 0.05;
    compare_moe<SigmoidBiasRouter, T>(rc, 2, 9);
    compare_moe<SimilaritySigmoidBiasRouter, T>(rc, 3, 37);

    MoEConfig cfg;
    cfg.d_model = 24;
    cfg.d_ff = 20;
    cfg.router = rc;
    using Policy = SimilaritySigmoidBiasRouter;
    Pair<MoELayer<Policy, T, cpu>, MoELayer<Policy, T, graphmoe::cuda>, T> p(
        [&](auto& arena, auto& l) { l.declare(arena, "moe.", cfg); },
        [](auto& l) { Rng r(7); l.init(r); });
    Rng data(13);
    GraphContext<T, cpu> hctx{16, nullptr};
    GraphContext<T, graphmoe::cuda> dctx{16, nullptr};
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      for (int micro = 0; micro < 2; ++micro) {
        const Tensor<T, cpu> u = random_tensor<T>(Shape{32, cfg.d_model}, data);
        Tensor<T, cpu> hy;
        Tensor<T, graphmoe::cuda> yd;
        p.host.forward(u, hctx, hy);
        p.dev.forward(to_device(u), dctx, yd);
        check_equal("indices", p.host.routing().selection.indices,
                    p.dev.routing().selection.indices);
        check_equal("step loads", p.host.router().step_loads(), p.dev.router().step_loads());
      }
      p.host.router().after_step(p.host_arena);
      p.dev.router().after_step(p.dev_arena);
      check_equal("expert bias", p.host_arena.value("moe.router.selector.expert_bias"),
                  p.dev_arena.value("moe.router.selector.expert_bias"));
    }
    const Tensor<T, cpu> bias = to_host(p.dev_arena.value("moe.router.selector.expert_bias"));
    double moved = 0;
    for (index_t e = 0; e < bias.numel(); ++e) moved += std::abs(static_cast<double>(bias.data()[e]));
    CHECK(moved > 0);
  }
}

namespace {

// A communicator of `size` ranks whose other ranks all hold `others` in every all-reduce: in host
// memory (doubles, as RouterImpl::after_step sums the host vector for the CPU backend) or in device
// memory (int32, the device counts summed in place: copied to the host, added, copied back).
class FakeRanks final : public dist::Communicator {
 public:
  FakeRanks(dist::MemorySpace space, int size, std::vector<std::int32_t> others)
      : space_(space), size_(size), others_(std::move(others)) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  dist::MemorySpace memory_space() const override { return space_; }
  index_t max_count() const override { return 1 << 20; }
  void barrier() override {}
  int reduces = 0;

 protected:
  void all_reduce_sum_impl(void* data, index_t count, dist::ElementType type) override {
    REQUIRE(count == static_cast<index_t>(others_.size()));
    const auto add = [&](auto* d) {
      for (index_t i = 0; i < count; ++i) d[i] += (size_ - 1) * others_[static_cast<std::size_t>(i)];
    };
    if (space_ == dist::MemorySpace::Host) {
      REQUIRE(type == dist::ElementType::F64);
      add(static_cast<double*>(data));
    } else {
      REQUIRE(type == dist::ElementType::I32);
      std::vector<std::int32_t> h(static_cast<std::size_t>(count));
      const std::size_t bytes = h.size() * sizeof(std::int32_t);
      GRAPHMOE_CUDA_CHECK(
          cudaMemcpyAsync(h.data(), data, bytes, cudaMemcpyDeviceToHost, cuda_stream()));
      GRAPHMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
      add(h.data());
      GRAPHMOE_CUDA_CHECK(
          cudaMemcpyAsync(data, h.data(), bytes, cudaMemcpyHostToDevice, cuda_stream()));
      GRAPHMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    }
    ++reduces;
  }
  void broadcast_impl(void*, index_t, dist::ElementType, int) override {}
  void all_to_all_v_impl(const void*, const index_t*, const index_t*, void*, const index_t*,
                         const index_t*, dist::ElementType) override {}
  void min_over_ranks(std::span<std::int64_t>) override {}

 private:
  dist::MemorySpace space_;
  int size_;
  std::vector<std::int32_t> others_;
};

}  // namespace

// Data-parallel bias balancing: the CPU router sums its host vector over a host communicator, the
// CUDA router its device counts in place over a device one, and both update the bias from the
// summed counts (RouterStep::load_counts) to the same bits.
TEST_CASE_TEMPLATE("cuda vs cpu: bias balancing over ranks, host and device communicators", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  RouterConfig rc = small_router();
  rc.options<graphmoe::BiasBalancedTopK>().bias_update_rate = 0.01;
  test::set_scorer_init_std(rc, 0.7);
  const index_t d = 12, n = 20, e = rc.num_experts;
  using Policy = SigmoidBiasRouter;
  Pair<RouterImpl<Policy, T, cpu>, RouterImpl<Policy, T, graphmoe::cuda>, T> p(
      [&](auto& arena, auto& r) { r.declare(arena, "router.", d, rc); },
      [](auto& r) { Rng g(5); r.init(g); });
  // the two other ranks sent expert 0 many tokens: it is the one expert above the summed mean
  std::vector<std::int32_t> others(static_cast<std::size_t>(e), 1);
  others[0] = 500;
  FakeRanks host_world(dist::MemorySpace::Host, 3, others);
  FakeRanks dev_world(dist::MemorySpace::Device, 3, others);
  Rng data(19);
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const Tensor<T, cpu> u = random_tensor<T>(Shape{n, d}, data);
    RouterOutput<T, cpu> ho;
    RouterOutput<T, graphmoe::cuda> dout;
    p.host.forward(u, GraphContext<T, cpu>{n, nullptr}, ho);
    p.dev.forward(to_device(u), GraphContext<T, graphmoe::cuda>{n, nullptr}, dout);
    check_equal("indices", ho.selection.indices, dout.selection.indices);
    const Tensor<T, cpu> before = p.host_arena.value("router.selector.expert_bias").clone();
    p.host.after_step(p.host_arena, &host_world);
    p.dev.after_step(p.dev_arena, &dev_world);
    CHECK(host_world.reduces == step + 1);
    CHECK(dev_world.reduces == step + 1);
    const Tensor<T, cpu> hb = p.host_arena.value("router.selector.expert_bias");
    check_equal("expert bias", hb, p.dev_arena.value("router.selector.expert_bias"));
    CHECK(static_cast<double>(hb(0)) < static_cast<double>(before(0)));  // the summed counts
    for (index_t x = 1; x < e; ++x) CHECK(static_cast<double>(hb(x)) > static_cast<double>(before(x)));
    check_equal("step loads restarted", p.host.step_loads(), p.dev.step_loads());
  }
}

// with_deferred_checks on the GPU (core/deferred_check.hpp): the checks inside report the same
// errors as outside, the first one in program order wins, also over a later exception, and the
// scope leaves nothing open behind it.
// A bf16 Linear fed an input its caller converted (the attention layer converts x once for q, k
// and v): the same output and gradients, bit for bit, as converting it itself; a converted input
// of another shape is refused; a later plain forward converts into its own buffer, not the
// caller's.
TEST_CASE("cuda: Linear with a caller-converted bf16 input") {
  SKIP_WITHOUT_CUDA_DEVICE();
  using D = graphmoe::cuda;
  using L = Linear<float, D, __nv_bfloat16>;
  ParameterArena<float, D> arena;
  L a, b;
  a.declare(arena, "a.", 12, 5);
  b.declare(arena, "b.", 12, 5);
  arena.allocate();
  a.bind(arena);
  b.bind(arena);
  Rng r(3);
  a.init(r, 0.5);
  arena.value("b.weight").copy_from(arena.value("a.weight"));
  arena.value("b.bias").copy_from(arena.value("a.bias"));
  Rng data(4);
  const auto x = to_device(random_tensor<float>(Shape{7, 12}, data));
  const auto dy = to_device(random_tensor<float>(Shape{7, 5}, data));
  Tensor<__nv_bfloat16, D> xc = Tensor<__nv_bfloat16, D>::uninitialized(x.shape());
  convert(x, xc);
  Tensor<float, D> ya, yb, dxa(x.shape()), dxb(x.shape());
  a.forward(x, ya);
  b.forward(x, xc, yb);
  check_equal("y", to_host(ya), yb);
  a.backward(dy, &dxa);
  b.backward(dy, &dxb);
  check_equal("dx", to_host(dxa), dxb);
  check_equal("dW", to_host(arena.grad("a.weight")), arena.grad("b.weight"));
  Tensor<float, D> y2;
  CHECK(error_of([&] { b.forward(x, Tensor<__nv_bfloat16, D>::uninitialized(Shape{7, 11}), y2); })
            .find("the converted input has shape (7, 11), expected the input's (7, 12)") !=
        std::string::npos);
  auto widened = [](const Tensor<__nv_bfloat16, D>& t) {
    Tensor<float, D> f = Tensor<float, D>::uninitialized(t.shape());
    convert(t, f);
    return f;
  };
  const Tensor<float, cpu> kept = to_host(widened(xc));
  const auto other = to_device(random_tensor<float>(Shape{7, 12}, data));
  b.forward(other, y2);  // its own conversion
  check_equal("the caller's converted input", kept, widened(xc));
}

TEST_CASE("cuda: with_deferred_checks reports the first failed check, word for word") {
  SKIP_WITHOUT_CUDA_DEVICE();
  using D = graphmoe::cuda;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor<double, D> good = to_device(Tensor<double, cpu>::from({2, 3}, {1, 2, 3, 4, 5, 6}));
  const Tensor<double, D> bad = to_device(Tensor<double, cpu>::from({2, 3}, {1, 2, 3, 4, nan, 6}));
  const std::string finite_error = error_of([&] { check_finite("A", "x", bad); });
  const std::string softmax_error = error_of([&] {
    Tensor<double, D> y;
    softmax_forward(bad, y);
  });
  REQUIRE(finite_error.find("graphmoe::A: x of shape (2, 3) holds nan at flat index 4") == 0);
  REQUIRE(softmax_error.find("row 1 of x") != std::string::npos);
  // clean checks: nothing thrown, the results are written
  Tensor<double, D> y;
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            check_finite("A", "x", good);
            softmax_forward(good, y);
          });
        }) == "");
  CHECK(to_host(y)(1, 2) == doctest::Approx(std::exp(2.0) / (1 + std::exp(1.0) + std::exp(2.0))));
  // a failed check: its own message, at the end of the scope
  bool body_finished = false;
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            check_finite("A", "x", good);
            Tensor<double, D> z;
            softmax_forward(bad, z);
            body_finished = true;
          });
        }) == softmax_error);
  CHECK(body_finished);  // deferred: the check did not stop the body
  // two failed checks: the first in program order
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            check_finite("A", "x", bad);
            Tensor<double, D> z;
            softmax_forward(bad, z);
          });
        }) == finite_error);
  // a later exception gives way to the earlier failed check, and passes when none failed
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            check_finite("A", "x", bad);
            throw Error("graphmoe::later: an op tripping over the bad values");
          });
        }) == finite_error);
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            check_finite("A", "x", good);
            throw Error("graphmoe::later: its own error");
          });
        }) == "graphmoe::later: its own error");
  // a nested scope joins the outer one; a read inside brings the flags, which still wait for the
  // end of the scope
  CHECK(error_of([&] {
          with_deferred_checks(D{}, [&] {
            with_deferred_checks(D{}, [&] { check_finite("A", "x", bad); });
            (void)to_host(good);
          });
        }) == finite_error);
  // nothing is left open: checks outside a scope throw at once again
  CHECK(detail::active_deferred_checks() == nullptr);
  CHECK(error_of([&] { check_finite("A", "x", bad); }) == finite_error);
}

// Bad input reaching the MoE layer on the GPU gives the CPU layer's error word for word, although
// there the router's four content checks are read with the dispatch plan's expert offsets (one
// synchronisation per forward instead of five).
TEST_CASE_TEMPLATE("cuda vs cpu: the MoE layer's bad-input errors with deferred router checks", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  MoEConfig cfg;
  cfg.d_model = 24;
  cfg.d_ff = 20;
  cfg.router = small_router();
  Pair<MoELayer<SoftmaxRouter, T, cpu>, MoELayer<SoftmaxRouter, T, graphmoe::cuda>, T> p(
      [&](auto& arena, auto& l) { l.declare(arena, "moe.", cfg); },
      [](auto& l) { Rng r(7); l.init(r); });
  Rng data(11);
  const index_t len = 9, n = 2 * len;
  Tensor<T, cpu> u = random_tensor<T>(Shape{n, cfg.d_model}, data);
  GraphContext<T, cpu> hctx{len, nullptr};
  GraphContext<T, graphmoe::cuda> dctx{len, nullptr};
  Tensor<T, cpu> hy;
  Tensor<T, graphmoe::cuda> yd;
  auto errors = [&](const Tensor<T, cpu>& x) {
    return std::pair{error_of([&] { p.host.forward(x, hctx, hy); }),
                     error_of([&] { p.dev.forward(to_device(x), dctx, yd); })};
  };
  auto check_clean_forward = [&] {
    hy = Tensor<T, cpu>();
    yd = Tensor<T, graphmoe::cuda>();
#if defined(GRAPHMOE_CUDA_EMULATION)
    const auto before = graphmoe_cuda_emulation::counters();
    p.dev.forward(to_device(u), dctx, yd);
    const auto after = graphmoe_cuda_emulation::counters();
    // the plan's expert offsets (one wait), the four flags queued asynchronously before it
    CHECK(after.copies_to_host - before.copies_to_host == 1);
    CHECK(after.async_copies_to_host - before.async_copies_to_host == 1);
#else
    p.dev.forward(to_device(u), dctx, yd);
#endif
    p.host.forward(u, hctx, hy);
    check_close("MoE y", hy, yd, layer_tolerance<T>());
  };
  check_clean_forward();
  SUBCASE("a NaN in the router's input: check_finite's error") {
    Tensor<T, cpu> bad = u.clone();
    bad(5, 3) = std::numeric_limits<T>::quiet_NaN();
    const auto [host, dev] = errors(bad);
    CHECK(host.find("graphmoe::Router: u of shape (18, 24) holds nan at flat index 123") == 0);
    CHECK(dev == host);
  }
  SUBCASE("a NaN router weight: the softmax's error, not the top-k's or the plan's after it") {
    index_t id = -1;
    for (index_t i = 0; i < p.host_arena.size() && id < 0; ++i)
      if (p.host_arena.params()[static_cast<std::size_t>(i)].name.rfind("moe.router.", 0) == 0)
        id = i;
    REQUIRE(id >= 0);
    Tensor<T, cpu> w = p.host_arena.value(id);
    w.data()[0] = std::numeric_limits<T>::quiet_NaN();
    copy_parameters(p.host_arena, p.dev_arena);
    const auto [host, dev] = errors(u);
    CHECK(host.find("graphmoe::softmax_forward: row 0 of x") == 0);
    CHECK(dev == host);
    Rng r(7);
    p.host.init(r);  // the same weights as before the NaN
    copy_parameters(p.host_arena, p.dev_arena);
  }
  // the failed forward left nothing behind: the next one runs and agrees
  check_clean_forward();
}

namespace {

// A pre-norm block (LN, attention, LN, MoE or FFN) on both backends.
template <class Policy, class T>
void compare_block(bool moe, bool causal) {
  BlockConfig cfg;
  cfg.d_model = 16;
  cfg.num_heads = 4;
  cfg.d_ff = 24;
  cfg.causal = causal;
  cfg.moe = moe;
  cfg.init_std = 0.3;
  cfg.moe_config.router = small_router();
  cfg.moe_config.router.causal = causal;
  Pair<TransformerBlock<Policy, T, cpu>, TransformerBlock<Policy, T, graphmoe::cuda>, T> p(
      [&](auto& arena, auto& l) { l.declare(arena, "block.", cfg); },
      [](auto& l) { Rng r(13); l.init(r); });
  Rng data(17);
  const Tensor<T, cpu> h = random_tensor<T>(Shape{2, 10, cfg.d_model}, data);
  const Tensor<T, cpu> dout = random_tensor<T>(h.shape(), data);
  Tensor<T, cpu> hout, hdh;
  Tensor<T, graphmoe::cuda> outd, dhd;
  p.host.forward(h, hout);
  p.dev.forward(to_device(h), outd);
  check_close("block out", hout, outd, layer_tolerance<T>());
  if (moe)
    check_equal("block router indices", p.host.moe().routing().selection.indices,
                p.dev.moe().routing().selection.indices);
  p.host.backward(dout, hdh);
  p.dev.backward(to_device(dout), dhd);
  check_close("block dh", hdh, dhd, layer_tolerance<T>());
  check_gradients("block", p.host_arena, p.dev_arena);
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: transformer block, dense and with each graph", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    compare_block<SoftmaxRouter, T>(false, causal);
    compare_block<SoftmaxRouter, T>(true, causal);
    compare_block<SimilarityRouter, T>(true, causal);
    compare_block<AttentionRouter, T>(true, causal);
  }
}

// The load-balancing loss as routers use it (ops/aux_losses.hpp): the value as a deferred value
// of the open batch (no wait of its own), the gradient without a read back; both equal the CPU's.
TEST_CASE_TEMPLATE("cuda vs cpu: the load-balancing loss's deferred value and device gradient", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(31);
  const index_t n = 300, e = 6, k = 2;
  Tensor<T, cpu> p = random_tensor<T>(Shape{n, e}, rng, 0.0, 1.0);
  Tensor<std::int32_t, cpu> ids(Shape{n, k});
  for (index_t i = 0; i < ids.numel(); ++i)
    ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
  const auto dpv = to_device(p);
  const auto dids = to_device(ids);
  double hv = -1, dv = -1;
  load_balance_loss_into(p, ids, hv);
  CHECK(hv == doctest::Approx(load_balance_loss(p, ids, 0.0, nullptr)).epsilon(1e-15));
  load_balance_loss_into(dpv, dids, dv);  // outside a scope: at once
  CHECK(dv == doctest::Approx(hv).epsilon(1e-6));
  double deferred = -1;
  with_deferred_checks(graphmoe::cuda{}, [&] {
#if defined(GRAPHMOE_CUDA_EMULATION)
    const auto before = graphmoe_cuda_emulation::counters();
    load_balance_loss_into(dpv, dids, deferred);
    CHECK(graphmoe_cuda_emulation::counters().copies_to_host == before.copies_to_host);
#else
    load_balance_loss_into(dpv, dids, deferred);
#endif
  });
  CHECK(deferred == dv);  // delivered when the scope ended
  // gradient: dp += coef E f_e / N
  const Tensor<T, cpu> g0 = random_tensor<T>(Shape{n, e}, rng);
  Tensor<T, cpu> hg = g0.clone();
  auto dg = to_device(g0);
  load_balance_loss_backward(p, ids, 0.01, hg);
  load_balance_loss_backward(dpv, dids, 0.01, dg);
  check_close("load-balancing gradient", hg, dg);
  // a bad id: the CPU's message, at once and deferred
  Tensor<std::int32_t, cpu> bad = ids.clone();
  bad.data()[5] = static_cast<std::int32_t>(e);
  const std::string cpu_error = error_of([&] {
    double v = 0;
    load_balance_loss_into(p, bad, v);
  });
  CHECK(cpu_error.find("expert id 6 out of [0, 6)") != std::string::npos);
  CHECK(error_of([&] {
          double v = 0;
          load_balance_loss_into(dpv, to_device(bad), v);
        }) == cpu_error);
  CHECK(error_of([&] {
          double v = 0;
          with_deferred_checks(graphmoe::cuda{},
                               [&] { load_balance_loss_into(dpv, to_device(bad), v); });
        }) == cpu_error);
}

// The sequence-wise balance loss (ops/aux_losses.hpp seq_aux_loss): on the device from host
// copies of the CPU's arithmetic, inside a deferred scope too; the same value, gradient and errors.
TEST_CASE_TEMPLATE("cuda vs cpu: the sequence-wise balance loss", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(33);
  const index_t nb = 4, len = 25, n = nb * len, e = 6, k = 2;
  Tensor<T, cpu> p = random_tensor<T>(Shape{n, e}, rng, 0.05, 1.0);
  Tensor<std::int32_t, cpu> ids(Shape{n, k});
  for (index_t i = 0; i < ids.numel(); ++i)
    ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
  const auto dpv = to_device(p);
  const auto dids = to_device(ids);
  const double hv = seq_aux_loss(p, ids, len, 0.0, nullptr);
  CHECK(hv > 0);
  CHECK(seq_aux_loss(dpv, dids, len, 0.0, nullptr) == hv);  // the same host arithmetic
  double deferred = -1;
  with_deferred_checks(graphmoe::cuda{}, [&] { deferred = seq_aux_loss(dpv, dids, len, 0.0, nullptr); });
  CHECK(deferred == hv);
  const Tensor<T, cpu> g0 = random_tensor<T>(Shape{n, e}, rng);
  Tensor<T, cpu> hg = g0.clone();
  auto dg = to_device(g0);
  (void)seq_aux_loss(p, ids, len, 0.5, &hg);
  (void)seq_aux_loss(dpv, dids, len, 0.5, &dg);
  check_close("sequence-wise balance gradient", hg, dg);
  // a row of zero scores: the CPU's message, at once and inside a scope
  Tensor<T, cpu> zero = p.clone();
  for (index_t x = 0; x < e; ++x) zero.data()[7 * e + x] = T(0);
  const std::string cpu_error = error_of([&] { (void)seq_aux_loss(zero, ids, len, 0.0, nullptr); });
  CHECK(cpu_error.find("row 7 of p sums to 0") != std::string::npos);
  const auto dzero = to_device(zero);
  CHECK(error_of([&] { (void)seq_aux_loss(dzero, dids, len, 0.0, nullptr); }) == cpu_error);
  CHECK(error_of([&] {
          with_deferred_checks(graphmoe::cuda{},
                               [&] { (void)seq_aux_loss(dzero, dids, len, 0.0, nullptr); });
        }) == cpu_error);
}

// The router z-loss likewise (ops/aux_losses.hpp z_loss_into / z_loss_backward): a deferred
// value and a device gradient, equal to the host arithmetic of core/aux_losses.hpp.
TEST_CASE_TEMPLATE("cuda vs cpu: the z-loss's deferred value and device gradient", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(37);
  const index_t n = 300, e = 7;
  // logits with a spread, so that lse differs from the max by more than rounding
  const Tensor<T, cpu> gamma = random_tensor<T>(Shape{n, e}, rng, -6.0, 6.0);
  const auto dgv = to_device(gamma);
  double hv = -1, dv = -1;
  z_loss_into(gamma, hv);
  CHECK(hv == doctest::Approx(z_loss(gamma, 0.0, nullptr)).epsilon(1e-15));
  // a naive evaluation in double
  double naive = 0;
  for (index_t i = 0; i < n; ++i) {
    double s = 0;
    for (index_t x = 0; x < e; ++x) s += std::exp(static_cast<double>(gamma.data()[i * e + x]));
    naive += std::log(s) * std::log(s);
  }
  naive /= static_cast<double>(n);
  CHECK(hv == doctest::Approx(naive).epsilon(std::is_same_v<T, float> ? 1e-6 : 1e-13));
  z_loss_into(dgv, dv);  // outside a scope: at once
  CHECK(dv == doctest::Approx(hv).epsilon(std::is_same_v<T, float> ? 1e-6 : 1e-13));
  double deferred = -1;
  with_deferred_checks(graphmoe::cuda{}, [&] {
#if defined(GRAPHMOE_CUDA_EMULATION)
    const auto before = graphmoe_cuda_emulation::counters();
    z_loss_into(dgv, deferred);
    CHECK(graphmoe_cuda_emulation::counters().copies_to_host == before.copies_to_host);
#else
    z_loss_into(dgv, deferred);
#endif
    CHECK(deferred == -1);  // not yet read
  });
  CHECK(deferred == dv);  // delivered when the scope ended
  // gradient: dgamma += coef (2 / N) lse_i softmax(gamma_i), onto a non-zero dgamma
  const Tensor<T, cpu> g0 = random_tensor<T>(Shape{n, e}, rng);
  Tensor<T, cpu> hg = g0.clone();
  auto dg = to_device(g0);
  z_loss_backward(gamma, 0.25, hg);
  z_loss_backward(dgv, 0.25, dg);
  check_close("z-loss gradient", hg, dg);
  // wrong shapes are refused before any work, naming the op
  Tensor<T, graphmoe::cuda> wrong(Shape{n, e + 1});
  CHECK(test::error_of([&] { z_loss_backward(dgv, 0.25, wrong); }).find("z_loss_backward") !=
        std::string::npos);
}

}  // namespace graphmoe
