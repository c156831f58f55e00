// Cross-backend tests of the token graphs on the GPU (routing/token_graphs.hpp on the op layer of
// ops/token_graph.hpp, kernels in backend/cuda/similarity_graph.cuh and attention_graph.cuh):
// GraphImpl<Independent | Similarity | Attention, T, cuda> against
// the CPU GraphImpl, the reference, on random inputs (as test_cuda_ops.cu does for the ops).
//
//   error metric   err = max_i |cuda_i - cpu_i| / max_i |cpu_i|     (normwise, L-infinity, from
//                  tests/cuda/cuda_test_support.cuh); row entropies divide by max(1, max |cpu|)
//   tolerance      double 1e-11; float 5e-5: the logits u_i . u_j / tau are sums of D products
//                  of size up to |u|^2 / tau, whose fp32 rounding (different summation orders,
//                  fused multiply-adds on the GPU) moves S by a few 1e-6 relative
//                  exact equality for Independent (copies), the heads h* and two GPU runs of
//                  the same backward (no atomics: the kernels are deterministic)
//   error messages the CUDA graph throws the CPU graph's message, compared as strings
//
// Without a CUDA device every case prints "skipped: no CUDA device" and passes: the file is
// compiled by nvcc in CI and runs in full on a GPU machine.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/graph_blend.cuh"
#include "graphmoe/backend/cuda/token_graph.cuh"
#include "graphmoe/ops/token_graph.hpp"
#include "graphmoe/routing/graphs/blended.hpp"
#include "graphmoe/routing/token_graphs.hpp"
#include "cuda/cuda_test_support.cuh"
#include "routing/router_fixtures.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

