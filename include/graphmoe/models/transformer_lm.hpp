// graphmoe/models/transformer_lm.hpp: decoder-only transformer LM with MoE FFNs.
//
//   h0 = tok_emb[ids] + pos_emb[t]                      (B, T, D); no pos_emb with RoPE
//   h_l = Block_l(h_{l-1})  (MoE FFN per the layout)    Switch: every block; GLaM: every other;
//                                                       the first first_k_dense blocks dense
//   logits = LN_f(h_L) W^T                              W = tok_emb (tied) or lm_head
//
// The blocks of the families trained today are config fields (TransformerLMConfig): RMSNorm,
// rotary positions, grouped-query attention, QK-norm, bias-free projections, fine-grained experts
// (expert_d_ff), shared experts; the presets (llama, mixtral, qwen2_moe, qwen3_moe, olmoe,
// deepseek_v3) set them as those families do, and every field can be set alone.
//   loss = mean cross-entropy over targets != ignore_index
//
// Plain struct in llm.c's style: forward calls the blocks in order, backward in reverse. All
// parameters live in one ParameterArena (`arena()`: the model's own, or one it was declared in
// beside other models and layers), named as a PyTorch user would expect
// ("blocks.3.moe.router.weight", under the prefix given to declare). In a causal LM the routers are causal (RouterConfig::causal):
// the Similarity graph masks later tokens and the Attention graph chooses h* from the prefix
// (HeadChoice::PerSequenceCausal, its default in a causal router; PerSequence is refused), so no
// logit at position i depends on a token after i. causal is TransformerLMConfig::router's
// default, and validate() rejects a config that turns it off (the model never overrides what it
// was given).
//
// Compute type C (default T): mixed precision. With T = float and C = __nv_bfloat16 (or __half)
// on graphmoe::cuda every GEMM of the model reads C operands and accumulates in fp32 into fp32
// outputs: the blocks' projections and experts (TransformerBlock's C) and the LM head (xf
// converted once per forward, the head weight read from the compute mirror below, dlogits
// converted once per backward). Parameters (master weights), gradients, optimizer state,
// embeddings, LayerNorm, attention softmax, routers, the residual stream, logits and the loss
// stay fp32; no loss scaling (bf16 has fp32's exponent range). The classification head (num_classes > 0) stays in T. C = T is the plain model (the
// same calls, bit for bit); any other C on the CPU backend is a compile-time error.
//
// Compute mirror (C != T): bind() creates a ComputeMirror of the arena (layers/compute_mirror.hpp,
// compute_mirror()) and every GEMM weight of the model (projections, dense FFNs, experts, the head:
// with tied embeddings the token embedding's slice) is read from it instead of converted per
// forward; a stale mirror is refreshed at the next forward. Pass it to the optimizer
// (opt.step(arena, lr, lm.compute_mirror())) so that the step writes it in the same pass as the
// fp32 weights. set_compute_mirror(false) converts per forward again (the same values). With C = T
// compute_mirror() is nullptr.
#pragma once

#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/ops/embedding.hpp"
#include "graphmoe/layers/block.hpp"
#include "graphmoe/layers/compute_mirror.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gemm.hpp"

namespace graphmoe {

enum class MoELayout {
  Switch,  // every FFN is MoE
  GLaM,    // every other FFN is MoE: block i is MoE iff (i + 1) % 2 == 0 (torchscale, Megatron)
  Dense,   // no MoE (a dense baseline)
};
inline constexpr EnumName<MoELayout> kMoELayoutNames[] = {
    {MoELayout::Switch, "switch"}, {MoELayout::GLaM, "glam"}, {MoELayout::Dense, "dense"}};
inline const char* moe_layout_name(MoELayout l) { return name_of(kMoELayoutNames, l); }
inline MoELayout moe_layout_from_name(std::string_view s) {
  return value_of("moe_layout_from_name", "MoE layout", kMoELayoutNames, s);
}

struct TransformerLMConfig {
  index_t vocab_size = 10000;
  index_t max_seq_len = 128;
  index_t d_model = 128;
  index_t num_layers = 6;
  index_t num_heads = 4;
  index_t d_ff = 512;
  MoELayout layout = MoELayout::Switch;
  bool tie_embeddings = true;
  // num_experts, k, policies' options; causal (required, see validate)
  RouterConfig router = causal_router();
  // The MoE layers' row layout (MoEConfig::layout, layers/moe.hpp): Padded needs
  // router.capacity_factor > 0 and takes no read back to the host per layer on a GPU.
  ExpertLayout expert_layout = ExpertLayout::Compact;
  GeluForm gelu = GeluForm::Tanh;
  // The feed-forward networks' activation (dense blocks, experts, shared experts): GELU or SwiGLU
  // (a fused gate|up first projection), and whether they have biases.
  FfnActivation activation = FfnActivation::Gelu;
  bool ffn_bias = true;
  double init_std = 0.02;
  // Normalisation of every block and of the final LN_f (RMSNorm: Llama and the MoE families).
  NormKind norm = NormKind::LayerNorm;
  double norm_eps = 1e-5;
  // Grouped keys and values, RoPE, QK-norm, projection biases (layers/attention.hpp). With
  // attention.rope_theta > 0 the model has no learned position embedding.
  AttentionOptions attention;
  // The experts' width (0: d_ff), so that fine-grained experts (E = 64 to 256, small width) and
  // the dense blocks' d_ff differ, as in OLMoE / DeepSeek (moe_intermediate_size).
  index_t expert_d_ff = 0;
  // Shared experts in every MoE block: their total width (0: none; DeepSeek: n_shared_experts x
  // moe_intermediate_size) and Qwen2-MoE's per-token sigmoid gate on them.
  index_t shared_d_ff = 0;
  bool shared_expert_gate = false;
  // The first blocks dense (DeepSeek's first_k_dense_replace) and, with the Switch layout, MoE in
  // every moe_every-th block only ((i + 1) % moe_every == 0, Qwen2-MoE's decoder_sparse_step).
  index_t first_k_dense = 0;
  index_t moe_every = 1;
  // > 0: add a sequence-classification head ("cls_head", mean pooling over each sequence's
  // tokens) used by forward_classify; the LM head stays for forward.
  index_t num_classes = 0;

