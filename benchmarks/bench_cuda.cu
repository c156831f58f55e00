// The CUDA backend on a GPU: cuBLAS GEMM throughput, the MoE layer per router, the similarity
// token graph and one LM training step, all on graphmoe::cuda.
//
//   gemm/<type>/<case>/MxKxN      C = op(A) op(B), one cuBLAS GEMM; FLOP = 2 M K N
//       expert_fwd_NT    256 x 352 x 352   one expert's share of the routed slots, H = X w1^T
//       expert_dX_NN     256 x 352 x 352   its input gradient, dX = dH w1
//       expert_dW_TN     352 x 256 x 352   its weight gradient, dw1 += dH^T X
//       all_slots_NT    4096 x 352 x 352   every routed slot through one weight (dense upper bound)
//       square_NN       4096 x 4096 x 4096 cuBLAS's large-matrix throughput (the yardstick)
//     in float (CUBLAS_DEFAULT_MATH: true fp32, no TF32) and in bf16 when graphmoe::gemm accepts
//     Tensor<__nv_bfloat16, cuda> (detected at compile time, see kHaveBf16Gemm).
//   moe/float/<router>/{fwd,fwdbwd}   MoELayer<Router, float, graphmoe::cuda> at the paper's medium
//     shape: batch 4 x 512 tokens, D = 352, E = 16, d_ff = 352, top-2, causal graphs, as bench_moe
//     on the CPU. fwdbwd = forward, zero_grad, backward. The attention router reads the cache of a
//     MultiHeadAttention<float, graphmoe::cuda> (8 heads) run once on the same tokens. Counter
//     expert_flop: 4 D d_ff per routed slot forward (two GEMMs), x3 with backward: the useful
//     work, not everything the layer computes.
//   moe/bf16/<router>/{fwd,fwdbwd}    MoELayer<Router, float, graphmoe::cuda, __nv_bfloat16>: the
//     same layer with its expert GEMMs on bf16 operands (fp32 accumulation and outputs); the
//     parameters, the router (logits, softmax, graph, gates) and the activations stay fp32, and
//     the conversions to bf16 (xs, A, dy, dh) are part of the measured time; w1 and w2 are read
//     in bf16 from a ComputeMirror of the arena (layers/compute_mirror.hpp), which in training the
//     optimizer step writes (lm_train's bf16 rows), so no weight is converted per step.
//   moe_large/<type>/<router>/fwdbwd  the same at a large shape: batch 16 x 2048 tokens, D = 1024,
//     E = 64, d_ff = 4096, top-2 (3.3 TFLOP of expert work per step); 3 timed iterations, one
//     repetition (the setup moves 4 GiB of parameters). The experts are initialised by drawing
//     expert 0's w1 and w2 and copying them to the others (a full draw of 537 M normals on the
//     host takes seconds per benchmark; the router, which decides the load, is drawn in full).
//   Every moe row also reports peak_work_bytes: the high-water mark of the caching allocator over
//   the warm-up and timed steps, less what was in use before them (parameters, their gradients,
//   the inputs and the attention cache): the memory the layer's forward and backward add.
//   graph/float/similarity/{fwd,fwdbwd}   GraphImpl<Similarity, float, graphmoe::cuda> alone on the
//     same tokens (p = S r with S = softmax(U U^T / tau), causal), backward into dr and du.
//     Counter graph_FLOP/s: the causal products the graph performs (similarity_graph_flop).
//   <router>-tf32, <router>-bf16   the Similarity graph at GraphPrecision::TF32 / BF16 (the block
//     path of backend/cuda/similarity_blocks.cuh on tensor cores); plain "similarity" is
//     GraphPrecision::Exact, the fused fp32 kernel; attention-tf32: the Attention graph's (T, T)
//     products on TF32 tensor cores.
//   graph_large/float/{similarity,attention}/{fwd,fwdbwd}   the Similarity and the Attention graph
//     alone at the large shape (the attention graph on the cache of an 8-head causal attention
//     layer run once): the graph's share of the moe_large rows.
//   lm_train/float/<router>   one TransformerLM<Router, float, graphmoe::cuda> training step
//     (forward with the loss, zero_grad, backward, clip_grad_norm(1.0), AdamW) at
//     TransformerLMConfig::paper_medium (6 layers, D = 352, 8 heads, E = 16, top-2) with a
//     vocabulary of 1024, batch 4 x 512 tokens. Counter tokens/s.
//   lm_train/bf16/<router>   the same step with TransformerLM<Router, float, graphmoe::cuda,
//     __nv_bfloat16> (train_lm --precision bf16): every GEMM on bf16 operands with fp32
//     accumulation, fp32 master weights and AdamW state.
//   lm_train/{float,bf16}/softmax-cap1.25/{compact,padded}   the softmax step with capacity factor
//     1.25, in the compact expert layout (one wait per MoE layer for the expert sizes) and the
//     padded one (no wait in the forward before the loss; E C rows of expert work: 25% more at
//     a uniform load).
//   lm_train/{float,bf16}/{softmax,similarity}-cap1.25/padded-graph   the padded step with its
//     forward, zero_grad and backward captured once into a CUDA graph (backend/cuda/graph.cuh)
//     and replayed: one graph launch and one wait, then clip_grad_norm and AdamW as above.
//   decode/float/<router>/b<batch>/p<prompt>   incremental decoding (inference/decoder.hpp) on the
//     GPU: TransformerLM<Router, float, graphmoe::cuda> at paper_medium with a vocabulary of 10000
//     and max_seq_len 1088, `batch` slots prefilled with `prompt` tokens (untimed), then one step
//     per iteration (one new token per slot, the logits copied to the host as generate does),
//     the slots rewound to the prompt's length every 16 steps (bench_decode.cpp's protocol).
//     Counter tokens/s. decode_full/...: the O(t^2) reference, one forward over (batch, prompt)
//     per token of every sequence.
//
// Timing: every iteration is bracketed by CUDA events on graphmoe::cuda_stream() (the stream every
// op runs on) and reported with UseManualTime, so the time is the device's from the first queued
// op to the last one's end, host gaps included; each run starts with warm-up calls and a stream
// synchronisation. The small GEMMs are queued several at a time per iteration (counter reps) and
// the time divided by the count. An error (graphmoe::Error, a CUDA error) ends that benchmark with
// SkipWithError; the others still run.
//
// bf16 is the experts' compute type (mixed precision) and, in the -bf16 rows, the graph's product
// inputs; parameters, activations and the LM are float.
//
// Without a CUDA device the program says so and exits 0.
//
//   ./build/benchmarks/bench_cuda --benchmark_min_time=0.2 --benchmark_format=json >bench_cuda.json
//   /usr/bin/python3 benchmarks/compare/cuda_report.py bench_cuda.json
#include <benchmark/benchmark.h>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/cuda.cuh"
#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/ops/gemm.hpp"

