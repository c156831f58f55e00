// graphmoe/layers/latent_attention.hpp: multi-head latent attention (DeepSeek-V2/V3), what
// MultiHeadAttention computes when AttentionOptions::kv_lora_rank > 0 (layer contract in
// linear.hpp). H heads; dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, r =
// kv_lora_rank, rq = q_lora_rank; N = B T rows:
//
//   q = x Wq^T                                  rq = 0                 (N, H (dn + dr))
//   q = RMSNorm(x Wqa^T) Wqb^T                  rq > 0 (the query latent, rq wide)
//   [c | kpe] = x Wkva^T                        (N, r + dr): the key/value latent c and one
//                                               rotary key kpe that every head shares
//   [knope_h | v_h] = RMSNorm(c) Wkvb^T         per head: (N, H (dn + dv))
//   q_h = [qnope_h | RoPE(qpe_h)],  k_h = [knope_h | RoPE(kpe)]
//   o_h = softmax(q_h k_h^T / sqrt(dn + dr) [+ causal mask]) v_h
//   a = [o_1 .. o_H] Wo^T + bo                  Wo (D, H dv)
//
// as Hugging Face's DeepseekV3Attention computes it without rope_scaling (its rope_interleave is
// RopeLayout::Interleaved: the scores are the same). The parameters, under the layer's prefix:
// q_proj (rq = 0) or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm,
// kv_b_proj; out_proj (its bias with out_bias); no other biases.
//
// The attention product runs the ops of every other attention (ops/attention.hpp, ops/decode.hpp)
// on heads of one width: v is padded with zero columns to dn + dr (v_head_dim <= dn + dr is
// required), which adds nothing to o_h, and the padding's columns are dropped from the output.
// Incremental decoding caches the full keys and padded values of the H heads (2 H (dn + dr)
// values per token and layer), not the latent (r + dr): the same results, not MLA's smaller
// cache. The Attention token graph does not read this layer (TransformerBlock refuses the pair).
#pragma once

#include <string>
#include <vector>

#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/rope.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/heads.hpp"
#include "graphmoe/ops/rmsnorm.hpp"
#include "graphmoe/ops/rope.hpp"

