// The blocks of the MoE families trained today inside the LM: RMSNorm, rotary positions (both
// layouts), grouped-query and multi-query attention, QK-norm over rows and over heads, bias-free
// projections, shared experts (gated and not), fine-grained expert widths and dense first
// blocks. The attention layer against a loop-by-loop evaluation in double, the whole LM by finite
// differences in double for every router kind, causality, and incremental decoding against the
// full forward.
#include <doctest/doctest.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/layers/attention.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/heads.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {

// Two variants that together switch every option on; the third is the first with heads wider
// than d_model / num_heads (head_dim 6: q is 24 wide for d_model 8) and q/k/v biases; the fourth
// the first with multi-head latent attention.
TransformerLMConfig modern_config(int variant) {
  const bool v0 = variant != 1;  // variants 0 and 2
  TransformerLMConfig c;
  c.vocab_size = 9;
  c.max_seq_len = 12;
  c.d_model = 8;
  c.num_layers = 3;
  c.num_heads = 4;
  c.d_ff = 5;
  c.tie_embeddings = variant == 1;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.allow_unused_options = true;
  test::set_scorer_init_std(c.router, 0.5);
  c.router.options<Similarity>().tau = 2.0;
  c.router.load_balance_coef = 0.05;
  c.init_std = 0.4;
  c.norm = NormKind::RMSNorm;
  c.norm_eps = 1e-6;
  c.attention.rope_theta = v0 ? 10000.0 : 500.0;
  c.attention.rope_layout = v0 ? RopeLayout::HalfSplit : RopeLayout::Interleaved;
  c.attention.num_kv_heads = v0 ? 2 : 1;
  c.attention.qk_norm = v0 ? QKNorm::Full : QKNorm::PerHead;
  c.attention.qkv_bias = variant != 0;
  c.attention.out_bias = false;
  c.attention.head_dim = variant == 2 ? 6 : 0;
  if (variant == 3) {  // multi-head latent attention in place of the heads above
    c.attention.num_kv_heads = 0;
    c.attention.qk_norm = QKNorm::None;
    c.attention.qkv_bias = false;
    c.attention.kv_lora_rank = 4;
    c.attention.q_lora_rank = 5;
    c.attention.qk_nope_head_dim = 2;
    c.attention.qk_rope_head_dim = 2;
    c.attention.v_head_dim = 3;
  }
  c.expert_d_ff = 3;
  c.shared_d_ff = 4;
  c.shared_expert_gate = v0;
  c.first_k_dense = v0 ? 1 : 0;
  c.moe_every = v0 ? 1 : 2;
  c.activation = v0 ? FfnActivation::SwiGLU : FfnActivation::Gelu;
  c.ffn_bias = variant == 1;
  return c;
}

Tensor<std::int32_t> random_ids(index_t b, index_t t, index_t vocab, Rng& rng) {
  Tensor<std::int32_t> x({b, t});
  for (index_t i = 0; i < x.numel(); ++i)
    x.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return x;
}

double rms_inv(const double* x, index_t n, double eps) {
  double s = 0;
  for (index_t i = 0; i < n; ++i) s += x[i] * x[i];
  return 1.0 / std::sqrt(s / static_cast<double>(n) + eps);
}

// RoPE of one head's vector at position p, written out pair by pair.
void rope_ref(double* v, index_t dh, index_t p, double theta, RopeLayout layout) {
  std::vector<double> out(v, v + dh);
  for (index_t i = 0; i < dh / 2; ++i) {
    const double freq = 1.0 / std::pow(theta, 2.0 * static_cast<double>(i) / static_cast<double>(dh));
    const double a = static_cast<double>(p) * freq, c = std::cos(a), s = std::sin(a);
    const index_t i0 = layout == RopeLayout::HalfSplit ? i : 2 * i;
    const index_t i1 = layout == RopeLayout::HalfSplit ? i + dh / 2 : 2 * i + 1;
    out[i0] = v[i0] * c - v[i1] * s;
    out[i1] = v[i1] * c + v[i0] * s;
  }
  std::copy(out.begin(), out.end(), v);
}