namespace graphmoe::bench {
namespace {

// The paper's medium shape (bench_moe.cpp).
constexpr index_t kBatch = 4, kSeq = 512, kTokens = kBatch * kSeq, kD = 352, kE = 16, kFF = 352,
                  kK = 2, kHeads = 8, kVocab = 1024;

// The MoE layer's shape: the medium one above, or the large one of the GPU targets.
struct MoeShape {
  index_t batch, seq, d, e, ff;
  bool large;
  index_t tokens() const { return batch * seq; }
};
constexpr MoeShape kMedium{kBatch, kSeq, kD, kE, kFF, false};
constexpr MoeShape kLarge{16, 2048, 1024, 64, 4096, true};
constexpr int kWarmup = 3;

// ---- bf16 GEMM detection ----------------------------------------------------------------------
// graphmoe::gemm on Tensor<T, graphmoe::cuda> with scalars of type S, as a requires-expression.
// A requires-expression sees only the declaration, and the backend's gemm may be a template that
// names its types in a static_assert in its body rather than in a constraint: then "callable"
// holds for any T, and instantiating it for an unsupported T is a hard error. So the answer for
// bf16 is trusted when the declaration turns away a type it surely does not support (GemmProbe),
// and otherwise only when the cuBLAS call under it (detail::cublas_gemm) takes bf16 pointers.
struct GemmProbe {
  float value;
};

template <class T, class S>
concept CudaGemmWith = requires(const Tensor<T, graphmoe::cuda>& a, Tensor<T, graphmoe::cuda>& c,
                                S s) { graphmoe::gemm(Trans::N, Trans::N, s, a, a, s, c); };

template <class T>
concept CublasGemmFor = requires(const T* a, T* c, float s) {
  graphmoe::detail::cublas_gemm(cublasHandle_t{}, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, s, a, 1, a,
                                1, s, c, 1);
};

constexpr bool kCudaGemmConstrained =
    !CudaGemmWith<GemmProbe, GemmProbe> && !CudaGemmWith<GemmProbe, float>;

template <class T>
constexpr bool kCudaGemmFor =
    std::is_same_v<T, float> || ((CudaGemmWith<T, T> || CudaGemmWith<T, float>) &&
                                 (kCudaGemmConstrained || CublasGemmFor<T>));

constexpr bool kHaveBf16Gemm = kCudaGemmFor<__nv_bfloat16>;

// The scalar type the backend's gemm takes for T: T itself, else float (a bf16 GEMM computing in
// fp32 may take fp32 alpha and beta).
template <class T>
using gemm_scalar_t = std::conditional_t<CudaGemmWith<T, T>, T, float>;

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float" : "bf16";
}

// ---- timing -----------------------------------------------------------------------------------
// Two CUDA events on the backend's stream: start() before the work, seconds() after it (waits for
// the stop event, i.e. for everything queued before it).
class EventTimer {
 public:
  EventTimer() {
    GRAPHMOE_CUDA_CHECK(cudaEventCreate(&start_));
    GRAPHMOE_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    if (start_ != nullptr) (void)cudaEventDestroy(start_);
    if (stop_ != nullptr) (void)cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void start() { GRAPHMOE_CUDA_CHECK(cudaEventRecord(start_, cuda_stream())); }
  double seconds() {
    GRAPHMOE_CUDA_CHECK(cudaEventRecord(stop_, cuda_stream()));
    GRAPHMOE_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    GRAPHMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return static_cast<double>(ms) * 1e-3;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Runs body(state) and turns an exception into SkipWithError, so that one failing benchmark (a
// graphmoe::Error, a CUDA error) leaves the others to run and shows in the JSON output.
template <class Body>
void guarded(benchmark::State& state, Body&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// ---- data -------------------------------------------------------------------------------------
// A device tensor of entries uniform in [-a, a) with a = sqrt(3) stddev (variance stddev^2),
// drawn on the host from rng's raw 32-bit stream (cheap enough for 4096 x 4096 inputs on every
// run of a benchmark) and converted to T there.
template <class T>
Tensor<T, graphmoe::cuda> random_device(const Shape& shape, Rng& rng, double stddev) {
  Tensor<T, graphmoe::cuda> d(shape);
  std::vector<T> h(static_cast<std::size_t>(d.numel()));
  const double a = std::sqrt(3.0) * stddev;
  for (T& x : h) {
    const double u = static_cast<double>(rng.next_u32()) * (1.0 / 4294967296.0);  // [0, 1)
    x = T(static_cast<float>(a * (2.0 * u - 1.0)));
  }
  GRAPHMOE_CUDA_CHECK(
      cudaMemcpyAsync(d.data(), h.data(), d.bytes(), cudaMemcpyHostToDevice, cuda_stream()));
  cuda_stream_synchronize();
  return d;
}

// Uniform in [lo, hi), for router probabilities.
Tensor<float, graphmoe::cuda> uniform_device(const Shape& shape, Rng& rng, double lo, double hi) {
  Tensor<float, cpu> h(shape);
  for (index_t i = 0; i < h.numel(); ++i)
    h.data()[i] = static_cast<float>(rng.uniform(lo, hi));
  return to_device(h);
}

// ---- GEMM -------------------------------------------------------------------------------------
struct GemmCase {
  const char* name;
  index_t m, k, n;
  Trans ta, tb;
};

constexpr GemmCase kGemmCases[] = {
    {"expert_fwd_NT", kTokens * kK / kE, kD, kFF, Trans::N, Trans::T},
    {"expert_dX_NN", kTokens * kK / kE, kFF, kD, Trans::N, Trans::N},
    {"expert_dW_TN", kFF, kTokens * kK / kE, kD, Trans::T, Trans::N},
    {"all_slots_NT", kTokens * kK, kD, kFF, Trans::N, Trans::T},
    {"square_NN", 4096, 4096, 4096, Trans::N, Trans::N},
};

template <class T>
void BM_gemm(benchmark::State& state, GemmCase g) {
  guarded(state, [&] {
    using S = gemm_scalar_t<T>;
    Rng rng(1);
    // A is op(A) = (m, k), B is op(B) = (k, n) before the transpositions.
    const Shape sa = g.ta == Trans::N ? Shape{g.m, g.k} : Shape{g.k, g.m};
    const Shape sb = g.tb == Trans::N ? Shape{g.k, g.n} : Shape{g.n, g.k};
    const Tensor<T, graphmoe::cuda> a = random_device<T>(sa, rng, 1.0);
    const Tensor<T, graphmoe::cuda> b = random_device<T>(sb, rng, 1.0);
    Tensor<T, graphmoe::cuda> c(Shape{g.m, g.n});
    const double flop = 2.0 * static_cast<double>(g.m) * static_cast<double>(g.k) *
                        static_cast<double>(g.n);
    // About 2 GFLOP per timed batch, so that a few-microsecond GEMM is not timed alone.
    const int reps = static_cast<int>(std::max(1.0, std::ceil(2e9 / flop)));
    auto run = [&] {
      for (int r = 0; r < reps; ++r) graphmoe::gemm(g.ta, g.tb, S(1.0f), a, b, S(0.0f), c);
    };
    for (int i = 0; i < kWarmup; ++i) run();
    cuda_stream_synchronize();
    EventTimer timer;
    for (auto _ : state) {
      timer.start();
      run();
      state.SetIterationTime(timer.seconds() / reps);
    }
    state.counters["flop"] = flop;
    state.counters["FLOP/s"] = benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["reps"] = reps;
  });
}

// ---- MoE layer --------------------------------------------------------------------------------
MoEConfig moe_config(const MoeShape& shape = kMedium,
                     GraphPrecision precision = GraphPrecision::Exact) {
  MoEConfig cfg;
  cfg.d_model = shape.d;
  cfg.d_ff = shape.ff;
  cfg.router.num_experts = shape.e;
  cfg.router.k = kK;
  cfg.router.allow_unused_options = true;  // one config for every router benchmarked
  cfg.router.options<graphmoe::ScheduledTopK>().k_min = kK;
  cfg.router.options<graphmoe::ScheduledTopK>().k_max = kK;
  cfg.router.causal = true;
  cfg.router.options<Similarity>().precision = precision;
  // the Attention graph has Exact and TF32 (a -bf16 row keeps its attention graph Exact)
  cfg.router.options<Attention>().precision =
      precision == GraphPrecision::TF32 ? precision : GraphPrecision::Exact;
  return cfg;
}

// The products a causal Similarity graph performs, useful ones only (the masked half of each
// (T, T) product left out): per sequence T (T + 1) / 2 entries of L = U U^T (depth D) and of
// p = S R (depth E) forward; backward recomputes L and adds dL U, dL^T U (depth D) and
// dp R^T, S^T dp (depth E). 2 FLOP per multiply-add.
double similarity_graph_flop(const MoeShape& shape, bool backward) {
  const double pairs = static_cast<double>(shape.batch) * static_cast<double>(shape.seq) *
                       static_cast<double>(shape.seq + 1) / 2.0;
  const double d = static_cast<double>(shape.d), e = static_cast<double>(shape.e);
  return 2.0 * pairs * ((d + e) + (backward ? 3.0 * d + 2.0 * e : 0.0));
}

// The products a causal Attention graph performs, useful ones only: per sequence T (T + 1) / 2
// entries of G = Q~ V^T (depth D) and of p = A^p R (depth E) forward, with the masked queries
// (N, D, d_model); backward dr, dp R^T (depth E), dQ~ = dL V, dV = dL^T Q~ (depth D), dout and
// dW_o (N, D, d_model each). The heads' Gram terms (O(N dh^2)) and the column sums are left out.
double attention_graph_flop(const MoeShape& shape, bool backward) {
  const double pairs = static_cast<double>(shape.batch) * static_cast<double>(shape.seq) *
                       static_cast<double>(shape.seq + 1) / 2.0;
  const double d = static_cast<double>(shape.d), e = static_cast<double>(shape.e);
  const double proj = static_cast<double>(shape.tokens()) * d * d;  // (N, D, d_model)
  return 2.0 * (pairs * (d + e) + proj) +
         (backward ? 2.0 * (pairs * (2.0 * d + 2.0 * e) + 2.0 * proj) : 0.0);
}

// The large shape's parameters without a full host draw: the router's weight in full, expert 0's
// w1 and w2 copied to every expert, biases zero (see the header). Any other parameter is an error,
// so that a new one cannot be left uninitialised.
template <class T>
void init_large(ParameterArena<T, graphmoe::cuda>& arena, Rng& rng, double stddev) {
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (index_t id = 0; id < arena.size(); ++id) {
    const std::string& name = arena.params()[static_cast<std::size_t>(id)].name;
    Tensor<T, graphmoe::cuda> v = arena.value(id);
    if (ends_with(name, "experts.w1") || ends_with(name, "experts.w2")) {
      const index_t per_expert = v.numel() / v.shape()[0];
      const Tensor<T, graphmoe::cuda> block = random_device<T>(Shape{per_expert}, rng, stddev);
      for (index_t e = 0; e < v.shape()[0]; ++e)
        GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(v.data() + e * per_expert, block.data(), block.bytes(),
                                            cudaMemcpyDeviceToDevice, cuda_stream()));
      cuda_stream_synchronize();
    } else if (ends_with(name, "router.weight")) {
      const Tensor<T, graphmoe::cuda> w = random_device<T>(v.shape(), rng, stddev);
      GRAPHMOE_CUDA_CHECK(cudaMemcpyAsync(v.data(), w.data(), w.bytes(), cudaMemcpyDeviceToDevice,
                                          cuda_stream()));
      cuda_stream_synchronize();
    } else if (ends_with(name, ".b1") || ends_with(name, ".b2") || ends_with(name, ".bias")) {
      v.zero();
    } else {
      throw Error("bench_cuda: init_large does not know how to initialise parameter " + name);
    }
  }
}

// Compute: the expert GEMMs' operand type (float, or __nv_bfloat16 with fp32 parameters and router).
template <class Policy, class Compute = float>
void BM_moe(benchmark::State& state, bool backward, MoeShape shape, GraphPrecision precision) {
  guarded(state, [&] {
    using T = float;
    const index_t n = shape.tokens(), d = shape.d;
    cuda_empty_cache();
    ParameterArena<T, graphmoe::cuda> arena;
    MoELayer<Policy, T, graphmoe::cuda, Compute> layer;
    const MoEConfig cfg = moe_config(shape, precision);
    layer.declare(arena, "moe.", cfg);
    arena.allocate();
    layer.bind(arena);
    Rng rng(1);
    if (shape.large)
      init_large(arena, rng, cfg.init_std);
    else
      layer.init(rng);
    // bf16: the weights' bf16 copy that training keeps current (taken after init: refreshed once)
    std::unique_ptr<ComputeMirror<T, Compute, graphmoe::cuda>> mirror;
    if constexpr (!std::is_same_v<Compute, T>) {
      mirror = std::make_unique<ComputeMirror<T, Compute, graphmoe::cuda>>(arena);
      layer.attach_mirror(mirror.get());
    }
    const Tensor<T, graphmoe::cuda> u = random_device<T>(Shape{n, d}, rng, 1.0);  // (N, D)
    const Tensor<T, graphmoe::cuda> dy = random_device<T>(Shape{n, d}, rng, 1.0);

    // The attention router's cache: a causal 8-head attention layer run once on the same tokens,
    // with the gradient sinks the graph's backward accumulates into.
    ParameterArena<T, graphmoe::cuda> attn_arena;
    MultiHeadAttention<T, graphmoe::cuda> attn;
    AttentionCache<T, graphmoe::cuda>* cache = nullptr;
    if constexpr (Policy::needs_attention) {
      attn.declare(attn_arena, "attn.", d, kHeads, /*causal=*/true);
      attn_arena.allocate();
      attn.bind(attn_arena);
      attn.init(rng, 1.0 / std::sqrt(static_cast<double>(d)));
      Tensor<T, graphmoe::cuda> a;
      attn.forward(u.view(Shape{shape.batch, shape.seq, d}), a);  // (B, T, D)
      attn.enable_graph_gradients();
      cache = &attn.cache();
    }
    const GraphContext<T, graphmoe::cuda> ctx{shape.seq, cache};

    Tensor<T, graphmoe::cuda> y, du;
    auto step = [&] {
      layer.forward(u, ctx, y);
      if (backward) {
        arena.zero_grad();
        layer.backward(dy, du);
      }
    };
    cuda_stream_synchronize();
    cuda_reset_peak_memory();
    const std::size_t in_use_before = cuda_memory_stats().bytes_in_use;
    for (int i = 0; i < kWarmup; ++i) step();
    cuda_stream_synchronize();
    // Routed slots of the last forward (dropless by default, so N k).
    const double slots = static_cast<double>(n * kK - dropped_count(layer.routing().selection));
    EventTimer timer;
    for (auto _ : state) {
      timer.start();
      step();
      state.SetIterationTime(timer.seconds());
    }
    const double flop = 4.0 * slots * static_cast<double>(d) * static_cast<double>(shape.ff) *
                        (backward ? 3.0 : 1.0);
    state.counters["expert_flop"] = flop;
    state.counters["expert_FLOP/s"] =
        benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(n),
                                                    benchmark::Counter::kIsIterationInvariantRate);
    state.counters["peak_work_bytes"] =
        static_cast<double>(cuda_memory_stats().peak_bytes_in_use - in_use_before);
    state.counters["param_bytes"] = static_cast<double>(arena.values().bytes());
  });
}

// ---- token graph alone ------------------------------------------------------------------------
// Graph = Similarity or Attention (the latter on the cache of an 8-head causal attention layer run
// once on the same tokens, as in BM_moe).
template <class Graph>
void BM_graph(benchmark::State& state, bool backward, MoeShape shape, GraphPrecision precision) {
  guarded(state, [&] {
    using T = float;
    const index_t n = shape.tokens(), d = shape.d, e = shape.e;
    GraphImpl<Graph, T, graphmoe::cuda> graph;
    graph.configure(d, moe_config(shape, precision).router);
    Rng rng(2);
    const Tensor<T, graphmoe::cuda> u = random_device<T>(Shape{n, d}, rng, 1.0);  // (N, D)
    const Tensor<T, graphmoe::cuda> r = uniform_device(Shape{n, e}, rng, 0.0, 1.0);  // (N, E)
    const Tensor<T, graphmoe::cuda> dp = random_device<T>(Shape{n, e}, rng, 1.0);
    ParameterArena<T, graphmoe::cuda> attn_arena;
    MultiHeadAttention<T, graphmoe::cuda> attn;
    AttentionCache<T, graphmoe::cuda>* cache = nullptr;
    if constexpr (graph_needs_attention_cache<Graph>()) {
      attn.declare(attn_arena, "attn.", d, kHeads, /*causal=*/true);
      attn_arena.allocate();
      attn.bind(attn_arena);
      attn.init(rng, 1.0 / std::sqrt(static_cast<double>(d)));
      Tensor<T, graphmoe::cuda> a;
      attn.forward(u.view(Shape{shape.batch, shape.seq, d}), a);  // (B, T, D)
      attn.enable_graph_gradients();
      cache = &attn.cache();
    }
    const GraphContext<T, graphmoe::cuda> ctx{shape.seq, cache};
    Tensor<T, graphmoe::cuda> p, dr, du(Shape{n, d});  // du accumulates
    auto step = [&] {
      graph.forward(u, r, ctx, p);
      if (backward) graph.backward(u, r, p, dp, ctx, dr, du);
    };
    for (int i = 0; i < kWarmup; ++i) step();
    cuda_stream_synchronize();
    EventTimer timer;
    for (auto _ : state) {
      timer.start();
      step();
      state.SetIterationTime(timer.seconds());
    }
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(n),
                                                    benchmark::Counter::kIsIterationInvariantRate);
    const double flop = std::is_same_v<Graph, Similarity> ? similarity_graph_flop(shape, backward)
                                                           : attention_graph_flop(shape, backward);
    state.counters["graph_flop"] = flop;
    state.counters["graph_FLOP/s"] =
        benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
  });
}

// ---- LM training step -------------------------------------------------------------------------
template <class Policy, class C = float>
void BM_lm_train_capacity(benchmark::State& state, double capacity_factor, ExpertLayout layout,
                          bool graphed = false) {
  guarded(state, [&] {
    using T = float;
    TransformerLMConfig cfg = TransformerLMConfig::paper_medium(kVocab);
    cfg.router.capacity_factor = capacity_factor;
    cfg.expert_layout = layout;
    TransformerLM<Policy, T, graphmoe::cuda, C> lm(cfg, /*seed=*/1);
    AdamWConfig acfg;
    acfg.lr = 1e-3;
    acfg.weight_decay = 0.01;
    AdamW<T, graphmoe::cuda> opt(lm.arena(), acfg);

    // Inputs and next-token targets from one random stream (bench_lm.cpp).
    Rng rng(1234);
    Tensor<std::int32_t, cpu> ids(Shape{kBatch, kSeq}), targets(Shape{kBatch, kSeq});
    for (index_t b = 0; b < kBatch; ++b) {
      std::int32_t prev = static_cast<std::int32_t>(rng.next_u32() % kVocab);
      for (index_t t = 0; t < kSeq; ++t) {
        const std::int32_t next = static_cast<std::int32_t>(rng.next_u32() % kVocab);
        ids.data()[b * kSeq + t] = prev;
        targets.data()[b * kSeq + t] = next;
        prev = next;
      }
    }
    const Tensor<std::int32_t, graphmoe::cuda> ids_dev = to_device(ids);
    const Tensor<std::int32_t, graphmoe::cuda> targets_dev = to_device(targets);

    std::int64_t step = 0;
    double loss = 0;
    CudaGraph graph;  // graphed: the forward, zero_grad and backward, captured after the warm-up
    auto train_step = [&] {
      lm.set_step(step++);
      if (graph.captured()) {
        graph.replay();
        loss = lm.last_loss().total();
      } else {
        loss = lm.forward(ids_dev, targets_dev).total();
        lm.arena().zero_grad();
        lm.backward();
      }
      double norm = clip_grad_norm(lm.arena(), 1.0);
      opt.step(lm.arena(), opt.config().lr, lm.compute_mirror());  // bf16: the fused step
      benchmark::DoNotOptimize(norm);
    };
    for (int i = 0; i < kWarmup; ++i) train_step();
    if (graphed) {
      graph.capture([&] {
        (void)lm.forward(ids_dev, targets_dev);
        lm.arena().zero_grad();
        lm.backward();
      });
      train_step();  // the first replay (instantiation's first launch) untimed
    }
    cuda_stream_synchronize();
    EventTimer timer;
    for (auto _ : state) {
      timer.start();
      train_step();
      state.SetIterationTime(timer.seconds());
    }
    state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(kTokens),
                                                    benchmark::Counter::kIsIterationInvariantRate);
    state.counters["loss"] = static_cast<double>(loss);
  });
}

template <class Policy, class C = float>
void BM_lm_train(benchmark::State& state) {
  BM_lm_train_capacity<Policy, C>(state, 0.0, ExpertLayout::Compact);
}

// ---- decoding ---------------------------------------------------------------------------------
constexpr index_t kDecodeVocab = 10000, kDecodeMaxSeq = 1088, kDecodeRewind = 16;

TransformerLMConfig decode_config() {
  TransformerLMConfig c = TransformerLMConfig::paper_medium(kDecodeVocab);
  c.max_seq_len = kDecodeMaxSeq;
  return c;
}

template <class Policy>
void BM_decode(benchmark::State& state, index_t batch, index_t prompt, bool full_forward) {
  guarded(state, [&] {
    using T = float;
    TransformerLM<Policy, T, graphmoe::cuda> lm(decode_config(), /*seed=*/1);
    lm.set_mode(Mode::Eval);
    Rng rng(7);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * (prompt + kDecodeRewind)));
    for (auto& id : ids) id = static_cast<std::int32_t>(rng.next_u32() % kDecodeVocab);
    const double tokens = static_cast<double>(batch);
    if (full_forward) {
      Tensor<std::int32_t, cpu> host(Shape{batch, prompt});
      std::copy_n(ids.begin(), batch * prompt, host.data());
      const Tensor<std::int32_t, graphmoe::cuda> dev = to_device(host);
      const Tensor<std::int32_t, graphmoe::cuda> none;
      lm.forward(dev, none);
      cuda_stream_synchronize();
      EventTimer timer;
      for (auto _ : state) {
        timer.start();
        lm.forward(dev, none);
        benchmark::DoNotOptimize(to_host(lm.logits()).data());  // as the reference decoder reads it
        state.SetIterationTime(timer.seconds());
      }
    } else {
      Decoder<Policy, T, graphmoe::cuda> dec(lm, batch);
      std::vector<index_t> slots(static_cast<std::size_t>(batch));
      for (index_t s = 0; s < batch; ++s) slots[static_cast<std::size_t>(s)] = s;
      std::vector<std::int32_t> step(static_cast<std::size_t>(batch));
      auto feed = [&](index_t p) {
        for (index_t s = 0; s < batch; ++s)
          step[static_cast<std::size_t>(s)] = ids[static_cast<std::size_t>(s * (prompt + kDecodeRewind) + p)];
        return dec.step(slots, step).data();
      };
      for (index_t p = 0; p < prompt; ++p) (void)feed(p);
      cuda_stream_synchronize();
      index_t k = 0;
      EventTimer timer;
      for (auto _ : state) {
        if (k == kDecodeRewind) {
          for (index_t s = 0; s < batch; ++s) dec.rewind(s, prompt);
          k = 0;
        }
        timer.start();
        benchmark::DoNotOptimize(feed(prompt + k));
        state.SetIterationTime(timer.seconds());
        ++k;
      }
    }
    state.counters["tokens/s"] =
        benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
  });
}

