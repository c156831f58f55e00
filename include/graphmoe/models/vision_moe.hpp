// graphmoe/models/vision_moe.hpp: a ViT with MoE FFNs (V-MoE, Riquelme et al. 2021) for image
// classification.
//
//   patches = the image cut into P x P patches, flattened              (B, Np, P P C)
//   h0 = [cls; patches W_p^T + b_p] + pos                              (B, Np + 1, D)
//   h_l = Block_l(h_{l-1})   full (non-causal) attention; MoE per the layout
//   logits = head(LN_f(h_L)[:, 0])                                     (B, classes)
//   loss = mean cross-entropy
//
// Layouts (google-research/vmoe): MoE in the last `moe_last` blocks, or in every other block.
// Token graphs are non-causal here (every patch may look at every other); the Attention graph
// chooses h* per image.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/layers/block.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

enum class VisionLayout {
  Last,         // MoE in the last `moe_last` blocks (V-MoE)
  Alternating,  // MoE in every other block, starting with the second
};

struct VisionMoEConfig {
  index_t image_height = 28, image_width = 28, channels = 1;
  index_t patch = 7;
  index_t num_classes = 10;
  index_t d_model = 64;
  index_t num_layers = 4;
  index_t num_heads = 4;
  index_t d_ff = 128;
  VisionLayout layout = VisionLayout::Last;
  index_t moe_last = 2;
  RouterConfig router;  // the graph must be non-causal (validate); h* per image by default
  GeluForm gelu = GeluForm::Tanh;
  double init_std = 0.02;

  index_t num_patches() const { return (image_height / patch) * (image_width / patch); }
  index_t patch_dim() const { return patch * patch * channels; }
  bool is_moe_layer(index_t i) const {
    return layout == VisionLayout::Last ? i >= num_layers - moe_last : (i + 1) % 2 == 0;
  }
  void validate() const {
    GRAPHMOE_CHECK(patch >= 1 && image_height % patch == 0 && image_width % patch == 0,
                   "VisionMoEConfig", "patch ", patch, " must divide the image size ",
                   image_height, " x ", image_width);
    GRAPHMOE_CHECK(channels >= 1 && num_classes >= 2 && d_model >= 1 && num_layers >= 1 &&
                       d_ff >= 1 && moe_last >= 0 && moe_last <= num_layers,
                   "VisionMoEConfig", "bad sizes: channels ", channels, ", classes ",
                   num_classes, ", d_model ", d_model, ", layers ", num_layers, ", moe_last ",
                   moe_last);
    GRAPHMOE_CHECK(num_heads >= 1 && d_model % num_heads == 0, "VisionMoEConfig",
                   "num_heads = ", num_heads, " must divide d_model = ", d_model);
    // (HeadChoice::PerSequenceCausal, h* of each token from the tokens up to it, is allowed: an
    // alternative to the paper's per-image choice, not a mask.)
    GRAPHMOE_CHECK(!router.causal, "VisionMoEConfig",
                   "every patch attends to every other, so the token graph must not be causal: "
                   "set router.causal = false (the default)");
    router.validate();
  }
};

// One implementation for every backend (images and labels live on B).
template <class RouterPolicy, class T, class B = cpu>
class VisionMoE : public BlockStackModel<VisionMoE<RouterPolicy, T, B>, RouterPolicy, T, B> {
  using Stack = BlockStackModel<VisionMoE, RouterPolicy, T, B>;
  using Stack::blocks_;

 public:
  // The lifecycle of TransformerLM and of every layer: declare(arena, prefix, cfg), the arena's
  // allocate(), bind(arena), init(rng); forward, backward and arena() before bind() raise
  // graphmoe::Error.
  VisionMoE() = default;
  // The owning shorthand: the model's own arena (arena()), no prefix, init from Rng(seed).
  explicit VisionMoE(const VisionMoEConfig& cfg, std::uint64_t seed = 0)
      : owned_(std::make_unique<ParameterArena<T, B>>()) {
    declare(*owned_, "", cfg);
    owned_->allocate();
    bind(*owned_);
    Rng rng(seed);
    init(rng);
  }

