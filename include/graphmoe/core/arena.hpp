// graphmoe/core/arena.hpp: all parameters of a model in one buffer, all gradients in another.
//
// Two phases. First, layers declare their parameters with add(name, shape). Then allocate()
// makes one zero-filled buffer for the values and one for the gradients, and value(name) /
// grad(name) return named views into them. One flat buffer makes the optimizer step, gradient
// clipping, zero_grad and checkpointing single loops over contiguous memory (llm.c's layout).
// Every parameter starts at a multiple of kAlign elements, so each view is SIMD-aligned.
//
// values_version() counts the writes of the values: every writer the library has (the
// optimizers' steps, a model's init, checkpoint loads, broadcast_parameters) calls
// mark_values_written(), and so must code that writes through value() / values() itself. A copy
// of the values in another type (ComputeMirror, layers/compute_mirror.hpp: the bf16 weights of a
// mixed-precision model) compares it with the version it copied, and copies again when they differ.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {
// A layer's or model's forward/backward before bind() has no parameters to read: every layer
// and model calls this.
inline void require_bound(bool bound, const char* layer, const char* op) {
  GRAPHMOE_CHECK(bound, layer, op,
                 " before bind(): declare it in an arena, allocate the arena, then bind (and init) it");
}
}  // namespace detail

struct ParameterInfo {
  std::string name;
  Shape shape;
  index_t offset = 0;     // in elements, from the start of the buffer
  bool trainable = true;  // false: a fixed buffer (e.g. SMoE-Dropout's frozen router) that
                          // optimizers skip; it is still saved in checkpoints
  // Expert parallelism (docs/distributed.md): a sharded parameter is rows
  // [shard_begin, shard_begin + shape[0]) of a logical parameter of shard_rows rows (the rest of
  // its shape is `shape`'s); each rank holds its own rows. shard_rows == 0: not sharded, every
  // data-parallel rank holds the whole parameter.
  index_t shard_begin = 0;
  index_t shard_rows = 0;
  bool sharded() const { return shard_rows > 0; }
  // The logical (unsharded) shape.
  Shape full_shape() const {
    if (!sharded()) return shape;
    std::vector<index_t> dims{shard_rows};
    for (int i = 1; i < shape.rank(); ++i) dims.push_back(shape[i]);
    return Shape::from_range(dims.begin(), dims.end());
  }
};

template <class T, class B = cpu>
class ParameterArena {
 public:
  static constexpr index_t kAlign = 16;

  // Declares a parameter; returns its index. Names must be unique.
  index_t add(const std::string& name, const Shape& shape, bool trainable = true) {
    GRAPHMOE_CHECK(!allocated(), "ParameterArena::add", "cannot add '", name,
                   "' after allocate()");
    GRAPHMOE_CHECK(!name.empty(), "ParameterArena::add", "parameter name is empty");
    GRAPHMOE_CHECK(index_.find(name) == index_.end(), "ParameterArena::add",
                   "duplicate parameter name '", name, "'");
    const index_t id = static_cast<index_t>(params_.size());
    params_.push_back({name, shape, size_, trainable});
    size_ += (shape.numel() + kAlign - 1) / kAlign * kAlign;
    index_[name] = id;
    return id;
  }
  // Declares this rank's rows [begin, begin + shape[0]) of a parameter of `rows` rows along its
  // first dimension (an expert-parallel expert bank: ParameterInfo::sharded).
  index_t add_shard(const std::string& name, const Shape& shape, index_t rows, index_t begin,
                    bool trainable = true) {
    GRAPHMOE_CHECK(shape.rank() >= 1 && shape[0] >= 1 && begin >= 0 && rows >= 1 &&
                       begin + shape[0] <= rows,
                   "ParameterArena::add_shard", "'", name, "': rows [", begin, ", ",
                   begin + (shape.rank() >= 1 ? shape[0] : 0), ") of shape ", shape,
                   " are not a non-empty block of a parameter with ", rows, " rows");
    const index_t id = add(name, shape, trainable);
    params_.back().shard_begin = begin;
    params_.back().shard_rows = rows;
    return id;
  }
  // Whether any parameter is sharded (expert parallel).
  bool has_shards() const {
    for (const auto& p : params_)
      if (p.sharded()) return true;
    return false;
  }

