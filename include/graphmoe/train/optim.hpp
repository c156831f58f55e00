// graphmoe/train/optim.hpp: AdamW, SGD and global gradient-norm clipping over a ParameterArena.
//
//   AdamW<T> opt(arena, AdamWConfig{});     state m, v: flat tensors the size of arena.values()
//   clip_grad_norm(arena, 1.0);             global L2 norm of the trainable gradients
//   opt.step(arena, schedule.at(step));     one update of every trainable parameter
//
// Update rules (t = the step count after increment, starting at 1; g = the gradient):
//
//   AdamW (Loshchilov & Hutter, decoupled weight decay):
//     m = beta1 m + (1 - beta1) g            m_hat = m / (1 - beta1^t)
//     v = beta2 v + (1 - beta2) g^2          v_hat = v / (1 - beta2^t)
//     p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p)        (wd p only for decayed parameters)
//
//   SGD (PyTorch's torch.optim.SGD with dampening 0; weight decay is coupled, an L2 term):
//     d = g + wd p                                        (wd p only for decayed parameters)
//     momentum > 0:  buf = momentum buf + d;  d = nesterov ? d + momentum buf : buf
//     p -= lr d
//
// Which parameters decay: by default those of rank >= 2 (weight matrices, embeddings), not those
// of rank 0 or 1 (biases, layernorm gains), the usual GPT/BERT recipe. set_no_decay(pred) replaces
// that rule: a parameter decays unless pred(name) is true. set_no_decay({}) restores the default.
//
// Backends. AdamW<T, B>, SGD<T, B> and clip_grad_norm work on a ParameterArena<T, B>: the updates
// are the ops of ops/optim.hpp (clip_grad_norm is one of them), run by backend/cpu/optim.hpp or,
// for B = cuda, graphmoe/backend/cuda/optim.cuh. The per-element arithmetic is one functor for
// both (core/optim_math.hpp), so the two backends update bitwise alike.
//
// Layout and threads. The state tensors mirror arena.values(), padding included, so every
// parameter is one contiguous, 64-byte aligned range in each buffer, and the padding (zero in
// values and gradients) stays zero. Each trainable parameter's padded range is cut into chunks of
// kOptimChunk elements (ops/optim.hpp); the CPU updates chunks in parallel, each by one loop of
// the element functor. The chunks depend on the arena's layout only, never on the thread count,
// and the update is elementwise, so the result is bitwise the same for any number of threads. The
// gradient norm sums per-chunk partial sums (in double) in chunk order: also thread-independent.
//
// Compute mirror (layers/compute_mirror.hpp): step(arena, lr, &mirror) writes the mirror's C copy
// of each updated parameter in the same pass as the parameter (AdamW: one kernel reading g, m, v,
// w and writing m, v, w, C(w)), bitwise the step followed by a conversion, so a mixed-precision
// model's layers read current C weights without converting them. Every step marks the arena's
// values written; a mirror that was stale before the step is refreshed in full after it (the
// frozen parameters are not written by the step). SGD has no fused form: its step leaves a mirror
// stale, and the next forward refreshes it.
//
// Non-trainable parameters (ParameterInfo::trainable == false) are skipped: their values, state
// and gradients are never touched, and they are not part of state() or of the gradient norm.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/layers/compute_mirror.hpp"
#include "graphmoe/ops/optim.hpp"

namespace graphmoe {

struct AdamWConfig {
  double lr = 1e-3;  // used by step(arena); step(arena, lr) overrides it (e.g. from an LRSchedule)
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;  // must be > 0 (it also keeps 0 / sqrt(0) out of untouched entries)
  double weight_decay = 0.01;

  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(lr) && lr >= 0, "AdamW",
                   "learning rate must be finite and >= 0, got ", lr);
    GRAPHMOE_CHECK(beta1 >= 0 && beta1 < 1, "AdamW", "beta1 must be in [0, 1), got ", beta1);
    GRAPHMOE_CHECK(beta2 >= 0 && beta2 < 1, "AdamW", "beta2 must be in [0, 1), got ", beta2);
    GRAPHMOE_CHECK(std::isfinite(eps) && eps > 0, "AdamW", "eps must be finite and > 0, got ", eps);
    GRAPHMOE_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "AdamW",
                   "weight_decay must be finite and >= 0, got ", weight_decay);
  }
};