  // The paper's medium WikiText-103 model (Table 6): 6 layers, D = 352, 8 heads, d_ff = 352,
  // E = 16, top-2, sequence 512.
  static TransformerLMConfig paper_medium(index_t vocab) {
    TransformerLMConfig c;
    c.vocab_size = vocab;
    c.max_seq_len = 512;
    c.d_model = 352;
    c.num_layers = 6;
    c.num_heads = 8;
    c.d_ff = 352;
    c.router.num_experts = 16;
    c.router.k = 2;
    return c;
  }

  // ---- presets: the architectures of the families, at a CPU scale -----------------------------
  // Each sets the switches as the family's Hugging Face config does (norms, RoPE base and layout,
  // key/value heads, QK-norm, biases, tied or untied embeddings, the experts' count, width and
  // top-k, gate normalisation and scaling, shared experts, dense first blocks, the auxiliary-loss
  // coefficients) on a small shape (4 blocks, D = 256, 8 heads; vocab_size given) that trains on 2
  // cores: every size is a field to change. The router policy is the model's template argument
  // (softmax top-k for most families, SigmoidBiasRouter for DeepSeek-V3; any graph composes);
  // the presets set the options of TopK and BiasBalancedTopK alike and allow_unused_options, so
  // that one preset serves every router. The arch names: preset_names().
  static TransformerLMConfig gpt(index_t vocab) {
    TransformerLMConfig c;
    c.vocab_size = vocab;
    return c;
  }
  // Llama (dense): RMSNorm, RoPE (HalfSplit), grouped-query attention, no biases, untied embeddings.
  static TransformerLMConfig llama(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.layout = MoELayout::Dense;
    c.d_ff = 688;  // about 8/3 D, as Llama's SwiGLU width
    c.attention.rope_theta = 500000.0;  // Llama 3
    c.norm_eps = 1e-5;
    return c;
  }
  // Mixtral: Llama's blocks with 8 experts, top-2, renormalised gates, auxiliary loss 0.02.
  static TransformerLMConfig mixtral(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.attention.rope_theta = 1e6;
    c.norm_eps = 1e-5;
    c.d_ff = 688;
    set_experts(c, 8, 2, true, 1.0);
    c.router.load_balance_coef = 0.02;
    return c;
  }
  // Qwen2-MoE: q/k/v biases, 60 fine-grained experts of top-4 with unnormalised gates, one shared
  // expert of 4x their width behind a per-token sigmoid gate.
  static TransformerLMConfig qwen2_moe(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.attention.rope_theta = 1e6;
    c.attention.qkv_bias = true;
    set_experts(c, 60, 4, false, 1.0);
    c.expert_d_ff = 88;
    c.shared_d_ff = 4 * 88;
    c.shared_expert_gate = true;
    c.router.load_balance_coef = 0.001;
    return c;
  }
  // Qwen3-MoE: per-head QK-norm, no biases, 128 experts of top-8 with renormalised gates.
  static TransformerLMConfig qwen3_moe(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.attention.rope_theta = 1e6;
    c.attention.qk_norm = QKNorm::PerHead;
    set_experts(c, 128, 8, true, 1.0);
    c.expert_d_ff = 64;
    c.router.load_balance_coef = 0.001;
    return c;
  }
  // OLMoE: QK-norm over the whole projections, 64 experts of top-8 with unnormalised gates,
  // auxiliary loss 0.01 and z-loss 0.001, RoPE base 10,000, untied embeddings.
  static TransformerLMConfig olmoe(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.attention.rope_theta = 10000.0;
    c.attention.qk_norm = QKNorm::Full;
    c.attention.num_kv_heads = 0;  // OLMoE: multi-head attention
    set_experts(c, 64, 8, false, 1.0);
    c.expert_d_ff = 128;
    c.router.load_balance_coef = 0.01;
    c.router.z_loss_coef = 0.001;
    return c;
  }
  // DeepSeek-V3 with standard attention (its multi-head latent attention: AttentionOptions'
  // kv_lora_rank and the options beside it, which the Hugging Face reader sets): a dense
  // first block, 64 routed experts of top-8 in 8 groups (4 per token), renormalised gates scaled
  // by 2.5, one shared expert; the bias balances (use SigmoidBiasRouter), with the sequence-wise
  // balance loss at DeepSeek-V3's 1e-4 beside it and no batch load-balancing loss.
  static TransformerLMConfig deepseek_v3(index_t vocab) {
    TransformerLMConfig c = modern_base(vocab);
    c.attention.rope_theta = 10000.0;
    c.attention.num_kv_heads = 0;
    set_experts(c, 64, 8, true, 2.5);
    c.expert_d_ff = 128;
    c.shared_d_ff = 128;
    c.first_k_dense = 1;
    c.d_ff = 688;
    c.router.options<TopK>().n_group = 8;
    c.router.options<TopK>().topk_group = 4;
    c.router.seq_aux_loss_coef = 1e-4;
    return c;
  }
  // The preset of an arch name (gpt, llama, mixtral, qwen2-moe, qwen3-moe, olmoe, deepseek-v3).
  static TransformerLMConfig preset(const std::string& arch, index_t vocab) {
    if (arch == "gpt") return gpt(vocab);
    if (arch == "llama") return llama(vocab);
    if (arch == "mixtral") return mixtral(vocab);
    if (arch == "qwen2-moe") return qwen2_moe(vocab);
    if (arch == "qwen3-moe") return qwen3_moe(vocab);
    if (arch == "olmoe") return olmoe(vocab);
    if (arch == "deepseek-v3") return deepseek_v3(vocab);
    std::string valid;
    for (const auto& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
    detail::throw_error("TransformerLMConfig::preset", "unknown arch '", arch, "'; valid: ", valid);
  }
  static const std::vector<std::string>& preset_names() {
    static const std::vector<std::string> names = {"gpt",       "llama", "mixtral",    "qwen2-moe",
                                                   "qwen3-moe", "olmoe", "deepseek-v3"};
    return names;
  }

  // The RouterConfig defaults with the router made causal, as a causal LM needs.
  static RouterConfig causal_router() {
    RouterConfig r;
    r.causal = true;
    return r;
  }

  bool learned_positions() const { return attention.rope_theta == 0; }

 private:
  // What the modern presets share: RMSNorm, RoPE (HalfSplit), 4 key/value heads of 8, SwiGLU
  // feed-forward networks, no biases (the router's included), untied embeddings, on 4 blocks of
  // D = 256.
  static TransformerLMConfig modern_base(index_t vocab) {
    TransformerLMConfig c;
    c.vocab_size = vocab;
    c.max_seq_len = 256;
    c.d_model = 256;
    c.num_layers = 4;
    c.num_heads = 8;
    c.d_ff = 512;
    c.tie_embeddings = false;
    c.norm = NormKind::RMSNorm;
    c.norm_eps = 1e-6;
    c.attention.rope_theta = 10000.0;
    c.attention.rope_layout = RopeLayout::HalfSplit;
    c.attention.num_kv_heads = 4;
    c.attention.qkv_bias = false;
    c.attention.out_bias = false;
    c.activation = FfnActivation::SwiGLU;
    c.ffn_bias = false;
    c.router.allow_unused_options = true;  // TopK's options: other selectors ignore them
    c.router.options<LinearScorer>().bias = false;  // the families' routers (gate) have no bias
    return c;
  }
  static void set_experts(TransformerLMConfig& c, index_t e, index_t k, bool norm, double scale) {
    c.layout = MoELayout::Switch;
    c.router.num_experts = e;
    c.router.k = k;
    c.router.options<TopK>().norm_topk_prob = norm;
    c.router.options<TopK>().routed_scaling_factor = scale;
  }

 public:
  index_t experts_width() const { return expert_d_ff > 0 ? expert_d_ff : d_ff; }

  bool is_moe_layer(index_t i) const {
    if (i < first_k_dense) return false;
    switch (layout) {
      case MoELayout::Switch: return (i + 1) % moe_every == 0;
      case MoELayout::GLaM: return (i + 1) % 2 == 0;
      case MoELayout::Dense: return false;
    }
    return false;
  }

  void validate() const {
    GRAPHMOE_CHECK(vocab_size >= 2 && max_seq_len >= 1 && d_model >= 1 && num_layers >= 1 &&
                       d_ff >= 1,
                   "TransformerLMConfig", "sizes must be positive (vocab >= 2), got vocab ",
                   vocab_size, ", max_seq_len ", max_seq_len, ", d_model ", d_model, ", layers ",
                   num_layers, ", d_ff ", d_ff);
    GRAPHMOE_CHECK(num_heads >= 1 && (attention.head_dim != 0 || attention.latent() ||
                                       d_model % num_heads == 0),
                   "TransformerLMConfig", "num_heads = ", num_heads, " must divide d_model = ",
                   d_model, " (or set attention.head_dim)");
    GRAPHMOE_CHECK(num_classes >= 0, "TransformerLMConfig", "num_classes must be >= 0, got ", num_classes);
    GRAPHMOE_CHECK(expert_d_ff >= 0 && shared_d_ff >= 0 && first_k_dense >= 0 && moe_every >= 1,
                   "TransformerLMConfig", "need expert_d_ff >= 0, shared_d_ff >= 0, first_k_dense "
                   ">= 0 and moe_every >= 1, got ", expert_d_ff, ", ", shared_d_ff, ", ",
                   first_k_dense, ", ", moe_every);
    GRAPHMOE_CHECK(shared_d_ff > 0 || !shared_expert_gate, "TransformerLMConfig",
                   "shared_expert_gate needs shared experts (shared_d_ff > 0)");
    GRAPHMOE_CHECK(norm_eps > 0 && norm_eps < 1, "TransformerLMConfig",
                   "norm_eps must be in (0, 1), got ", norm_eps);
    attention.validate(d_model, num_heads);
    GRAPHMOE_CHECK(router.causal, "TransformerLMConfig",
                   "router.causal is false, but the LM is causal: a non-causal token graph lets "
                   "later tokens change how earlier ones are routed (leave it true, the default)");
    // (a graph that cannot be causal, e.g. the Attention graph with HeadChoice::PerSequence,
    // refuses a causal router itself when the model is declared)
    router.validate();
  }
};

// One implementation for every backend: ids, targets and labels live on B; the classifier's
// lengths (metadata) stay on the host.
template <class RouterPolicy, class T, class B = cpu, class C = T>
class TransformerLM
    : public BlockStackModel<TransformerLM<RouterPolicy, T, B, C>, RouterPolicy, T, B, C> {
  using Stack = BlockStackModel<TransformerLM, RouterPolicy, T, B, C>;
  using Stack::blocks_;

 public:
  using router_policy = RouterPolicy;
  using compute_type = C;
  static_assert(std::is_same_v<C, T> || backend_mixed_precision<B>,
                "graphmoe::TransformerLM: a compute type other than T (mixed precision) needs a "
                "backend with mixed_precision (graphmoe::cuda)");
  static_assert(!selector_chooses_across_tokens<typename RouterPolicy::selector>(),
                "graphmoe::TransformerLM: this selector (e.g. ExpertChoice) chooses a token's "
                "experts from its whole sequence, later tokens included, which a causal LM must not "
                "see (SequenceClassifier's trunk is this causal LM too); use a token-choice "
                "selector (TopK, ScheduledTopK), or VisionMoE / a non-causal MoELayer");
  static constexpr std::int32_t kIgnoreIndex = -100;

  // One lifecycle with the layers (docs/design.md "One lifecycle"):
  //   TransformerLM<SimilarityRouter, float> lm;  // nothing declared yet
  //   lm.declare(arena, "lm.", cfg);              // parameters named "lm.tok_emb.weight", ...
  //   arena.allocate();                           // (other layers / models may share the arena)
  //   lm.bind(arena);                             // the arena the model reads and writes
  //   Rng rng(seed); lm.init(rng);
  // forward, backward and arena() before bind() raise graphmoe::Error.
  TransformerLM() = default;
  // The owning shorthand: the model's own arena (arena()), no prefix, init from Rng(seed).
  explicit TransformerLM(const TransformerLMConfig& cfg, std::uint64_t seed = 0)
      : owned_(std::make_unique<ParameterArena<T, B>>()) {
    declare(*owned_, "", cfg);
    owned_->allocate();
    bind(*owned_);
    Rng rng(seed);
    init(rng);
  }

  // The owning shorthand without init: every parameter zero until written, for a caller that
  // fills them all (a checkpoint reader: graphmoe/hf/reader.hpp), so that a large model is not
  // drawn at random first.
  struct NoInit {};
  TransformerLM(const TransformerLMConfig& cfg, NoInit)
      : owned_(std::make_unique<ParameterArena<T, B>>()) {
    declare(*owned_, "", cfg);
    owned_->allocate();
    bind(*owned_);
  }

  // Expert parallel (docs/distributed.md): every MoE layer's experts split over experts' ranks
  // (cfg.router.num_experts a multiple of its size), the rest replicated; forward and backward
  // are then collective. The same seed on every rank gives one process's model.
  TransformerLM(const TransformerLMConfig& cfg, std::uint64_t seed, dist::Communicator& experts)
      : owned_(std::make_unique<ParameterArena<T, B>>()) {
    declare(*owned_, "", cfg, &experts);
    owned_->allocate();
    bind(*owned_);
    Rng rng(seed);
    init(rng);
  }

  // Validates cfg and adds the model's parameters to arena under prefix. Once per model; if it
  // throws (a bad config, or a name the arena already holds), the model stays undeclared.
  // experts: as in the expert-parallel constructor (nullptr: every expert in this process).
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, const TransformerLMConfig& cfg,
               dist::Communicator* experts = nullptr) {
    GRAPHMOE_CHECK(declared_in_ == nullptr, "TransformerLM::declare",
                   "the model is already declared (in an arena of ", declared_in_->size(),
                   " parameters); declare a new model instead");
    cfg.validate();
    if (experts != nullptr) {  // refused before any parameter is added
      (void)dist::expert_shard(cfg.router.num_experts, experts->rank(), experts->size());
    }
    cfg_ = cfg;
    prefix_ = prefix;
    first_param_ = arena.size();
    id_tok_ = arena.add(prefix + "tok_emb.weight", Shape{cfg_.vocab_size, cfg_.d_model});
    id_pos_ = -1;
    if (cfg_.learned_positions())
      id_pos_ = arena.add(prefix + "pos_emb.weight", Shape{cfg_.max_seq_len, cfg_.d_model});
    blocks_.declare(arena, prefix, cfg_.num_layers, [&](index_t i) {
      BlockConfig bc;
      bc.d_model = cfg_.d_model;
      bc.num_heads = cfg_.num_heads;
      bc.causal = true;
      bc.moe = cfg_.is_moe_layer(i);
      bc.d_ff = bc.moe ? cfg_.experts_width() : cfg_.d_ff;
      bc.norm = cfg_.norm;
      bc.norm_eps = cfg_.norm_eps;
      bc.attention = cfg_.attention;
      bc.shared_d_ff = bc.moe ? cfg_.shared_d_ff : 0;
      bc.shared_expert_gate = bc.moe && cfg_.shared_expert_gate;
      bc.moe_config.router = cfg_.router;
      bc.moe_config.layout = cfg_.expert_layout;
      bc.moe_config.gelu = cfg_.gelu;
      bc.moe_config.activation = cfg_.activation;
      bc.moe_config.bias = cfg_.ffn_bias;
      bc.init_std = cfg_.init_std;
      bc.out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(cfg_.num_layers));
      return bc;
    }, experts);
    ln_f_.declare(arena, prefix + "ln_f.", cfg_.d_model, cfg_.norm, cfg_.norm_eps);
    id_head_ = -1;
    if (!cfg_.tie_embeddings) id_head_ = arena.add(prefix + "lm_head.weight", Shape{cfg_.vocab_size, cfg_.d_model});
    if (cfg_.num_classes > 0) cls_head_.declare(arena, prefix + "cls_head.", cfg_.d_model, cfg_.num_classes);
    end_param_ = arena.size();
    declared_in_ = &arena;
  }

