// graphmoe/layers/attention.hpp: multi-head self-attention with separate q, k, v projections and
// an output projection, exposing its cache to the Attention token graph (layer contract in
// linear.hpp).
//
//   q = x Wq^T + bq,  k = x Wk^T + bk,  v = x Wv^T + bv        q (N, H dh), k, v (N, Hkv dh), N = B T
//   q, k <- RMSNorm(q), RMSNorm(k)      with qk_norm: over each row (OLMoE) or each head (Qwen3)
//   q, k <- RoPE(q, t), RoPE(k, t)      with rope_theta > 0, t the token's position in its sequence
//   k, v <- repeat_heads(k), (v)        with Hkv < H (grouped-query; Hkv = 1 multi-query)
//   o = concat_h softmax(q_h k_h^T / sqrt(dh) [+ causal mask]) v_h
//   a = o Wo^T + bo                                               Wo (D, H dh)
//
// With AttentionOptions::kv_lora_rank > 0 the layer computes multi-head latent attention instead
// (DeepSeek-V2/V3: layers/latent_attention.hpp), which the Attention token graph does not read.
//
// dh is D / H unless AttentionOptions::head_dim sets it (Hugging Face's head_dim: Qwen3-MoE's
// releases have H dh = 2 D); the scores are scaled by 1 / sqrt(dh) either way.
// AttentionOptions holds the modern variants (num_kv_heads, rope_theta and layout, qk_norm, the
// biases); the defaults are GPT-2's attention, computed by the same calls as without them. The
// Attention graph sees the heads' values after repeat_heads (every query head's v_h), and its
// gradient into them is summed back over each group. Incremental decoding caches the Hkv heads
// only (kv_cache()); query head h reads cached head h / (H / Hkv), with the same values.
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
#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/layers/latent_attention.hpp"
#include "graphmoe/layers/linear.hpp"
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/ops/decode.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/heads.hpp"
#include "graphmoe/ops/rmsnorm.hpp"
#include "graphmoe/ops/rope.hpp"

namespace graphmoe {

// Normalisation of the queries and keys before RoPE.
enum class QKNorm {
  None,
  Full,     // RMSNorm over each row of q (H dh) and of k (Hkv dh): OLMoE
  PerHead,  // RMSNorm over each head (dh), one weight shared by the heads: Qwen3
};
inline constexpr EnumName<QKNorm> kQKNormNames[] = {
    {QKNorm::None, "none"}, {QKNorm::Full, "full"}, {QKNorm::PerHead, "per-head"}};
inline QKNorm qk_norm_from_name(std::string_view s) {
  return value_of("qk_norm_from_name", "QK-norm", kQKNormNames, s);
}

struct AttentionOptions {
  // Key/value heads: 0 means num_heads (multi-head); a divisor of num_heads shares each key/value
  // head among num_heads / num_kv_heads query heads (grouped-query; 1: multi-query).
  index_t num_kv_heads = 0;
  // > 0: rotary position embeddings of base theta on q and k (then a model has no learned
  // positions); 0: none.
  double rope_theta = 0;
  RopeLayout rope_layout = RopeLayout::HalfSplit;
  QKNorm qk_norm = QKNorm::None;
  double qk_norm_eps = 1e-6;
  bool qkv_bias = true;  // biases of the q, k, v projections (Qwen2: yes; Llama, OLMoE: no)
  bool out_bias = true;  // bias of the output projection
  // Each head's width: 0 means d_model / num_heads (which num_heads must then divide); otherwise
  // the projections map d_model to num_heads * head_dim (queries) and num_kv_heads * head_dim
  // (keys, values), and the output projection back (Hugging Face's head_dim).
  index_t head_dim = 0;
  static constexpr index_t kMaxHeadDim = 65536;
  // Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank > 0
  // (layers/latent_attention.hpp): keys and values from a latent of kv_lora_rank (RMSNorm'ed,
  // then each head's qk_nope_head_dim key and v_head_dim value), one rotary key of
  // qk_rope_head_dim that the heads share, queries from x or through a latent of q_lora_rank
  // (0: none); latent_norm_eps is the two latents' RMSNorm epsilon. It needs RoPE (rope_theta >
  // 0) and replaces head_dim, num_kv_heads, qk_norm and the q/k/v biases (all left unset).
  index_t q_lora_rank = 0, kv_lora_rank = 0;
  index_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  double latent_norm_eps = 1e-6;

