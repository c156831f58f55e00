// graphmoe/models/sequence_classifier.hpp: an LM backbone with a pooled classification head,
// initialised from a pretrained TransformerLM (the paper's fine-tuning on SST-2, SST-5 and
// Banking-77).
//
//   logits = cls_head(mean over the real tokens of LN_f(trunk(ids)))
//
// The backbone is a TransformerLM with num_classes > 0 (causal, so right-padding never reaches
// the real tokens). load_backbone copies every backbone parameter from whatever source the caller
// hands it (a name -> tensor callback); the classification head keeps its fresh initialisation.
// Models read no files: train/pretrained.hpp's load_pretrained(model, checkpoint, prefix) is the
// source for a saved TransformerLM checkpoint.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

// One implementation for every backend (ids and labels on B, lengths on the host).
template <class RouterPolicy, class T, class B = cpu>
class SequenceClassifier {
 public:
  // The lifecycle of TransformerLM (whose declare / bind / init these forward to, with
  // cfg.num_classes = num_classes): declare(arena, prefix, cfg, num_classes), the arena's
  // allocate(), bind(arena), init(rng).
  SequenceClassifier() = default;
  // The owning shorthand: the model's own arena, no prefix, init from Rng(seed).
  SequenceClassifier(TransformerLMConfig cfg, index_t num_classes, std::uint64_t seed = 0)
      : lm_(with_classes(std::move(cfg), num_classes), seed) {}

  void declare(ParameterArena<T, B>& arena, const std::string& prefix, TransformerLMConfig cfg,
               index_t num_classes) {
    lm_.declare(arena, prefix, with_classes(std::move(cfg), num_classes));
  }
  void bind(ParameterArena<T, B>& arena) { lm_.bind(arena); }
  void init(Rng& rng) { lm_.init(rng); }

  // Whether `name` is a parameter of the backbone, i.e. one a pretrained LM provides: every
  // parameter but the classification head's ("cls_head.*").
  static bool is_backbone_parameter(const std::string& name) {
    return name.rfind("cls_head.", 0) != 0;
  }

  // Copies every backbone parameter from a pretrained model, in arena order: the seam between
  // the model and wherever pretrained weights are kept. fetch(name, shape) is called once per
  // backbone parameter and returns its pretrained values as a host tensor of that shape, or
  // throws (naming its source) when it has none; a tensor of another shape is refused here.
  // Parameters copied before a throw stay copied.
  template <class Fetch>
    requires std::invocable<Fetch&, const std::string&, const Shape&> &&
             std::convertible_to<std::invoke_result_t<Fetch&, const std::string&, const Shape&>,
                                 Tensor<T, cpu>>
  void load_backbone(Fetch&& fetch) {
    ParameterArena<T, B>& arena = lm_.arena();
    const std::string& prefix = lm_.prefix();
    const auto [first, end] = lm_.parameter_ids();
    for (index_t id = first; id < end; ++id) {  // this model's parameters (the arena may hold more)
      const ParameterInfo& info = arena.params()[static_cast<std::size_t>(id)];
      const std::string name = info.name.substr(prefix.size());  // as the pretrained LM names it
      if (!is_backbone_parameter(name)) continue;
      const Tensor<T, cpu> t = fetch(name, info.shape);
      GRAPHMOE_CHECK(t.shape() == info.shape, "SequenceClassifier::load_backbone",
                     "the pretrained tensor for '", name, "' has shape ", t.shape(),
                     ", the model expects ", info.shape);
      copy_from_host(arena.value(id), t);
    }
    arena.mark_values_written();
  }

  // The loss broken down (layers/loss.hpp); backward differentiates its total().
  Loss forward(const Tensor<std::int32_t, B>& ids, const Tensor<std::int32_t, cpu>& lengths,
               const Tensor<std::int32_t, B>& labels) {
    return lm_.forward_classify(ids, lengths, labels);
  }
  void backward() { lm_.backward_classify(); }
  const Tensor<T, B>& logits() const { return lm_.class_logits(); }
  ParameterArena<T, B>& arena() const { return lm_.arena(); }
  TransformerLM<RouterPolicy, T, B>& backbone() { return lm_; }
  void set_step(std::int64_t s) { lm_.set_step(s); }
  // After every optimizer step (TransformerLM::after_optimizer_step).
  void after_optimizer_step(dist::Communicator* comm = nullptr) { lm_.after_optimizer_step(comm); }
  // Train (the default) or eval for every router policy that takes a mode (core/mode.hpp).
  void set_mode(Mode mode) { lm_.set_mode(mode); }
  Mode mode() const { return lm_.mode(); }

 private:
  static TransformerLMConfig with_classes(TransformerLMConfig cfg, index_t n) {
    GRAPHMOE_CHECK(n >= 2, "SequenceClassifier", "num_classes must be >= 2, got ", n);
    cfg.num_classes = n;
    return cfg;
  }
  TransformerLM<RouterPolicy, T, B> lm_;
};

}  // namespace graphmoe
