// graphmoe/ops/optim.hpp: the optimizers' updates and the global gradient norm over the flat
// buffers of a ParameterArena (the optimizers themselves: train/optim.hpp).
//
//   upload_optim_chunks(chunks)                    chunks.host -> chunks.table (B's memory)
//   adamw_update(chunks, u, p, g, m, v)            AdamWUpdate u on every element of every chunk
//   adamw_update(chunks, u, p, g, m, v, pc)        the same, and pc[j] = p[j] in pc's type (the
//                                                  compute mirror, layers/compute_mirror.hpp) in
//                                                  the same pass: bitwise the update followed by
//                                                  a conversion (backends with 16-bit types: cuda)
//   sgd_update(chunks, u, p, g, buf)               SGDUpdate u likewise (buf unused without momentum)
//   clip_grad_norm(arena, max_norm)                the L2 norm of the trainable gradients, and the
//                                                  gradients scaled to max_norm when above it
//
// The chunks (core/optim_math.hpp) are the trainable parameters' padded ranges cut into pieces of
// at most kOptimChunk elements: they depend on the arena's layout only. p, g, m, v, buf point to
// buffers the size of arena.values(), in B's memory. The per-element arithmetic is one functor for
// every backend (core/optim_math.hpp), and the norm is summed in one fixed order (per-chunk sums
// of eight strided lanes, then the chunks in arena order), so every backend updates bitwise alike
// and returns the same norm bit for bit, for any number of threads.
//
// Op layer: the arguments are checked here, once for every backend; then the backend's
// upload_optim_chunks(B{}, ...), adamw_update(B{}, ...), sgd_update(B{}, ...), grad_sumsq(B{},
// ...) and scale_grads(B{}, ...) (backend/cpu/optim.hpp, backend/cuda/optim.cuh, or a user
// backend's overloads found by argument-dependent lookup).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "graphmoe/backend/cpu/optim.hpp"
#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {
namespace detail {

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

}  // namespace detail

// chunks.table = chunks.host in B's memory (for kernels that read it there; a no-op on cpu).
template <Backend B>
void upload_optim_chunks(detail::OptimChunks<B>& chunks) {
  upload_optim_chunks(B{}, chunks);
}

// One AdamW update of every element of every chunk of p (with g, m, v at the same offsets).
template <class T, Backend B>
void adamw_update(const detail::OptimChunks<B>& chunks, const detail::AdamWUpdate<T>& u, T* p,
                  const T* g, T* m, T* v) {
  if (chunks.size() > 0)
    GRAPHMOE_CHECK(p != nullptr && g != nullptr && m != nullptr && v != nullptr, "adamw_update",
                   "a buffer is missing (p, g, m and v must all be allocated)");
  adamw_update(B{}, chunks, u, p, g, m, v);
}

// adamw_update, and pc[j] = the updated p[j] converted to M (as convert() rounds it), for every
// element of every chunk, in one pass.
template <class T, class M, Backend B>
void adamw_update(const detail::OptimChunks<B>& chunks, const detail::AdamWUpdate<T>& u, T* p,
                  const T* g, T* m, T* v, M* pc) {
  if (chunks.size() > 0)
    GRAPHMOE_CHECK(p != nullptr && g != nullptr && m != nullptr && v != nullptr && pc != nullptr,
                   "adamw_update", "a buffer is missing (p, g, m, v and the mirror must all be "
                   "allocated)");
  adamw_update(B{}, chunks, u, p, g, m, v, pc);
}

// One SGD update of every element of every chunk of p (buf: the momentum buffer, with momentum).
template <class T, Backend B>
void sgd_update(const detail::OptimChunks<B>& chunks, const detail::SGDUpdate<T>& u, T* p,
                const T* g, T* buf) {
  if (chunks.size() > 0)
    GRAPHMOE_CHECK(p != nullptr && g != nullptr && (buf != nullptr || !u.use_momentum),
                   "sgd_update", "a buffer is missing (p, g and, with momentum, buf)");
  sgd_update(B{}, chunks, u, p, g, buf);
}

// The global L2 norm of the trainable gradients, sqrt(sum g^2), accumulated in double in a fixed
// order (per-chunk sums, then the chunks in arena order), so the value does not depend on the
// thread count or the backend. If max_norm > 0 and the norm exceeds it, every trainable gradient
// is multiplied by max_norm / norm (exactly; PyTorch's clip_grad_norm_ adds 1e-6 to the norm).
// max_norm <= 0 only measures. Returns the norm before clipping. Throws "gradient norm is nan"
// (or inf) when a gradient is NaN or Inf, whatever max_norm is. A backend whose memory is not the
// host's synchronises (the norm is read back).
template <class T, Backend B>
double clip_grad_norm(ParameterArena<T, B>& arena, double max_norm) {
  detail::check_clip_args(arena, max_norm);
  auto& cached = arena.grad_norm_chunks();  // built and uploaded on the first call only
  if (!cached) {
    detail::OptimChunks<B> built;
    built.host = detail::trainable_chunks(arena);
    if (built.size() > 0) upload_optim_chunks(B{}, built);
    cached = std::move(built);
  }
  const detail::OptimChunks<B>& chunks = *cached;
  if (chunks.size() == 0) return detail::checked_norm(0.0);
  T* const gv = arena.grads().data();
  const double norm = detail::checked_norm(grad_sumsq(B{}, chunks, static_cast<const T*>(gv)));
  if (max_norm > 0 && norm > max_norm) {
    const T scale = static_cast<T>(max_norm / norm);
    scale_grads(B{}, chunks, gv, scale);
  }
  return norm;
}

}  // namespace graphmoe