  bool latent() const { return kv_lora_rank > 0; }
  // Whether o has the same latent attention: ranks, head widths and, when latent, the latents'
  // norm eps (checkpoint readers and writers compare models with it).
  bool same_latent(const AttentionOptions& o) const {
    return kv_lora_rank == o.kv_lora_rank && q_lora_rank == o.q_lora_rank &&
           qk_nope_head_dim == o.qk_nope_head_dim && qk_rope_head_dim == o.qk_rope_head_dim &&
           v_head_dim == o.v_head_dim && (!latent() || latent_norm_eps == o.latent_norm_eps);
  }

  // The width of one head for a model of d_model and num_heads.
  index_t head_dim_for(index_t d_model, index_t num_heads) const {
    return head_dim != 0 ? head_dim : d_model / num_heads;
  }
  bool plain() const { return rope_theta == 0 && qk_norm == QKNorm::None; }
  void validate(index_t d_model, index_t num_heads) const {
    const char* op = "AttentionOptions";
    GRAPHMOE_CHECK(num_heads >= 1, op, "num_heads must be >= 1, got ", num_heads);
    GRAPHMOE_CHECK(kv_lora_rank >= 0 && q_lora_rank >= 0, op,
                   "kv_lora_rank and q_lora_rank must be >= 0, got ", kv_lora_rank, " and ",
                   q_lora_rank);
    if (latent()) {
      validate_latent();
      return;
    }
    GRAPHMOE_CHECK(q_lora_rank == 0 && qk_nope_head_dim == 0 && qk_rope_head_dim == 0 &&
                       v_head_dim == 0,
                   op, "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim belong to "
                   "multi-head latent attention: set kv_lora_rank too (got ", q_lora_rank, ", ",
                   qk_nope_head_dim, ", ", qk_rope_head_dim, ", ", v_head_dim, ")");
    GRAPHMOE_CHECK(head_dim >= 0 && head_dim <= kMaxHeadDim, op, "head_dim = ", head_dim,
                   " must be in [0, ", kMaxHeadDim, "] (0: d_model / num_heads)");
    GRAPHMOE_CHECK(head_dim != 0 || d_model % num_heads == 0, op, "num_heads = ", num_heads,
                   " must divide d_model = ", d_model, " (or set head_dim)");
    const index_t kv = num_kv_heads == 0 ? num_heads : num_kv_heads;
    GRAPHMOE_CHECK(kv >= 1 && num_heads % kv == 0, op, "num_kv_heads = ", num_kv_heads,
                   " must divide num_heads = ", num_heads, " (0: num_heads)");
    GRAPHMOE_CHECK(rope_theta >= 0 && rope_theta < 1e300, op,
                   "rope_theta must be >= 0 and finite (0: no RoPE), got ", rope_theta);
    GRAPHMOE_CHECK(rope_theta == 0 || head_dim_for(d_model, num_heads) % 2 == 0, op,
                   "RoPE rotates pairs of a head's dimensions: head_dim = ",
                   head_dim_for(d_model, num_heads), " must be even");
    GRAPHMOE_CHECK(rope_layout == RopeLayout::HalfSplit || rope_layout == RopeLayout::Interleaved,
                   op, static_cast<int>(rope_layout), " is not a RopeLayout");
    GRAPHMOE_CHECK(qk_norm == QKNorm::None || qk_norm == QKNorm::Full ||
                       qk_norm == QKNorm::PerHead,
                   op, static_cast<int>(qk_norm), " is not a QKNorm");
    GRAPHMOE_CHECK(qk_norm_eps > 0 && qk_norm_eps < 1, op, "qk_norm_eps must be in (0, 1), got ",
                   qk_norm_eps);
  }

