// graphmoe/train/training_state.hpp: a training checkpoint = the model's parameters ("model.<name>",
// PyTorch-readable) + the AdamW state ("adamw.m.<name>", "adamw.v.<name>") + metadata (the
// optimizer's step count under "optimizer_steps", and whatever the caller adds: config, step).
// Saved atomically (save_safetensors); loading checks every name, shape and dtype before it
// changes anything in the model, then restores the optimizer so that training continues bit for
// bit.
#pragma once

#include <map>
#include <string>

#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/optim.hpp"

namespace graphmoe {

template <class T>
void save_training_state(const std::string& path, const ParameterArena<T, cpu>& arena,
                         const AdamW<T>& adam, std::map<std::string, std::string> metadata) {
  std::vector<TensorRef> refs;
  append_arena(refs, arena, "model.");
  const auto state = adam.state(arena);
  for (const auto& [name, view] : state) refs.push_back({name, dtype_of<T>(), view.shape(), view.data()});
  metadata["optimizer_steps"] = std::to_string(adam.steps());
  save_safetensors(path, refs, metadata);
}

// Restores the model and the optimizer from `f` (see save_training_state); returns f.metadata.
template <class T>
const std::map<std::string, std::string>& load_training_state(const SafetensorsFile& f,
                                                              ParameterArena<T, cpu>& arena,
                                                              AdamW<T>& adam) {
  GRAPHMOE_CHECK(f.metadata.count("optimizer_steps") != 0, "load_training_state", "'", f.path,
                 "' has no optimizer_steps in its metadata (not a training checkpoint)");
  auto state = adam.state(arena);
  std::vector<Tensor<T, cpu>> loaded;
  for (const auto& [name, view] : state) {
    Tensor<T, cpu> t = f.at(name).template to_tensor<T>();
    GRAPHMOE_CHECK(t.numel() == view.numel(), "load_training_state", "'", f.path, "': tensor '",
                   name, "' has shape ", t.shape(), ", expected ", view.shape());
    loaded.push_back(t);
  }
  load_arena(f, arena, "model.");  // validates everything before copying
  for (std::size_t i = 0; i < state.size(); ++i) state[i].second.copy_from(loaded[i].view(state[i].second.shape()));
  adam.set_steps(std::stoll(f.metadata.at("optimizer_steps")));
  return f.metadata;
}

}  // namespace graphmoe