// max |a - b| over two tensors of one shape (0 exactly when they are bit-identical)
double max_abs_diff(const Tensor<double>& a, const Tensor<double>& b) {
  REQUIRE(a.shape() == b.shape());
  double m = 0;
  for (index_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.data()[i] - b.data()[i]));
  return m;
}

// An attention layer of d_model d and h heads declared, bound and drawn from Rng(seed), with its
// norm weights and biases drawn too (not 1 and 0), so that a misplaced one shows; returns the rng.
Rng make_layer(ParameterArena<double>& arena, MultiHeadAttention<double>& attn, index_t d,
               index_t h, const AttentionOptions& o, std::uint64_t seed) {
  attn.declare(arena, "a.", d, h, true, o);
  arena.allocate();
  attn.bind(arena);
  Rng rng(seed);
  attn.init(rng, 0.5);
  for (const auto& info : arena.params())
    if (info.name.find("norm") != std::string::npos || info.name.find("bias") != std::string::npos)
      fill_normal(arena.value(info.name), rng, 0.5);
  return rng;
}

using Rows = std::vector<std::vector<double>>;

// Causal attention of row i of sequence bb (T rows each), written out: for every head h,
// softmax(q_h k_g^T / sqrt(dqk)) v_g over positions 0..i, where g = h / group is the key/value
// head it reads. q, k, v: each row's heads side by side (q and k dqk wide, v dv wide per head).
std::vector<double> reference_heads(const Rows& q, const Rows& k, const Rows& v, index_t t,
                                    index_t bb, index_t i, index_t heads, index_t group,
                                    index_t dqk, index_t dv) {
  std::vector<double> att(static_cast<std::size_t>(heads * dv), 0.0);
  for (index_t hh = 0; hh < heads; ++hh) {
    const index_t g = hh / group;
    std::vector<double> sc;
    double mx = -1e300;
    for (index_t j = 0; j <= i; ++j) {
      double dot = 0;
      for (index_t c = 0; c < dqk; ++c) dot += q[bb * t + i][hh * dqk + c] * k[bb * t + j][g * dqk + c];
      sc.push_back(dot / std::sqrt(static_cast<double>(dqk)));
      mx = std::max(mx, sc.back());
    }
    double z = 0;
    for (double& e : sc) z += (e = std::exp(e - mx));
    for (index_t j = 0; j <= i; ++j)
      for (index_t c = 0; c < dv; ++c) att[hh * dv + c] += sc[j] / z * v[bb * t + j][g * dv + c];
  }
  return att;
}

// An attention layer's gradients with respect to x and every parameter, by finite differences of
// a random weighting of its output.
void check_layer_gradients(MultiHeadAttention<double>& attn, ParameterArena<double>& arena,
                           Tensor<double> x, const Shape& out, Rng& rng) {
  Tensor<double> w = random_normal<double>(out, rng), a;
  auto loss = [&] {
    Tensor<double> y;
    attn.forward(x, y);
    return weighted_sum(y, w);
  };
  attn.forward(x, a);
  arena.zero_grad();
  Tensor<double> dx;
  attn.backward(w, dx);
  check_gradient("dx", x, dx, loss);
  for (const auto& info : arena.params()) {
    Tensor<double> val = arena.value(info.name);
    check_gradient(info.name, val, arena.grad(info.name), loss);
  }
}

}  // namespace