struct SGDConfig {
  double lr = 0.1;  // used by step(arena); step(arena, lr) overrides it
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;  // requires momentum > 0

  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(lr) && lr >= 0, "SGD",
                   "learning rate must be finite and >= 0, got ", lr);
    GRAPHMOE_CHECK(momentum >= 0 && momentum < 1, "SGD", "momentum must be in [0, 1), got ",
                   momentum);
    GRAPHMOE_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "SGD",
                   "weight_decay must be finite and >= 0, got ", weight_decay);
    GRAPHMOE_CHECK(!nesterov || momentum > 0, "SGD", "nesterov momentum requires momentum > 0");
  }
};

namespace detail {

// What an optimizer remembers of the arena it was built for, to refuse another one.
template <class T, class B>
class ArenaLayout {
 public:
  ArenaLayout() = default;
  ArenaLayout(const ParameterArena<T, B>& arena, const char* op) {
    GRAPHMOE_CHECK(arena.allocated(), op, "the parameter arena is not allocated (call allocate() "
                   "before building the optimizer)");
    size_ = arena.values().numel();
    for (const auto& p : arena.params())
      params_.push_back({p.name, p.shape, p.offset, p.trainable});
  }
  void check(const ParameterArena<T, B>& arena, const char* op) const {
    GRAPHMOE_CHECK(arena.allocated(), op, "the parameter arena is not allocated");
    GRAPHMOE_CHECK(arena.values().numel() == size_ && arena.params().size() == params_.size(),
                   op, "the arena (", arena.params().size(), " parameters, ",
                   arena.values().numel(),
                   " elements) is not the one the optimizer was built for (", params_.size(),
                   " parameters, ", size_, " elements)");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& a = arena.params()[i];
      const auto& b = params_[i];
      GRAPHMOE_CHECK(a.offset == b.offset && a.shape == b.shape && a.trainable == b.trainable, op,
                     "parameter ", i, " ('", a.name, "' ", a.shape,
                     ") differs from the one the optimizer was built for ('", b.name, "' ",
                     b.shape, ")");
    }
  }
  const std::vector<ParameterInfo>& params() const { return params_; }
  index_t size() const { return size_; }

 private:
  index_t size_ = 0;
  std::vector<ParameterInfo> params_;
};

// Default weight-decay rule: rank >= 2 decays; biases and norm gains (rank <= 1) do not.
inline std::vector<char> decay_flags(const std::vector<ParameterInfo>& params,
                                     const std::function<bool(const std::string&)>& no_decay) {
  std::vector<char> flags(params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    flags[i] = no_decay ? !no_decay(params[i].name) : params[i].shape.rank() >= 2;
  return flags;
}

// Copies the per-parameter flags into the chunks and the chunks to the backend.
template <class B>
void set_chunk_decay(OptimChunks<B>& chunks, const std::vector<char>& flags) {
  for (OptimChunk& c : chunks.host) c.decay = flags[static_cast<std::size_t>(c.param)] != 0;
  upload_optim_chunks(chunks);
}

inline void check_lr(const char* op, double lr) {
  GRAPHMOE_CHECK(std::isfinite(lr) && lr >= 0, op, "learning rate must be finite and >= 0, got ",
                 lr);
}

// A named view of `buffer` with the shape and offset of parameter p.
template <class T, class B>
Tensor<T, B> state_view(const Tensor<T, B>& buffer, const ParameterInfo& p) {
  return buffer.slice(p.offset, p.offset + p.shape.numel()).view(p.shape);
}

}  // namespace detail

template <class T, class B = cpu>
class AdamW {
  static_assert(std::is_floating_point_v<T>, "graphmoe::AdamW<T>: T must be float or double");

