// Cross-backend tests of incremental decoding on the GPU (ops/decode.hpp with
// backend/cuda/decode.cuh; TransformerLM::decode, Decoder and generate on graphmoe::cuda), the CPU
// backend as the reference:
//   - each decode op alone on the same random inputs and caches (every Similarity option, the
//     Attention graph's prior floor, head choice and all-zero-row error);
//   - TransformerLM<Policy, T, cuda>::decode over three slots of different lengths for the three
//     token graphs against the CPU model's decode (same parameters: the same seed) and the CUDA
//     model's own full forward, with the same experts and graph weights, one token per slot and
//     step or in chunks of several tokens per slot and step (rows of slots interleaved);
//   - greedy generate / generate_batch in double on the GPU give the CPU's tokens (the sliding
//     window and explain included).
//
//   tolerance   ops: float 1e-5, double 1e-12 (normwise per tensor, cuda_test_support.cuh);
//               models: double 1e-12, float 2e-5 (as the CPU's decode tests); the caches'
//               copied entries, h*, the entropy prefix sums
//               (host arithmetic), experts and tokens: exact
//
// Without a CUDA device every case passes with "skipped: no CUDA device"; the file runs in CI under
// the CPU emulation (test_emu_cuda_decode), so its shapes are small.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/cuda.cuh"
#include "graphmoe/inference/generate.hpp"
#include "cuda/cuda_test_support.cuh"
#include "support/decode_fixtures.hpp"
#include "support/gradcheck.hpp"

namespace graphmoe {
using test::check_close;
using test::check_equal;
using test::decode_config;
using test::error_of;
using test::random_ids;
using test::random_normal;
using test::random_tensor;

namespace {

constexpr index_t kSlots = 4, kMaxLen = 12;

// Three rows of a step: slot 2 at position 5, slot 0 starting a sequence, slot 3 at the last
// position of the cache.
DecodeRows step_rows() { return DecodeRows{{2, 0, 3}, {5, 0, kMaxLen - 1}}; }

template <class T>
KVCache<T, graphmoe::cuda> to_device(const KVCache<T, cpu>& c) {
  KVCache<T, graphmoe::cuda> d;
  d.k = graphmoe::to_device(c.k);
  d.v = graphmoe::to_device(c.v);
  d.query_heads = c.query_heads;
  return d;
}

// (rows, cols) rows of a softmax of normal logits.
template <class T>
Tensor<T, cpu> random_rows_of_probs(index_t rows, index_t cols, Rng& rng) {
  Tensor<T, cpu> g = random_normal<T>(Shape{rows, cols}, rng, 1.5), p;
  softmax_forward(g, p);
  return p;
}

}  // namespace

// ---- the ops alone -------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: attention_decode appends k, v and attends over positions 0..t", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const index_t nh = 4, dh = 4, width = nh * dh;
  index_t nkv = nh;  // multi-head, grouped-query (2 query heads per cached head), multi-query
  SUBCASE("multi-head") {}
  SUBCASE("grouped-query") { nkv = 2; }
  SUBCASE("multi-query") { nkv = 1; }
  CAPTURE(nkv);
  const DecodeRows rows = step_rows();
  const index_t n = rows.size();
  Rng rng(3);
  KVCache<T, cpu> kv(kSlots, nh, nkv, kMaxLen, dh);
  REQUIRE(kv.kv_heads() == nkv);
  kv.k = random_normal<T>(kv.k.shape(), rng);  // earlier positions (and stale later ones)
  kv.v = random_normal<T>(kv.v.shape(), rng);
  KVCache<T, graphmoe::cuda> dkv = to_device(kv);
  const Tensor<T, cpu> q = random_normal<T>(Shape{n, width}, rng, 1.5);
  const Tensor<T, cpu> k = random_normal<T>(Shape{n, nkv * dh}, rng);
  const Tensor<T, cpu> v = random_normal<T>(Shape{n, nkv * dh}, rng);
  Tensor<T, cpu> probs, ent, out;
  attention_decode(q, k, v, rows, kv, probs, ent, out);
  Tensor<T, graphmoe::cuda> dprobs, dent, dout;
  attention_decode(to_device(q), to_device(k), to_device(v), rows, dkv, dprobs, dent, dout);
  check_close("probs", probs, dprobs);
  check_close("row entropy", ent, dent);
  check_close("out", out, dout);
  check_equal("K cache", kv.k, dkv.k);
  check_equal("V cache", kv.v, dkv.v);
}