TEST_CASE("attention with GQA, RoPE, QK-norm and head_dim: matches a loop-by-loop evaluation") {
  for (int variant : {0, 1, 2}) {
    CAPTURE(variant);
    const TransformerLMConfig lc = modern_config(variant);
    const AttentionOptions& o = lc.attention;
    const index_t b = 2, t = 5, d = lc.d_model, h = lc.num_heads, kvh = o.num_kv_heads,
                  dh = o.head_dim_for(d, h), dq = h * dh;
    CHECK(dq == (variant == 2 ? 24 : d));
    ParameterArena<double> arena;
    MultiHeadAttention<double> attn;
    Rng rng = make_layer(arena, attn, d, h, o, 5);
    Tensor<double> x = random_normal<double>({b, t, d}, rng), a;
    attn.forward(x, a);

    auto proj = [&](const std::string& name, index_t out, index_t row) {
      Tensor<double> w = arena.value(name + ".weight");
      const bool bias = arena.contains(name + ".bias");
      std::vector<double> y(static_cast<std::size_t>(out), 0.0);
      for (index_t i = 0; i < out; ++i) {
        for (index_t j = 0; j < d; ++j) y[i] += x.data()[row * d + j] * w(i, j);
        if (bias) y[i] += arena.value(name + ".bias")(i);
      }
      return y;
    };
    const index_t n = b * t;
    Rows q(n), k(n), v(n);
    for (index_t r = 0; r < n; ++r) {
      q[r] = proj("a.q_proj", dq, r);
      k[r] = proj("a.k_proj", kvh * dh, r);
      v[r] = proj("a.v_proj", kvh * dh, r);
      Tensor<double> qn = arena.value("a.q_norm.weight"), kn = arena.value("a.k_norm.weight");
      if (o.qk_norm == QKNorm::Full) {
        const double iq = rms_inv(q[r].data(), dq, o.qk_norm_eps);
        const double ik = rms_inv(k[r].data(), kvh * dh, o.qk_norm_eps);
        for (index_t i = 0; i < dq; ++i) q[r][i] *= iq * qn(i);
        for (index_t i = 0; i < kvh * dh; ++i) k[r][i] *= ik * kn(i);
      } else {
        for (index_t hh = 0; hh < h; ++hh) {
          const double iq = rms_inv(q[r].data() + hh * dh, dh, o.qk_norm_eps);
          for (index_t i = 0; i < dh; ++i) q[r][hh * dh + i] *= iq * qn(i);
        }
        for (index_t hh = 0; hh < kvh; ++hh) {
          const double ik = rms_inv(k[r].data() + hh * dh, dh, o.qk_norm_eps);
          for (index_t i = 0; i < dh; ++i) k[r][hh * dh + i] *= ik * kn(i);
        }
      }
      for (index_t hh = 0; hh < h; ++hh) rope_ref(q[r].data() + hh * dh, dh, r % t, o.rope_theta, o.rope_layout);
      for (index_t hh = 0; hh < kvh; ++hh) rope_ref(k[r].data() + hh * dh, dh, r % t, o.rope_theta, o.rope_layout);
    }
    Tensor<double> wo = arena.value("a.out_proj.weight");
    REQUIRE_FALSE(arena.contains("a.out_proj.bias"));
    double worst = 0;
    for (index_t bb = 0; bb < b; ++bb)
      for (index_t i = 0; i < t; ++i) {
        const std::vector<double> att = reference_heads(q, k, v, t, bb, i, h, h / kvh, dh, dh);
        for (index_t c = 0; c < d; ++c) {
          double y = 0;
          for (index_t j = 0; j < dq; ++j) y += att[j] * wo(c, j);
          worst = std::max(worst, std::abs(y - a(bb, i, c)));
        }
      }
    CHECK(worst < 1e-12);
    check_layer_gradients(attn, arena, x, a.shape(), rng);
  }
}