  // Binds the model to the arena it was declared in, once allocated. The model keeps a pointer to
  // it (arena()): the arena must outlive the model's use.
  void bind(ParameterArena<T, B>& arena) {
    detail::check_model_bind(declared_in_, arena, "TransformerLM");
    tok_ = arena.value(id_tok_);
    dtok_ = arena.grad(id_tok_);
    if (id_pos_ >= 0) {
      pos_ = arena.value(id_pos_);
      dpos_ = arena.grad(id_pos_);
    }
    blocks_.bind(arena);
    ln_f_.bind(arena);
    if (cfg_.num_classes > 0) cls_head_.bind(arena);
    arena_ = &arena;
    if constexpr (!std::is_same_v<C, T>) set_compute_mirror(true);
  }

  // C != T: the mirror every GEMM weight is read from (created by bind(); nullptr after
  // set_compute_mirror(false), and always with C = T). Give it to the optimizer's step.
  ComputeMirror<T, C, B>* compute_mirror() const { return mirror_.get(); }
  // C != T: on (bind's default) reads the weights from a mirror of the arena, off converts them
  // per forward (the same values; for comparisons). Needs bind().
  void set_compute_mirror(bool on) {
    static_assert(!std::is_same_v<C, T>, "TransformerLM::set_compute_mirror: C = T has no mirror");
    check_bound("set_compute_mirror");
    if (on == (mirror_ != nullptr)) return;
    std::unique_ptr<ComputeMirror<T, C, B>> next;
    if (on) next = std::make_unique<ComputeMirror<T, C, B>>(*arena_);
    blocks_.attach_mirror(next.get());
    headc_ = Tensor<C, B>();  // never convert into the mirror's storage
    mirror_ = std::move(next);
  }