// Everything lives in namespace graphmoe: with `using namespace graphmoe;` at global scope the
// backend tag `cuda` would be ambiguous with CCCL's `namespace cuda` (libcu++).
namespace graphmoe {

// The cache's definition is backend-generic: the device cache is a plain instantiation.
template struct AttentionCache<float, cuda>;
template struct AttentionCache<double, cuda>;

using graphmoe::test::random_attention_cache;
using graphmoe::test::random_normal;
using graphmoe::test::random_probs;

namespace {

using test::check_equal;
using test::error_of;
using test::normwise_error;
using test::type_name;

// A looser tolerance for the comparisons of one scope (a reduced-precision graph).
double g_tolerance_override = 0;
struct ToleranceScope {
  explicit ToleranceScope(double tol) { g_tolerance_override = tol; }
  ~ToleranceScope() { g_tolerance_override = 0; }
};

// See the file comment: fp32 logits of size |u|^2 / tau move S by a few 1e-6.
template <class T>
double graph_tolerance() {
  if (g_tolerance_override > 0) return g_tolerance_override;
  return std::is_same_v<T, float> ? 5e-5 : 1e-11;
}

template <class T>
void check_close(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, cuda>& got) {
  test::check_close(what, ref, got, graph_tolerance<T>());
}

// Row entropies: max |cuda - cpu| / max(1, max |cpu|). Nearly one-hot rows have entropies close
// to 0 whose rounding error is absolute (nats), not relative.
template <class T>
void check_entropy(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, cuda>& got) {
  const Tensor<T, cpu> h = to_host(got);
  REQUIRE_MESSAGE(h.shape() == ref.shape(), what, ": shape ", h.shape().str(), " vs ",
                  ref.shape().str());
  double diff = 0, scale = 1;
  for (index_t i = 0; i < ref.numel(); ++i) {
    const double r = static_cast<double>(ref.data()[i]), g = static_cast<double>(h.data()[i]);
    diff = std::isnan(g) ? std::numeric_limits<double>::infinity()
                         : std::max(diff, std::abs(g - r));
    scale = std::max(scale, std::abs(r));
  }
  const double err = diff / scale, tol = graph_tolerance<T>();
  if (test::verbose())
    std::printf("  %-36s %-6s error %.3e (tolerance %.0e)\n", what.c_str(), type_name<T>(), err,
                tol);
  CHECK_MESSAGE(err <= tol, what, " (", type_name<T>(), "): error ", err, " > tolerance ", tol);
}

void check_scalar(const std::string& what, double ref, double got, double tol) {
  const double err = std::abs(got - ref) / std::max(1.0, std::abs(ref));
  if (test::verbose()) std::printf("  %-36s error %.3e (tolerance %.0e)\n", what.c_str(), err, tol);
  CHECK_MESSAGE(err <= tol, what, ": ", got, " vs ", ref);
}

template <class T>
Tensor<T, cuda> nan_device(const Shape& s) {
  Tensor<T, cpu> h(s);
  h.fill(std::numeric_limits<T>::quiet_NaN());
  return to_device(h);
}

template <class T>
AttentionCache<T, cuda> to_device(const AttentionCache<T, cpu>& c) {
  AttentionCache<T, cuda> d;
  d.num_heads = c.num_heads;
  d.causal = c.causal;
  d.probs = to_device(c.probs);
  d.v = to_device(c.v);
  d.w_o = to_device(c.w_o);
  d.b_o = to_device(c.b_o);
  d.out = to_device(c.out);
  d.row_entropy = to_device(c.row_entropy);
  d.dprobs = to_device(c.dprobs);
  d.dv = to_device(c.dv);
  d.dw_o = to_device(c.dw_o);
  d.db_o = to_device(c.db_o);
  d.dout = to_device(c.dout);
  return d;
}

// ---- Similarity ---------------------------------------------------------------------------------

struct SimilarityCase {
  index_t nseq, len, d, e;
};

template <class T>
void compare_similarity(const SimilarityCase& sc, const RouterConfig& cfg, Rng& rng) {
  CAPTURE(sc.nseq);
  CAPTURE(sc.len);
  CAPTURE(sc.d);
  CAPTURE(sc.e);
  CAPTURE(cfg.causal);
  CAPTURE(static_cast<int>(cfg.options<Similarity>().tau_mode));
  CAPTURE(cfg.options<Similarity>().detach);
  const index_t n = sc.nseq * sc.len;
  auto u = random_normal<T>({n, sc.d}, rng, 0.7);
  auto r = random_probs<T>(n, sc.e, rng);
  auto dp = random_normal<T>({n, sc.e}, rng);
  auto du0 = random_normal<T>({n, sc.d}, rng);
  const auto ud = to_device(u), rd = to_device(r), dpd = to_device(dp);

  GraphImpl<Similarity, T, cpu> ref;
  GraphImpl<Similarity, T, cuda> gpu;
  ref.configure(sc.d, cfg);
  gpu.configure(sc.d, cfg);
  CHECK(gpu.tau() == ref.tau());
  Tensor<T, cpu> p;
  auto pd = nan_device<T>({n, sc.e});  // an arena view holding anything: overwritten
  ref.forward(u, r, {sc.len, nullptr}, p);
  gpu.forward(ud, rd, {sc.len, nullptr}, pd);
  check_close("similarity p", p, pd);
  check_entropy("similarity row entropy", ref.row_entropy(), gpu.row_entropy());
  check_scalar("similarity mean entropy", ref.mean_entropy(), gpu.mean_entropy(),
               graph_tolerance<T>());

  Tensor<T, cpu> dr, du = du0.clone();
  auto drd = nan_device<T>({n, sc.e});  // assigned
  auto dud = to_device(du0);            // accumulated
  ref.backward(u, r, p, dp, {sc.len, nullptr}, dr, du);
  gpu.backward(ud, rd, pd, dpd, {sc.len, nullptr}, drd, dud);
  check_close("similarity dr", dr, drd);
  check_close("similarity du (accumulated)", du, dud);

  // deterministic: a second backward gives the same bits
  auto drd2 = nan_device<T>({n, sc.e});
  auto dud2 = to_device(du0);
  gpu.backward(ud, rd, pd, dpd, {sc.len, nullptr}, drd2, dud2);
  check_equal("similarity dr, second run", to_host(drd), drd2);
  check_equal("similarity du, second run", to_host(dud), dud2);
}

// ---- Attention ----------------------------------------------------------------------------------

struct AttentionCase {
  index_t nb, len, heads, d, e;
};

// Returns whether some sequence's rows took different heads (HeadChoice::PerSequenceCausal), the
// case where the CUDA graph's masked queries mix heads within one product.
template <class T>
bool compare_attention(const AttentionCase& ac, const RouterConfig& cfg, bool causal,
                       bool with_bias, bool with_row_entropy, Rng& rng) {
  CAPTURE(ac.nb);
  CAPTURE(ac.len);
  CAPTURE(ac.heads);
  CAPTURE(causal);
  CAPTURE(static_cast<int>(cfg.options<Attention>().head_choice_for(cfg.causal)));
  CAPTURE(cfg.options<Attention>().detach);
  CAPTURE(with_bias);
  CAPTURE(with_row_entropy);
  const index_t n = ac.nb * ac.len;
  auto cache = random_attention_cache<T>(ac.nb, ac.len, ac.heads, ac.d, causal, rng, 2.0);
  for (index_t i = 0; i < cache.out.numel(); ++i) cache.out.data()[i] *= T(0.3);
  if (!with_bias) {
    cache.b_o = Tensor<T, cpu>();
    cache.db_o = Tensor<T, cpu>();
  }
  if (with_row_entropy) {
    cache.row_entropy = Tensor<T, cpu>({ac.nb, ac.heads, ac.len});
    for (index_t k = 0; k < cache.row_entropy.numel(); ++k) {
      double h = 0;
      for (index_t j = 0; j < ac.len; ++j) {
        const double a = static_cast<double>(cache.probs.data()[k * ac.len + j]);
        if (a > 0) h -= a * std::log(a);
      }
      cache.row_entropy.data()[k] = static_cast<T>(h);
    }
  }
  for (Tensor<T, cpu>* g : {&cache.dprobs, &cache.dv, &cache.dw_o, &cache.db_o, &cache.dout})
    if (!g->empty()) *g = random_normal<T>(g->shape(), rng, 0.1);
  auto cache_d = to_device(cache);
  auto u = random_normal<T>({n, ac.d}, rng);
  auto r = random_probs<T>(n, ac.e, rng);
  auto dp = random_normal<T>({n, ac.e}, rng);
  const auto ud = to_device(u), rd = to_device(r), dpd = to_device(dp);

  GraphImpl<Attention, T, cpu> ref;
  GraphImpl<Attention, T, cuda> gpu;
  RouterConfig ref_cfg = cfg;  // the CPU reference is Exact
  ref_cfg.options<Attention>().precision = GraphPrecision::Exact;
  ref.configure(ac.d, ref_cfg);
  gpu.configure(ac.d, cfg);
  Tensor<T, cpu> p;
  auto pd = nan_device<T>({n, ac.e});
  ref.forward(u, r, {ac.len, &cache}, p);
  gpu.forward(ud, rd, {ac.len, &cache_d}, pd);
  CHECK(gpu.heads() == ref.heads());
  check_close("attention p", p, pd);
  check_close("attention posterior", ref.posterior(), gpu.posterior());
  check_scalar("attention mean entropy", ref.mean_entropy(), gpu.mean_entropy(),
               graph_tolerance<T>());

  Tensor<T, cpu> dr, du_unused;
  Tensor<T, cuda> drd, dud_unused;
  ref.backward(u, r, p, dp, {ac.len, &cache}, dr, du_unused);
  gpu.backward(ud, rd, pd, dpd, {ac.len, &cache_d}, drd, dud_unused);
  check_close("attention dr", dr, drd);
  check_close("attention dprobs", cache.dprobs, cache_d.dprobs);
  check_close("attention dv", cache.dv, cache_d.dv);
  check_close("attention dw_o", cache.dw_o, cache_d.dw_o);
  check_close("attention dout", cache.dout, cache_d.dout);
  if (with_bias) check_close("attention db_o", cache.db_o, cache_d.db_o);
  const std::vector<int> heads = ref.heads();
  for (index_t b = 0; b < ac.nb; ++b)
    for (index_t i = 1; i < ac.len; ++i)
      if (heads[static_cast<std::size_t>(b * ac.len + i)] != heads[static_cast<std::size_t>(b * ac.len)])
        return true;
  return false;
}

}  // namespace

// ---- Independent --------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: Independent graph copies r and dp", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(1);
  auto u = random_normal<T>({12, 5}, rng);
  auto r = random_probs<T>(12, 7, rng);
  auto dp = random_normal<T>({12, 7}, rng);
  GraphImpl<Independent, T, cuda> g;
  g.configure(5, RouterConfig{});
  Tensor<T, cuda> p, dr, du;
  g.forward(to_device(u), to_device(r), {4, nullptr}, p);
  check_equal("independent p", r, p);
  g.backward(to_device(u), to_device(r), p, to_device(dp), {4, nullptr}, dr, du);
  check_equal("independent dr", dp, dr);
  CHECK(g.mean_entropy() == 0.0);
}