 public:
  AdamW(const ParameterArena<T, B>& arena, AdamWConfig cfg) : cfg_(cfg), layout_(arena, "AdamW") {
    cfg_.validate();
    m_ = Tensor<T, B>(Shape{layout_.size()});
    v_ = Tensor<T, B>(Shape{layout_.size()});
    chunks_.host = detail::trainable_chunks(arena);
    decay_ = detail::decay_flags(layout_.params(), no_decay_);
    detail::set_chunk_decay(chunks_, decay_);
  }

  const AdamWConfig& config() const { return cfg_; }

  // pred(name) true: no weight decay for that parameter. An empty function restores the default
  // (decay rank >= 2 parameters only).
  void set_no_decay(std::function<bool(const std::string&)> pred) {
    no_decay_ = std::move(pred);
    decay_ = detail::decay_flags(layout_.params(), no_decay_);
    detail::set_chunk_decay(chunks_, decay_);
  }
  // Whether parameter `id` (its index in arena.params()) gets weight decay.
  bool decays(index_t id) const {
    GRAPHMOE_CHECK(0 <= id && id < static_cast<index_t>(decay_.size()), "AdamW::decays",
                   "parameter index ", id, " out of range (", decay_.size(), " parameters)");
    return decay_[static_cast<std::size_t>(id)] != 0;
  }

  // One update with the configured learning rate.
  void step(ParameterArena<T, B>& arena) { step(arena, cfg_.lr); }

  // One update of every trainable parameter from arena.grads() with learning rate lr.
  void step(ParameterArena<T, B>& arena, double lr) {
    detail::check_lr("AdamW::step", lr);
    layout_.check(arena, "AdamW::step");
    ++t_;
    const auto u = detail::AdamWUpdate<T>::make(cfg_.beta1, cfg_.beta2, cfg_.eps,
                                                cfg_.weight_decay, lr, t_);
    adamw_update(chunks_, u, arena.values().data(), arena.grads().data(), m_.data(), v_.data());
    arena.mark_values_written();
  }

  // The step, and mirror's C copy of every updated parameter written in the same pass (see the
  // header comment). mirror == nullptr, or C = T: step(arena, lr).
  template <class C>
  void step(ParameterArena<T, B>& arena, double lr, ComputeMirror<T, C, B>* mirror) {
    if constexpr (std::is_same_v<C, T>) {
      step(arena, lr);
    } else {
      if (mirror == nullptr) return step(arena, lr);
      GRAPHMOE_CHECK(&mirror->arena() == &arena, "AdamW::step",
                     "the mirror is another arena's (take the mirror of the arena that is stepped)");
      detail::check_lr("AdamW::step", lr);
      layout_.check(arena, "AdamW::step");
      const bool was_current = mirror->current();
      ++t_;
      const auto u = detail::AdamWUpdate<T>::make(cfg_.beta1, cfg_.beta2, cfg_.eps,
                                                  cfg_.weight_decay, lr, t_);
      adamw_update(chunks_, u, arena.values().data(), arena.grads().data(), m_.data(), v_.data(),
                   mirror->values().data());
      arena.mark_values_written();
      if (was_current)
        mirror->mark_synced();
      else
        mirror->refresh();
    }
  }

  // Steps taken so far (the bias-correction step of the next update is steps() + 1).
  std::int64_t steps() const { return t_; }
  void set_steps(std::int64_t t) {
    GRAPHMOE_CHECK(t >= 0, "AdamW::set_steps", "step count must be >= 0, got ", t);
    t_ = t;
  }