template <class Policy>
void register_decode(const std::string& router) {
  for (index_t batch : {1, 8})
    for (index_t prompt : {64, 1024})
      for (bool full : {false, true}) {
        const std::string name = std::string(full ? "decode_full" : "decode") + "/float/" + router +
                                 "/b" + std::to_string(batch) + "/p" + std::to_string(prompt);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_decode<Policy>, batch, prompt, full)
                      ->UseManualTime()
                      ->Unit(benchmark::kMillisecond);
        if (full) b->Iterations(batch * prompt > 1024 ? 4 : 16);
        else b->Iterations(96);
      }
}

// ---- registration -----------------------------------------------------------------------------
template <class T>
void register_gemm() {
  if constexpr (kCudaGemmFor<T>) {
    for (const GemmCase& g : kGemmCases) {
      const std::string name = std::string("gemm/") + type_name<T>() + "/" + g.name + "/" +
                               std::to_string(g.m) + "x" + std::to_string(g.k) + "x" +
                               std::to_string(g.n);
      benchmark::RegisterBenchmark(name.c_str(), BM_gemm<T>, g)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

// The router's name in the benchmark's: the Similarity graph's precision after a dash when it is
// not Exact (similarity-tf32, similarity-bf16).
std::string router_label(const std::string& router, GraphPrecision precision) {
  return precision == GraphPrecision::Exact ? router
                                            : router + "-" + graph_precision_name(precision);
}

template <class Policy, class Compute = float>
void register_moe(const std::string& router, GraphPrecision precision = GraphPrecision::Exact) {
  const std::string type = std::is_same_v<Compute, float> ? "float" : "bf16";
  for (bool backward : {false, true}) {
    const std::string name = "moe/" + type + "/" + router_label(router, precision) +
                             (backward ? "/fwdbwd" : "/fwd");
    benchmark::RegisterBenchmark(name.c_str(), BM_moe<Policy, Compute>, backward, kMedium,
                                 precision)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

template <class Policy, class Compute = float>
void register_moe_large(const std::string& router,
                        GraphPrecision precision = GraphPrecision::Exact) {
  const std::string type = std::is_same_v<Compute, float> ? "float" : "bf16";
  const std::string name = "moe_large/" + type + "/" + router_label(router, precision) + "/fwdbwd";
  benchmark::RegisterBenchmark(name.c_str(), BM_moe<Policy, Compute>, true, kLarge, precision)
      ->UseManualTime()
      ->Iterations(3)
      ->Repetitions(1)
      ->Unit(benchmark::kMillisecond);
}

void register_all() {
  using P = GraphPrecision;
  register_gemm<float>();
  register_gemm<__nv_bfloat16>();
  register_moe<SoftmaxRouter>("softmax");
  register_moe<SimilarityRouter>("similarity");
  register_moe<SimilarityRouter>("similarity", P::TF32);
  register_moe<AttentionRouter>("attention");
  register_moe<SoftmaxRouter, __nv_bfloat16>("softmax");
  register_moe<SimilarityRouter, __nv_bfloat16>("similarity");
  register_moe<SimilarityRouter, __nv_bfloat16>("similarity", P::BF16);
  register_moe<AttentionRouter, __nv_bfloat16>("attention");
  register_moe_large<SoftmaxRouter>("softmax");
  register_moe_large<SimilarityRouter>("similarity");
  register_moe_large<SimilarityRouter>("similarity", P::TF32);
  register_moe_large<AttentionRouter>("attention");
  register_moe_large<AttentionRouter>("attention", P::TF32);
  register_moe_large<SoftmaxRouter, __nv_bfloat16>("softmax");
  register_moe_large<SimilarityRouter, __nv_bfloat16>("similarity");
  register_moe_large<SimilarityRouter, __nv_bfloat16>("similarity", P::BF16);
  register_moe_large<AttentionRouter, __nv_bfloat16>("attention");
  register_moe_large<AttentionRouter, __nv_bfloat16>("attention", P::TF32);
  register_moe_large<AttentionRouter, __nv_bfloat16>("attention", P::BF16);
  for (bool backward : {false, true}) {
    const std::string pass = backward ? "fwdbwd" : "fwd";
    for (const P prec : {P::Exact, P::TF32, P::BF16}) {
      const std::string sim = router_label("similarity", prec);
      benchmark::RegisterBenchmark(("graph/float/" + sim + "/" + pass).c_str(),
                                   BM_graph<Similarity>, backward, kMedium, prec)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("graph_large/float/" + sim + "/" + pass).c_str(),
                                   BM_graph<Similarity>, backward, kLarge, prec)
          ->UseManualTime()
          ->Iterations(3)
          ->Repetitions(1)
          ->Unit(benchmark::kMillisecond);
    }
    for (const P prec : {P::Exact, P::TF32, P::BF16})
      benchmark::RegisterBenchmark(
          ("graph_large/float/" + router_label("attention", prec) + "/" + pass).c_str(),
          BM_graph<Attention>, backward, kLarge, prec)
          ->UseManualTime()
          ->Iterations(3)
          ->Repetitions(1)
          ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("lm_train/float/softmax", BM_lm_train<SoftmaxRouter>)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("lm_train/float/similarity", BM_lm_train<SimilarityRouter>)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("lm_train/bf16/softmax", BM_lm_train<SoftmaxRouter, __nv_bfloat16>)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("lm_train/bf16/similarity",
                               BM_lm_train<SimilarityRouter, __nv_bfloat16>)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  for (const ExpertLayout layout : {ExpertLayout::Compact, ExpertLayout::Padded}) {
    const std::string suffix = std::string("/softmax-cap1.25/") + expert_layout_name(layout);
    benchmark::RegisterBenchmark(("lm_train/float" + suffix).c_str(), BM_lm_train_capacity<SoftmaxRouter>,
                                 1.25, layout, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("lm_train/bf16" + suffix).c_str(),
                                 BM_lm_train_capacity<SoftmaxRouter, __nv_bfloat16>, 1.25,
                                 layout, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const char* router : {"softmax", "similarity"}) {
    const std::string r = router;
    const std::string suffix = "/" + r + "-cap1.25/padded-graph";
    auto fp32 = r == "softmax" ? BM_lm_train_capacity<SoftmaxRouter>
                               : BM_lm_train_capacity<SimilarityRouter>;
    auto bf16 = r == "softmax" ? BM_lm_train_capacity<SoftmaxRouter, __nv_bfloat16>
                               : BM_lm_train_capacity<SimilarityRouter, __nv_bfloat16>;
    benchmark::RegisterBenchmark(("lm_train/float" + suffix).c_str(), fp32, 1.25,
                                 ExpertLayout::Padded, true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("lm_train/bf16" + suffix).c_str(), bf16, 1.25,
                                 ExpertLayout::Padded, true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  register_decode<SoftmaxRouter>("softmax");
  register_decode<SimilarityRouter>("similarity");
  register_decode<AttentionRouter>("attention");
}

}  // namespace
}  // namespace graphmoe::bench

int main(int argc, char** argv) {
  if (graphmoe::cuda_device_count() == 0) {
    std::printf(
        "bench_cuda: no CUDA device (cudaGetDeviceCount found none): nothing to measure. Run it "
        "on a machine with a GPU, e.g. through bash scripts/gpu-check.sh.\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    benchmark::AddCustomContext("cuda_device", graphmoe::cuda_device_name());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
  benchmark::AddCustomContext("bf16_gemm", graphmoe::bench::kHaveBf16Gemm ? "yes" : "no");
  benchmark::AddCustomContext("bf16_moe_layer",
                              "yes (bf16 expert GEMMs, fp32 parameters, router and activations)");
  graphmoe::bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