// Multi-head latent attention: the layer against a loop-by-loop evaluation of its formulas
// (layers/latent_attention.hpp) in double, and its gradients by finite differences; with and
// without the query latent, with v as wide as the query heads and narrower, both RoPE layouts.
TEST_CASE("multi-head latent attention: matches a loop-by-loop evaluation, finite-difference gradients") {
  for (int variant : {0, 1, 2}) {
    CAPTURE(variant);
    AttentionOptions o;
    o.rope_theta = variant == 1 ? 500.0 : 10000.0;
    o.rope_layout = variant == 2 ? RopeLayout::Interleaved : RopeLayout::HalfSplit;
    o.qkv_bias = false;
    o.out_bias = variant == 1;
    o.kv_lora_rank = 5;
    o.q_lora_rank = variant == 0 ? 0 : 6;
    o.qk_nope_head_dim = 3;
    o.qk_rope_head_dim = 4;
    o.v_head_dim = variant == 2 ? 7 : 2;  // 7 = dn + dr: no padding
    o.latent_norm_eps = 1e-5;
    const index_t b = 2, t = 5, d = 8, h = 3, dn = 3, dr = 4, dv = o.v_head_dim, r = 5,
                  rq = o.q_lora_rank, dqk = dn + dr;
    ParameterArena<double> arena;
    MultiHeadAttention<double> attn;
    Rng rng = make_layer(arena, attn, d, h, o, 11);
    CHECK(arena.contains("a.q_proj.weight") == (rq == 0));
    CHECK(arena.contains("a.q_a_layernorm.weight") == (rq > 0));
    CHECK(arena.value("a.kv_a_proj_with_mqa.weight").shape() == (Shape{r + dr, d}));
    CHECK(arena.value("a.kv_b_proj.weight").shape() == (Shape{h * (dn + dv), r}));
    CHECK(arena.value("a.out_proj.weight").shape() == (Shape{d, h * dv}));
    Tensor<double> x = random_normal<double>({b, t, d}, rng), a;
    attn.forward(x, a);

    // y = W v (+ bias) for a named linear map
    auto linear = [&](const std::string& name, const std::vector<double>& in) {
      Tensor<double> w = arena.value(name + ".weight");
      std::vector<double> y(static_cast<std::size_t>(w.dim(0)), 0.0);
      for (index_t i = 0; i < w.dim(0); ++i)
        for (index_t j = 0; j < w.dim(1); ++j) y[i] += w(i, j) * in[j];
      if (arena.contains(name + ".bias"))
        for (index_t i = 0; i < w.dim(0); ++i) y[i] += arena.value(name + ".bias")(i);
      return y;
    };
    auto rms = [&](std::vector<double> v, const std::string& name) {
      const double inv = rms_inv(v.data(), static_cast<index_t>(v.size()), o.latent_norm_eps);
      Tensor<double> w = arena.value(name);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] *= inv * w(static_cast<index_t>(i));
      return v;
    };
    const index_t n = b * t;
    Rows q(n), k(n), v(n);
    for (index_t row = 0; row < n; ++row) {
      const std::vector<double> xr(x.data() + row * d, x.data() + (row + 1) * d);
      const std::vector<double> qraw =
          rq == 0 ? linear("a.q_proj", xr)
                  : linear("a.q_b_proj", rms(linear("a.q_a_proj", xr), "a.q_a_layernorm.weight"));
      const std::vector<double> ckv = linear("a.kv_a_proj_with_mqa", xr);
      const std::vector<double> c(ckv.begin(), ckv.begin() + r);
      std::vector<double> kpe(ckv.begin() + r, ckv.end());
      rope_ref(kpe.data(), dr, row % t, o.rope_theta, o.rope_layout);
      const std::vector<double> kv = linear("a.kv_b_proj", rms(c, "a.kv_a_layernorm.weight"));
      q[row].resize(static_cast<std::size_t>(h * dqk));
      k[row].resize(static_cast<std::size_t>(h * dqk));
      v[row].resize(static_cast<std::size_t>(h * dv));
      for (index_t hh = 0; hh < h; ++hh) {
        std::vector<double> qpe(qraw.begin() + hh * dqk + dn, qraw.begin() + (hh + 1) * dqk);
        rope_ref(qpe.data(), dr, row % t, o.rope_theta, o.rope_layout);
        for (index_t j = 0; j < dn; ++j) {
          q[row][hh * dqk + j] = qraw[hh * dqk + j];
          k[row][hh * dqk + j] = kv[hh * (dn + dv) + j];
        }
        for (index_t j = 0; j < dr; ++j) {
          q[row][hh * dqk + dn + j] = qpe[j];
          k[row][hh * dqk + dn + j] = kpe[j];
        }
        for (index_t j = 0; j < dv; ++j) v[row][hh * dv + j] = kv[hh * (dn + dv) + dn + j];
      }
    }
    double worst = 0;
    for (index_t bb = 0; bb < b; ++bb)
      for (index_t i = 0; i < t; ++i) {
        const std::vector<double> y =
            linear("a.out_proj", reference_heads(q, k, v, t, bb, i, h, 1, dqk, dv));
        for (index_t c = 0; c < d; ++c) worst = std::max(worst, std::abs(y[c] - a(bb, i, c)));
      }
    CHECK(worst < 1e-12);
    check_layer_gradients(attn, arena, x, a.shape(), rng);
  }
}