namespace graphmoe {

template <class T, class B = cpu, class C = T>
class LatentAttention {
 public:
  // opts: AttentionOptions (layers/attention.hpp) with kv_lora_rank > 0, validated by the caller.
  template <class Options>
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               index_t num_heads, bool causal, const Options& opts) {
    d_ = d_model;
    heads_ = num_heads;
    causal_ = causal;
    dn_ = opts.qk_nope_head_dim;
    dr_ = opts.qk_rope_head_dim;
    dv_ = opts.v_head_dim;
    r_ = opts.kv_lora_rank;
    rq_ = opts.q_lora_rank;
    theta_ = opts.rope_theta;
    layout_ = opts.rope_layout;
    eps_ = opts.latent_norm_eps;
    out_bias_ = opts.out_bias;
    const index_t dqk = dn_ + dr_;
    if (rq_ == 0) {
      q_.declare(arena, prefix + "q_proj.", d_model, heads_ * dqk, false);
    } else {
      qa_.declare(arena, prefix + "q_a_proj.", d_model, rq_, false);
      id_qan_ = arena.add(prefix + "q_a_layernorm.weight", Shape{rq_});
      qb_.declare(arena, prefix + "q_b_proj.", rq_, heads_ * dqk, false);
    }
    kva_.declare(arena, prefix + "kv_a_proj_with_mqa.", d_model, r_ + dr_, false);
    id_kvn_ = arena.add(prefix + "kv_a_layernorm.weight", Shape{r_});
    kvb_.declare(arena, prefix + "kv_b_proj.", r_, heads_ * (dn_ + dv_), false);
    o_.declare(arena, prefix + "out_proj.", heads_ * dv_, d_model, out_bias_);
  }
  void bind(const ParameterArena<T, B>& arena) {
    for (Linear<T, B, C>* l : linears()) l->bind(arena);
    if (rq_ > 0) {
      qan_ = arena.value(id_qan_);
      dqan_ = arena.grad(id_qan_);
    }
    kvn_ = arena.value(id_kvn_);
    dkvn_ = arena.grad(id_kvn_);
    if (!out_bias_) zero_bo_ = Tensor<T, B>(Shape{d_});
  }
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    for (Linear<T, B, C>* l : linears()) l->attach_mirror(mirror);
  }
  void init(Rng& rng, double stddev, double out_scale) {
    for (Linear<T, B, C>* l : linears()) l->init(rng, l == &o_ ? stddev * out_scale : stddev);
    if (rq_ > 0) fill(qan_, T(1));
    fill(kvn_, T(1));
  }

  // x (B, T, D) -> a (B, T, D)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& a) {
    const Shape s = x.shape();
    const index_t n = s[0] * s[1], dqk = dn_ + dr_;
    sequence_positions(s[0], s[1], positions_, positions_t_);
    Tensor<T, B> v;
    project(x.view(Shape{n, d_}), positions_, true, q_t_, k_t_, v);
    const Shape hs{s[0], s[1], heads_ * dqk};
    vpad_ = padded(v);
    probs_ = Tensor<T, B>();
    Tensor<T, B> opad;
    attention_forward(q_t_.view(hs), k_t_.view(hs), vpad_.view(hs), heads_, causal_, probs_, opad);
    prepare_output("LatentAttention", "a", a, s);
    Tensor<T, B> af = a.view(Shape{n, d_});
    o_.forward(unpadded(opad.view(Shape{n, heads_ * dqk})), af);
  }

  // da (B, T, D) -> dx (B, T, D) assigned; the parameter gradients accumulated.
  void backward(const Tensor<T, B>& da, Tensor<T, B>& dx) {
    const Shape s = da.shape();
    const index_t n = s[0] * s[1], dqk = dn_ + dr_;
    const Shape hs{s[0], s[1], heads_ * dqk};
    Tensor<T, B> dout = new_output<T, B>(Shape{n, heads_ * dv_});
    o_.backward(da.view(Shape{n, d_}), &dout);
    Tensor<T, B> dq, dk, dvpad;
    attention_backward(q_t_.view(hs), k_t_.view(hs), vpad_.view(hs), heads_, causal_, probs_,
                       padded(dout).view(hs), Tensor<T, B>(), dq, dk, dvpad);
    const Tensor<T, B> dv = unpadded(dvpad.view(Shape{n, heads_ * dqk}));
    // k_h = [knope_h | RoPE(kpe)]: the heads' rotary gradients summed into the one kpe
    Tensor<T, B> dknope, dkpe_rep, dkpe_r, dkpe, dkv, dc, dckv;
    Tensor<T, B> dcn = new_output<T, B>(Shape{n, r_});  // assigned by kv_b_proj's backward
    split_heads(dk.view(Shape{n, heads_ * dqk}), heads_, dn_, dknope, dkpe_rep);
    repeat_heads_backward(dkpe_rep, 1, heads_, dkpe_r);
    rope_backward(dkpe_r, positions_, 1, theta_, layout_, dkpe);
    concat_heads(dknope, dv, heads_, dkv);
    kvb_.backward(dkv, &dcn);
    rmsnorm_backward(c_, kvn_, c_inv_, dcn, dc, dkvn_);
    concat_heads(dc, dkpe, 1, dckv);
    prepare_output("LatentAttention::backward", "dx", dx, s);
    Tensor<T, B> dxf = dx.view(Shape{n, d_});
    kva_.backward(dckv, &dxf);  // dx assigned
    // q_h = [qnope_h | RoPE(qpe_h)]
    Tensor<T, B> dqnope, dqpe_r, dqpe, dqraw;
    split_heads(dq.view(Shape{n, heads_ * dqk}), heads_, dn_, dqnope, dqpe_r);
    rope_backward(dqpe_r, positions_, heads_, theta_, layout_, dqpe);
    concat_heads(dqnope, dqpe, heads_, dqraw);
    if (rq_ == 0) {
      q_.backward(dqraw, &dxf, true);  // dx += dq W_q
    } else {
      Tensor<T, B> dql, dqln = new_output<T, B>(Shape{n, rq_});
      qb_.backward(dqraw, &dqln);
      rmsnorm_backward(ql_, qan_, ql_inv_, dqln, dql, dqan_);
      qa_.backward(dql, &dxf, true);  // dx += dq_a W_qa
    }
  }

  // Incremental decoding (core/decode.hpp): x (n, D), one new token per row of `rows`; appends
  // its keys and padded values to kv (kv_cache()) and attends over its slot's positions 0..t.
  void decode(const Tensor<T, B>& x, const DecodeRows& rows, KVCache<T, B>& kv,
              AttentionStep<T, B>& step, Tensor<T, B>& a) {
    const index_t n = x.rows(), dqk = dn_ + dr_;
    Tensor<T, B> q, k, v, opad;
    project(x, decode_positions<B>(rows), false, q, k, v);
    if (step.probs.shape() != Shape{n, heads_, kv.max_len()}) step.probs = Tensor<T, B>();
    if (step.row_entropy.shape() != Shape{n, heads_}) step.row_entropy = Tensor<T, B>();
    attention_decode(q, k, padded(v), rows, kv, step.probs, step.row_entropy, opad);
    prepare_output("LatentAttention", "a", a, x.shape());
    o_.forward(unpadded(opad.view(Shape{n, heads_ * dqk})), a);
    step.num_heads = heads_;
    step.out = a;
    step.w_o = o_.weight();
    step.b_o = out_bias_ ? o_.bias() : zero_bo_;
    step.kv = &kv;
  }
  // An empty KV cache for `slots` sequences of at most max_len tokens: every head's key and
  // padded value, dn + dr wide.
  KVCache<T, B> kv_cache(index_t slots, index_t max_len) const {
    return KVCache<T, B>(slots, heads_, heads_, max_len, dn_ + dr_);
  }

 private:
  std::vector<Linear<T, B, C>*> linears() {
    if (rq_ == 0) return {&q_, &kva_, &kvb_, &o_};
    return {&qa_, &qb_, &kva_, &kvb_, &o_};
  }
  // x (n, D) -> q, k (n, H (dn + dr)) with RoPE at pos, v (n, H dv). keep: the norms' inputs and
  // inverse RMS for backward.
  void project(const Tensor<T, B>& x, const Tensor<std::int32_t, B>& pos, bool keep,
               Tensor<T, B>& q, Tensor<T, B>& k, Tensor<T, B>& v) {
    Tensor<T, B> qraw, qnope, qpe, qpe_r;
    if (rq_ == 0) {
      q_.forward(x, qraw);
    } else {
      Tensor<T, B> ql, qln, qinv;
      qa_.forward(x, ql);
      rmsnorm_forward(ql, qan_, eps_, qln, qinv);
      qb_.forward(qln, qraw);
      if (keep) {
        ql_ = ql;
        ql_inv_ = qinv;
      }
    }
    split_heads(qraw, heads_, dn_, qnope, qpe);
    rope_forward(qpe, pos, heads_, theta_, layout_, qpe_r);
    q = Tensor<T, B>();
    concat_heads(qnope, qpe_r, heads_, q);
    Tensor<T, B> ckv, c, kpe, cn, cinv, kv, knope, kpe_r, kpe_rep;
    kva_.forward(x, ckv);
    split_heads(ckv, 1, r_, c, kpe);
    rmsnorm_forward(c, kvn_, eps_, cn, cinv);
    kvb_.forward(cn, kv);
    v = Tensor<T, B>();
    split_heads(kv, heads_, dn_, knope, v);
    rope_forward(kpe, pos, 1, theta_, layout_, kpe_r);
    repeat_heads(kpe_r, 1, heads_, kpe_rep);
    k = Tensor<T, B>();
    concat_heads(knope, kpe_rep, heads_, k);
    if (keep) {
      c_ = c;
      c_inv_ = cinv;
    }
  }
  // v (n, H dv) -> (n, H (dn + dr)) with zero columns after each head's dv; v itself when equal
  Tensor<T, B> padded(const Tensor<T, B>& v) const {
    const index_t pad = dn_ + dr_ - dv_;
    if (pad == 0) return v;
    Tensor<T, B> zeros(Shape{v.rows(), heads_ * pad}), out;  // zero-filled on every backend
    concat_heads(v, zeros, heads_, out);
    return out;
  }
  // the inverse: each head's first dv columns
  Tensor<T, B> unpadded(const Tensor<T, B>& x) const {
    if (dn_ + dr_ == dv_) return x;
    Tensor<T, B> v, rest;
    split_heads(x, heads_, dv_, v, rest);
    return v;
  }

  index_t d_ = 0, heads_ = 1, dn_ = 0, dr_ = 0, dv_ = 0, r_ = 0, rq_ = 0;
  bool causal_ = true, out_bias_ = false;
  double theta_ = 0, eps_ = 1e-6;
  RopeLayout layout_ = RopeLayout::HalfSplit;
  Linear<T, B, C> q_, qa_, qb_, kva_, kvb_, o_;
  index_t id_qan_ = -1, id_kvn_ = -1;
  Tensor<T, B> qan_, dqan_, kvn_, dkvn_;
  Tensor<T, B> q_t_, k_t_, vpad_, probs_;  // the forward's, for backward
  Tensor<T, B> ql_, ql_inv_, c_, c_inv_;         // the norms' inputs and inverse RMS
  Tensor<std::int32_t, B> positions_;
  index_t positions_t_ = 0;
  Tensor<T, B> zero_bo_;
};

}  // namespace graphmoe