  // Draws every parameter from rng, in the order the owning constructor always has (so a seed
  // gives the same model either way).
  void init(Rng& rng) {
    check_bound("init");
    fill_normal(arena_->value(id_tok_), rng, cfg_.init_std);
    if (id_pos_ >= 0) fill_normal(arena_->value(id_pos_), rng, cfg_.init_std);
    blocks_.init(rng);
    ln_f_.init();
    if (id_head_ >= 0) fill_normal(arena_->value(id_head_), rng, cfg_.init_std);
    if (cfg_.num_classes > 0) cls_head_.init(rng, cfg_.init_std);
    arena_->mark_values_written();
  }

  // The arena the model is bound to (its own, for the owning constructor).
  ParameterArena<T, B>& arena() const {
    check_bound("arena()");
    return *arena_;
  }
  bool bound() const { return arena_ != nullptr; }
  // The prefix given to declare ("" for the owning constructor), and the ids [first, end) of the
  // model's parameters in its arena (declare adds them in one run).
  const std::string& prefix() const { return prefix_; }
  std::pair<index_t, index_t> parameter_ids() const { return {first_param_, end_param_}; }

  TransformerLM(const TransformerLM&) = delete;
  TransformerLM& operator=(const TransformerLM&) = delete;

  // ids, targets: (B, T) with T <= max_seq_len; targets may be empty (logits only, task = 0).
  // Returns the loss broken down (layers/loss.hpp): task = the mean cross-entropy over targets !=
  // kIgnoreIndex, plus the routers' weighted auxiliary losses; backward differentiates total().
  //
  // The content checks of the whole forward are deferred (core/deferred_check.hpp): on a GPU the
  // routers' checks and load-balancing losses are read with the loss, so that a forward with the
  // padded expert layout (expert_layout) runs without a read back to the host until its loss;
  // the first failed check throws its own error.
  //
  // On a GPU the forward and backward with the padded expert layout can be captured into a CUDA
  // graph (backend/cuda/graph.cuh): write the next batch into the same ids and targets tensors,
  // replay, and read last_loss() (the replay delivers its values). The forward's return value
  // inside a capture is meaningless (nothing has run). A forward that throws leaves backward()
  // asking for a new one.
  Loss forward(const Tensor<std::int32_t, B>& ids, const Tensor<std::int32_t, B>& targets) {
    check_bound("forward");
    has_loss_ = false;  // backward() needs a forward that finished, not what a failed one left
    if (!targets.empty()) check_shape("TransformerLM", "targets", targets, ids.shape());
    with_deferred_checks(B{}, [&] { forward_checked(ids, targets); });
    has_loss_ = !targets.empty();  // the scope ended without an error
    return last_loss();  // the values are delivered once the scope ended
  }