// ---- Similarity ---------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: Similarity forward and backward, causal and not, both tau modes",
                   T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(2);
  // lengths below, at and across the tiles (16 owned rows, 32 streamed columns), D across the
  // depth chunk of 32, E beyond the 256 threads of a block
  for (const SimilarityCase sc :
       {SimilarityCase{4, 1, 3, 4}, SimilarityCase{3, 7, 5, 8}, SimilarityCase{2, 16, 32, 16},
        SimilarityCase{2, 33, 40, 6}, SimilarityCase{3, 70, 96, 3}, SimilarityCase{1, 129, 17, 300},
        SimilarityCase{2, 257, 64, 8}}) {
    for (const bool causal : {false, true}) {
      for (const TauMode mode : {TauMode::Fixed, TauMode::ScaledSqrtD}) {
        RouterConfig cfg;
        cfg.num_experts = sc.e;
        cfg.causal = causal;
        cfg.options<Similarity>().tau_mode = mode;
        cfg.options<Similarity>().tau = mode == TauMode::Fixed ? 2.0 : 0.5;
        compare_similarity<T>(sc, cfg, rng);
      }
    }
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: Similarity detached, and GraphMemory::Recompute changes nothing", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(3);
  for (const bool causal : {false, true}) {
    RouterConfig cfg;
    cfg.num_experts = 5;
    cfg.causal = causal;
    cfg.options<Similarity>().detach = true;  // du untouched, dr still assigned
    compare_similarity<T>(SimilarityCase{2, 45, 20, 5}, cfg, rng);
    cfg.options<Similarity>().detach = false;
    cfg.options<Similarity>().memory = GraphMemory::Recompute;  // the CPU recomputes too; the GPU always does
    compare_similarity<T>(SimilarityCase{2, 45, 20, 5}, cfg, rng);
  }
}

TEST_CASE("cuda: Similarity causal graph never reads later tokens") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(4);
  const index_t len = 40, d = 8, e = 4;
  RouterConfig cfg;
  cfg.num_experts = e;
  cfg.causal = true;
  auto u = random_normal<float>({len, d}, rng);
  auto r = random_probs<float>(len, e, rng);
  GraphImpl<Similarity, float, cuda> g;
  g.configure(d, cfg);
  Tensor<float, cuda> p1, p2;
  g.forward(to_device(u), to_device(r), {len, nullptr}, p1);
  const index_t j = 21;
  for (index_t k = 0; k < d; ++k) u(j, k) += 3.0f;
  for (index_t k = 0; k < e; ++k) r(j, k) = k == 0 ? 1.0f : 0.0f;
  g.forward(to_device(u), to_device(r), {len, nullptr}, p2);
  const auto h1 = to_host(p1);
  check_equal("rows before the perturbed token", h1.slice(0, j).clone(), p2.slice(0, j));
  CHECK(normwise_error(h1.slice(j, len).clone(), to_host(p2).slice(j, len).clone()) > 0);
}

// ---- Attention ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: Attention forward and backward into the attention cache", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(5);
  bool mixed_heads = false;  // some sequence whose rows took different heads
  for (const AttentionCase ac : {AttentionCase{3, 1, 2, 4, 3}, AttentionCase{2, 19, 3, 6, 4},
                                 AttentionCase{2, 70, 4, 32, 8}, AttentionCase{1, 300, 2, 16, 5}}) {
    for (const bool causal : {false, true}) {
      for (const HeadChoice choice : {HeadChoice::PerSequence, HeadChoice::PerSequenceCausal}) {
        RouterConfig cfg;
        cfg.num_experts = ac.e;
        cfg.options<Attention>().sigma = 1.5;
        cfg.options<Attention>().head_choice = choice;
        const bool mixed = compare_attention<T>(ac, cfg, causal, true, false, rng);
        if (choice == HeadChoice::PerSequence) CHECK_FALSE(mixed);
        mixed_heads = mixed_heads || mixed;
      }
    }
  }
  CHECK(mixed_heads);  // the per-row head masks were exercised
  RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.options<Attention>().head_choice = HeadChoice::PerSequenceCausal;
  compare_attention<T>(AttentionCase{2, 23, 4, 8, 4}, cfg, true, false, true, rng);
  cfg.options<Attention>().detach = true;
  compare_attention<T>(AttentionCase{2, 23, 4, 8, 4}, cfg, true, true, false, rng);
}

