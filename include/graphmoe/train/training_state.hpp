// graphmoe/train/training_state.hpp: a training checkpoint = the model's parameters ("model.<name>",
// PyTorch-readable) + the AdamW state ("adamw.m.<name>", "adamw.v.<name>") + metadata (the
// optimizer's step count under "optimizer_steps", and whatever the caller adds: config, step).
// Saved atomically (save_safetensors); loading checks every name, shape and dtype before it
// changes anything in the model, then restores the optimizer so that training continues bit for
// bit.
//
// Reading a checkpoint's metadata (for the examples and any caller), each error naming the file
// and the field (docs/reliability.md):
//   metadata_field(f, key)            the string; throws "'<path>' has no metadata field '<key>'"
//   metadata_int(f, key, lo, hi)      a decimal integer in [lo, hi]; throws naming the text
//   metadata_json(f, key)             the JSON value; throws with the parser's message and byte
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/optim.hpp"

namespace graphmoe {

// The metadata field `key` of f; throws graphmoe::Error naming the file and the field when absent.
inline const std::string& metadata_field(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata.find(key);
  GRAPHMOE_CHECK(it != f.metadata.end(), "metadata_field", "'", f.path,
                 "' has no metadata field '", key, "'");
  return it->second;
}

// The metadata field `key` of f as a decimal integer in [lo, hi] (no sign but '-', no spaces, no
// other characters); throws naming the file, the field and its text.
inline std::int64_t metadata_int(const SafetensorsFile& f, const std::string& key,
                                 std::int64_t lo, std::int64_t hi) {
  const std::string& text = metadata_field(f, key);
  std::int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v, 10);
  GRAPHMOE_CHECK(!text.empty() && r.ec != std::errc::invalid_argument &&
                     r.ptr == text.data() + text.size(),
                 "metadata_int", "'", f.path, "': metadata field '", key, "' is '", text,
                 "', not a decimal integer");
  GRAPHMOE_CHECK(r.ec != std::errc::result_out_of_range && v >= lo && v <= hi, "metadata_int",
                 "'", f.path, "': metadata field '", key, "' is ", text,
                 ", out of the range [", lo, ", ", hi, "]");
  return v;
}

// The metadata field `key` of f parsed as JSON; throws naming the file, the field and the
// parser's error.
inline nlohmann::json metadata_json(const SafetensorsFile& f, const std::string& key) {
  const std::string& text = metadata_field(f, key);
  detail::check_json_depth("metadata_json", "'" + f.path + "': metadata field '" + key + "'", text);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    detail::throw_error("metadata_json", "'", f.path, "': metadata field '", key,
                        "' is not valid JSON: ", e.what());
  }
}

namespace detail {
// An arena on the host with the same parameters (names, shapes, trainable flags, hence the same
// layout) as `arena`, allocated and zero.
template <class T, class B>
ParameterArena<T, cpu> host_mirror(const ParameterArena<T, B>& arena) {
  ParameterArena<T, cpu> h;
  for (const auto& p : arena.params()) h.add(p.name, p.shape, p.trainable);
  h.allocate();
  return h;
}

// load_arena (train/checkpoint.hpp) into an arena of any backend: a host arena directly, any other
// through a host mirror (everything checked there before the values are copied to the device).
template <class T>
void load_arena_any(const SafetensorsFile& f, ParameterArena<T, cpu>& arena,
                    const std::string& prefix) {
  load_arena(f, arena, prefix);
}
template <class T, class B>
void load_arena_any(const SafetensorsFile& f, ParameterArena<T, B>& arena,
                    const std::string& prefix) {
  ParameterArena<T, cpu> mirror = host_mirror(arena);
  load_arena(f, mirror, prefix);
  copy_from_host(arena.values(), mirror.values());
  arena.mark_values_written();
}
}  // namespace detail