  // The loss of the last forward, broken down as forward returned it; after a replay of a
  // captured forward, the replay's.
  Loss last_loss() const {
    Loss loss = blocks_.moe_losses();
    loss.task = has_loss_ ? ce_.loss : 0.0;
    return loss;
  }

 private:
  // The forward (its task loss lands in ce_, a deferred value on a GPU).
  void forward_checked(const Tensor<std::int32_t, B>& ids,
                       const Tensor<std::int32_t, B>& targets) {
    trunk_forward(ids);
    const index_t b = ids.dim(0), t = ids.dim(1), d = cfg_.d_model;
    targets_ = targets;
    // The (B T, V) buffers are the largest of a step (41 MB at B T = 1024, V = 10,000): they are
    // kept across steps of the same shape, since allocating them afresh costs page faults that
    // were measured at a quarter of a training step (docs/benchmarks.md). logits() is therefore
    // overwritten by the next forward.
    const Shape lshape{b, t, cfg_.vocab_size};
    if (logits_.shape() != lshape) {
      logits_ = Tensor<T, B>(lshape);
      log_probs_ = Tensor<T, B>(lshape);
      dlogits_ = Tensor<T, B>(lshape);
    }
    Tensor<T, B> lflat = logits_.view(Shape{b * t, cfg_.vocab_size});
    head_forward(xf_.view(Shape{b * t, d}), lflat);
    ce_ = CrossEntropyResult<B>();  // a forward that throws leaves the backward to scan (and throw)
    if (targets.empty()) return;
    cross_entropy_forward_into(logits_, targets, log_probs_, kIgnoreIndex, ce_);
  }