  // Named views of the state, for checkpoints: "adamw.m.<param>", "adamw.v.<param>" for each
  // trainable parameter in arena order, with the parameter's shape. The views share the
  // optimizer's storage: writing into them (loading a checkpoint) sets the state. The step count
  // is not a tensor: save steps() and restore it with set_steps().
  std::vector<std::pair<std::string, Tensor<T, B>>> state(const ParameterArena<T, B>& arena) const {
    layout_.check(arena, "AdamW::state");
    std::vector<std::pair<std::string, Tensor<T, B>>> out;
    for (const auto& p : layout_.params()) {
      if (!p.trainable) continue;
      out.emplace_back("adamw.m." + p.name, detail::state_view(m_, p));
      out.emplace_back("adamw.v." + p.name, detail::state_view(v_, p));
    }
    return out;
  }

 private:
  AdamWConfig cfg_;
  detail::ArenaLayout<T, B> layout_;
  Tensor<T, B> m_, v_;  // (arena size,) like arena.values()
  detail::OptimChunks<B> chunks_;
  std::function<bool(const std::string&)> no_decay_;
  std::vector<char> decay_;  // per parameter
  std::int64_t t_ = 0;
};

template <class T, class B = cpu>
class SGD {
  static_assert(std::is_floating_point_v<T>, "graphmoe::SGD<T>: T must be float or double");

 public:
  SGD(const ParameterArena<T, B>& arena, SGDConfig cfg) : cfg_(cfg), layout_(arena, "SGD") {
    cfg_.validate();
    if (cfg_.momentum > 0) buf_ = Tensor<T, B>(Shape{layout_.size()});
    chunks_.host = detail::trainable_chunks(arena);
    decay_ = detail::decay_flags(layout_.params(), no_decay_);
    detail::set_chunk_decay(chunks_, decay_);
  }

  const SGDConfig& config() const { return cfg_; }

  // As AdamW::set_no_decay (the default decays rank >= 2 parameters only).
  void set_no_decay(std::function<bool(const std::string&)> pred) {
    no_decay_ = std::move(pred);
    decay_ = detail::decay_flags(layout_.params(), no_decay_);
    detail::set_chunk_decay(chunks_, decay_);
  }
  bool decays(index_t id) const {
    GRAPHMOE_CHECK(0 <= id && id < static_cast<index_t>(decay_.size()), "SGD::decays",
                   "parameter index ", id, " out of range (", decay_.size(), " parameters)");
    return decay_[static_cast<std::size_t>(id)] != 0;
  }

  void step(ParameterArena<T, B>& arena) { step(arena, cfg_.lr); }

  void step(ParameterArena<T, B>& arena, double lr) {
    detail::check_lr("SGD::step", lr);
    layout_.check(arena, "SGD::step");
    ++t_;
    const auto u =
        detail::SGDUpdate<T>::make(lr, cfg_.momentum, cfg_.weight_decay, cfg_.nesterov);
    sgd_update(chunks_, u, arena.values().data(), arena.grads().data(), buf_.data());
    arena.mark_values_written();
  }

  std::int64_t steps() const { return t_; }
  void set_steps(std::int64_t t) {
    GRAPHMOE_CHECK(t >= 0, "SGD::set_steps", "step count must be >= 0, got ", t);
    t_ = t;
  }

  // "sgd.momentum.<param>" for each trainable parameter (views into the momentum buffer, as in
  // AdamW::state); empty when momentum == 0.
  std::vector<std::pair<std::string, Tensor<T, B>>> state(const ParameterArena<T, B>& arena) const {
    layout_.check(arena, "SGD::state");
    std::vector<std::pair<std::string, Tensor<T, B>>> out;
    if (buf_.empty()) return out;
    for (const auto& p : layout_.params())
      if (p.trainable) out.emplace_back("sgd.momentum." + p.name, detail::state_view(buf_, p));
    return out;
  }

 private:
  SGDConfig cfg_;
  detail::ArenaLayout<T, B> layout_;
  Tensor<T, B> buf_;  // (arena size,) when momentum > 0
  detail::OptimChunks<B> chunks_;
  std::function<bool(const std::string&)> no_decay_;
  std::vector<char> decay_;
  std::int64_t t_ = 0;
};

// clip_grad_norm(arena, max_norm): ops/optim.hpp (every backend).

}  // namespace graphmoe