  void allocate() {
    GRAPHMOE_CHECK(!allocated(), "ParameterArena::allocate", "already allocated");
    // zeros the system fills when first written: a loaded model's values are written once (no
    // fill pass first), and the gradients of a model that never runs backward take no memory
    values_ = Tensor<T, B>::zeros_on_demand(Shape{size_});
    grads_ = Tensor<T, B>::zeros_on_demand(Shape{size_});
  }
  bool allocated() const { return !values_.empty(); }

  index_t size() const { return static_cast<index_t>(params_.size()); }
  // Number of scalar parameters (without the alignment padding).
  index_t numel() const {
    index_t n = 0;
    for (const auto& p : params_) n += p.shape.numel();
    return n;
  }
  const std::vector<ParameterInfo>& params() const { return params_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  index_t find(const std::string& name) const {
    auto it = index_.find(name);
    GRAPHMOE_CHECK(it != index_.end(), "ParameterArena::find", "no parameter named '", name, "'");
    return it->second;
  }

  Tensor<T, B> value(index_t id) const { return view_of(values_, id, "value"); }
  Tensor<T, B> grad(index_t id) const { return view_of(grads_, id, "grad"); }
  Tensor<T, B> value(const std::string& name) const { return value(find(name)); }
  Tensor<T, B> grad(const std::string& name) const { return grad(find(name)); }

  // The whole buffers, padding included (padding stays zero).
  const Tensor<T, B>& values() const { return values_; }
  const Tensor<T, B>& grads() const { return grads_; }
  void zero_grad() { grads_.zero(); }

  // The number of writes of values() so far (see the header comment): a copy taken at version n
  // is current while values_version() == n.
  std::uint64_t values_version() const { return version_; }
  void mark_values_written() { ++version_; }

  // clip_grad_norm's chunk table (ops/optim.hpp fills it on first use): the layout cannot change
  // once the arena is allocated, so the table is built and uploaded once, and a training step
  // uploads nothing for it.
  std::optional<detail::OptimChunks<B>>& grad_norm_chunks() const { return norm_chunks_; }

 private:
  Tensor<T, B> view_of(const Tensor<T, B>& buffer, index_t id, const char* what) const {
    GRAPHMOE_CHECK(allocated(), "ParameterArena", "call allocate() before taking a ", what);
    GRAPHMOE_CHECK(0 <= id && id < size(), "ParameterArena", "parameter index ", id,
                   " out of range (", size(), " parameters)");
    const ParameterInfo& p = params_[static_cast<std::size_t>(id)];
    return buffer.slice(p.offset, p.offset + p.shape.numel()).view(p.shape);
  }

  std::vector<ParameterInfo> params_;
  std::unordered_map<std::string, index_t> index_;
  index_t size_ = 0;
  Tensor<T, B> values_, grads_;
  std::uint64_t version_ = 0;
  mutable std::optional<detail::OptimChunks<B>> norm_chunks_;  // none until clip_grad_norm
};

namespace detail {
// A model binds to the arena it declared its parameters in (the ids it keeps index that arena),
// once the arena is allocated.
template <class T, class B>
void check_model_bind(const ParameterArena<T, B>* declared_in, const ParameterArena<T, B>& arena,
                      const char* model) {
  GRAPHMOE_CHECK(declared_in != nullptr, model,
                 "bind() before declare(): declare the model in an arena, allocate the arena, "
                 "then bind (and init) it");
  GRAPHMOE_CHECK(declared_in == &arena, model,
                 "bind() to another arena than the one the model was declared in");
  GRAPHMOE_CHECK(arena.allocated(), model,
                 "bind() before the arena's allocate(): declare, allocate, bind, then init");
}
}  // namespace detail

}  // namespace graphmoe