 public:

  // Gradients of the last forward's loss.total() (mean cross-entropy + the routers' weighted
  // auxiliary losses) into arena.grads(), accumulated: call arena.zero_grad() first.
  void backward() {
    GRAPHMOE_CHECK(has_loss_, "TransformerLM::backward", "call forward with targets first");
    const index_t b = ids_.dim(0), t = ids_.dim(1), d = cfg_.d_model;
    // the forward's count of targets: no second scan (on a GPU, no read back to the host)
    cross_entropy_backward(log_probs_, targets_, T(1), dlogits_, kIgnoreIndex, ce_);
    Tensor<T, B> dlf = dlogits_.view(Shape{b * t, cfg_.vocab_size});
    Tensor<T, B> dxf(Shape{b * t, d});
    Tensor<T, B> dhead = head_grad();
    if constexpr (std::is_same_v<C, T>) {
      gemm_backward(Trans::N, Trans::T, T(1), xf_.view(Shape{b * t, d}), head_weight(), dlf, T(0),
                    dxf, T(1), dhead);
    } else {  // the same two products on the C copies head_forward kept
      to_compute(dlf, dlc_);
      gemm(Trans::N, Trans::N, T(1), dlc_, headc_, T(0), dxf);
      gemm(Trans::T, Trans::N, T(1), dlc_, xfc_, T(1), dhead);
    }
    trunk_backward(dxf.view(Shape{b, t, d}));
  }

  // Sequence classification (needs num_classes > 0): ids (B, T) right-padded, lengths (B) the
  // number of real tokens of each sequence (1..T), labels (B) or empty. The causal trunk means
  // that padding after a sequence's last token never influences its tokens; the classifier reads
  // the mean of LN_f(h) over the real tokens. Returns the loss broken down (task = the mean
  // cross-entropy, 0 without labels; backward_classify differentiates total()); class_logits()
  // holds (B, classes). As forward, in one deferred-check scope: on a GPU the routers' checks,
  // the ids' and the labels' come back with the loss in one read; the first failed check throws
  // its own error (and backward_classify then needs a new forward).
  Loss forward_classify(const Tensor<std::int32_t, B>& ids, const Tensor<std::int32_t, cpu>& lengths,
                     const Tensor<std::int32_t, B>& labels) {
    check_bound("forward_classify");
    GRAPHMOE_CHECK(cfg_.num_classes > 0, "TransformerLM::forward_classify",
                   "the model has no classification head (num_classes = 0)");
    GRAPHMOE_CHECK(ids.rank() == 2, "TransformerLM::forward_classify", "ids must be (B, T), got ", ids.shape());
    const index_t b = ids.dim(0), t = ids.dim(1);
    check_shape("TransformerLM::forward_classify", "lengths", lengths, Shape{b});
    for (index_t i = 0; i < b; ++i)
      GRAPHMOE_CHECK(lengths.data()[i] >= 1 && lengths.data()[i] <= t, "TransformerLM::forward_classify",
                     "length ", lengths.data()[i], " of sequence ", i, " out of [1, ", t, "]");
    if (!labels.empty()) check_shape("TransformerLM::forward_classify", "labels", labels, Shape{b});
    class_log_probs_ = Tensor<T, B>();
    class_ce_ = CrossEntropyResult<B>();
    has_loss_ = false;  // the trunk's caches are overwritten: backward() needs a new LM forward
    try {
      with_deferred_checks(B{}, [&] { classify_checked(ids, lengths, labels); });
    } catch (...) {
      class_log_probs_ = Tensor<T, B>();  // backward_classify needs a forward that finished
      throw;
    }
    Loss loss = blocks_.moe_losses();  // the values are delivered once the scope ended
    if (!labels.empty()) loss.task = class_ce_.loss;
    return loss;
  }

 private:
  // forward_classify's work (its task loss lands in class_ce_, a deferred value on a GPU).
  void classify_checked(const Tensor<std::int32_t, B>& ids, const Tensor<std::int32_t, cpu>& lengths,
                        const Tensor<std::int32_t, B>& labels) {
    const index_t b = ids.dim(0), d = cfg_.d_model;
    trunk_forward(ids);
    lengths_ = lengths;
    labels_ = labels;
    Tensor<T, B> pooled(Shape{b, d});
    for (index_t i = 0; i < b; ++i) {  // mean over the real tokens
      const index_t len = lengths.data()[i];
      Tensor<T, B> row = pooled[i];
      accumulate_column_sums(xf_[i].slice(0, len), row);
      scale(row, T(1) / static_cast<T>(len));
    }
    class_logits_ = Tensor<T, B>();
    cls_head_.forward(pooled, class_logits_);
    if (!labels.empty())
      cross_entropy_forward_into(class_logits_, labels, class_log_probs_, -100, class_ce_);
  }

