// graphmoe/layers/block.hpp: the pre-norm transformer block, with a dense FFN or an MoE layer.
//
//   x = LN1(h);  a = MHA(x);  h1 = h + a;  u = LN2(h1);  f = FFN(u) or MoE(u);  out = h1 + f
//
// LN is LayerNorm or RMSNorm (BlockConfig::norm); the attention takes AttentionOptions (grouped
// keys and values, RoPE, QK-norm, biases: layers/attention.hpp). An MoE block may have shared
// experts beside the routed ones (Qwen2-MoE, DeepSeek): a dense FFN of width shared_d_ff that
// every token goes through, f = MoE(u) + g(u) Shared(u), with g = sigmoid(u . w_g) when
// shared_expert_gate (Qwen2-MoE's per-token gate) and 1 otherwise.
//
// With an Attention-graph router, the MoE layer reads this block's attention cache (probs,
// values, output map and output) and its backward sends gradients into them, which the attention
// backward folds in. Layer contract in linear.hpp; the residual stream's gradient is the sum of
// the skip path and the branch. The dense FFN takes its activation (GELU or SwiGLU), GELU's form
// and its bias flag from moe_config (activation, gelu, bias), as the experts do.
//
// Compute type C (default T): the GEMM operand type of the block's projections (attention q, k,
// v, out; the dense FFN) and of its experts (MoELayer's C). With T = float and C =
// __nv_bfloat16 on graphmoe::cuda every product reads bf16 operands and accumulates in fp32
// (mixed precision: fp32 master weights, gradients, LayerNorm, softmax, router and residual
// stream); C = T is the plain block.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/layers/attention.hpp"
#include "graphmoe/layers/ffn.hpp"
#include "graphmoe/layers/moe.hpp"
#include "graphmoe/layers/norm.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

struct BlockConfig {
  index_t d_model = 128;
  index_t num_heads = 4;
  index_t d_ff = 512;
  bool causal = true;   // attention mask (the Similarity graph follows RouterConfig::causal)
  bool moe = true;      // MoE FFN (else dense)
  MoEConfig moe_config; // d_model / d_ff are taken from the fields above
  double init_std = 0.02;
  double out_scale = 1.0;  // output projections' init scale (GPT-2: 1 / sqrt(2 layers))
  NormKind norm = NormKind::LayerNorm;
  double norm_eps = 1e-5;
  AttentionOptions attention;
  // MoE blocks: the shared experts' total width (0: none) and whether a per-token sigmoid gate
  // scales their output
  index_t shared_d_ff = 0;
  bool shared_expert_gate = false;
};

template <class RouterPolicy, class T, class B = cpu, class C = T>
class TransformerBlock {
  static_assert(std::is_same_v<C, T> || backend_mixed_precision<B>,
                "graphmoe::TransformerBlock: a compute type other than T needs a backend with mixed_precision (graphmoe::cuda)");

