// graphmoe/train/pretrained.hpp: a SequenceClassifier's backbone from a saved TransformerLM
// checkpoint (the paper's fine-tuning: train_lm's checkpoint, then finetune_classifier).
//
// The model side is SequenceClassifier::load_backbone, which takes the tensors from a callback
// (models sit below the training code and read no files); this header is the checkpoint side.
#pragma once

#include <string>

#include "graphmoe/models/sequence_classifier.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace graphmoe {

// Copies every backbone parameter of `model` (all but "cls_head.*") from an LM checkpoint whose
// tensors are named prefix + parameter name (train_lm writes them under "model."); throws naming
// the first missing or mis-shaped one. The classification head keeps its initialisation. The
// checkpoint's tensors must have the model's scalar type (LoadedTensor::to_tensor checks it);
// tensors of the file that are not backbone parameters are ignored.
template <class RouterPolicy, class T, class B>
void load_pretrained(SequenceClassifier<RouterPolicy, T, B>& model, const SafetensorsFile& f,
                     const std::string& prefix = "") {
  model.load_backbone([&](const std::string& name, const Shape& shape) {
    const std::string key = prefix + name;
    GRAPHMOE_CHECK(f.contains(key), "SequenceClassifier::load_pretrained", "'", f.path,
                   "' has no tensor '", key, "' (is it a checkpoint of the same LM?)");
    Tensor<T, cpu> t = f.at(key).template to_tensor<T>();
    GRAPHMOE_CHECK(t.shape() == shape, "SequenceClassifier::load_pretrained", "tensor '", key,
                   "' has shape ", t.shape(), ", the model expects ", shape);
    return t;
  });
}

}  // namespace graphmoe