TEST_CASE_TEMPLATE("cuda vs cpu: similarity_graph_decode, every option", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  const index_t d = 8, e = 5;
  const DecodeRows rows = step_rows();
  const index_t n = rows.size();
  SimilarityGraphArgs args;
  args.causal = true;
  args.d_model = d;
  std::string what = "plain";
  SUBCASE("plain") {}
  SUBCASE("exclude_self") {
    args.exclude_self = true;
    what = "exclude_self";
  }
  SUBCASE("projection") {
    args.projection = true;
    what = "projection";
  }
  SUBCASE("learned tau") {
    args.learned_tau = true;
    what = "learned tau";
  }
  SUBCASE("all at once") {
    args.exclude_self = args.projection = args.learned_tau = true;
    what = "all";
  }
  CAPTURE(what);
  Rng rng(7);
  SimilarityDecodeCache<T, cpu> cache;
  cache.u = random_normal<T>(Shape{kSlots, kMaxLen, d}, rng);
  cache.r = random_rows_of_probs<T>(kSlots * kMaxLen, e, rng).view(Shape{kSlots, kMaxLen, e});
  SimilarityGraphParams<T, cpu> params;
  if (args.projection) {
    params.w_s = random_normal<T>(Shape{d, d}, rng, 0.3);
    for (index_t i = 0; i < d; ++i) params.w_s.data()[i * d + i] += T(1);
  }
  if (args.learned_tau) params.log_tau = Tensor<T, cpu>::from(Shape{1}, {static_cast<T>(std::log(0.6))});
  SimilarityDecodeCache<T, graphmoe::cuda> dcache;
  dcache.u = to_device(cache.u);
  dcache.r = to_device(cache.r);
  SimilarityGraphParams<T, graphmoe::cuda> dparams;
  dparams.w_s = to_device(params.w_s);
  dparams.log_tau = to_device(params.log_tau);
  const Tensor<T, cpu> u = random_normal<T>(Shape{n, d}, rng);
  const Tensor<T, cpu> r = random_rows_of_probs<T>(n, e, rng);
  const double tau = 0.8;  // ignored under a learned temperature
  Tensor<T, cpu> p, w;
  similarity_graph_decode(u, r, rows, args, params, tau, cache, p, &w);
  Tensor<T, graphmoe::cuda> dp, dw;
  const Tensor<T, graphmoe::cuda> du = to_device(u), dr = to_device(r);
  similarity_graph_decode(du, dr, rows, args, dparams, tau, dcache, dp, &dw);
  check_close(what + " p", p, dp);
  check_close(what + " weights", w, dw);
  check_equal(what + " u cache", cache.u, dcache.u);
  check_equal(what + " r cache", cache.r, dcache.r);
  // without weights: the same p (the row of S goes to scratch)
  Tensor<T, graphmoe::cuda> dp2;
  similarity_graph_decode(du, dr, rows, args, dparams, tau, dcache, dp2);
  check_equal(what + " p without weights", to_host(dp), dp2);
}

namespace {

// An attention layer's step and the Attention graph's routing cache, random, on the host:
// probs rows normalised over positions 0..t (one entry below the prior floor, exact zeros after
// t), row entropies in [0.2, 2], the cache's entropy prefix sums increasing along each slot.
template <class T>
struct AttentionGraphCase {
  static constexpr index_t nh = 3, dh = 4, d = nh * dh, e = 5;
  DecodeRows rows = step_rows();
  KVCache<T, cpu> kv;
  AttentionStep<T, cpu> step;
  AttentionDecodeCache<T, cpu> cache;
  Tensor<T, cpu> r;

