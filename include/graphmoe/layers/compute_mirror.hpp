// graphmoe/layers/compute_mirror.hpp: the parameters of a ParameterArena<T, B> in the compute
// type C (a mixed-precision model's bf16 weights), kept beside the T master weights so that the
// layers read their C weights instead of converting them on every forward.
//
//   ComputeMirror<float, __nv_bfloat16, cuda> mirror(arena);   // one buffer of arena's size
//   linear.attach_mirror(&mirror);        // Linear, ExpertBank, TransformerLM's head read views
//   opt.step(arena, lr, &mirror);         // AdamW: w and bf16(w) written in the same pass
//
// Layout: values() is one contiguous Tensor<C, B> of arena.values()'s size, each parameter at its
// arena offset (value(id) is the view), padding zero. Contents: exactly convert(arena.values()),
// elementwise, i.e. what the layers' per-forward conversions produced, so a model computes bit
// for bit the same with or without a mirror.
//
// Staleness: the mirror records the arena's values_version() it copied (core/arena.hpp). current()
// compares; ensure_current() converts the whole arena again when they differ (the layers call it
// at every forward: one integer comparison when current). Writers that keep the mirror current
// themselves (AdamW::step with the mirror) call mark_synced() after marking the arena written.
// Code that writes the values behind the library's back must call arena.mark_values_written()
// (any library writer does: optimizers, init, checkpoint loads, broadcast_parameters).
//
// C != T only (a mirror of T in T would be the values themselves); with C = T nothing creates
// one. The arena must outlive the mirror and keep its buffers (it never reallocates them).
#pragma once

#include <cstdint>
#include <limits>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

template <class T, class C, class B>
class ComputeMirror {
 public:
  explicit ComputeMirror(const ParameterArena<T, B>& arena) : arena_(&arena) {
    GRAPHMOE_CHECK(arena.allocated(), "ComputeMirror",
                   "the arena is not allocated (allocate it before taking its mirror)");
    values_ = Tensor<C, B>(arena.values().shape());
  }
  ComputeMirror(const ComputeMirror&) = delete;
  ComputeMirror& operator=(const ComputeMirror&) = delete;

  const ParameterArena<T, B>& arena() const { return *arena_; }
  // Whether the mirror holds the arena's current values.
  bool current() const { return synced_ == arena_->values_version(); }
  // values() = the arena's values in C (one conversion of the whole buffer).
  void refresh() {
    convert(arena_->values(), values_);
    synced_ = arena_->values_version();
  }
  void ensure_current() {
    if (!current()) refresh();
  }
  // For a writer that has just written both the arena's values and the mirror (and marked the
  // arena written): the mirror is current at the arena's new version.
  void mark_synced() { synced_ = arena_->values_version(); }

  // The whole buffer, and parameter id's view (the arena's offsets and shapes).
  const Tensor<C, B>& values() const { return values_; }
  Tensor<C, B> value(index_t id) const {
    const ParameterInfo& p = arena_->params().at(static_cast<std::size_t>(id));
    return values_.slice(p.offset, p.offset + p.shape.numel()).view(p.shape);
  }

 private:
  const ParameterArena<T, B>* arena_;
  Tensor<C, B> values_;
  std::uint64_t synced_ = std::numeric_limits<std::uint64_t>::max();  // never copied yet
};

}  // namespace graphmoe