#if defined(GRAPHMOE_CUDA_EMULATION)
// The Attention graph does every head's work at once (attention_graph.cuh): its launches and cuBLAS
// calls for a forward and backward do not grow with the number of heads: 13 launches and 21
// cuBLAS calls at 2 heads and at 8 (the form with one pass per head: 20 and 27 at 2 heads, 68 and
// 99 at 8).
TEST_CASE("cuda: Attention graph calls do not grow with the heads") {
  Rng rng(21);
  auto calls = [&](index_t heads) {
    const index_t nb = 2, len = 16, d = 32, e = 4, n = nb * len;
    auto cache = to_device(random_attention_cache<float>(nb, len, heads, d, true, rng, 2.0));
    const auto r = to_device(random_probs<float>(n, e, rng));
    const auto dp = to_device(random_normal<float>({n, e}, rng));
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = true;
    GraphImpl<Attention, float, graphmoe::cuda> graph;
    graph.configure(d, cfg);
    Tensor<float, graphmoe::cuda> p, dr, du_unused;
    const auto u_unused = to_device(random_normal<float>({n, d}, rng));
    const auto before = graphmoe_cuda_emulation::counters();
    graph.forward(u_unused, r, {len, &cache}, p);
    graph.backward(u_unused, r, p, dp, {len, &cache}, dr, du_unused);
    const auto after = graphmoe_cuda_emulation::counters();
    return std::pair{after.kernel_launches - before.kernel_launches,
                     after.cublas_calls - before.cublas_calls};
  };
  const auto two = calls(2), eight = calls(8);
  CHECK(two.first > 0);
  CHECK(eight.first == two.first);
  CHECK(eight.second == two.second);
}
#endif

// ---- bad input ----------------------------------------------------------------------------------

// The Attention graph on tensor cores, against the CPU graph in float: GraphPrecision::TF32 at
// 1e-2 (twice the Similarity block path's TF32 tolerance: db_o sums over tokens with
// cancellation), GraphPrecision::BF16 (the (T, T) products on bf16 operands with fp32
// accumulation, the (N, D, dm) ones on TF32) at 6e-2 (1.5x the block path's BF16 tolerance: dV
// is the difference of the product dL^T Q~ and the mean term, of similar size); causal over two
// row blocks too, and detached. Heads agree exactly (they come from the cache's entropies, not
// the products).
TEST_CASE("cuda vs cpu: Attention with TF32 and BF16 products") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(13);
  // measured under the emulation: TF32 4.2e-3 (db_o), BF16 2.6e-2 (dV)
  for (const auto& [precision, tol] : {std::pair{GraphPrecision::TF32, 1e-2},
                                       std::pair{GraphPrecision::BF16, 6e-2}}) {
    CAPTURE(graph_precision_name(precision));
    const ToleranceScope scope(tol);
    for (const bool causal : {false, true}) {
      RouterConfig cfg;
      cfg.num_experts = 5;
      cfg.causal = causal;
      cfg.options<Attention>().precision = precision;
      compare_attention<float>(AttentionCase{2, 21, 4, 16, 5}, cfg, causal, true, false, rng);
      cfg.options<Attention>().sigma = 0.7;
      cfg.options<Attention>().head_choice = HeadChoice::PerSequenceCausal;
      compare_attention<float>(AttentionCase{3, 9, 2, 8, 3}, cfg, causal, false, true, rng);
    }
    RouterConfig cfg;
    cfg.num_experts = 4;
    cfg.causal = true;
    cfg.options<Attention>().precision = precision;
    compare_attention<float>(AttentionCase{1, 300, 2, 16, 4}, cfg, true, true, false, rng);
    cfg.options<Attention>().detach = true;  // dr only
    compare_attention<float>(AttentionCase{2, 23, 4, 8, 4}, cfg, true, true, false, rng);
  }
  // TF32 (and BF16) need a float router and a backend with tensor-core products; a value that
  // is not a GraphPrecision is refused
  RouterConfig bad;
  bad.num_experts = 3;
  bad.options<Attention>().precision = static_cast<GraphPrecision>(7);
  GraphImpl<Attention, float, cuda> g;
  CHECK(error_of([&] { g.configure(8, bad); }) ==
        "graphmoe::Attention::Options: precision 7 is not a GraphPrecision");
  bad.options<Attention>().precision = GraphPrecision::BF16;
  GraphImpl<Attention, double, cuda> gb;
  CHECK(error_of([&] { gb.configure(8, bad); }) ==
        "graphmoe::Attention: precision bf16 rounds float inputs: it needs a float router (use "
        "GraphPrecision::Exact)");
  bad.options<Attention>().precision = GraphPrecision::TF32;
  GraphImpl<Attention, double, cuda> gd;
  CHECK(error_of([&] { gd.configure(8, bad); }) ==
        "graphmoe::Attention: precision tf32 rounds float inputs: it needs a float router (use "
        "GraphPrecision::Exact)");
  GraphImpl<Attention, float, cpu> gc;
  CHECK(error_of([&] { gc.configure(8, bad); }) ==
        "graphmoe::Attention: precision tf32 needs tensor-core products, which the cpu backend "
        "does not have: use GraphPrecision::Exact");
}

