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
#pragma once

#include <cmath>
#include <string>

#include "graphmoe/backend/cpu/attention.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/routing/attention_cache.hpp"

namespace graphmoe {

template <class T, class B = cpu>
class MultiHeadAttention;

template <class T>
class MultiHeadAttention<T, cpu> {
 public:
  void declare(ParameterArena<T, cpu>& arena, const std::string& prefix, index_t d_model,
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
  void bind(const ParameterArena<T, cpu>& arena) {
    q_.bind(arena);
    k_.bind(arena);
    v_.bind(arena);
    o_.bind(arena);
  }
  // Projections ~ N(0, std^2); the output projection scaled by out_scale (GPT-2's 1/sqrt(2 L)).
  void init(Rng& rng, double stddev, double out_scale = 1.0) {
    q_.init(rng, stddev);
    k_.init(rng, stddev);
    v_.init(rng, stddev);
    o_.init(rng, stddev * out_scale);
  }
  // x (B, T, D) -> a (B, T, D)
  void forward(const Tensor<T, cpu>& x, Tensor<T, cpu>& a) {
    GRAPHMOE_CHECK(x.rank() == 3 && x.dim(2) == d_, "MultiHeadAttention", "input has shape ",
                   x.shape(), ", expected (B, T, ", d_, ")");
    const Shape s = x.shape();
    const Shape flat{s[0] * s[1], d_};
    qt_ = Tensor<T, cpu>();
    kt_ = Tensor<T, cpu>();
    Tensor<T, cpu> xf = x.view(flat);
    q_.forward(xf, qt_);
    k_.forward(xf, kt_);
    cache_.v = Tensor<T, cpu>();
    v_.forward(xf, cache_.v);
    o_att_ = Tensor<T, cpu>();
    cache_.probs = Tensor<T, cpu>();
    cache_.row_entropy = Tensor<T, cpu>();
    attention_forward(qt_.view(s), kt_.view(s), cache_.v.view(s), heads_, causal_, cache_.probs, o_att_,
                      &cache_.row_entropy);
    prepare_output("MultiHeadAttention", "a", a, s);
    Tensor<T, cpu> af = a.view(flat);
    o_.forward(o_att_.view(flat), af);
    // the cache the Attention graph reads, with zeroed gradient sinks
    cache_.num_heads = heads_;
    cache_.w_o = o_.weight();
    cache_.b_o = o_.bias();
    cache_.out = af;
    cache_.dw_o = o_.dweight();
    cache_.db_o = o_.dbias();
    for (auto* t : {&cache_.dprobs, &cache_.dv, &cache_.dout}) *t = Tensor<T, cpu>();
    sinks_ready_ = false;
  }
  // Allocates (zeroed) the gradient sinks the Attention graph accumulates into; call between
  // forward and the MoE layer's backward when the block's router reads this cache.
  void enable_graph_gradients() {
    cache_.dprobs = Tensor<T, cpu>(cache_.probs.shape());
    cache_.dv = Tensor<T, cpu>(cache_.v.shape());
    cache_.dout = Tensor<T, cpu>(cache_.out.shape());
    sinks_ready_ = true;
  }
  // da (B, T, D) -> dx (B, T, D) assigned; folds in the Attention graph's gradients if any.
  void backward(const Tensor<T, cpu>& da, Tensor<T, cpu>& dx) {
    const Shape s = da.shape();
    const Shape flat{s[0] * s[1], d_};
    Tensor<T, cpu> daf = da.view(flat);
    if (sinks_ready_) {
      daf = daf.clone();
      as_matrix(daf) += as_matrix(cache_.dout);
    }
    Tensor<T, cpu> do_att(flat);
    o_.backward(daf, &do_att);
    Tensor<T, cpu> dq, dk, dv;
    attention_backward(qt_.view(s), kt_.view(s), cache_.v.view(s), heads_, causal_, cache_.probs,
                       do_att.view(s), sinks_ready_ ? cache_.dprobs : Tensor<T, cpu>(), dq, dk, dv);
    Tensor<T, cpu> dvf = dv.view(flat);
    if (sinks_ready_) as_matrix(dvf) += as_matrix(cache_.dv);
    prepare_output("MultiHeadAttention::backward", "dx", dx, s);
    Tensor<T, cpu> dxf = dx.view(flat), tmp(flat);
    q_.backward(dq.view(flat), &dxf);
    k_.backward(dk.view(flat), &tmp);
    as_matrix(dxf) += as_matrix(tmp);
    v_.backward(dvf, &tmp);
    as_matrix(dxf) += as_matrix(tmp);
  }

  AttentionCache<T, cpu>& cache() { return cache_; }
  bool causal() const { return causal_; }
  index_t num_heads() const { return heads_; }

 private:
  index_t d_ = 0, heads_ = 1;
  bool causal_ = true;
  Linear<T, cpu> q_, k_, v_, o_;
  Tensor<T, cpu> qt_, kt_, o_att_;
  AttentionCache<T, cpu> cache_;
  bool sinks_ready_ = false;
};

}  // namespace graphmoe