TEST_CASE_TEMPLATE("modern LM blocks: finite-difference gradients of the whole model", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter, SimilaritySigmoidBiasRouter) {
  for (int variant : {0, 1, 2, 3}) {
    if (variant == 3 && Policy::needs_attention) continue;  // refused: a test case below
    CAPTURE(variant);
    const TransformerLMConfig cfg = modern_config(variant);
    TransformerLM<Policy, double> lm(cfg, 3);
    CHECK_FALSE(lm.arena().contains("pos_emb.weight"));  // RoPE: no learned positions
    // variant 0: the first block dense (first_k_dense); variant 1: MoE every other block
    CHECK_FALSE(lm.block(0).is_moe());
    CHECK(lm.block(1).is_moe());
    CHECK(lm.block(2).is_moe() == (variant != 1));
    CHECK(lm.block(1).has_shared());
    // SwiGLU: the fused gate|up projection (2F rows), no biases
    CHECK(lm.arena().value("blocks.1.moe.experts.w1").dim(1) == (variant != 1 ? 6 : 3));
    if (variant != 3)
      CHECK(lm.arena().value("blocks.1.attn.q_proj.weight").shape() ==
            (Shape{variant == 2 ? 24 : cfg.d_model, cfg.d_model}));
    else  // 4 heads of 2 + 2 through a query latent of 5
      CHECK(lm.arena().value("blocks.1.attn.q_b_proj.weight").shape() == (Shape{16, 5}));
    CHECK(lm.arena().contains("blocks.1.moe.experts.b1") == (variant == 1));
    CHECK_FALSE(lm.block(0).has_shared());
    CHECK(lm.arena().contains("blocks.1.shared_expert_gate.weight") == (variant != 1));
    Rng rng(4);
    auto ids = random_ids(2, 6, cfg.vocab_size, rng);
    auto targets = random_ids(2, 6, cfg.vocab_size, rng);
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
}

TEST_CASE_TEMPLATE("modern LM blocks: causal, and incremental decoding equals the full forward", Policy,
                   SoftmaxRouter, SimilarityRouter, AttentionRouter, SigmoidBiasRouter) {
  for (int variant : {0, 1, 2, 3}) {
    if (variant == 3 && Policy::needs_attention) continue;
    CAPTURE(variant);
    const TransformerLMConfig cfg = modern_config(variant);
    TransformerLM<Policy, double> lm(cfg, 7);
    lm.set_mode(Mode::Eval);
    Rng rng(9);
    const index_t t = cfg.max_seq_len;
    auto ids = random_ids(1, t, cfg.vocab_size, rng);
    lm.forward(ids, Tensor<std::int32_t>());
    const Tensor<double> full = lm.logits().clone();
    // causality: a later token changes no earlier logit
    auto changed = ids.clone();
    changed(0, t - 1) = (changed(0, t - 1) + 1) % static_cast<std::int32_t>(cfg.vocab_size);
    lm.forward(changed, Tensor<std::int32_t>());
    for (index_t i = 0; i < t - 1; ++i)
      for (index_t c = 0; c < cfg.vocab_size; ++c) CHECK(lm.logits()(0, i, c) == full(0, i, c));
    // one token per step; the KV cache holds the num_kv_heads heads only
    auto cache = lm.decode_cache(1);
    // (multi-head latent attention: every head's key and padded value, dn + dr = 4 wide)
    const bool mla = cfg.attention.latent();
    const index_t dh = mla ? 4 : cfg.attention.head_dim_for(cfg.d_model, cfg.num_heads);
    const index_t kvh = mla ? cfg.num_heads : cfg.attention.num_kv_heads;
    for (const auto& b : cache.blocks) {
      CHECK(b.kv.kv_heads() == kvh);
      CHECK(b.kv.heads() == cfg.num_heads);
      CHECK(b.kv.head_dim() == dh);
    }
    CHECK(cache.kv_values_per_token() == cfg.num_layers * 2 * kvh * dh);
    double worst = 0;
    for (index_t i = 0; i < t; ++i) {
      Tensor<std::int32_t> one(Shape{1});
      one.data()[0] = ids(0, i);
      Tensor<double> logits;
      lm.decode(one, DecodeRows{{0}, {i}}, cache, logits);
      for (index_t c = 0; c < cfg.vocab_size; ++c)
        worst = std::max(worst, std::abs(logits(0, c) - full(0, i, c)));
    }
    CHECK(worst < 1e-12);
  }
}

TEST_CASE("decode ops: a grouped KV cache gives exactly what the repeated heads give") {
  // H = 4 query heads over Hkv = 2 cached heads (and 1: multi-query): attention_decode and the
  // Attention graph's decode read cached head h / g; the same step on a cache of the repeated
  // heads (what a multi-head cache of repeat_heads(k), repeat_heads(v) holds) is the reference.
  const index_t nh = 4, dh = 3, slots = 2, max_len = 6, e = 5;
  for (index_t nkv : {2, 1}) {
    CAPTURE(nkv);
    Rng rng(17);
    KVCache<double, cpu> grouped(slots, nh, nkv, max_len, dh), full(slots, nh, max_len, dh);
    CHECK(grouped.values_per_token() == 2 * nkv * dh);
    CHECK(grouped.group() == nh / nkv);
    AttentionDecodeCache<double, cpu> gcache, fcache;
    for (auto* c : {&gcache, &fcache}) {
      c->r = Tensor<double>(Shape{slots, max_len, e});
      c->msq = Tensor<double>(Shape{slots, nh, max_len});
      c->entropy_prefix.assign(static_cast<std::size_t>(slots * max_len * nh), 0.0);
    }
    const Tensor<double> w_o = random_normal<double>(Shape{nh * dh, nh * dh}, rng, 0.4);
    const Tensor<double> b_o = random_normal<double>(Shape{nh * dh}, rng, 0.2);
    AttentionGraphArgs args;
    args.causal_heads = true;
    args.sigma = 1.1;
    args.d_model = nh * dh;
    // three steps: slot 0 one token at a time, slot 1 a chunk of two
    const std::vector<DecodeRows> steps = {DecodeRows{{0, 1, 1}, {0, 0, 1}}, DecodeRows{{0}, {1}},
                                           DecodeRows{{1, 0}, {2, 2}}};
    for (const DecodeRows& rows : steps) {
      const index_t n = rows.size();
      const Tensor<double> q = random_normal<double>(Shape{n, nh * dh}, rng);
      const Tensor<double> k = random_normal<double>(Shape{n, nkv * dh}, rng);
      const Tensor<double> v = random_normal<double>(Shape{n, nkv * dh}, rng);
      Tensor<double> kr, vr, pg, eg, og, pf, ef, of;
      repeat_heads(k, nkv, nh, kr);
      repeat_heads(v, nkv, nh, vr);
      attention_decode(q, k, v, rows, grouped, pg, eg, og);
      attention_decode(q, kr, vr, rows, full, pf, ef, of);
      CHECK(max_abs_diff(pg, pf) == 0.0);
      CHECK(max_abs_diff(eg, ef) == 0.0);
      CHECK(max_abs_diff(og, of) == 0.0);
      // the Attention graph's step reads the V cache through the same head map
      Tensor<double> r(Shape{n, e});
      for (index_t i = 0; i < n; ++i) {
        double sum = 0;
        for (index_t c = 0; c < e; ++c) sum += (r(i, c) = rng.uniform(0.1, 1.0));
        for (index_t c = 0; c < e; ++c) r(i, c) /= sum;
      }
      AttentionStep<double, cpu> sg{nh, pg, eg, og, w_o, b_o, &grouped};
      AttentionStep<double, cpu> sf{nh, pf, ef, of, w_o, b_o, &full};
      Tensor<double> p_g, p_f, w_g, w_f;
      std::vector<int> h_g, h_f;
      attention_graph_decode(r, rows, sg, args, gcache, p_g, h_g, &w_g);
      attention_graph_decode(r, rows, sf, args, fcache, p_f, h_f, &w_f);
      CHECK(h_g == h_f);
      CHECK(max_abs_diff(p_g, p_f) == 0.0);
      CHECK(max_abs_diff(w_g, w_f) == 0.0);
      CHECK(max_abs_diff(gcache.msq, fcache.msq) == 0.0);
    }
  }
  // a cache whose heads do not divide the query heads is refused
  CHECK_THROWS_WITH_AS((KVCache<double, cpu>(1, 4, 3, 4, 2)), doctest::Contains("must divide heads"),
                       std::exception);
}

TEST_CASE("modern LM blocks: bad options are refused naming the field") {
  TransformerLMConfig c = modern_config(0);
  c.attention.num_kv_heads = 3;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("num_kv_heads = 3"), Error);
  c = modern_config(0);
  c.num_heads = 8;  // head_dim 1: odd, RoPE needs pairs
  c.attention.num_kv_heads = 2;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("must be even"), Error);
  c = modern_config(0);
  c.shared_d_ff = 0;  // a gate without shared experts
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("shared_expert_gate"), Error);
  c = modern_config(0);
  c.moe_every = 0;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("moe_every"), Error);
  c = modern_config(2);
  c.attention.head_dim = 5;  // odd, RoPE needs pairs
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("head_dim = 5 must be even"), Error);
  c.attention.head_dim = -2;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("head_dim = -2"), Error);
  c = modern_config(0);
  c.num_heads = 3;  // does not divide d_model = 8, and no head_dim
  c.attention.num_kv_heads = 1;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("must divide d_model = 8"), Error);
  c.attention.head_dim = 4;  // which head_dim allows
  CHECK_NOTHROW((TransformerLM<SoftmaxRouter, double>(c, 1)));
  // multi-head latent attention: its options, and not with the Attention graph
  c = modern_config(3);
  c.attention.v_head_dim = 5;  // above qk_nope_head_dim + qk_rope_head_dim = 4
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("v_head_dim = 5 must be at most"), Error);
  c = modern_config(3);
  c.attention.qk_rope_head_dim = 3;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("qk_rope_head_dim = 3 must be even"), Error);
  c = modern_config(3);
  c.attention.num_kv_heads = 2;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("leave head_dim = 0, num_kv_heads = 0"), Error);
  c = modern_config(3);
  c.attention.rope_theta = 0;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("rope_theta must be > 0"), Error);
  c = modern_config(0);
  c.attention.v_head_dim = 3;  // without kv_lora_rank
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("set kv_lora_rank too"), Error);
  CHECK_THROWS_WITH_AS((TransformerLM<AttentionRouter, double>(modern_config(3), 1)),
                       doctest::Contains("multi-head latent attention (kv_lora_rank = 4) does not expose"), Error);
  c = modern_config(0);
  c.attention.rope_theta = -1;
  CHECK_THROWS_WITH_AS((TransformerLM<SoftmaxRouter, double>(c, 1)), doctest::Contains("rope_theta"), Error);
}