// The model and AdamW state of any backend (device tensors are copied to the host first).
template <class T, class B>
void save_training_state(const std::string& path, const ParameterArena<T, B>& arena,
                         const AdamW<T, B>& adam, std::map<std::string, std::string> metadata) {
  GRAPHMOE_CHECK(arena.allocated(), "save_training_state", "the arena is not allocated");
  GRAPHMOE_CHECK(!arena.has_shards(), "save_training_state",
                 "the arena holds expert shards (expert parallel): this rank alone cannot write "
                 "the model; use dist::save_training_state (graphmoe/train/distributed_checkpoint.hpp), "
                 "collective over the ranks");
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

// Restores what save_training_state wrote into an arena and optimizer of any backend. Everything
// is checked before anything changes: the model tensors as load_arena(strict) checks them (every
// parameter present, exact dtype and shape, no "model." tensor that is not a parameter) and every
// model value finite; every AdamW state tensor present with exactly its parameter's dtype and
// shape, finite, and the second moments non-negative; no other tensor in the file (a stray "adamw." tensor, or one outside both
// prefixes, is refused by name); and the metadata field optimizer_steps a decimal integer >= 0.
template <class T, class B>
const std::map<std::string, std::string>& load_training_state(const SafetensorsFile& f,
                                                              ParameterArena<T, B>& arena,
                                                              AdamW<T, B>& adam) {
  const char* op = "load_training_state";
  GRAPHMOE_CHECK(f.metadata.count("optimizer_steps") != 0, op, "'", f.path,
                 "' has no optimizer_steps in its metadata (not a training checkpoint)");
  const std::int64_t steps =
      metadata_int(f, "optimizer_steps", 0, std::numeric_limits<std::int64_t>::max());
  auto state = adam.state(arena);
  std::set<std::string> expected;
  std::vector<Tensor<T, cpu>> loaded;
  for (const auto& [name, view] : state) {
    expected.insert(name);
    // an expert shard's state ("adamw.m." / "adamw.v." + its name) is its rows of the whole tensor
    const ParameterInfo* shard = nullptr;
    if (name.size() > 8 && arena.contains(name.substr(8)) &&
        arena.params()[static_cast<std::size_t>(arena.find(name.substr(8)))].sharded()) {
      shard = &arena.params()[static_cast<std::size_t>(arena.find(name.substr(8)))];
    }
    const Shape want = shard != nullptr ? shard->full_shape() : view.shape();
    GRAPHMOE_CHECK(f.contains(name), op, "'", f.path, "' has no optimizer-state tensor '", name,
                   "' of shape ", want);
    const LoadedTensor& lt = f.at(name);
    GRAPHMOE_CHECK(lt.dtype == dtype_of<T>(), op, "'", f.path, "': optimizer-state tensor '",
                   name, "' has dtype ", lt.dtype, ", expected ", dtype_of<T>(),
                   " (no conversion is done)");
    GRAPHMOE_CHECK(lt.shape == want, op, "'", f.path, "': optimizer-state tensor '", name,
                   "' has shape ", lt.shape, ", expected ", want);
    Tensor<T, cpu> t = lt.template to_tensor<T>();
    if (shard != nullptr) t = t.slice(shard->shard_begin, shard->shard_begin + shard->shape[0]).clone();
    const bool second_moment = name.rfind("adamw.v.", 0) == 0;
    for (index_t i = 0; i < t.numel(); ++i) {
      const T x = t.data()[i];
      GRAPHMOE_CHECK(std::isfinite(x) && (!second_moment || x >= T(0)), op, "'", f.path,
                     "': optimizer-state tensor '", name, "' holds ", x, " at element ", i,
                     second_moment ? " (second moments must be finite and >= 0)"
                                   : " (must be finite)");
    }
    loaded.push_back(t);
  }
  // finite weights: training from a NaN or Inf weight only turns every activation into NaN
  // (a wrong dtype is load_arena's error, below)
  check_weight_values<T>(f, "model.", op, "a training checkpoint's");
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("model.", 0) == 0 || expected.count(name) != 0) continue;
    detail::throw_error(op, "'", f.path, "' has the tensor '", name, "' of shape ", t.shape,
                        ", which is neither a model parameter ('model.<name>') nor a state "
                        "tensor of this optimizer");
  }
  detail::load_arena_any(f, arena, "model.");  // validates everything before copying
  for (std::size_t i = 0; i < state.size(); ++i)
    copy_from_host(state[i].second, loaded[i].view(state[i].second.shape()));
  adam.set_steps(steps);
  return f.metadata;
}

}  // namespace graphmoe