 public:
  // experts: the expert-parallel communicator of the MoE layer (MoELayer::declare), or nullptr
  // for all experts in this process.
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, const BlockConfig& cfg,
               dist::Communicator* experts = nullptr) {
    cfg_ = cfg;
    cfg_.moe_config.d_model = cfg.d_model;
    cfg_.moe_config.d_ff = cfg.d_ff;
    GRAPHMOE_CHECK(cfg.shared_d_ff >= 0 && (cfg.shared_d_ff == 0 || cfg.moe) &&
                       (cfg.shared_d_ff > 0 || !cfg.shared_expert_gate),
                   "TransformerBlock", "shared experts (shared_d_ff = ", cfg.shared_d_ff,
                   ", gate ", cfg.shared_expert_gate, ") need an MoE block and a width > 0");
    if constexpr (RouterPolicy::needs_attention)
      GRAPHMOE_CHECK(!cfg.moe || !cfg.attention.latent(), "TransformerBlock",
                     "the Attention token graph reads each head's attention and values through "
                     "the output projection, which multi-head latent attention (kv_lora_rank = ",
                     cfg.attention.kv_lora_rank, ") does not expose: route with another graph");
    ln1_.declare(arena, prefix + "ln1.", cfg.d_model, cfg.norm, cfg.norm_eps);
    attn_.declare(arena, prefix + "attn.", cfg.d_model, cfg.num_heads, cfg.causal, cfg.attention);
    ln2_.declare(arena, prefix + "ln2.", cfg.d_model, cfg.norm, cfg.norm_eps);
    if (cfg.moe && experts != nullptr)
      moe_.declare(arena, prefix + "moe.", cfg_.moe_config, *experts);
    else if (cfg.moe)
      moe_.declare(arena, prefix + "moe.", cfg_.moe_config);
    else
      ffn_.declare(arena, prefix + "ffn.", cfg.d_model, cfg.d_ff, cfg_.moe_config.gelu,
                   cfg_.moe_config.activation, cfg_.moe_config.bias);
    if (cfg.shared_d_ff > 0) {  // the shared experts: the experts' activation and bias
      shared_.declare(arena, prefix + "shared_expert.", cfg.d_model, cfg.shared_d_ff,
                      cfg_.moe_config.gelu, cfg_.moe_config.activation, cfg_.moe_config.bias);
      if (cfg.shared_expert_gate)
        gate_.declare(arena, prefix + "shared_expert_gate.", cfg.d_model, 1, /*bias=*/false);
    }
  }
  void bind(const ParameterArena<T, B>& arena) {
    ln1_.bind(arena);
    attn_.bind(arena);
    ln2_.bind(arena);
    if (cfg_.moe) moe_.bind(arena); else ffn_.bind(arena);
    if (has_shared()) shared_.bind(arena);
    if (cfg_.shared_expert_gate) gate_.bind(arena);
    bound_ = true;
  }
  // Every GEMM weight of the block in C read from mirror (layers/compute_mirror.hpp), nullptr:
  // converted per forward. C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    attn_.attach_mirror(mirror);
    if (cfg_.moe) moe_.attach_mirror(mirror); else ffn_.attach_mirror(mirror);
    if (has_shared()) shared_.attach_mirror(mirror);
    if (cfg_.shared_expert_gate) gate_.attach_mirror(mirror);
  }
  void init(Rng& rng) {
    ln1_.init();
    ln2_.init();
    attn_.init(rng, cfg_.init_std, cfg_.out_scale);
    if (cfg_.moe) {
      cfg_.moe_config.init_std = cfg_.init_std;
      moe_.init(rng);
    } else {
      ffn_.init(rng, cfg_.init_std, cfg_.out_scale);
    }
    if (has_shared()) shared_.init(rng, cfg_.init_std, cfg_.out_scale);
    if (cfg_.shared_expert_gate) gate_.init(rng, cfg_.init_std);
  }

  // h (B, T, D) -> out (B, T, D)
  void forward(const Tensor<T, B>& h, Tensor<T, B>& out) {
    check_bound("forward");
    const Shape s = h.shape();
    const index_t n = s[0] * s[1];
    Tensor<T, B> x, a;
    ln1_.forward(h, x);
    attn_.forward(x, a);
    h1_ = Tensor<T, B>();
    add(h, a, h1_);  // the residual, in one pass (not a copy and an axpy)
    u_ = Tensor<T, B>();
    ln2_.forward(h1_, u_);
    Tensor<T, B> f = new_output<T, B>(Shape{n, cfg_.d_model});  // assigned by the MoE or FFN
    if (cfg_.moe) {
      GraphContext<T, B> ctx{s[1], nullptr};
      // the Attention graph reads the attention layer's cache; its gradient sinks ((B, H, T, T)
      // dprobs among them) are allocated by backward, so a forward alone (evaluation,
      // inference) never holds them
      if constexpr (RouterPolicy::needs_attention) ctx.attention = &attn_.cache();
      moe_.forward(u_.view(Shape{n, cfg_.d_model}), ctx, f);
      if (has_shared()) shared_forward(u_.view(Shape{n, cfg_.d_model}), f);
    } else {
      ffn_.forward(u_.view(Shape{n, cfg_.d_model}), f);
    }
    prepare_output("TransformerBlock", "out", out, s);
    add(h1_, f.view(s), out);
  }

  // What a decoder keeps of this block between steps: the attention layer's KV cache and, in an
  // MoE block, the token graph's routing cache (routing/concepts.hpp, GraphDecodes).
  using graph_cache =
      graph_decode_cache_t<typename RouterPolicy::graph, T, B>;
  struct DecodeCache {
    KVCache<T, B> kv;
    graph_cache graph;
    AttentionStep<T, B> step;  // the last step's attention outputs (read by the Attention graph)
  };
  DecodeCache decode_cache(index_t slots, index_t max_len, index_t num_experts) {
    DecodeCache c;
    c.kv = attn_.kv_cache(slots, max_len);
    static_assert(check_graph_decodes<typename RouterPolicy::graph, T, B>());
    if constexpr (GraphDecodes<typename RouterPolicy::graph, T, B>) {
      if (!cfg_.moe) return c;
      GraphDecodeDims dims;
      dims.slots = slots;
      dims.max_len = max_len;
      dims.d_model = cfg_.d_model;
      dims.num_experts = num_experts;
      dims.num_heads = cfg_.num_heads;
      moe_.router().graph().decode_init(c.graph, dims);
    }
    return c;
  }

  // Incremental decoding: h (n, D), one new token per row of `rows` -> out (n, D). weights
  // (optional): each row's graph weights over its slot's positions (n, max_len), left empty by a
  // graph that has none (Independent) and in a dense block.
  void decode(const Tensor<T, B>& h, const DecodeRows& rows, DecodeCache& c, Tensor<T, B>& out,
              Tensor<T, B>* weights = nullptr) {
    check_bound("decode");
    const index_t n = h.rows();
    Tensor<T, B> x, a;
    ln1_.forward(h, x);
    attn_.decode(x, rows, c.kv, c.step, a);
    Tensor<T, B> h1;
    add(h, a, h1);
    Tensor<T, B> u;
    ln2_.forward(h1, u);
    Tensor<T, B> f = new_output<T, B>(Shape{n, cfg_.d_model});  // assigned by the MoE or FFN
    if (cfg_.moe) {
      GraphDecodeContext<T, B> ctx;
      ctx.rows = &rows;
      ctx.attention = &c.step;
      ctx.weights = weights;
      moe_.decode(u, ctx, c.graph, f);
      if (has_shared()) shared_forward(u, f);
    } else {
      ffn_.forward(u, f);
      if (weights != nullptr) *weights = Tensor<T, B>();
    }
    prepare_output("TransformerBlock", "out", out, h.shape());
    add(h1, f, out);
  }

  // dout (B, T, D) -> dh (B, T, D) assigned.
  void backward(const Tensor<T, B>& dout, Tensor<T, B>& dh) {
    check_bound("backward");
    const Shape s = dout.shape();
    const index_t n = s[0] * s[1];
    Tensor<T, B> du;
    Tensor<T, B> dflat = dout.view(Shape{n, cfg_.d_model});
    if constexpr (RouterPolicy::needs_attention) {
      if (cfg_.moe) attn_.enable_graph_gradients();  // zeroed sinks the MoE backward fills
    }
    if (cfg_.moe) moe_.backward(dflat, du); else ffn_.backward(dflat, du);
    if (has_shared()) shared_backward(dflat, du);
    Tensor<T, B> dh1;
    ln2_.backward(du.view(s), dh1);
    axpy(T(1), dout, dh1);  // skip path
    Tensor<T, B> dx;
    attn_.backward(dh1, dx);
    ln1_.backward(dx, dh);
    axpy(T(1), dh1, dh);    // skip path
  }

  bool is_moe() const { return cfg_.moe; }
  bool has_shared() const { return cfg_.shared_d_ff > 0; }
  MoELayer<RouterPolicy, T, B, C>& moe() { return moe_; }
  const MoELayer<RouterPolicy, T, B, C>& moe() const { return moe_; }
  MultiHeadAttention<T, B, C>& attention() { return attn_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "TransformerBlock", op); }
  // f += g Shared(u), g = sigmoid(u w_g) or 1 (the gate's values kept for backward)
  void shared_forward(const Tensor<T, B>& u, Tensor<T, B>& f) {
    shared_out_ = Tensor<T, B>();
    shared_.forward(u, shared_out_);
    if (!cfg_.shared_expert_gate) {
      add(f, shared_out_, f);
      return;
    }
    Tensor<T, B> logit;
    gate_.forward(u, logit);  // (n, 1)
    gate_sig_ = Tensor<T, B>();
    sigmoid_forward(logit.view(Shape{u.rows()}), gate_sig_);
    Tensor<T, B> gated;
    scale_rows(shared_out_, gate_sig_, gated);
    add(f, gated, f);
  }
  // du += the shared branch's gradient, from df (the gradient of f)
  void shared_backward(const Tensor<T, B>& df, Tensor<T, B>& du) {
    Tensor<T, B> dshared = df;
    if (cfg_.shared_expert_gate) {
      const index_t n = df.rows();
      dshared = Tensor<T, B>();
      scale_rows(df, gate_sig_, dshared);
      Tensor<T, B> dg, dlogit;
      row_dots(df, shared_out_, dg);
      sigmoid_backward(gate_sig_, dg, dlogit);
      Tensor<T, B> dl2 = dlogit.view(Shape{n, 1});
      gate_.backward(dl2, &du, true);  // du += dlogit w_g
    }
    Tensor<T, B> dus;
    shared_.backward(dshared, dus);
    axpy(T(1), dus, du);
  }

  BlockConfig cfg_;
  Norm<T, B> ln1_, ln2_;
  MultiHeadAttention<T, B, C> attn_;
  FeedForward<T, B, C> shared_;  // the shared experts (has_shared())
  Linear<T, B, C> gate_;          // their gate (shared_expert_gate)
  Tensor<T, B> shared_out_, gate_sig_;
  FeedForward<T, B, C> ffn_;
  MoELayer<RouterPolicy, T, B, C> moe_;
  Tensor<T, B> h1_, u_;
};