TEST_CASE("cuda vs cpu: bad graph inputs throw the CPU messages") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(6);
  const index_t n = 8, d = 4, e = 3, len = 4;
  auto u = random_normal<float>({n, d}, rng);
  auto r = random_probs<float>(n, e, rng);
  const auto ud = to_device(u), rd = to_device(r);
  auto r_short = random_probs<float>(n - 1, e, rng);
  RouterConfig cfg;
  cfg.num_experts = e;

  const auto same = [](const std::string& what, const std::string& cpu_msg,
                       const std::string& cuda_msg) {
    CAPTURE(what);
    CHECK(!cpu_msg.empty());
    CHECK(cuda_msg == cpu_msg);
  };

  {  // Similarity
    GraphImpl<Similarity, float, cpu> c;
    GraphImpl<Similarity, float, cuda> g;
    c.configure(d, cfg);
    g.configure(d, cfg);
    Tensor<float, cpu> p;
    Tensor<float, cuda> pd;
    same("seq_len", error_of([&] { c.forward(u, r, {3, nullptr}, p); }),
         error_of([&] { g.forward(ud, rd, {3, nullptr}, pd); }));
    same("N", error_of([&] { c.forward(u, r_short, {1, nullptr}, p); }),
         error_of([&] { g.forward(ud, to_device(r_short), {1, nullptr}, pd); }));
    Tensor<float, cpu> p_bad({n, e + 1});
    Tensor<float, cuda> pd_bad(Shape{n, e + 1});
    same("p shape", error_of([&] { c.forward(u, r, {len, nullptr}, p_bad); }),
         error_of([&] { g.forward(ud, rd, {len, nullptr}, pd_bad); }));
    c.forward(u, r, {len, nullptr}, p);
    g.forward(ud, rd, {len, nullptr}, pd);
    Tensor<float, cpu> dr, du_bad({n, d + 1});
    Tensor<float, cuda> drd, dud_bad(Shape{n, d + 1});
    same("du shape", error_of([&] { c.backward(u, r, p, r, {len, nullptr}, dr, du_bad); }),
         error_of([&] { g.backward(ud, rd, pd, rd, {len, nullptr}, drd, dud_bad); }));
    RouterConfig bad = cfg;
    bad.options<Similarity>().tau = -1;
    same("tau", error_of([&] { c.configure(d, bad); }), error_of([&] { g.configure(d, bad); }));
  }

  {  // Attention
    GraphImpl<Attention, float, cpu> c;
    GraphImpl<Attention, float, cuda> g;
    c.configure(d, cfg);
    g.configure(d, cfg);
    Tensor<float, cpu> p;
    Tensor<float, cuda> pd;
    same("no cache", error_of([&] { c.forward(u, r, {len, nullptr}, p); }),
         error_of([&] { g.forward(ud, rd, {len, nullptr}, pd); }));
    const auto good = random_attention_cache<float>(n / len, len, 2, d, false, rng);
    const auto try_cache = [&](const std::string& what, auto&& spoil) {
      AttentionCache<float, cpu> hc = good;
      spoil(hc);
      auto dc = to_device(hc);
      same(what, error_of([&] { c.forward(u, r, {len, &hc}, p); }),
           error_of([&] { g.forward(ud, rd, {len, &dc}, pd); }));
    };
    try_cache("probs shape",
              [](AttentionCache<float, cpu>& k) { k.probs = Tensor<float>({2, 2, 4, 3}); });
    try_cache("values", [](AttentionCache<float, cpu>& k) { k.v = Tensor<float>({8, 5}); });
    try_cache("w_o", [](AttentionCache<float, cpu>& k) { k.w_o = Tensor<float>({4, 3}); });
    try_cache("out", [](AttentionCache<float, cpu>& k) { k.out = Tensor<float>({8, 5}); });
    try_cache("b_o", [](AttentionCache<float, cpu>& k) { k.b_o = Tensor<float>({5}); });
    try_cache("incomplete", [](AttentionCache<float, cpu>& k) { k.v = Tensor<float>(); });
    try_cache("row_entropy", [](AttentionCache<float, cpu>& k) {
      k.row_entropy = Tensor<float>({2, 2, 5});
    });
    // an all-zero attention row of the chosen head (sequences 0 and 1)
    try_cache("all-zero row", [&](AttentionCache<float, cpu>& k) {
      k.probs = k.probs.clone();
      GraphImpl<Attention, float, cpu> probe;
      probe.configure(d, cfg);
      Tensor<float, cpu> pp;
      probe.forward(u, r, {len, &k}, pp);
      for (index_t b = 0; b < n / len; ++b)
        for (index_t j = 0; j < len; ++j)
          k.probs(b, probe.heads()[static_cast<std::size_t>(b * len)], 2, j) = 0.0f;
    });
  }
}

