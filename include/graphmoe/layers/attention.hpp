// graphmoe/layers/attention.hpp: multi-head self-attention with separate q, k, v projections and
// an output projection, exposing its cache to the Attention token graph (layer contract in
// linear.hpp).
//
//   q = x Wq^T + bq,  k = x Wk^T + bk,  v = x Wv^T + bv        (N, D), N = B T
//   o = concat_h softmax(q_h k_h^T / sqrt(dh) [+ causal mask]) v_h
//   a = o Wo^T + bo
//
// cache() is the AttentionCache an Attention-graph router of the same block reads (probs, v, Wo,
// bo, a); its gradient sinks (dprobs, dv, dout) are zeroed by forward and folded into backward,
// and its dw_o / db_o are views of this layer's own parameter gradients.
//
// Compute type C (default T): the four projections' GEMM operand type (Linear<T, B, C>: fp32
// parameters, outputs and gradients, C operands with fp32 accumulation on graphmoe::cuda). The
// attention products themselves (q k^T, probs v) and the softmax stay in T.
#pragma once

#include <cmath>
#include <string>

#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

template <class T, class B = cpu, class C = T>
class MultiHeadAttention {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               index_t num_heads, bool causal) {
    GRAPHMOE_CHECK(num_heads >= 1 && d_model % num_heads == 0, "MultiHeadAttention",
                   "num_heads = ", num_heads, " must divide d_model = ", d_model);
    d_ = d_model;
    heads_ = num_heads;
    causal_ = causal;
    q_.declare(arena, prefix + "q_proj.", d_model, d_model);
    k_.declare(arena, prefix + "k_proj.", d_model, d_model);
    v_.declare(arena, prefix + "v_proj.", d_model, d_model);
    o_.declare(arena, prefix + "out_proj.", d_model, d_model);
  }
  void bind(const ParameterArena<T, B>& arena) {
    q_.bind(arena);
    k_.bind(arena);
    v_.bind(arena);
    o_.bind(arena);
    bound_ = true;
  }
  // The four projections read their C weights from mirror (Linear::attach_mirror). C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    for (Linear<T, B, C>* l : {&q_, &k_, &v_, &o_}) l->attach_mirror(mirror);
  }
  // Projections ~ N(0, std^2); the output projection scaled by out_scale (GPT-2's 1/sqrt(2 L)).
  void init(Rng& rng, double stddev, double out_scale = 1.0) {
    q_.init(rng, stddev);
    k_.init(rng, stddev);
    v_.init(rng, stddev);
    o_.init(rng, stddev * out_scale);
  }
  // x (B, T, D) -> a (B, T, D)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& a) {
    check_bound("forward");
    GRAPHMOE_CHECK(x.rank() == 3 && x.dim(2) == d_, "MultiHeadAttention", "input has shape ",
                   x.shape(), ", expected (B, T, ", d_, ")");
    const Shape s = x.shape();
    const Shape flat{s[0] * s[1], d_};
    qt_ = Tensor<T, B>();
    kt_ = Tensor<T, B>();
    Tensor<T, B> xf = x.view(flat);
    cache_.v = Tensor<T, B>();
    if constexpr (std::is_same_v<C, T>) {
      q_.forward(xf, qt_);
      k_.forward(xf, kt_);
      v_.forward(xf, cache_.v);
    } else {  // one conversion of x for the three projections, kept for their backward
      if (xc_.shape() != flat) xc_ = new_output<C, B>(flat);
      convert(xf, xc_);
      q_.forward(xf, xc_, qt_);
      k_.forward(xf, xc_, kt_);
      v_.forward(xf, xc_, cache_.v);
    }
    o_att_ = Tensor<T, B>();
    cache_.probs = Tensor<T, B>();
    cache_.row_entropy = Tensor<T, B>();
    attention_forward(qt_.view(s), kt_.view(s), cache_.v.view(s), heads_, causal_, cache_.probs, o_att_,
                      &cache_.row_entropy);
    prepare_output("MultiHeadAttention", "a", a, s);
    Tensor<T, B> af = a.view(flat);
    o_.forward(o_att_.view(flat), af);
    // the cache the Attention graph reads, with zeroed gradient sinks
    cache_.num_heads = heads_;
    cache_.causal = causal_;
    cache_.w_o = o_.weight();
    cache_.b_o = o_.bias();
    cache_.out = af;
    cache_.dw_o = o_.dweight();
    cache_.db_o = o_.dbias();
    for (auto* t : {&cache_.dprobs, &cache_.dv, &cache_.dout}) *t = Tensor<T, B>();
    sinks_ready_ = false;
  }
  // Allocates (zeroed) the gradient sinks the Attention graph accumulates into; call between
  // forward and the MoE layer's backward when the block's router reads this cache.
  void enable_graph_gradients() {
    cache_.dprobs = Tensor<T, B>(cache_.probs.shape());
    cache_.dv = Tensor<T, B>(cache_.v.shape());
    cache_.dout = Tensor<T, B>(cache_.out.shape());
    sinks_ready_ = true;
  }
  // da (B, T, D) -> dx (B, T, D) assigned; folds in the Attention graph's gradients if any.
  void backward(const Tensor<T, B>& da, Tensor<T, B>& dx) {
    check_bound("backward");
    const Shape s = da.shape();
    const Shape flat{s[0] * s[1], d_};
    Tensor<T, B> daf = da.view(flat);
    if (sinks_ready_) {  // da + the graph's dout, in one pass (no copy of da first)
      Tensor<T, B> sum = new_output<T, B>(flat);
      add(daf, cache_.dout, sum);
      daf = sum;
    }
    Tensor<T, B> do_att = new_output<T, B>(flat);  // assigned by o_.backward
    o_.backward(daf, &do_att);
    Tensor<T, B> dq, dk, dv;
    attention_backward(qt_.view(s), kt_.view(s), cache_.v.view(s), heads_, causal_, cache_.probs,
                       do_att.view(s), sinks_ready_ ? cache_.dprobs : Tensor<T, B>(), dq, dk, dv);
    Tensor<T, B> dvf = dv.view(flat);
    if (sinks_ready_) axpy(T(1), cache_.dv, dvf);
    prepare_output("MultiHeadAttention::backward", "dx", dx, s);
    Tensor<T, B> dxf = dx.view(flat);
    q_.backward(dq.view(flat), &dxf);
    k_.backward(dk.view(flat), &dxf, true);  // dx += dk W_k
    v_.backward(dvf, &dxf, true);            // dx += dv W_v
  }

  // Incremental decoding (core/decode.hpp): x (n, D), one new token per row of `rows`; appends
  // each row's key and value to kv (allocated (S, H, max_len, D / H), kv_cache()) and attends over
  // its slot's positions 0..t (a causal layer only) -> a (n, D). step receives what the Attention
  // graph of the block reads (probs, row entropies, a, w_o, b_o, the cache). Overwrites the
  // projections' forward cache (run forward again before a backward).
  void decode(const Tensor<T, B>& x, const DecodeRows& rows, KVCache<T, B>& kv,
              AttentionStep<T, B>& step, Tensor<T, B>& a) {
    check_bound("decode");
    GRAPHMOE_CHECK(causal_, "MultiHeadAttention",
                   "incremental decoding needs a causal layer (a token cannot attend to later ones "
                   "that are not decoded yet)");
    GRAPHMOE_CHECK(x.rank() == 2 && x.dim(1) == d_, "MultiHeadAttention", "input has shape ",
                   x.shape(), ", expected (n, ", d_, ")");
    Tensor<T, B> q, k, v, o;
    q_.forward(x, q);
    k_.forward(x, k);
    v_.forward(x, v);
    // the step's outputs are kept across steps of the same number of rows
    const index_t n = x.rows();
    if (step.probs.shape() != Shape{n, heads_, kv.max_len()}) step.probs = Tensor<T, B>();
    if (step.row_entropy.shape() != Shape{n, heads_}) step.row_entropy = Tensor<T, B>();
    attention_decode(q, k, v, rows, kv, step.probs, step.row_entropy, o);
    prepare_output("MultiHeadAttention", "a", a, x.shape());
    o_.forward(o, a);
    step.num_heads = heads_;
    step.out = a;
    step.w_o = o_.weight();
    step.b_o = o_.bias();
    step.kv = &kv;
  }
  // An empty KV cache of this layer for `slots` sequences of at most max_len tokens.
  KVCache<T, B> kv_cache(index_t slots, index_t max_len) const {
    return KVCache<T, B>(slots, heads_, max_len, d_ / heads_);
  }

  AttentionCache<T, B>& cache() { return cache_; }
  bool causal() const { return causal_; }
  index_t num_heads() const { return heads_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "MultiHeadAttention", op); }
  index_t d_ = 0, heads_ = 1;
  bool causal_ = true;
  Linear<T, B, C> q_, k_, v_, o_;
  Tensor<T, B> qt_, kt_, o_att_;
  Tensor<C, B> xc_;  // C != T: the input in C, shared by the q, k, v projections
  AttentionCache<T, B> cache_;
  bool sinks_ready_ = false;
};

}  // namespace graphmoe