// A model's blocks in order, the scaffolding TransformerLM and VisionMoE share: block i
// declared as "<prefix>blocks.<i>." with the BlockConfig config(i) gives, bound, drawn in order;
// the forward keeps every block's input for the backward, which runs the blocks in reverse; and
// over the MoE blocks, the routers' training step, mode, after-step hook and auxiliary losses.
template <class RouterPolicy, class T, class B = cpu, class C = T>
class BlockStack {
 public:
  using Block = TransformerBlock<RouterPolicy, T, B, C>;

  // Replaces the stack with n blocks; config(i) -> BlockConfig; experts as in
  // TransformerBlock::declare.
  template <class ConfigOf>
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t n, ConfigOf&& config,
               dist::Communicator* experts = nullptr) {
    blocks_.clear();
    blocks_.resize(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i)
      blocks_[static_cast<std::size_t>(i)].declare(arena, prefix + "blocks." + std::to_string(i) + ".",
                                                   config(i), experts);
  }
  void bind(const ParameterArena<T, B>& arena) {
    for (auto& b : blocks_) b.bind(arena);
  }
  void init(Rng& rng) {
    for (auto& b : blocks_) b.init(rng);
  }
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    for (auto& b : blocks_) b.attach_mirror(mirror);
  }

  // h through every block; returns the last block's output (kept until the next forward).
  const Tensor<T, B>& forward(const Tensor<T, B>& h) {
    acts_.assign(blocks_.size() + 1, Tensor<T, B>());
    acts_[0] = h;
    for (std::size_t l = 0; l < blocks_.size(); ++l) blocks_[l].forward(acts_[l], acts_[l + 1]);
    return acts_.back();
  }
  // The gradient of the last forward's output -> that of its input.
  Tensor<T, B> backward(Tensor<T, B> dh) {
    for (std::size_t l = blocks_.size(); l-- > 0;) {
      Tensor<T, B> dprev;
      blocks_[l].backward(dh, dprev);
      dh = dprev;
    }
    return dh;
  }

  std::size_t size() const { return blocks_.size(); }
  Block& operator[](std::size_t i) { return blocks_[i]; }
  Block& at(std::size_t i) { return blocks_.at(i); }
  auto begin() { return blocks_.begin(); }
  auto end() { return blocks_.end(); }

  // The sum of the MoE blocks' auxiliary losses of the last forward (MoELayer::losses, task = 0).
  Loss moe_losses() const {
    Loss s;
    for (const auto& blk : blocks_)
      if (blk.is_moe()) s += blk.moe().losses();
    return s;
  }
  // The training step every router sees (ScheduledTopK's k schedule).
  void set_step(std::int64_t step) {
    for (auto& blk : blocks_)
      if (blk.is_moe()) blk.moe().router().set_step(step);
  }
  // After every optimizer step, for every router (RouterImpl::after_step: the step's loads summed
  // over comm's ranks go to each policy's after_step hook; nothing for a router without one).
  void after_step(ParameterArena<T, B>& arena, dist::Communicator* comm) {
    for (auto& blk : blocks_)
      if (blk.is_moe()) blk.moe().router().after_step(arena, comm);
  }
  // Train or eval (core/mode.hpp) for every router and, through it, every policy that takes a mode.
  void set_mode(Mode mode) {
    for (auto& blk : blocks_)
      if (blk.is_moe()) blk.moe().router().set_mode(mode);
  }

 private:
  std::vector<Block> blocks_;
  std::vector<Tensor<T, B>> acts_;  // acts_[l] is block l's input, acts_.back() the output
};