  // nkv: the cached key/value heads (nh, or 1: multi-query, every query head reads one V)
  AttentionGraphCase(bool bias, Rng& rng, index_t nkv = nh) : kv(kSlots, nh, nkv, kMaxLen, dh) {
    const index_t n = rows.size();
    kv.k = random_normal<T>(kv.k.shape(), rng, 0.5);
    kv.v = random_normal<T>(kv.v.shape(), rng, 0.5);
    step.num_heads = nh;
    step.probs = Tensor<T, cpu>(Shape{n, nh, kMaxLen});
    for (index_t i = 0; i < n; ++i) {
      const index_t len = rows.pos[static_cast<std::size_t>(i)] + 1;
      for (index_t h = 0; h < nh; ++h) {
        T* row = step.probs.data() + (i * nh + h) * kMaxLen;
        const Tensor<T, cpu> pr = random_rows_of_probs<T>(1, len, rng);
        std::copy_n(pr.data(), len, row);
        if (len > 2) row[1] = static_cast<T>(0.5 * attention_prior_floor<T>());  // -inf logit
      }
    }
    step.row_entropy = random_tensor<T>(Shape{n, nh}, rng, 0.2, 2.0);
    step.out = random_normal<T>(Shape{n, d}, rng);
    step.w_o = random_normal<T>(Shape{d, d}, rng, 0.3);
    if (bias) step.b_o = random_normal<T>(Shape{d}, rng, 0.3);
    step.kv = &kv;
    cache.r = random_rows_of_probs<T>(kSlots * kMaxLen, e, rng).view(Shape{kSlots, kMaxLen, e});
    cache.msq = random_tensor<T>(Shape{kSlots, nh, kMaxLen}, rng, 0.0, 4.0);
    cache.entropy_prefix.assign(static_cast<std::size_t>(kSlots * kMaxLen * nh), 0.0);
    for (index_t s = 0; s < kSlots; ++s)
      for (index_t t = 0; t < kMaxLen; ++t)
        for (index_t h = 0; h < nh; ++h) {
          const std::size_t at = static_cast<std::size_t>((s * kMaxLen + t) * nh + h);
          cache.entropy_prefix[at] = (t > 0 ? cache.entropy_prefix[at - nh] : 0.0) +
                                     rng.uniform(0.2, 2.0);
        }
    r = random_rows_of_probs<T>(n, e, rng);
  }
};

template <class T>
AttentionStep<T, graphmoe::cuda> to_device(const AttentionStep<T, cpu>& s,
                                           const KVCache<T, graphmoe::cuda>& kv) {
  AttentionStep<T, graphmoe::cuda> d;
  d.num_heads = s.num_heads;
  d.probs = graphmoe::to_device(s.probs);
  d.row_entropy = graphmoe::to_device(s.row_entropy);
  d.out = graphmoe::to_device(s.out);
  d.w_o = graphmoe::to_device(s.w_o);
  d.b_o = graphmoe::to_device(s.b_o);
  d.kv = &kv;
  return d;
}

template <class T>
AttentionDecodeCache<T, graphmoe::cuda> to_device(const AttentionDecodeCache<T, cpu>& c) {
  AttentionDecodeCache<T, graphmoe::cuda> d;
  d.r = graphmoe::to_device(c.r);
  d.msq = graphmoe::to_device(c.msq);
  d.entropy_prefix = c.entropy_prefix;
  return d;
}

AttentionGraphArgs attention_decode_args() {
  AttentionGraphArgs a;
  a.causal_heads = true;
  a.sigma = 1.3;
  a.d_model = AttentionGraphCase<double>::d;
  return a;
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: attention_graph_decode: h* from the prefix, the posterior, the floor",
                   T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  bool bias = true;
  index_t nkv = AttentionGraphCase<T>::nh;
  SUBCASE("with the output bias") {}
  SUBCASE("without it") { bias = false; }
  SUBCASE("multi-query: one cached value head") { nkv = 1; }
  CAPTURE(bias);
  CAPTURE(nkv);
  Rng rng(11);
  AttentionGraphCase<T> c(bias, rng, nkv);
  const KVCache<T, graphmoe::cuda> dkv = to_device(c.kv);
  const AttentionStep<T, graphmoe::cuda> dstep = to_device(c.step, dkv);
  AttentionDecodeCache<T, graphmoe::cuda> dcache = to_device(c.cache);
  const AttentionGraphArgs args = attention_decode_args();
  Tensor<T, cpu> p, w;
  std::vector<int> heads;
  attention_graph_decode(c.r, c.rows, c.step, args, c.cache, p, heads, &w);
  Tensor<T, graphmoe::cuda> dp, dw;
  std::vector<int> dheads;
  const Tensor<T, graphmoe::cuda> dr = to_device(c.r);
  attention_graph_decode(dr, c.rows, dstep, args, dcache, dp, dheads, &dw);
  CHECK(dheads == heads);
  CHECK(dcache.entropy_prefix == c.cache.entropy_prefix);  // the same host arithmetic
  check_close("p", p, dp);
  check_close("weights", w, dw);
  check_close("msq cache", c.cache.msq, dcache.msq);
  check_equal("r cache", c.cache.r, dcache.r);
  // the entry below the floor has weight exactly 0 on both
  const Tensor<T, cpu> hw = to_host(dw);
  CHECK(hw.data()[0 * kMaxLen + 1] == T(0));
  // without weights: the same p
  Tensor<T, graphmoe::cuda> dp2;
  attention_graph_decode(dr, c.rows, dstep, args, dcache, dp2, dheads);
  check_equal("p without weights", to_host(dp), dp2);
}

TEST_CASE_TEMPLATE("cuda vs cpu: attention_graph_decode refuses an all-zero attention row with the "
                   "CPU's message", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(13);
  AttentionGraphCase<T> c(true, rng);
  // row 2 (slot 3, position 11): every head's row at or below the floor, whichever h* is chosen
  const index_t nh = AttentionGraphCase<T>::nh;
  for (index_t h = 0; h < nh; ++h)
    for (index_t j = 0; j < kMaxLen; ++j)
      c.step.probs.data()[(2 * nh + h) * kMaxLen + j] =
          j % 2 == 0 ? T(0) : static_cast<T>(attention_prior_floor<T>());
  const KVCache<T, graphmoe::cuda> dkv = to_device(c.kv);
  const AttentionStep<T, graphmoe::cuda> dstep = to_device(c.step, dkv);
  AttentionDecodeCache<T, graphmoe::cuda> dcache = to_device(c.cache);
  const AttentionGraphArgs args = attention_decode_args();
  const std::string cpu_msg = error_of([&] {
    Tensor<T, cpu> p;
    std::vector<int> heads;
    attention_graph_decode(c.r, c.rows, c.step, args, c.cache, p, heads);
  });
  const std::string cuda_msg = error_of([&] {
    Tensor<T, graphmoe::cuda> p;
    std::vector<int> heads;
    attention_graph_decode(to_device(c.r), c.rows, dstep, args, dcache, p, heads);
  });
  CHECK(cpu_msg.find("position 11 of slot 3") != std::string::npos);
  CHECK(cpu_msg.find("prior floor") != std::string::npos);
  CHECK(cuda_msg == cpu_msg);
}

// ---- TransformerLM::decode ---------------------------------------------------------------------

namespace {

template <class B>
Tensor<std::int32_t, B> ids_on(const std::vector<std::int32_t>& ids, const Shape& shape) {
  Tensor<std::int32_t, cpu> h(shape);
  std::copy(ids.begin(), ids.end(), h.data());
  if constexpr (std::is_same_v<B, cpu>)
    return h;
  else
    return to_device(h);
}

// The models' tolerance: the CPU decode tests' (decoded vs full forward, tests/inference).
template <class T>
double model_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

// Decodes three sequences of different lengths (the longest `longest` tokens) in three slots of
// both models together (a slot drops out when its sequence ends) and compares every step's
// logits, experts and graph weights with the CPU model's decode and the CUDA model's full forward
// of each sequence. chunks empty: one token per slot and step; else up to chunks[s] tokens of
// slot s per step, the slots' rows interleaved (one row of each slot in turn).
template <class Policy, class T>
void compare_decode(index_t longest, const std::vector<index_t>& chunks = {}, index_t head_dim = 0) {
  const double tol = model_tolerance<T>();
  TransformerLMConfig cfg = decode_config(longest);
  cfg.attention.head_dim = head_dim;
  TransformerLM<Policy, T, cpu> host(cfg, 3);
  TransformerLM<Policy, T, graphmoe::cuda> dev(cfg, 3);
  host.set_mode(Mode::Eval);
  dev.set_mode(Mode::Eval);
  host.set_step(4);  // SMoE-Dropout: k = 2 of its 1..3 schedule
  dev.set_step(4);
  const std::vector<std::vector<std::int32_t>> seqs = {
      random_ids(longest, cfg.vocab_size, 1), random_ids(12, cfg.vocab_size, 2),
      random_ids(21, cfg.vocab_size, 3)};
  const index_t v = cfg.vocab_size, nslots = static_cast<index_t>(seqs.size());
  // the CUDA model's full forward of each sequence: logits (T, V) on the host
  std::vector<Tensor<T, cpu>> full;
  for (const auto& s : seqs) {
    const index_t len = static_cast<index_t>(s.size());
    dev.forward(ids_on<graphmoe::cuda>(s, Shape{1, len}), Tensor<std::int32_t, graphmoe::cuda>());
    full.push_back(to_host(dev.logits()).view(Shape{len, v}).clone());
  }
  auto hcache = host.decode_cache(nslots);
  auto dcache = dev.decode_cache(nslots);
  Tensor<T, cpu> hlogits;
  Tensor<T, graphmoe::cuda> dlogits;
  std::vector<Tensor<T, cpu>> hweights;
  std::vector<Tensor<T, graphmoe::cuda>> dweights;
  std::vector<index_t> fed(seqs.size(), 0);
  for (index_t i = 0;; ++i) {
    CAPTURE(i);
    test::DecodeStepInput in;
    if (chunks.empty()) {
      if (i == longest) break;
      in = test::decode_step_input(seqs, i);
    } else {
      for (index_t j = 0;; ++j) {  // the j-th row of every slot that has one left, in turn
        bool any = false;
        for (std::size_t s = 0; s < seqs.size(); ++s) {
          if (j >= chunks[s] || fed[s] == static_cast<index_t>(seqs[s].size())) continue;
          in.rows.slot.push_back(static_cast<index_t>(s));
          in.rows.pos.push_back(fed[s]);
          in.ids.push_back(seqs[s][static_cast<std::size_t>(fed[s]++)]);
          any = true;
        }
        if (!any) break;
      }
      if (in.ids.empty()) break;
    }
    const DecodeRows& rows = in.rows;
    const std::vector<std::int32_t>& ids = in.ids;
    const Shape shape{rows.size()};
    host.decode(ids_on<cpu>(ids, shape), rows, hcache, hlogits, &hweights);
    dev.decode(ids_on<graphmoe::cuda>(ids, shape), rows, dcache, dlogits, &dweights);
    check_close("decoded logits vs the CPU decode", hlogits, dlogits, tol);
    // the same rows of the CUDA full forward
    Tensor<T, cpu> want(Shape{rows.size(), v});
    for (index_t r = 0; r < rows.size(); ++r)
      std::copy_n(full[static_cast<std::size_t>(rows.slot[static_cast<std::size_t>(r)])].data() +
                      rows.pos[static_cast<std::size_t>(r)] * v,
                  v, want.data() + r * v);
    check_close("decoded logits vs the CUDA forward", want, dlogits, tol);
    for (index_t l = 0; l < cfg.num_layers; ++l) {
      CAPTURE(l);
      check_equal("experts", host.block(l).moe().routing().selection.indices,
                  dev.block(l).moe().routing().selection.indices);
      const Tensor<T, cpu>& hw = hweights[static_cast<std::size_t>(l)];
      const Tensor<T, graphmoe::cuda>& dw = dweights[static_cast<std::size_t>(l)];
      REQUIRE(hw.empty() == dw.empty());  // Independent: no graph weights
      if (!hw.empty()) check_close("graph weights", hw, dw, tol);
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM::decode over three slots equals the CPU decode and "
                   "the CUDA full forward", Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
  SUBCASE("double, 210 tokens") { compare_decode<Policy, double>(210); }
  SUBCASE("float") { compare_decode<Policy, float>(30); }
}

// Heads wider than d_model / num_heads (3 heads of 7 on d_model 12): the KV cache holds 7-wide
// heads, and the Attention graph's decode reads W_o (12 x 21) by head.
TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM::decode with head_dim set", Policy, SoftmaxRouter,
                   AttentionRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_decode<Policy, double>(30, {}, 7);
}

// A prompt in chunks (Decoder::prefill's steps): several rows of a slot at consecutive positions
// in one step, the slots' chunks interleaved, in double. Every op appends all rows in one kernel
// before any row reads in the next (backend/cuda/decode.cuh), so each row equals the CPU's
// whatever order the blocks run in.
TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM::decode of chunks of several tokens per slot and step",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
#if defined(GRAPHMOE_CUDA_EMULATION)
  // a GPU runs a launch's blocks in any order: the emulation runs them last first, so that a row
  // reading a cache entry that a later row's block writes in the same kernel would read it stale
  graphmoe_cuda_emulation::set_blocks_descending(true);
  struct Ascending {
    ~Ascending() { graphmoe_cuda_emulation::set_blocks_descending(false); }
  } ascending;
#endif
  compare_decode<Policy, double>(40, {16, 5, 7});
}

// The other causal routers differ from the three above in their scorer (X-MoE's cosine) or
// selector (SMoE-Dropout's scheduled k), which the decode shares with the forward; one of each,
// on a graph, in double (the CPU's tests/inference/test_decode.cpp has all nine).
TEST_CASE_TEMPLATE("cuda vs cpu: TransformerLM::decode with X-MoE and SMoE-Dropout routers", Policy,
                   SimilarityXMoERouter, AttentionSMoEDropoutRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
  compare_decode<Policy, double>(210);
}

// ---- generate ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: greedy generate and generate_batch give the CPU's tokens", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  SKIP_WITHOUT_CUDA_DEVICE();
  using T = double;
  const TransformerLMConfig cfg = decode_config(16);
  TransformerLM<Policy, T, cpu> host(cfg, 5);
  TransformerLM<Policy, T, graphmoe::cuda> dev(cfg, 5);
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.sampling.greedy = true;
  SUBCASE("a batch of three prompts, explained") {
    opt.explain = true;
    const std::vector<std::vector<std::int32_t>> prompts = {
        random_ids(5, cfg.vocab_size, 21), random_ids(2, cfg.vocab_size, 22),
        random_ids(9, cfg.vocab_size, 23)};
    std::vector<RoutedToken> hr, dr;
    const auto hres = generate_batch(host, prompts, opt, {}, [&](const RoutedToken& t) { hr.push_back(t); });
    const auto dres = generate_batch(dev, prompts, opt, {}, [&](const RoutedToken& t) { dr.push_back(t); });
    REQUIRE(hres.size() == dres.size());
    for (std::size_t b = 0; b < hres.size(); ++b) {
      CAPTURE(b);
      CHECK(dres[b].tokens == hres[b].tokens);
      CHECK(dres[b].reason == hres[b].reason);
    }
    REQUIRE(dr.size() == hr.size());
    CHECK(hr.size() == 3 * 6);
    for (std::size_t j = 0; j < hr.size(); ++j) {
      CAPTURE(j);
      CHECK(dr[j].sequence == hr[j].sequence);
      CHECK(dr[j].position == hr[j].position);
      REQUIRE(dr[j].layers.size() == hr[j].layers.size());
      for (std::size_t l = 0; l < hr[j].layers.size(); ++l) {
        CHECK(dr[j].layers[l].experts == hr[j].layers[l].experts);
        REQUIRE(dr[j].layers[l].sources.size() == hr[j].layers[l].sources.size());
        for (std::size_t k = 0; k < hr[j].layers[l].sources.size(); ++k) {
          CHECK(dr[j].layers[l].sources[k].position == hr[j].layers[l].sources[k].position);
          CHECK(dr[j].layers[l].sources[k].weight ==
                doctest::Approx(hr[j].layers[l].sources[k].weight).epsilon(model_tolerance<T>()));
        }
      }
    }
  }
  SUBCASE("one prompt past the context (the window slides), and the full-forward decoder") {
    const std::vector<std::int32_t> prompt = random_ids(13, cfg.vocab_size, 31);
    const GenerateResult h = generate(host, prompt, opt);
    const GenerateResult d = generate(dev, prompt, opt);
    CHECK(d.tokens == h.tokens);
    opt.decoding = Decoding::FullForward;
    CHECK(generate(dev, prompt, opt).tokens == h.tokens);
  }
}

}  // namespace graphmoe