// The op layer (ops/token_graph.hpp) checks once for both backends: a backward without its forward
// throws one message, and the options the CUDA backend lacks (token_graph_support) are refused in
// configure with the message the CUDA graph always gave.
TEST_CASE("cuda vs cpu: the op layer's checks give one message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(7);
  const index_t n = 8, d = 4, e = 3, len = 4;
  auto u = random_normal<float>({n, d}, rng);
  auto r = random_probs<float>(n, e, rng);
  const auto ud = to_device(u), rd = to_device(r);
  RouterConfig cfg;
  cfg.num_experts = e;
  Tensor<float, cpu> dr, du({n, d});
  Tensor<float, cuda> drd, dud(Shape{n, d});

  GraphImpl<Similarity, float, cpu> sc;
  GraphImpl<Similarity, float, cuda> sg;
  sc.configure(d, cfg);
  sg.configure(d, cfg);
  const std::string sim_cpu = error_of([&] { sc.backward(u, r, r, r, {len, nullptr}, dr, du); });
  CHECK(sim_cpu.find("no forward of these 8 tokens in sequences of 4") != std::string::npos);
  CHECK(error_of([&] { sg.backward(ud, rd, rd, rd, {len, nullptr}, drd, dud); }) == sim_cpu);

  const auto cache = random_attention_cache<float>(n / len, len, 2, d, false, rng);
  auto cache_d = to_device(cache);
  auto cache_c = cache;
  GraphImpl<Attention, float, cpu> ac;
  GraphImpl<Attention, float, cuda> ag;
  ac.configure(d, cfg);
  ag.configure(d, cfg);
  const std::string att_cpu =
      error_of([&] { ac.backward(u, r, r, r, {len, &cache_c}, dr, du); });
  CHECK(att_cpu.find("no forward of these 8 tokens in sequences of 4") != std::string::npos);
  CHECK(error_of([&] { ag.backward(ud, rd, rd, rd, {len, &cache_d}, drd, dud); }) == att_cpu);

  // every option configures on both backends now; the reduced precisions are refused where they
  // cannot run (the CPU backend, a double router) with one message each
  for (int option = 0; option < 3; ++option) {
    RouterConfig ok = cfg;
    if (option == 0) ok.options<Similarity>().tau_mode = TauMode::Learned;
    if (option == 1) ok.options<Similarity>().exclude_self = true;
    if (option == 2) ok.options<Similarity>().projection = true;
    CAPTURE(option);
    GraphImpl<Similarity, float, cpu> c;
    CHECK(error_of([&] { c.configure(d, ok); }).empty());
    GraphImpl<Similarity, float, cuda> g;
    CHECK(error_of([&] { g.configure(d, ok); }).empty());
  }
  for (const GraphPrecision prec : {GraphPrecision::TF32, GraphPrecision::BF16}) {
    RouterConfig reduced = cfg;
    reduced.options<Similarity>().precision = prec;
    const std::string name = graph_precision_name(prec);
    GraphImpl<Similarity, float, cuda> g;
    CHECK(error_of([&] { g.configure(d, reduced); }).empty());
    GraphImpl<Similarity, float, cpu> c;
    CHECK(error_of([&] { c.configure(d, reduced); }) ==
          "graphmoe::Similarity: precision " + name +
              " needs tensor-core products, which the cpu backend does not have: use "
              "GraphPrecision::Exact");
    GraphImpl<Similarity, double, cuda> gd;
    CHECK(error_of([&] { gd.configure(d, reduced); }) ==
          "graphmoe::Similarity: precision " + name +
              " rounds float inputs: it needs a float router (use GraphPrecision::Exact)");
  }
  RouterConfig junk = cfg;
  junk.options<Similarity>().precision = static_cast<GraphPrecision>(7);
  GraphImpl<Similarity, float, cuda> g;
  CHECK(error_of([&] { g.configure(d, junk); }).find("precision 7 is not a GraphPrecision") !=
        std::string::npos);
}

// ---- Similarity, the block path (similarity_blocks.cuh) -----------------------------------------
//
// Every option and precision against the CPU graph in double (the ops of ops/token_graph.hpp
// called directly, with the learned parameters). Tolerances (normwise, see the file comment):
//   Exact   as the fused kernel: double 1e-11, float 5e-5
//   TF32    5e-3: inputs of the products rounded to 10 mantissa bits (relative 2^-11 = 4.9e-4
//           each); logits of size |u|^2 / tau ~ 10 here move S by up to a few 1e-3
//   BF16    4e-2: 7 mantissa bits (relative 2^-8 = 3.9e-3 per input), the same amplification
//   dlog_tau (one cancelling sum) is held to 5x these in float (6.4e-5 measured at Exact on an
//   H100, 8.5e-2 at BF16)
// The errors measured here (GRAPHMOE_CUDA_TEST_VERBOSE=1 prints them) are in docs/routers.md ("Precision").