 private:
  void validate_latent() const {
    const char* op = "AttentionOptions";
    GRAPHMOE_CHECK(kv_lora_rank <= kMaxHeadDim && q_lora_rank <= kMaxHeadDim, op,
                   "kv_lora_rank = ", kv_lora_rank, " and q_lora_rank = ", q_lora_rank,
                   " must be at most ", kMaxHeadDim);
    GRAPHMOE_CHECK(qk_nope_head_dim >= 1 && qk_nope_head_dim <= kMaxHeadDim &&
                       v_head_dim >= 1 && v_head_dim <= kMaxHeadDim,
                   op, "multi-head latent attention needs qk_nope_head_dim and v_head_dim in [1, ",
                   kMaxHeadDim, "], got ", qk_nope_head_dim, " and ", v_head_dim);
    GRAPHMOE_CHECK(qk_rope_head_dim >= 2 && qk_rope_head_dim <= kMaxHeadDim &&
                       qk_rope_head_dim % 2 == 0,
                   op, "qk_rope_head_dim = ", qk_rope_head_dim,
                   " must be even and >= 2 (RoPE rotates pairs)");
    GRAPHMOE_CHECK(v_head_dim <= qk_nope_head_dim + qk_rope_head_dim, op, "v_head_dim = ",
                   v_head_dim, " must be at most qk_nope_head_dim + qk_rope_head_dim = ",
                   qk_nope_head_dim + qk_rope_head_dim);
    GRAPHMOE_CHECK(rope_theta > 0 && rope_theta < 1e300, op,
                   "multi-head latent attention rotates its rotary part: rope_theta must be > 0, "
                   "got ", rope_theta);
    GRAPHMOE_CHECK(rope_layout == RopeLayout::HalfSplit || rope_layout == RopeLayout::Interleaved,
                   op, static_cast<int>(rope_layout), " is not a RopeLayout");
    GRAPHMOE_CHECK(head_dim == 0 && num_kv_heads == 0 && qk_norm == QKNorm::None && !qkv_bias, op,
                   "multi-head latent attention sets its own head widths and has no key/value "
                   "groups, QK-norm or q/k/v biases: leave head_dim = 0, num_kv_heads = 0, "
                   "qk_norm = None and qkv_bias = false (got ", head_dim, ", ", num_kv_heads,
                   ", ", static_cast<int>(qk_norm), ", ", qkv_bias, ")");
    GRAPHMOE_CHECK(latent_norm_eps > 0 && latent_norm_eps < 1, op,
                   "latent_norm_eps must be in (0, 1), got ", latent_norm_eps);
  }
};

template <class T, class B = cpu, class C = T>
class MultiHeadAttention {
 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t d_model,
               index_t num_heads, bool causal, const AttentionOptions& opts = {}) {
    if (opts.latent()) {  // multi-head latent attention: LatentAttention computes it
      opts.validate(d_model, num_heads);
      d_ = d_model;
      heads_ = kv_heads_ = num_heads;
      causal_ = causal;
      opts_ = opts;
      latent_.declare(arena, prefix, d_model, num_heads, causal, opts);
      return;
    }
    GRAPHMOE_CHECK(num_heads >= 1 && (opts.head_dim != 0 || d_model % num_heads == 0),
                   "MultiHeadAttention", "num_heads = ", num_heads, " must divide d_model = ",
                   d_model, " (or set AttentionOptions::head_dim)");
    opts.validate(d_model, num_heads);
    d_ = d_model;
    heads_ = num_heads;
    causal_ = causal;
    opts_ = opts;
    kv_heads_ = opts.num_kv_heads == 0 ? num_heads : opts.num_kv_heads;
    dh_ = opts.head_dim_for(d_model, num_heads);
    const index_t dh = dh_, dq = num_heads * dh, dkv = kv_heads_ * dh;
    q_.declare(arena, prefix + "q_proj.", d_model, dq, opts.qkv_bias);
    k_.declare(arena, prefix + "k_proj.", d_model, dkv, opts.qkv_bias);
    v_.declare(arena, prefix + "v_proj.", d_model, dkv, opts.qkv_bias);
    o_.declare(arena, prefix + "out_proj.", dq, d_model, opts.out_bias);
    if (opts.qk_norm != QKNorm::None) {
      const bool full = opts.qk_norm == QKNorm::Full;
      id_qn_ = arena.add(prefix + "q_norm.weight", Shape{full ? dq : dh});
      id_kn_ = arena.add(prefix + "k_norm.weight", Shape{full ? dkv : dh});
    }
  }
  void bind(const ParameterArena<T, B>& arena) {
    if (opts_.latent()) {
      latent_.bind(arena);
      bound_ = true;
      return;
    }
    q_.bind(arena);
    k_.bind(arena);
    v_.bind(arena);
    o_.bind(arena);
    if (opts_.qk_norm != QKNorm::None) {
      qn_ = arena.value(id_qn_);
      dqn_ = arena.grad(id_qn_);
      kn_ = arena.value(id_kn_);
      dkn_ = arena.grad(id_kn_);
    }
    if (!opts_.out_bias) {  // the Attention graph reads b_o: zeros, and a sink nobody reads
      zero_bo_ = Tensor<T, B>(Shape{d_});
      fill(zero_bo_, T(0));
      dbo_sink_ = Tensor<T, B>(Shape{d_});
    }
    bound_ = true;
  }
  // The four projections read their C weights from mirror (Linear::attach_mirror). C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    if (opts_.latent()) {
      latent_.attach_mirror(mirror);
      return;
    }
    for (Linear<T, B, C>* l : {&q_, &k_, &v_, &o_}) l->attach_mirror(mirror);
  }
  // Projections ~ N(0, std^2); the output projection scaled by out_scale (GPT-2's 1/sqrt(2 L)).
  void init(Rng& rng, double stddev, double out_scale = 1.0) {
    if (opts_.latent()) {
      latent_.init(rng, stddev, out_scale);
      return;
    }
    q_.init(rng, stddev);
    k_.init(rng, stddev);
    v_.init(rng, stddev);
    o_.init(rng, stddev * out_scale);
    if (opts_.qk_norm != QKNorm::None) {
      fill(qn_, T(1));
      fill(kn_, T(1));
    }
  }
  // x (B, T, D) -> a (B, T, D)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& a) {
    check_bound("forward");
    GRAPHMOE_CHECK(x.rank() == 3 && x.dim(2) == d_, "MultiHeadAttention", "input has shape ",
                   x.shape(), ", expected (B, T, ", d_, ")");
    if (opts_.latent()) {
      latent_.forward(x, a);
      return;
    }
    const Shape s = x.shape();
    const Shape flat{s[0] * s[1], d_};
    const Shape hs{s[0], s[1], heads_ * dh_};  // q, k, v and the heads' outputs
    qt_ = Tensor<T, B>();
    kt_ = Tensor<T, B>();
    Tensor<T, B> xf = x.view(flat);
    cache_.v = Tensor<T, B>();
    const bool plain = opts_.plain() && kv_heads_ == heads_;
    // plain: the projections write q, k, v themselves; otherwise their raw outputs, which the
    // norms, RoPE and the head sharing turn into q, k, v
    Tensor<T, B> qp, kp, vp;
    Tensor<T, B>& qdst = plain ? qt_ : qp;
    Tensor<T, B>& kdst = plain ? kt_ : kp;
    Tensor<T, B>& vdst = kv_heads_ == heads_ ? cache_.v : vp;
    if constexpr (std::is_same_v<C, T>) {
      q_.forward(xf, qdst);
      k_.forward(xf, kdst);
      v_.forward(xf, vdst);
    } else {  // one conversion of x for the three projections, kept for their backward
      if (xc_.shape() != flat) xc_ = new_output<C, B>(flat);
      convert(xf, xc_);
      q_.forward(xf, xc_, qdst);
      k_.forward(xf, xc_, kdst);
      v_.forward(xf, xc_, vdst);
    }
    if (!plain) {
      if (opts_.rope_theta > 0) sequence_positions(s[0], s[1], positions_, positions_t_);
      Tensor<T, B> kr;
      modern_qk(qp, kp, positions_, qt_, kr, true);
      if (kv_heads_ == heads_) {
        kt_ = kr;
      } else {
        repeat_heads(kr, kv_heads_, heads_, kt_);
        repeat_heads(vp, kv_heads_, heads_, cache_.v);
      }
    }
    o_att_ = Tensor<T, B>();
    cache_.probs = Tensor<T, B>();
    cache_.row_entropy = Tensor<T, B>();
    attention_forward(qt_.view(hs), kt_.view(hs), cache_.v.view(hs), heads_, causal_, cache_.probs,
                      o_att_, &cache_.row_entropy);
    prepare_output("MultiHeadAttention", "a", a, s);
    Tensor<T, B> af = a.view(flat);
    o_.forward(o_att_.view(Shape{flat[0], heads_ * dh_}), af);
    // the cache the Attention graph reads, with zeroed gradient sinks
    cache_.num_heads = heads_;
    cache_.causal = causal_;
    cache_.w_o = o_.weight();
    cache_.b_o = opts_.out_bias ? o_.bias() : zero_bo_;
    cache_.out = af;
    cache_.dw_o = o_.dweight();
    if (opts_.out_bias) {
      cache_.db_o = o_.dbias();
    } else {
      fill(dbo_sink_, T(0));
      cache_.db_o = dbo_sink_;
    }
    for (auto* t : {&cache_.dprobs, &cache_.dv, &cache_.dout}) *t = Tensor<T, B>();
    sinks_ready_ = false;
  }
  // Allocates (zeroed) the gradient sinks the Attention graph accumulates into; call between
  // forward and the MoE layer's backward when the block's router reads this cache.
  void enable_graph_gradients() {
    GRAPHMOE_CHECK(!opts_.latent(), "MultiHeadAttention",
                   "the Attention token graph does not read multi-head latent attention");
    cache_.dprobs = Tensor<T, B>(cache_.probs.shape());
    cache_.dv = Tensor<T, B>(cache_.v.shape());
    cache_.dout = Tensor<T, B>(cache_.out.shape());
    sinks_ready_ = true;
  }
  // da (B, T, D) -> dx (B, T, D) assigned; folds in the Attention graph's gradients if any.
  void backward(const Tensor<T, B>& da, Tensor<T, B>& dx) {
    check_bound("backward");
    if (opts_.latent()) {
      latent_.backward(da, dx);
      return;
    }
    const Shape s = da.shape();
    const Shape flat{s[0] * s[1], d_};
    const Shape hs{s[0], s[1], heads_ * dh_}, hflat{s[0] * s[1], heads_ * dh_};
    Tensor<T, B> daf = da.view(flat);
    if (sinks_ready_) {  // da + the graph's dout, in one pass (no copy of da first)
      Tensor<T, B> sum = new_output<T, B>(flat);
      add(daf, cache_.dout, sum);
      daf = sum;
    }
    Tensor<T, B> do_att = new_output<T, B>(hflat);  // assigned by o_.backward
    o_.backward(daf, &do_att);
    Tensor<T, B> dq, dk, dv;
    attention_backward(qt_.view(hs), kt_.view(hs), cache_.v.view(hs), heads_, causal_,
                       cache_.probs, do_att.view(hs),
                       sinks_ready_ ? cache_.dprobs : Tensor<T, B>(), dq, dk, dv);
    Tensor<T, B> dvf = dv.view(hflat);
    if (sinks_ready_) axpy(T(1), cache_.dv, dvf);
    Tensor<T, B> dqf = dq.view(hflat), dkf = dk.view(hflat);
    if (kv_heads_ != heads_) {  // the group's query heads' gradients, summed per key/value head
      Tensor<T, B> dks, dvs;
      repeat_heads_backward(dkf, kv_heads_, heads_, dks);
      repeat_heads_backward(dvf, kv_heads_, heads_, dvs);
      dkf = dks;
      dvf = dvs;
    }
    if (!opts_.plain()) modern_qk_backward(dqf, dkf);
    prepare_output("MultiHeadAttention::backward", "dx", dx, s);
    Tensor<T, B> dxf = dx.view(flat);
    q_.backward(dqf, &dxf);
    k_.backward(dkf, &dxf, true);  // dx += dk W_k
    v_.backward(dvf, &dxf, true);  // dx += dv W_v
  }

  // Incremental decoding (core/decode.hpp): x (n, D), one new token per row of `rows`; appends
  // each row's key and value to kv (allocated (S, Hkv, max_len, D / H), kv_cache()) and attends over
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
    if (opts_.latent()) {
      latent_.decode(x, rows, kv, step, a);
      return;
    }
    Tensor<T, B> q, k, v, o;
    q_.forward(x, q);
    k_.forward(x, k);
    v_.forward(x, v);
    const index_t n = x.rows();
    if (!opts_.plain()) {
      Tensor<std::int32_t, B> pos;
      if (opts_.rope_theta > 0) pos = decode_positions<B>(rows);
      Tensor<T, B> qr, kr;
      modern_qk(q, k, pos, qr, kr, false);
      q = qr;
      k = kr;
    }
    // the step's outputs are kept across steps of the same number of rows
    if (step.probs.shape() != Shape{n, heads_, kv.max_len()}) step.probs = Tensor<T, B>();
    if (step.row_entropy.shape() != Shape{n, heads_}) step.row_entropy = Tensor<T, B>();
    attention_decode(q, k, v, rows, kv, step.probs, step.row_entropy, o);
    prepare_output("MultiHeadAttention", "a", a, x.shape());
    o_.forward(o, a);
    step.num_heads = heads_;
    step.out = a;
    step.w_o = o_.weight();
    step.b_o = opts_.out_bias ? o_.bias() : zero_bo_;
    step.kv = &kv;
  }
  // An empty KV cache of this layer for `slots` sequences of at most max_len tokens.
  // It holds the num_kv_heads key/value heads (grouped-query attention's saving at decode time).
  KVCache<T, B> kv_cache(index_t slots, index_t max_len) const {
    if (opts_.latent()) return latent_.kv_cache(slots, max_len);
    return KVCache<T, B>(slots, heads_, kv_heads_, max_len, dh_);
  }

  AttentionCache<T, B>& cache() { return cache_; }
  bool causal() const { return causal_; }
  index_t num_heads() const { return heads_; }
  index_t num_kv_heads() const { return kv_heads_; }
  index_t head_dim() const { return dh_; }
  const AttentionOptions& options() const { return opts_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "MultiHeadAttention", op); }
  // qp (n, H dh), kp (n, Hkv dh) the projections' outputs -> q, k after the norms and RoPE. keep:
  // the forward's caches for backward (the norms' inputs and inverse RMS).
  void modern_qk(const Tensor<T, B>& qp, const Tensor<T, B>& kp,
                 const Tensor<std::int32_t, B>& pos, Tensor<T, B>& q, Tensor<T, B>& k, bool keep) {
    const index_t n = qp.rows(), dh = dh_;
    Tensor<T, B> qn = qp, kn = kp;
    if (opts_.qk_norm != QKNorm::None) {
      const bool full = opts_.qk_norm == QKNorm::Full;
      const Shape qs = full ? Shape{n, heads_ * dh} : Shape{n * heads_, dh};
      const Shape ks = full ? Shape{n, kv_heads_ * dh} : Shape{n * kv_heads_, dh};
      Tensor<T, B> qo, ko, qinv, kinv;
      rmsnorm_forward(qp.view(qs), qn_, opts_.qk_norm_eps, qo, qinv);
      rmsnorm_forward(kp.view(ks), kn_, opts_.qk_norm_eps, ko, kinv);
      if (keep) {
        q_pre_ = qp.view(qs);
        k_pre_ = kp.view(ks);
        q_inv_ = qinv;
        k_inv_ = kinv;
      }
      qn = qo.view(qp.shape());
      kn = ko.view(kp.shape());
    }
    if (opts_.rope_theta > 0) {
      Tensor<T, B> qr, kr;
      rope_forward(qn, pos, heads_, opts_.rope_theta, opts_.rope_layout, qr);
      rope_forward(kn, pos, kv_heads_, opts_.rope_theta, opts_.rope_layout, kr);
      qn = qr;
      kn = kr;
    }
    q = qn;
    k = kn;
  }
  // dq (N, H dh), dk (N, Hkv dh) with respect to modern_qk's outputs -> with respect to its inputs,
  // in place (the norms' weights' gradients accumulated).
  void modern_qk_backward(Tensor<T, B>& dq, Tensor<T, B>& dk) {
    if (opts_.rope_theta > 0) {
      Tensor<T, B> dqr, dkr;
      rope_backward(dq, positions_, heads_, opts_.rope_theta, opts_.rope_layout, dqr);
      rope_backward(dk, positions_, kv_heads_, opts_.rope_theta, opts_.rope_layout, dkr);
      dq = dqr;
      dk = dkr;
    }
    if (opts_.qk_norm != QKNorm::None) {
      Tensor<T, B> dqn, dkn;
      rmsnorm_backward(q_pre_, qn_, q_inv_, dq.view(q_pre_.shape()), dqn, dqn_);
      rmsnorm_backward(k_pre_, kn_, k_inv_, dk.view(k_pre_.shape()), dkn, dkn_);
      dq = dqn.view(dq.shape());
      dk = dkn.view(dk.shape());
    }
  }

  index_t d_ = 0, heads_ = 1, kv_heads_ = 1, dh_ = 1;
  bool causal_ = true;
  AttentionOptions opts_;
  Linear<T, B, C> q_, k_, v_, o_;
  Tensor<T, B> qt_, kt_, o_att_;
  index_t id_qn_ = -1, id_kn_ = -1;
  Tensor<T, B> qn_, dqn_, kn_, dkn_;             // the q / k norms' weights and gradients
  Tensor<T, B> q_pre_, k_pre_, q_inv_, k_inv_;   // their forward caches
  Tensor<std::int32_t, B> positions_;
  index_t positions_t_ = 0;
  Tensor<T, B> zero_bo_, dbo_sink_;              // without an output bias (the Attention graph's)
  Tensor<C, B> xc_;  // C != T: the input in C, shared by the q, k, v projections
  AttentionCache<T, B> cache_;
  bool sinks_ready_ = false;
  LatentAttention<T, B, C> latent_;  // AttentionOptions::latent(): the layer computed instead
};

}  // namespace graphmoe
