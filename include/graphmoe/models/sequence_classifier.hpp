// graphmoe/models/sequence_classifier.hpp: an LM backbone with a pooled classification head,
// initialised from a saved TransformerLM checkpoint (the paper's fine-tuning on SST-2, SST-5 and
// Banking-77).
//
//   logits = cls_head(mean over the real tokens of LN_f(trunk(ids)))
//
// The backbone is a TransformerLM with num_classes > 0 (causal, so right-padding never reaches
// the real tokens). load_pretrained copies every backbone parameter from an LM checkpoint; the
// classification head keeps its fresh initialisation.
#pragma once

#include <string>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace graphmoe {

// One implementation for every backend (ids and labels on B, lengths on the host).
template <class RouterPolicy, class T, class B = cpu>
class SequenceClassifier {
 public:
  SequenceClassifier(TransformerLMConfig cfg, index_t num_classes, std::uint64_t seed = 0)
      : lm_((check_classes(num_classes), cfg.num_classes = num_classes, cfg), seed) {}

  // Copies every parameter of the backbone (all but "cls_head.*") from an LM checkpoint whose
  // tensors are named prefix + parameter name; throws naming the first missing or mis-shaped one.
  void load_pretrained(const SafetensorsFile& f, const std::string& prefix = "") {
    index_t copied = 0;
    for (const auto& info : lm_.arena.params()) {
      if (info.name.rfind("cls_head.", 0) == 0) continue;
      const std::string key = prefix + info.name;
      GRAPHMOE_CHECK(f.contains(key), "SequenceClassifier::load_pretrained", "'", f.path,
                     "' has no tensor '", key, "' (is it a checkpoint of the same LM?)");
      const Tensor<T, cpu> t = f.at(key).template to_tensor<T>();
      GRAPHMOE_CHECK(t.shape() == info.shape, "SequenceClassifier::load_pretrained", "tensor '",
                     key, "' has shape ", t.shape(), ", the model expects ", info.shape);
      copy_from_host(lm_.arena.value(info.name), t);
      ++copied;
    }
    (void)copied;
  }

  T forward(const Tensor<std::int32_t, B>& ids, const Tensor<std::int32_t, cpu>& lengths,
            const Tensor<std::int32_t, B>& labels) {
    return lm_.forward_classify(ids, lengths, labels);
  }
  void backward() { lm_.backward_classify(); }
  double aux_loss() const { return lm_.aux_loss(); }
  const Tensor<T, B>& logits() const { return lm_.class_logits(); }
  ParameterArena<T, B>& arena() { return lm_.arena; }
  TransformerLM<RouterPolicy, T, B>& backbone() { return lm_; }
  void set_step(std::int64_t s) { lm_.set_step(s); }

 private:
  static void check_classes(index_t n) {
    GRAPHMOE_CHECK(n >= 2, "SequenceClassifier", "num_classes must be >= 2, got ", n);
  }
  TransformerLM<RouterPolicy, T, B> lm_;
};

}  // namespace graphmoe