namespace {

struct BlockCase {
  index_t nseq, len, d, e;
  bool causal = false, exclude_self = false, projection = false, learned = false;
  bool store = false, detach = false;
  GraphPrecision prec = GraphPrecision::Exact;
};

double block_tolerance(GraphPrecision prec, bool is_float) {
  if (prec == GraphPrecision::TF32) return 5e-3;
  if (prec == GraphPrecision::BF16) return 4e-2;
  return is_float ? 5e-5 : 1e-11;
}

template <class T>
Tensor<double, cpu> as_double(const Tensor<T, cpu>& x) {
  Tensor<double, cpu> y(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) y.data()[i] = static_cast<double>(x.data()[i]);
  return y;
}

template <class T>
Tensor<T, cpu> as_type(const Tensor<double, cpu>& x) {
  Tensor<T, cpu> y(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) y.data()[i] = static_cast<T>(x.data()[i]);
  return y;
}

// The block path on CUDA in T against the CPU in double; returns the largest normwise error.
template <class T>
double compare_similarity_blocks(const BlockCase& bc, Rng& rng) {
  CAPTURE(bc.nseq);
  CAPTURE(bc.len);
  CAPTURE(bc.d);
  CAPTURE(bc.e);
  CAPTURE(bc.causal);
  CAPTURE(bc.exclude_self);
  CAPTURE(bc.projection);
  CAPTURE(bc.learned);
  CAPTURE(bc.store);
  CAPTURE(bc.detach);
  const std::string prec_name = graph_precision_name(bc.prec);
  CAPTURE(prec_name);
  const index_t n = bc.nseq * bc.len, d = bc.d, e = bc.e;
  // Exact without exclude_self, projection or a learned tau runs the fused kernel, which keeps
  // neither S nor the self weights
  const bool fused = bc.prec == GraphPrecision::Exact && !bc.exclude_self && !bc.projection &&
                     !bc.learned;
  // inputs rounded to T first, so that the reference sees the same values
  const auto u = as_double(random_normal<T>({n, d}, rng, 0.7));
  const auto r = as_double(random_probs<T>(n, e, rng));
  const auto dp = as_double(random_normal<T>({n, e}, rng));
  const auto du0 = as_double(random_normal<T>({n, d}, rng));
  auto w_s = as_double(random_normal<T>({d, d}, rng, 0.2));
  for (index_t i = 0; i < d; ++i) w_s.data()[i * d + i] += 1.0;
  const auto dw0 = as_double(random_normal<T>({d, d}, rng));
  const double tau = 1.5;

  SimilarityGraphArgs args;
  args.seq_len = bc.len;
  args.d_model = d;
  args.causal = bc.causal;
  args.learned_tau = bc.learned;
  args.exclude_self = bc.exclude_self;
  args.projection = bc.projection;
  args.store = bc.store;
  args.detach = bc.detach;
  SimilarityGraphArgs ref_args = args;  // the CPU is always Exact
  args.precision = bc.prec;

  SimilarityGraphParams<double, cpu> pc;
  SimilarityGraphParams<T, cuda> pg;
  if (bc.learned) {
    pc.log_tau = Tensor<double, cpu>(Shape{1});
    pc.log_tau.data()[0] = std::log(tau);
    pc.dlog_tau = Tensor<double, cpu>(Shape{1});
    pc.dlog_tau.data()[0] = 0.25;
    pg.log_tau = to_device(as_type<T>(pc.log_tau));
    pg.dlog_tau = to_device(as_type<T>(pc.dlog_tau));
  }
  if (bc.projection) {
    pc.w_s = w_s.clone();
    pc.dw_s = dw0.clone();
    pg.w_s = to_device(as_type<T>(w_s));
    pg.dw_s = to_device(as_type<T>(dw0));
  }
  SimilarityGraphState<double, cpu> sc;
  SimilarityGraphState<T, cuda> sg;
  sc.tau = sg.tau = bc.learned ? 99.0 : tau;  // a learned tau is read from log_tau

  Tensor<double, cpu> p;
  auto pd = nan_device<T>({n, e});
  similarity_graph_forward(u, r, ref_args, pc, sc, p);
  similarity_graph_forward(to_device(as_type<T>(u)), to_device(as_type<T>(r)), args, pg, sg, pd);
  const double tol1 = block_tolerance(bc.prec, std::is_same_v<T, float>);
  double worst = 0;
  auto check = [&](const std::string& what, const Tensor<double, cpu>& ref, const auto& got,
                   double factor = 1.0) {
    const double tol = factor * tol1;
    const double err = normwise_error(ref, as_double(to_host(got)));
    worst = std::max(worst, err);
    if (test::verbose())
      std::printf("  %-28s %-6s %-5s error %.3e (tolerance %.0e)\n", what.c_str(), type_name<T>(),
                  graph_precision_name(bc.prec), err, tol);
    CHECK_MESSAGE(err <= tol, what, ": error ", err, " > tolerance ", tol);
  };
  CHECK(sg.stores == (bc.store && !fused));
  check("blocks p", p, pd);
  check("blocks lse", sc.lse, sg.lse);
  if (!fused) check("blocks self weight", sc.self, sg.self);
  if (bc.store && !fused) check("blocks stored S", sc.s, sg.s);
  check_scalar("blocks mean entropy", similarity_graph_mean_entropy(sc),
               similarity_graph_mean_entropy(sg), std::max(tol1, graph_tolerance<T>()));

  Tensor<double, cpu> dr, du = du0.clone();
  auto drd = nan_device<T>({n, e});
  auto dud = to_device(as_type<T>(du0));
  similarity_graph_backward(u, r, p, dp, ref_args, pc, sc, dr, du);
  const auto pd_host = to_device(as_type<T>(p));  // the same p on both sides
  similarity_graph_backward(to_device(as_type<T>(u)), to_device(as_type<T>(r)), pd_host,
                            to_device(as_type<T>(dp)), args, pg, sg, drd, dud);
  check("blocks dr", dr, drd);
  check("blocks du (accumulated)", du, dud);
  // d loss / d log_tau = -sum_ij dL_ij L_ij is one sum of N T terms that cancel (rows of dL sum
  // to 0): its relative error is larger than the entries' under a reduced precision
  if (bc.learned)
    check("blocks dlog_tau (accumulated)", pc.dlog_tau, pg.dlog_tau,
          bc.prec == GraphPrecision::Exact && std::is_same_v<T, double> ? 1.0 : 5.0);
  if (bc.projection) check("blocks dW_s (accumulated)", pc.dw_s, pg.dw_s);
  return worst;
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: Similarity block path, every option and precision", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(11);
  std::vector<GraphPrecision> precs{GraphPrecision::Exact};
  if (std::is_same_v<T, float>) {
    precs.push_back(GraphPrecision::TF32);
    precs.push_back(GraphPrecision::BF16);
  }
  for (const GraphPrecision prec : precs) {
    // each option alone and all together, causal and not, stored and recomputed, with lengths
    // across the causal block rows is covered by the long case below
    for (int variant = 0; variant < 6; ++variant) {
      for (const bool causal : {false, true}) {
        BlockCase bc{2, 13, 9, 5};
        bc.prec = prec;
        bc.causal = causal;
        bc.exclude_self = variant == 1 || variant == 5;
        bc.projection = variant == 2 || variant == 5;
        bc.learned = variant == 3 || variant == 5;
        bc.store = variant == 4 || variant == 5;
        bc.detach = variant == 4;
        compare_similarity_blocks<T>(bc, rng);
      }
    }
  }
  // a length 1 sequence (exclude_self keeps S[0,0]) and a causal graph over several block rows
  // (kSimilarityCausalRows = 256)
  BlockCase one{3, 1, 4, 3};
  one.exclude_self = true;
  compare_similarity_blocks<T>(one, rng);
  BlockCase lng{1, 300, 8, 4};
  lng.causal = true;
  lng.exclude_self = true;
  lng.learned = true;
  compare_similarity_blocks<T>(lng, rng);
}

// Finite differences in double through the CUDA block path: u, log_tau and W_s with every option.
TEST_CASE("cuda: Similarity block path gradient check (double, every option)") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(12);
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const index_t nseq = 2, len = 4, d = 3, e = 3, n = nseq * len;
    auto u = random_normal<double>({n, d}, rng, 0.8);
    const auto r = random_probs<double>(n, e, rng);
    const auto w = random_normal<double>({n, e}, rng);  // L = sum w o p
    auto log_tau = Tensor<double, cpu>(Shape{1});
    log_tau.data()[0] = std::log(0.9);
    auto w_s = random_normal<double>({d, d}, rng, 0.3);
    for (index_t i = 0; i < d; ++i) w_s.data()[i * d + i] += 1.0;
    SimilarityGraphArgs args;
    args.seq_len = len;
    args.d_model = d;
    args.causal = causal;
    args.learned_tau = args.exclude_self = args.projection = true;
    auto loss = [&] {
      SimilarityGraphParams<double, cuda> pg;
      pg.log_tau = to_device(log_tau);
      pg.w_s = to_device(w_s);
      SimilarityGraphState<double, cuda> st;
      Tensor<double, cuda> p;
      similarity_graph_forward(to_device(u), to_device(r), args, pg, st, p);
      const auto ph = to_host(p);
      double l = 0;
      for (index_t i = 0; i < ph.numel(); ++i) l += w.data()[i] * ph.data()[i];
      return l;
    };
    SimilarityGraphParams<double, cuda> pg;
    pg.log_tau = to_device(log_tau);
    pg.dlog_tau = Tensor<double, cuda>(Shape{1});
    pg.w_s = to_device(w_s);
    pg.dw_s = Tensor<double, cuda>(Shape{d, d});
    SimilarityGraphState<double, cuda> st;
    Tensor<double, cuda> p, dr, du(Shape{n, d});
    const auto ud = to_device(u), rd = to_device(r);
    similarity_graph_forward(ud, rd, args, pg, st, p);
    similarity_graph_backward(ud, rd, p, to_device(w), args, pg, st, dr, du);
    test::check_gradient("blocks du", u, to_host(du), loss);
    test::check_gradient("blocks dlog_tau", log_tau, to_host(pg.dlog_tau), loss);
    test::check_gradient("blocks dW_s", w_s, to_host(pg.dw_s), loss);
  }
}

