// graphmoe/train/training_state.hpp: a training checkpoint = the model's parameters ("model.<name>",
// PyTorch-readable) + the AdamW state ("adamw.m.<name>", "adamw.v.<name>") + metadata (the
// optimizer's step count under "optimizer_steps", and whatever the caller adds: config, step).
// Saved atomically (save_safetensors); loading checks every name, shape and dtype before it
// changes anything in the model, then restores the optimizer so that training continues bit for
// bit.
#pragma once

#include <map>
#include <string>

#include <type_traits>
#include <vector>

#include "graphmoe/backend/cpu/elementwise.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/optim.hpp"

namespace graphmoe {

namespace detail {
// A host tensor with t's values: t itself on the CPU; a copy (to_host, found by argument-dependent
// lookup in graphmoe/backend/cuda/copy.cuh) for a device tensor.
template <class T, class B>
Tensor<T, cpu> host_values(const Tensor<T, B>& t) {
  if constexpr (std::is_same_v<B, cpu>) {
    return t;
  } else {
    return to_host(t);
  }
}

// An arena on the host with the same parameters (names, shapes, trainable flags, hence the same
// layout) as `arena`, allocated and zero.
template <class T, class B>
ParameterArena<T, cpu> host_mirror(const ParameterArena<T, B>& arena) {
  ParameterArena<T, cpu> h;
  for (const auto& p : arena.params()) h.add(p.name, p.shape, p.trainable);
  h.allocate();
  return h;
}
}  // namespace detail

// The model and AdamW state of any backend (device tensors are copied to the host first).
template <class T, class B>
void save_training_state(const std::string& path, const ParameterArena<T, B>& arena,
                         const AdamW<T, B>& adam, std::map<std::string, std::string> metadata) {
  GRAPHMOE_CHECK(arena.allocated(), "save_training_state", "the arena is not allocated");
  std::vector<Tensor<T, cpu>> host;  // keeps the host copies alive until the file is written
  std::vector<TensorRef> refs;
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    host.push_back(detail::host_values(arena.value(i)));
    refs.push_back({"model." + p.name, dtype_of<T>(), p.shape, host.back().data()});
  }
  for (const auto& [name, view] : adam.state(arena)) {
    host.push_back(detail::host_values(view));
    refs.push_back({name, dtype_of<T>(), view.shape(), host.back().data()});
  }
  metadata["optimizer_steps"] = std::to_string(adam.steps());
  save_safetensors(path, refs, metadata);
}

// Restores what save_training_state wrote into an arena and optimizer of any backend. Every name,
// shape and dtype is checked before anything changes.
template <class T, class B>
const std::map<std::string, std::string>& load_training_state(const SafetensorsFile& f,
                                                              ParameterArena<T, B>& arena,
                                                              AdamW<T, B>& adam) {
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
  if constexpr (std::is_same_v<B, cpu>) {
    load_arena(f, arena, "model.");  // validates everything before copying
  } else {
    ParameterArena<T, cpu> mirror = detail::host_mirror(arena);
    load_arena(f, mirror, "model.");
    copy_from_host(arena.values(), mirror.values());
  }
  for (std::size_t i = 0; i < state.size(); ++i)
    copy_from_host(state[i].second, loaded[i].view(state[i].second.shape()));
  adam.set_steps(std::stoll(f.metadata.at("optimizer_steps")));
  return f.metadata;
}

}  // namespace graphmoe