TEST_CASE("presets: every family's switches, a forward, a training step and decoding on a small copy") {
  CHECK(TransformerLMConfig::preset_names().size() == 7);
  for (const std::string& arch : TransformerLMConfig::preset_names()) {
    CAPTURE(arch);
    TransformerLMConfig c = TransformerLMConfig::preset(arch, 23);
    c.validate();
    if (arch == "llama") CHECK(c.layout == MoELayout::Dense);
    if (arch == "olmoe") {
      CHECK(c.attention.qk_norm == QKNorm::Full);
      CHECK_FALSE(c.router.options<TopK>().norm_topk_prob);
      CHECK(c.router.num_experts == 64);
      CHECK(c.router.k == 8);
    }
    if (arch == "qwen2-moe") CHECK(c.shared_expert_gate);
    if (arch == "deepseek-v3") {
      CHECK(c.first_k_dense == 1);
      CHECK(c.router.options<TopK>().routed_scaling_factor == 2.5);
      CHECK(c.router.options<TopK>().n_group == 8);
      CHECK(c.router.seq_aux_loss_coef == 1e-4);
      CHECK(c.router.load_balance_coef == 0);
    } else {
      CHECK(c.router.seq_aux_loss_coef == 0);
    }
    // a small copy: the same switches and expert counts, tiny widths
    c.d_model = 16;
    c.num_heads = 4;
    if (c.attention.num_kv_heads > 0) c.attention.num_kv_heads = 2;
    c.d_ff = 12;
    c.max_seq_len = 10;
    c.num_layers = 2;
    if (c.expert_d_ff > 0) c.expert_d_ff = 4;
    if (c.shared_d_ff > 0) c.shared_d_ff = 6;
    c.init_std = 0.3;
    auto check = [&]<class Policy>() {
      TransformerLM<Policy, double> lm(c, 5);
      // the families' routers (Hugging Face's gate) have no bias; GPT-2's preset keeps the
      // linear scorer's (the sigmoid scorer has none by default)
      bool router_bias = false;
      for (const auto& p : lm.arena().params())
        router_bias = router_bias || p.name.ends_with(".moe.router.bias");
      CHECK(router_bias == (arch == "gpt" && std::is_same_v<Policy, SoftmaxRouter>));
      Rng rng(3);
      auto ids = random_ids(2, 10, c.vocab_size, rng);
      const Loss l = lm.forward(ids, ids);
      const double l0 = l.total();
      CHECK(std::isfinite(l0));
      CHECK((l.seq_aux > 0) == (arch == "deepseek-v3"));
      lm.arena().zero_grad();
      lm.backward();
      lm.set_mode(Mode::Eval);
      Tensor<std::int32_t> row(Shape{1, 10});
      for (index_t i = 0; i < 10; ++i) row.data()[i] = ids.data()[i];
      lm.forward(row, Tensor<std::int32_t>());
      const Tensor<double> full = lm.logits().clone();
      auto cache = lm.decode_cache(1);
      double worst = 0;
      for (index_t i = 0; i < 10; ++i) {
        Tensor<std::int32_t> one(Shape{1});
        one.data()[0] = row.data()[i];
        Tensor<double> logits;
        lm.decode(one, DecodeRows{{0}, {i}}, cache, logits);
        for (index_t v = 0; v < c.vocab_size; ++v)
          worst = std::max(worst, std::abs(logits(0, v) - full(0, i, v)));
      }
      CHECK(worst < 1e-12);
    };
    check.template operator()<SoftmaxRouter>();
    check.template operator()<SimilaritySigmoidBiasRouter>();
  }
  CHECK_THROWS_WITH_AS(TransformerLMConfig::preset("mixtrall", 10), doctest::Contains("unknown arch 'mixtrall'"), Error);
}
