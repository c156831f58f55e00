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
// Backends. AdamW<T, B>, SGD<T, B> and clip_grad_norm work on a ParameterArena<T, B>; B = cpu is
// defined here, B = cuda by graphmoe/backend/cuda/optim.cuh (the same classes, kernels in
// detail::OptimKernels<cuda>). The per-element arithmetic is one functor for both
// (train/detail/optim_math.hpp), so the two backends update bitwise alike.
//
// Layout and threads. The state tensors mirror arena.values(), padding included, so every
// parameter is one contiguous, 64-byte aligned range in each buffer, and the padding (zero in
// values and gradients) stays zero. Each trainable parameter's padded range is cut into chunks of
// kOptimChunk elements; chunks are updated in parallel (parallel_for), each by one loop of the
// element functor. The chunks depend on the arena's layout only, never on the thread count, and
// the update is elementwise, so the result is bitwise the same for any number of threads. The
// gradient norm sums per-chunk partial sums (in double) in chunk order: also thread-independent.
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

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/config.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/train/detail/optim_math.hpp"

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

// Elements per unit of parallel work (a multiple of ParameterArena::kAlign).
inline constexpr index_t kOptimChunk = 8192;

// A contiguous range [begin, end) of the flat buffers inside parameter `param`; decay is that
// parameter's weight-decay flag (the optimizer's rule; clip_grad_norm ignores it).
struct OptimChunk {
  index_t begin = 0, end = 0;
  index_t param = 0;
  std::int32_t decay = 0;
};

// The padded range of every trainable parameter, cut into chunks of at most kOptimChunk elements.
// Depends on the layout only.
template <class T, class B>
std::vector<OptimChunk> trainable_chunks(const ParameterArena<T, B>& arena) {
  constexpr index_t align = ParameterArena<T, B>::kAlign;
  std::vector<OptimChunk> chunks;
  const auto& ps = arena.params();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (!ps[i].trainable) continue;
    const index_t begin = ps[i].offset;
    const index_t end = begin + (ps[i].shape.numel() + align - 1) / align * align;
    for (index_t b = begin; b < end; b += kOptimChunk)
      chunks.push_back({b, std::min(end, b + kOptimChunk), static_cast<index_t>(i), 0});
  }
  return chunks;
}

// The chunks of an optimizer: `host` for the CPU loops and the host side of every backend;
// `table`, the same list in B's memory for kernels that read it there (filled by
// OptimKernels<B>::upload; empty on cpu).
template <class B>
struct OptimChunks {
  std::vector<OptimChunk> host;
  Tensor<OptimChunk, B> table;
  index_t size() const { return static_cast<index_t>(host.size()); }
};

// The update loops of one backend. Specialised for cpu below and for cuda in
// backend/cuda/optim.cuh:
//   upload(chunks)                               host -> table
//   adamw(chunks, AdamWUpdate<T>, p, g, m, v)    every element of every chunk
//   sgd(chunks, SGDUpdate<T>, p, g, buf)
template <class B>
struct OptimKernels {
  static_assert(sizeof(B) == 0,
                "graphmoe optimizers: no update kernels for this backend (for graphmoe::cuda, "
                "include graphmoe/backend/cuda/optim.cuh)");
};

// x = sqrt(x) for n values, correctly rounded (as std::sqrt and CUDA's sqrt), with SIMD
// instructions. std::sqrt alone would not vectorise (GCC keeps its errno handling, -fmath-errno),
// and Eigen's float sqrt is an rsqrt approximation under EIGEN_FAST_MATH, off by 1-2 bits.
inline void sqrt_in_place(float* x, index_t n) {
  index_t j = 0;
#if defined(__AVX__)
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_sqrt_ps(_mm256_loadu_ps(x + j)));
#elif defined(__SSE2__)
  for (; j + 4 <= n; j += 4) _mm_storeu_ps(x + j, _mm_sqrt_ps(_mm_loadu_ps(x + j)));
#endif
  for (; j < n; ++j) x[j] = std::sqrt(x[j]);
}
inline void sqrt_in_place(double* x, index_t n) {
  index_t j = 0;
#if defined(__AVX__)
  for (; j + 4 <= n; j += 4) _mm256_storeu_pd(x + j, _mm256_sqrt_pd(_mm256_loadu_pd(x + j)));
#elif defined(__SSE2__)
  for (; j + 2 <= n; j += 2) _mm_storeu_pd(x + j, _mm_sqrt_pd(_mm_loadu_pd(x + j)));
#endif
  for (; j < n; ++j) x[j] = std::sqrt(x[j]);
}

// AdamWUpdate::apply over n elements, in blocks: moments() for the block, the square roots, then
// update(): each stage is one vectorised loop, and the result is apply()'s bit for bit.
template <bool Decay, class T>
void adamw_range(const AdamWUpdate<T>& u, T* __restrict p, const T* __restrict g,
                 T* __restrict m, T* __restrict v, index_t n) {
  constexpr index_t kBlock = 512;
  alignas(64) T root[kBlock];
  for (index_t b = 0; b < n; b += kBlock) {
    const index_t len = std::min(kBlock, n - b);
    T* __restrict r = root;
    for (index_t j = 0; j < len; ++j) r[j] = u.moments(g[b + j], m[b + j], v[b + j]);
    sqrt_in_place(r, len);
    for (index_t j = 0; j < len; ++j) u.template update<Decay>(p[b + j], m[b + j], r[j]);
  }
}