 public:
  void backward_classify() {
    GRAPHMOE_CHECK(!class_log_probs_.empty(), "TransformerLM::backward_classify",
                   "call forward_classify with labels first");
    const index_t b = ids_.dim(0), t = ids_.dim(1), d = cfg_.d_model;
    Tensor<T, B> dlogits, dpooled(Shape{b, d});
    cross_entropy_backward(class_log_probs_, labels_, T(1), dlogits, -100, class_ce_);  // no scan
    cls_head_.backward(dlogits, &dpooled);
    Tensor<T, B> dxf(Shape{b, t, d});
    for (index_t i = 0; i < b; ++i) {
      const index_t len = lengths_.data()[i];
      Tensor<T, B> row = dpooled[i];
      scale(row, T(1) / static_cast<T>(len));
      add_row_vector(row, dxf[i].slice(0, len));
    }
    trunk_backward(dxf);
  }
  const Tensor<T, B>& class_logits() const { return class_logits_; }


  // ---- incremental decoding (inference/decoder.hpp drives it) ----------------------------------
  // What a decoder keeps between steps: one KV cache per block and one routing cache per MoE
  // block, for `slots` sequences of at most max_len tokens each.
  struct DecodeCache {
    std::vector<typename TransformerBlock<RouterPolicy, T, B, C>::DecodeCache> blocks;
    index_t slots = 0, max_len = 0;
    // Values kept per cached token, summed over the layers: the KV caches' (2 D per layer) and the
    // routing caches' (what each MoE layer's graph declares).
    index_t kv_values_per_token() const {
      index_t v = 0;
      for (const auto& b : blocks) v += b.kv.values_per_token();
      return v;
    }
    index_t routing_values_per_token() const {
      index_t v = 0;
      for (const auto& b : blocks) v += b.graph.values_per_token();
      return v;
    }
  };
  // An empty cache for `slots` sequences of at most max_len tokens (1..max_seq_len; 0: max_seq_len).
  DecodeCache decode_cache(index_t slots, index_t max_len = 0) {
    check_bound("decode_cache");
    if (max_len == 0) max_len = cfg_.max_seq_len;
    GRAPHMOE_CHECK(slots >= 1 && max_len >= 1 && max_len <= cfg_.max_seq_len, "TransformerLM",
                   "a decode cache needs slots >= 1 and max_len in [1, max_seq_len = ",
                   cfg_.max_seq_len, "], got ", slots, " slots of ", max_len);
    DecodeCache c;
    c.slots = slots;
    c.max_len = max_len;
    c.blocks.reserve(blocks_.size());
    for (auto& b : blocks_) c.blocks.push_back(b.decode_cache(slots, max_len, cfg_.router.num_experts));
    return c;
  }
  // One decode step: ids (n) the new tokens, row i at position rows.pos[i] of slot rows.slot[i]
  // (earlier positions of that slot cached by previous steps; position 0 starts a new sequence)
  // -> logits (n, V) (reallocated when its shape differs), equal to forward's logits at those positions up to rounding. weights
  // (optional): per block, each row's graph weights over its slot's positions (n, max_len), empty
  // for a block without a graph. logit_rows (optional): only those rows' logits, (m, V) in that
  // order: a prefill chunk needs its last row's alone, and the LM head (V x D per row) is the
  // largest product of a row. Overwrites the forward caches (run forward before a backward).
  void decode(const Tensor<std::int32_t, B>& ids, const DecodeRows& rows, DecodeCache& cache,
              Tensor<T, B>& logits, std::vector<Tensor<T, B>>* weights = nullptr,
              std::span<const index_t> logit_rows = {}) {
    check_bound("decode");
    GRAPHMOE_CHECK(cache.blocks.size() == blocks_.size(), "TransformerLM::decode",
                   "the decode cache was not made by this model's decode_cache()");
    rows.validate("TransformerLM::decode", cache.slots, cache.max_len);
    const index_t n = rows.size();
    has_loss_ = false;                      // the blocks' forward caches are overwritten below:
    class_log_probs_ = Tensor<T, B>();      // backward() needs a new forward
    GRAPHMOE_CHECK(ids.rank() == 1 && ids.dim(0) == n, "TransformerLM::decode", "ids must be (",
                   n, ") for this step's rows, got ", ids.shape());
    for (std::size_t j = 0; j < logit_rows.size(); ++j)
      GRAPHMOE_CHECK(logit_rows[j] >= 0 && logit_rows[j] < n, "TransformerLM::decode",
                     "logit row ", logit_rows[j], " (entry ", j, ") is outside the step's ", n,
                     " rows");
    Tensor<T, B> h, hp;
    embedding_forward(ids, tok_, h);  // (n, D)
    if (id_pos_ >= 0) {  // learned positions (with RoPE the attention layers rotate q and k)
      Tensor<std::int32_t, cpu> pos_host(Shape{n});
      for (index_t i = 0; i < n; ++i)
        pos_host.data()[i] = static_cast<std::int32_t>(rows.pos[static_cast<std::size_t>(i)]);
      Tensor<std::int32_t, B> pos_ids(Shape{n});
      copy_from_host(pos_ids, pos_host);
      embedding_forward(pos_ids, pos_, hp);
      axpy(T(1), hp, h);
    }
    if (weights != nullptr) weights->assign(blocks_.size(), Tensor<T, B>());
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      Tensor<T, B> next;
      blocks_[l].decode(h, rows, cache.blocks[l], next, weights != nullptr ? &(*weights)[l] : nullptr);
      h = next;
    }
    Tensor<T, B> xf;
    ln_f_.forward(h, xf);
    if (!logit_rows.empty()) {  // the listed rows of xf (a gather of rows: embedding_forward)
      const index_t m = static_cast<index_t>(logit_rows.size());
      Tensor<std::int32_t, cpu> pick_host(Shape{m});
      for (index_t j = 0; j < m; ++j)
        pick_host.data()[j] = static_cast<std::int32_t>(logit_rows[static_cast<std::size_t>(j)]);
      Tensor<std::int32_t, B> pick(Shape{m});
      copy_from_host(pick, pick_host);
      Tensor<T, B> picked;
      embedding_forward(pick, xf, picked);
      xf = picked;
    }
    const index_t m = xf.rows();
    if (logits.shape() != Shape{m, cfg_.vocab_size}) logits = Tensor<T, B>(Shape{m, cfg_.vocab_size});
    head_forward(xf, logits);
  }

  const TransformerLMConfig& config() const { return cfg_; }
  const Tensor<T, B>& logits() const { return logits_; }  // (B, T, V) of the last forward
  index_t num_layers() const { return cfg_.num_layers; }
  // block(i), set_step, after_optimizer_step, set_mode, mode: BlockStackModel (layers/block.hpp)

 private:
  // embeddings -> blocks -> LN_f into xf_ (B, T, D)
  void trunk_forward(const Tensor<std::int32_t, B>& ids) {
    GRAPHMOE_CHECK(ids.rank() == 2, "TransformerLM", "ids must be (B, T), got ", ids.shape());
    const index_t b = ids.dim(0), t = ids.dim(1);
    GRAPHMOE_CHECK(t >= 1 && t <= cfg_.max_seq_len, "TransformerLM", "sequence length ", t,
                   " out of [1, max_seq_len = ", cfg_.max_seq_len, "]");
    ids_ = ids;
    Tensor<T, B> h;
    embedding_forward(ids, tok_, h);  // (B, T, D)
    // every sequence += the positions: one broadcast over the (B, T D) view
    if (id_pos_ >= 0)
      add_row_vector(pos_.slice(0, t).view(Shape{t * cfg_.d_model}),
                     h.view(Shape{b, t * cfg_.d_model}));
    xf_ = Tensor<T, B>();
    ln_f_.forward(blocks_.forward(h), xf_);
  }
  // dxf (B, T, D) -> parameter gradients of LN_f, the blocks and the embeddings
  void trunk_backward(const Tensor<T, B>& dxf) {
    const index_t b = ids_.dim(0), t = ids_.dim(1);
    Tensor<T, B> dtop;
    ln_f_.backward(dxf, dtop);
    const Tensor<T, B> dh = blocks_.backward(dtop);
    embedding_backward(ids_, dh, dtok_);
    // dpos += the sum over sequences, as one column sum over the (B, T D) view
    if (id_pos_ >= 0)
      accumulate_column_sums(dh.view(Shape{b, t * cfg_.d_model}),
                             dpos_.slice(0, t).view(Shape{t * cfg_.d_model}));
  }

  void check_bound(const char* op) const { detail::require_bound(arena_ != nullptr, "TransformerLM", op); }
  // logits (n, V) = x (n, D) W^T with the head weight W: in T, or (C != T) on C copies of x and W,
  // kept for backward (overwritten by decode, which needs no backward)
  void head_forward(const Tensor<T, B>& x, Tensor<T, B>& logits) {
    if constexpr (std::is_same_v<C, T>) {
      gemm(Trans::N, Trans::T, T(1), x, head_weight(), T(0), logits);
    } else {
      to_compute(x, xfc_);
      if (mirror_ != nullptr) {  // the head weight's (or the tied token embedding's) C view
        mirror_->ensure_current();
        headc_ = mirror_->value(id_head_ >= 0 ? id_head_ : id_tok_);
      } else {
        to_compute(head_weight(), headc_);
      }
      gemm(Trans::N, Trans::T, T(1), xfc_, headc_, T(0), logits);
    }
  }
  // dst = src in C (dst reallocated when its shape differs); C != T only.
  static void to_compute(const Tensor<T, B>& src, Tensor<C, B>& dst) {
    if (dst.empty() || dst.shape() != src.shape()) dst = Tensor<C, B>(src.shape());
    convert(src, dst);
  }
  Tensor<T, B> head_weight() const { return id_head_ >= 0 ? arena_->value(id_head_) : tok_; }
  Tensor<T, B> head_grad() const { return id_head_ >= 0 ? arena_->grad(id_head_) : dtok_; }

  std::unique_ptr<ParameterArena<T, B>> owned_;  // the owning constructor's arena
  ParameterArena<T, B>* declared_in_ = nullptr;
  ParameterArena<T, B>* arena_ = nullptr;  // set by bind()
  std::string prefix_;
  index_t first_param_ = 0, end_param_ = 0;
  TransformerLMConfig cfg_;
  index_t id_tok_ = -1, id_pos_ = -1, id_head_ = -1;
  Tensor<T, B> tok_, dtok_, pos_, dpos_;
  Norm<T, B> ln_f_;
  Linear<T, B> cls_head_;
  // forward cache
  Tensor<std::int32_t, B> ids_, targets_, labels_;
  Tensor<std::int32_t, cpu> lengths_;
  Tensor<T, B> xf_, logits_, log_probs_, dlogits_, class_logits_, class_log_probs_;
  CrossEntropyResult<B> ce_;  // the LM forward's loss and count of targets (cross-entropy)
  CrossEntropyResult<B> class_ce_;  // forward_classify's loss and count of labels
  Tensor<C, B> xfc_, headc_, dlc_;  // C != T: the LM head's operands in C (empty when C = T)
  // C != T: the arena's weights in C (compute_mirror()); declared last, so destroyed first
  std::unique_ptr<ComputeMirror<T, C, B>> mirror_;
  bool has_loss_ = false;
};

}  // namespace graphmoe