  // Validates cfg and adds the model's parameters to arena under prefix, once per model.
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, const VisionMoEConfig& cfg) {
    GRAPHMOE_CHECK(declared_in_ == nullptr, "VisionMoE::declare",
                   "the model is already declared (in an arena of ", declared_in_->size(),
                   " parameters); declare a new model instead");
    cfg.validate();
    cfg_ = cfg;
    const index_t d = cfg_.d_model;
    patch_.declare(arena, prefix + "patch_embed.", cfg_.patch_dim(), d);
    id_cls_ = arena.add(prefix + "cls_token", Shape{d});
    id_pos_ = arena.add(prefix + "pos_emb.weight", Shape{cfg_.num_patches() + 1, d});
    blocks_.declare(arena, prefix, cfg_.num_layers, [&](index_t i) {
      BlockConfig bc;
      bc.d_model = d;
      bc.num_heads = cfg_.num_heads;
      bc.d_ff = cfg_.d_ff;
      bc.causal = false;
      bc.moe = cfg_.is_moe_layer(i);
      bc.moe_config.router = cfg_.router;
      bc.moe_config.gelu = cfg_.gelu;
      bc.init_std = cfg_.init_std;
      bc.out_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(cfg_.num_layers));
      return bc;
    });
    ln_f_.declare(arena, prefix + "ln_f.", d);
    head_.declare(arena, prefix + "head.", d, cfg_.num_classes);
    declared_in_ = &arena;
  }

  // Binds the model to the arena it was declared in, once allocated (kept as arena(): the arena
  // must outlive the model's use).
  void bind(ParameterArena<T, B>& arena) {
    detail::check_model_bind(declared_in_, arena, "VisionMoE");
    patch_.bind(arena);
    blocks_.bind(arena);
    ln_f_.bind(arena);
    head_.bind(arena);
    arena_ = &arena;
  }

  // Draws every parameter from rng (the owning constructor's order).
  void init(Rng& rng) {
    check_bound("init");
    patch_.init(rng, cfg_.init_std);
    fill_normal(arena_->value(id_cls_), rng, cfg_.init_std);
    fill_normal(arena_->value(id_pos_), rng, cfg_.init_std);
    blocks_.init(rng);
    ln_f_.init();
    head_.init(rng, cfg_.init_std);
  }

  ParameterArena<T, B>& arena() const {
    check_bound("arena()");
    return *arena_;
  }
  bool bound() const { return arena_ != nullptr; }

  VisionMoE(const VisionMoE&) = delete;
  VisionMoE& operator=(const VisionMoE&) = delete;

  // images: (B, H, W, C) or (B, H, W) for C = 1, values as given (e.g. [0, 1]); labels (B) or
  // empty. Returns the loss broken down (layers/loss.hpp): task = the mean cross-entropy (0
  // without labels) and the routers' weighted auxiliary losses; logits() holds (B, classes).
  Loss forward(const Tensor<T, B>& images, const Tensor<std::int32_t, B>& labels) {
    check_bound("forward");
    log_probs_ = Tensor<T, B>();  // backward() needs a forward with labels that finished
    const index_t b = images.rank() >= 1 ? images.dim(0) : 0;
    const index_t per_image = cfg_.image_height * cfg_.image_width * cfg_.channels;
    GRAPHMOE_CHECK(images.rank() >= 2 && b >= 1 && images.numel() == b * per_image, "VisionMoE",
                   "images have shape ", images.shape(), ", expected (B, ", cfg_.image_height,
                   ", ", cfg_.image_width, (cfg_.channels > 1 ? ", C)" : ")"));
    if (!labels.empty()) check_shape("VisionMoE", "labels", labels, Shape{b});
    // the content checks of the whole forward deferred (core/deferred_check.hpp): on a GPU the
    // images' check, the routers' and the loss's come back in one read, the first failed check
    // throwing its own error
    try {
      with_deferred_checks(B{}, [&] { forward_checked(images, labels, b); });
    } catch (...) {
      log_probs_ = Tensor<T, B>();  // backward() needs a forward that finished
      throw;
    }
    Loss loss = blocks_.moe_losses();  // the values are delivered once the scope ended
    if (!labels.empty()) loss.task = ce_.loss;
    return loss;
  }

 private:
  void forward_checked(const Tensor<T, B>& images, const Tensor<std::int32_t, B>& labels, index_t b) {
    check_finite("VisionMoE", "images", images);
    const index_t np = cfg_.num_patches(), t = np + 1, d = cfg_.d_model;
    Tensor<T, B> patches;
    patchify(images, cfg_.patch, cfg_.image_height, cfg_.image_width, cfg_.channels, patches);
    Tensor<T, B> emb;
    patch_.forward(patches, emb);  // (B Np, D)
    // h_i = [cls; emb_i] + pos
    Tensor<T, B> h(Shape{b, t, d});
    const Tensor<T, B> pos = arena_->value(id_pos_), cls = arena_->value(id_cls_).view(Shape{1, d});
    for (index_t i = 0; i < b; ++i) {
      Tensor<T, B> hi = h[i];
      hi.slice(0, 1).copy_from(cls);
      hi.slice(1, t).copy_from(emb.slice(i * np, (i + 1) * np));
      axpy(T(1), pos, hi);
    }
    xf_ = Tensor<T, B>();
    ln_f_.forward(blocks_.forward(h), xf_);
    Tensor<T, B> cls_out(Shape{b, d});
    for (index_t i = 0; i < b; ++i) cls_out.slice(i, i + 1).copy_from(xf_[i].slice(0, 1));
    logits_ = Tensor<T, B>();
    head_.forward(cls_out, logits_);
    labels_ = labels;
    ce_ = CrossEntropyResult<B>();
    if (labels.empty()) return;
    cross_entropy_forward_into(logits_, labels, log_probs_, -100, ce_);
  }

 public:

  // Gradients of the last forward's loss.total() (mean cross-entropy + the routers' weighted
  // auxiliary losses), accumulated.
  void backward() {
    GRAPHMOE_CHECK(!log_probs_.empty(), "VisionMoE::backward", "call forward with labels first");
    const index_t b = logits_.dim(0), np = cfg_.num_patches(), t = np + 1, d = cfg_.d_model;
    Tensor<T, B> dlogits, dcls(Shape{b, d});
    cross_entropy_backward(log_probs_, labels_, T(1), dlogits, -100, ce_);  // no second scan
    head_.backward(dlogits, &dcls);
    Tensor<T, B> dxf(Shape{b, t, d});
    for (index_t i = 0; i < b; ++i) dxf[i].slice(0, 1).copy_from(dcls.slice(i, i + 1));
    Tensor<T, B> dtop;
    ln_f_.backward(dxf, dtop);
    const Tensor<T, B> dh = blocks_.backward(dtop);
    const Tensor<T, B> dpos = arena_->grad(id_pos_), dclsv = arena_->grad(id_cls_).view(Shape{1, d});
    Tensor<T, B> demb(Shape{b * np, d});
    for (index_t i = 0; i < b; ++i) {
      const Tensor<T, B> dhi = dh[i];
      axpy(T(1), dhi, dpos);
      axpy(T(1), dhi.slice(0, 1), dclsv);
      demb.slice(i * np, (i + 1) * np).copy_from(dhi.slice(1, t));
    }
    patch_.backward(demb, nullptr);
  }

  const VisionMoEConfig& config() const { return cfg_; }
  const Tensor<T, B>& logits() const { return logits_; }
  // block(i), set_step, after_optimizer_step, set_mode, mode: BlockStackModel (layers/block.hpp)

 private:
  void check_bound(const char* op) const { detail::require_bound(arena_ != nullptr, "VisionMoE", op); }

  std::unique_ptr<ParameterArena<T, B>> owned_;  // the owning constructor's arena
  ParameterArena<T, B>* declared_in_ = nullptr;
  ParameterArena<T, B>* arena_ = nullptr;  // set by bind()
  VisionMoEConfig cfg_;
  Linear<T, B> patch_, head_;
  index_t id_cls_ = -1, id_pos_ = -1;
  LayerNorm<T, B> ln_f_;
  Tensor<T, B> xf_, logits_, log_probs_;
  CrossEntropyResult<B> ce_;  // the forward's loss and count of labels (cross-entropy)
  Tensor<std::int32_t, B> labels_;
};

}  // namespace graphmoe