template <bool Decay, bool Momentum, bool Nesterov, class T>
void sgd_range(const SGDUpdate<T>& u, T* __restrict p, const T* __restrict g, T* __restrict buf,
               index_t n) {
  for (index_t j = 0; j < n; ++j) {
    if constexpr (Momentum) {
      u.template apply<Decay, true, Nesterov>(p[j], g[j], buf[j]);
    } else {
      T unused = T(0);  // not read without momentum (buf is null then)
      u.template apply<Decay, false, false>(p[j], g[j], unused);
    }
  }
}

template <>
struct OptimKernels<cpu> {
  static void upload(OptimChunks<cpu>&) {}

  // Chunks in parallel; inside a chunk, one loop with the decay decision hoisted out of it.
  template <class T>
  static void adamw(const OptimChunks<cpu>& chunks, const AdamWUpdate<T>& u, T* p, const T* g,
                    T* m, T* v) {
    parallel_for(0, chunks.size(), [&](index_t ci) {
      const OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
      const index_t b = c.begin, n = c.end - c.begin;
      if (u.decays(c.decay != 0))
        adamw_range<true>(u, p + b, g + b, m + b, v + b, n);
      else
        adamw_range<false>(u, p + b, g + b, m + b, v + b, n);
    });
  }

  template <class T>
  static void sgd(const OptimChunks<cpu>& chunks, const SGDUpdate<T>& u, T* p, const T* g,
                  T* buf) {
    parallel_for(0, chunks.size(), [&](index_t ci) {
      const OptimChunk& c = chunks.host[static_cast<std::size_t>(ci)];
      const index_t b = c.begin, n = c.end - c.begin;
      T* const bb = u.use_momentum ? buf + b : nullptr;
      if (u.decays(c.decay != 0)) {
        if (!u.use_momentum)
          sgd_range<true, false, false>(u, p + b, g + b, bb, n);
        else if (u.nesterov)
          sgd_range<true, true, true>(u, p + b, g + b, bb, n);
        else
          sgd_range<true, true, false>(u, p + b, g + b, bb, n);
      } else {
        if (!u.use_momentum)
          sgd_range<false, false, false>(u, p + b, g + b, bb, n);
        else if (u.nesterov)
          sgd_range<false, true, true>(u, p + b, g + b, bb, n);
        else
          sgd_range<false, true, false>(u, p + b, g + b, bb, n);
      }
    });
  }
};

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
  OptimKernels<B>::upload(chunks);
}

inline void check_lr(const char* op, double lr) {
  GRAPHMOE_CHECK(std::isfinite(lr) && lr >= 0, op, "learning rate must be finite and >= 0, got ",
                 lr);
}

// clip_grad_norm's argument checks and its norm (with the NaN / Inf check), for every backend.
template <class T, class B>
void check_clip_args(const ParameterArena<T, B>& arena, double max_norm) {
  GRAPHMOE_CHECK(arena.allocated(), "clip_grad_norm", "the parameter arena is not allocated");
  GRAPHMOE_CHECK(!std::isnan(max_norm), "clip_grad_norm", "max_norm is nan");
}
inline double checked_norm(double sumsq) {
  const double norm = std::sqrt(sumsq);
  GRAPHMOE_CHECK(std::isfinite(norm), "clip_grad_norm", "gradient norm is ",
                 std::isnan(norm) ? "nan" : "inf",
                 " (a trainable gradient holds NaN or Inf: check the loss and the learning rate)");
  return norm;
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
    detail::OptimKernels<B>::adamw(chunks_, u, arena.values().data(), arena.grads().data(),
                                   m_.data(), v_.data());
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
    detail::OptimKernels<B>::sgd(chunks_, u, arena.values().data(), arena.grads().data(),
                                 buf_.data());
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

// The global L2 norm of the trainable gradients, sqrt(sum g^2), accumulated in double in a fixed
// order (per-chunk sums, then the chunks in arena order), so the value does not depend on the
// thread count. If max_norm > 0 and the norm exceeds it, every trainable gradient is multiplied by
// max_norm / norm (exactly; PyTorch's clip_grad_norm_ adds 1e-6 to the norm). max_norm <= 0 only
// measures. Returns the norm before clipping. Throws "gradient norm is nan" (or inf) when a
// gradient is NaN or Inf, whatever max_norm is. (The cuda overload, in backend/cuda/optim.cuh,
// sums in the same order and returns the same norm bit for bit.)
template <class T>
double clip_grad_norm(ParameterArena<T, cpu>& arena, double max_norm) {
  detail::check_clip_args(arena, max_norm);
  const std::vector<detail::OptimChunk> chunks = detail::trainable_chunks(arena);
  const index_t n = static_cast<index_t>(chunks.size());
  T* const gv = arena.grads().data();
  std::vector<double> partial(chunks.size(), 0.0);
  parallel_for(0, n, [&](index_t ci) {
    const detail::OptimChunk& c = chunks[static_cast<std::size_t>(ci)];
    const T* g = gv + c.begin;
    partial[static_cast<std::size_t>(ci)] = detail::accumulate_double(
        c.end - c.begin, [g](index_t j) { return static_cast<double>(g[j]) * g[j]; });
  });
  double sumsq = 0;
  for (double s : partial) sumsq += s;
  const double norm = detail::checked_norm(sumsq);
  if (max_norm > 0 && norm > max_norm) {
    const T scale = static_cast<T>(max_norm / norm);
    parallel_for(0, n, [&](index_t ci) {
      const detail::OptimChunk& c = chunks[static_cast<std::size_t>(ci)];
      for (index_t j = c.begin; j < c.end; ++j) gv[j] = detail::fp::mul(gv[j], scale);
    });
  }
  return norm;
}

}  // namespace graphmoe