// What a model built on a BlockStack (TransformerLM, VisionMoE) exposes of it, written once: the
// model derives from BlockStackModel<Model, ...> (after_optimizer_step reads Model::arena()) and
// keeps its blocks in blocks_ and its mode in mode_.
template <class Model, class RouterPolicy, class T, class B, class C = T>
class BlockStackModel {
 public:
  TransformerBlock<RouterPolicy, T, B, C>& block(index_t i) {
    return blocks_.at(static_cast<std::size_t>(i));
  }
  // Sets the training step of every router (ScheduledTopK's k schedule).
  void set_step(std::int64_t step) { blocks_.set_step(step); }
  // Call after every optimizer step (a collective over comm, the data-parallel communicator, when
  // given: every rank calls it): the routers' stateful policies update from the step's expert
  // loads (BiasBalancedTopK's bias). Nothing for routers without such a policy.
  void after_optimizer_step(dist::Communicator* comm = nullptr) {
    blocks_.after_step(static_cast<const Model&>(*this).arena(), comm);
  }
  // Train (the default) or eval: passed to every router policy that takes a mode (core/mode.hpp),
  // e.g. a noisy scorer draws no noise in eval. Nothing in graphmoe's own layers depends on it.
  void set_mode(Mode mode) {
    mode_ = mode;
    blocks_.set_mode(mode);
  }
  Mode mode() const { return mode_; }

 protected:
  BlockStack<RouterPolicy, T, B, C> blocks_;
  Mode mode_ = Mode::Train;
};

}  // namespace graphmoe