// ---- Blended<G> ---------------------------------------------------------------------------------

// p = (1 - a) r + a G r and its gradients (dr, du, d a, the inner graph's) on both backends, with
// a read on the device; at a = 0 the CUDA p is r bit for bit.
TEST_CASE_TEMPLATE("cuda vs cpu: Blended Similarity and Attention, forward and backward", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(41);
  const index_t nb = 2, len = 9, d = 8, e = 70, heads = 2;
  auto u = random_normal<T>({nb * len, d}, rng);
  auto r = random_probs<T>(nb * len, e, rng);
  auto dp = random_normal<T>({nb * len, e}, rng);
  auto cache = random_attention_cache<T>(nb, len, heads, d, true, rng);
  auto cache_d = to_device(cache);
  const auto ud = to_device(u), rd = to_device(r), dpd = to_device(dp);
  for (const double a : {0.0, 0.35}) {
    CAPTURE(a);
    RouterConfig cfg;
    cfg.num_experts = e;
    cfg.causal = true;
    cfg.options<Similarity>().tau_mode = TauMode::Learned;
    auto run = [&]<class G>(G*) {
      ParameterArena<T, cpu> ha;
      ParameterArena<T, cuda> da;
      BlendedImpl<G, T, cpu> ref;
      BlendedImpl<G, T, cuda> gpu;
      ref.declare(ha, "g.", d, cfg);
      gpu.declare(da, "g.", d, cfg);
      ha.allocate();
      da.allocate();
      ref.bind(ha);
      gpu.bind(da);
      Rng r1(7), r2(7);
      ref.init(r1);
      gpu.init(r2);
      ha.value("g.blend").data()[0] = static_cast<T>(a);
      fill(da.value("g.blend"), static_cast<T>(a));
      ha.zero_grad();
      da.zero_grad();
      const bool att = graph_needs_attention_cache<G>();
      Tensor<T, cpu> p, dr, du(u.shape());
      Tensor<T, cuda> pd, drd, dud(Shape{nb * len, d});
      fill(dud, T(0));
      ref.forward(u, r, {len, att ? &cache : nullptr}, p);
      gpu.forward(ud, rd, {len, att ? &cache_d : nullptr}, pd);
      check_close(std::string(G::name) + " p", p, pd);
      if (a == 0.0) check_equal(std::string(G::name) + " p at a = 0", r, pd);
      ref.backward(u, r, p, dp, {len, att ? &cache : nullptr}, dr, du);
      gpu.backward(ud, rd, pd, dpd, {len, att ? &cache_d : nullptr}, drd, dud);
      check_close(std::string(G::name) + " dr", dr, drd);
      check_close(std::string(G::name) + " du", du, dud);
      check_close(std::string(G::name) + " dblend", ha.grad("g.blend"), da.grad("g.blend"));
      check_scalar(std::string(G::name) + " blend", ref.blend(), gpu.blend(), 0);
    };
    run(static_cast<Similarity*>(nullptr));
    run(static_cast<Attention*>(nullptr));
  }
}

}  // namespace graphmoe
