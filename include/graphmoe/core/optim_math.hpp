// graphmoe/core/optim_math.hpp: the per-element arithmetic of the optimizers (internal), one
// definition for the CPU loops (backend/cpu/optim.hpp) and the CUDA kernels
// (backend/cuda/optim.cuh), and the chunk list they run over (ops/optim.hpp; the optimizers:
// train/optim.hpp).
//
//   AdamWUpdate<T>   m, v and the parameter of one element (optim.hpp states the rule)
//   SGDUpdate<T>     the momentum buffer and the parameter of one element
//   OptimChunk, OptimChunks<B>
//                    the ranges the update and the gradient norm run over
//   sumsq_lane, combine_sumsq_lanes
//                    the sum of squares of one gradient chunk in the CPU's order
//                    (detail::accumulate_double): eight strided lanes, combined pairwise, then the
//                    tail, so that the CUDA gradient norm is the CPU's bit for bit
//
// The arithmetic is written with rounded operations (mul, add, sub, div, sqrt below): plain
// operators on the host, and in nvcc's device pass the _rn intrinsics, which the compiler never
// contracts into fused multiply-adds and which round exactly like the host's IEEE operations
// whatever -use_fast_math / -fmad say. With a host compiler that does not contract either (the
// default x86-64 target has no FMA; -march=native with GCC's -ffp-contract=fast may fuse), the
// CPU and CUDA updates are bitwise the same.
//
// Plain C++: no CUDA header is included, so the same functors run under g++ through Thrust's CPP
// system (tests/cuda/test_host_optim.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe::detail {

// Elements per unit of parallel work (a multiple of ParameterArena::kAlign).
inline constexpr index_t kOptimChunk = 8192;

// A contiguous range [begin, end) of the flat buffers inside parameter `param`; decay is that
// parameter's weight-decay flag (the optimizer's rule; clip_grad_norm ignores it).
struct OptimChunk {
  index_t begin = 0, end = 0;
  index_t param = 0;
  std::int32_t decay = 0;
};

// The chunks of an optimizer: `host` for the CPU loops and the host side of every backend;
// `table`, the same list in B's memory for kernels that read it there (filled by
// upload_optim_chunks, ops/optim.hpp; empty on cpu).
template <class B>
struct OptimChunks {
  std::vector<OptimChunk> host;
  Tensor<OptimChunk, B> table;
  index_t size() const { return static_cast<index_t>(host.size()); }
};

namespace fp {
// Correctly rounded operations that are never fused.
GRAPHMOE_HOST_DEVICE inline float mul(float a, float b) {
#if GRAPHMOE_DEVICE_PASS
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GRAPHMOE_HOST_DEVICE inline double mul(double a, double b) {
#if GRAPHMOE_DEVICE_PASS
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
GRAPHMOE_HOST_DEVICE inline float add(float a, float b) {
#if GRAPHMOE_DEVICE_PASS
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GRAPHMOE_HOST_DEVICE inline double add(double a, double b) {
#if GRAPHMOE_DEVICE_PASS
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
GRAPHMOE_HOST_DEVICE inline float sub(float a, float b) {
#if GRAPHMOE_DEVICE_PASS
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
GRAPHMOE_HOST_DEVICE inline double sub(double a, double b) {
#if GRAPHMOE_DEVICE_PASS
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
GRAPHMOE_HOST_DEVICE inline float div(float a, float b) {
#if GRAPHMOE_DEVICE_PASS
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
GRAPHMOE_HOST_DEVICE inline double div(double a, double b) {
#if GRAPHMOE_DEVICE_PASS
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
GRAPHMOE_HOST_DEVICE inline float sqrt(float a) {
#if GRAPHMOE_DEVICE_PASS
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
GRAPHMOE_HOST_DEVICE inline double sqrt(double a) {
#if GRAPHMOE_DEVICE_PASS
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
}  // namespace fp

// AdamW for one element (t = the step count after increment, g the gradient):
//   m = beta1 m + (1 - beta1) g
//   v = beta2 v + (1 - beta2) g^2
//   p = p - lr ((m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd p)   (wd p: Decay)
// The constants are T, rounded once from the double configuration by make().
template <class T>
struct AdamWUpdate {
  T beta1, beta2;                        // beta1, beta2
  T one_minus_beta1, one_minus_beta2;    // 1 - beta1, 1 - beta2 (rounded from double)
  T correction1, correction2;            // 1 - beta1^t, 1 - beta2^t
  T eps, lr, weight_decay;

  static AdamWUpdate make(double beta1, double beta2, double eps, double weight_decay, double lr,
                          std::int64_t t) {
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(t));
    return {static_cast<T>(beta1),        static_cast<T>(beta2),
            static_cast<T>(1.0 - beta1),  static_cast<T>(1.0 - beta2),
            static_cast<T>(bc1),          static_cast<T>(bc2),
            static_cast<T>(eps),          static_cast<T>(lr),
            static_cast<T>(weight_decay)};
  }

  // Whether a parameter whose decay flag is `param_decays` takes the weight-decay term.
  GRAPHMOE_HOST_DEVICE bool decays(bool param_decays) const {
    return param_decays && weight_decay != T(0);
  }

  // The update in two stages around the square root, so that a CPU loop can take the roots of a
  // block at once with SIMD instructions (optim.hpp); apply() is the composition.
  // Stage 1: m and v; returns v_hat = v / (1 - beta2^t).
  GRAPHMOE_HOST_DEVICE T moments(T g, T& m, T& v) const {
    m = fp::add(fp::mul(beta1, m), fp::mul(one_minus_beta1, g));
    v = fp::add(fp::mul(beta2, v), fp::mul(one_minus_beta2, fp::mul(g, g)));
    return fp::div(v, correction2);
  }
  // Stage 2: the parameter, from the new m and root = sqrt(v_hat).
  template <bool Decay>
  GRAPHMOE_HOST_DEVICE void update(T& p, T m, T root) const {
    T u = fp::div(fp::div(m, correction1), fp::add(root, eps));
    if constexpr (Decay) u = fp::add(u, fp::mul(weight_decay, p));
    p = fp::sub(p, fp::mul(lr, u));
  }

  template <bool Decay>
  GRAPHMOE_HOST_DEVICE void apply(T& p, T g, T& m, T& v) const {
    const T v_hat = moments(g, m, v);
    update<Decay>(p, m, fp::sqrt(v_hat));
  }

  // decay: the result of decays() for this element's parameter.
  GRAPHMOE_HOST_DEVICE void operator()(T& p, T g, T& m, T& v, bool decay) const {
    if (decay)
      apply<true>(p, g, m, v);
    else
      apply<false>(p, g, m, v);
  }
};

// SGD (PyTorch's, dampening 0) for one element:
//   d = g + wd p                                     (wd p: Decay)
//   Momentum: buf = momentum buf + d;  d = Nesterov ? d + momentum buf : buf
//   p = p - lr d
template <class T>
struct SGDUpdate {
  T lr, momentum, weight_decay;
  bool use_momentum, nesterov;

  static SGDUpdate make(double lr, double momentum, double weight_decay, bool nesterov) {
    return {static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(weight_decay),
            momentum > 0, nesterov};
  }

  GRAPHMOE_HOST_DEVICE bool decays(bool param_decays) const {
    return param_decays && weight_decay != T(0);
  }

  // buf is not read or written without Momentum.
  template <bool Decay, bool Momentum, bool Nesterov>
  GRAPHMOE_HOST_DEVICE void apply(T& p, T g, T& buf) const {
    T d = g;
    if constexpr (Decay) d = fp::add(g, fp::mul(weight_decay, p));
    if constexpr (Momentum) {
      const T b = fp::add(fp::mul(momentum, buf), d);
      buf = b;
      d = Nesterov ? fp::add(d, fp::mul(momentum, b)) : b;
    }
    p = fp::sub(p, fp::mul(lr, d));
  }

  GRAPHMOE_HOST_DEVICE void operator()(T& p, T g, T& buf, bool decay) const {
    if (decay) {
      if (!use_momentum)
        apply<true, false, false>(p, g, buf);
      else if (nesterov)
        apply<true, true, true>(p, g, buf);
      else
        apply<true, true, false>(p, g, buf);
    } else {
      if (!use_momentum)
        apply<false, false, false>(p, g, buf);
      else if (nesterov)
        apply<false, true, true>(p, g, buf);
      else
        apply<false, true, false>(p, g, buf);
    }
  }
};

// Lane k (0..7) of the sum of squares of g[0, n): sum over the complete groups of eight,
// g[j + k]^2 for j = 0, 8, 16, ..., in that order, in double (accumulate_double's a[k]).
template <class T>
GRAPHMOE_HOST_DEVICE double sumsq_lane(const T* g, index_t n, int k) {
  double a = 0;
  for (index_t j = 0; j + 8 <= n; j += 8) {
    const double x = static_cast<double>(g[j + k]);
    a = fp::add(a, fp::mul(x, x));
  }
  return a;
}

// The sum of squares of g[0, n) from its eight lanes: pairwise, then the tail (n mod 8 entries)
// in order, as accumulate_double does.
template <class T>
GRAPHMOE_HOST_DEVICE double combine_sumsq_lanes(const double* a, const T* g, index_t n) {
  double s = fp::add(fp::add(fp::add(a[0], a[1]), fp::add(a[2], a[3])),
                     fp::add(fp::add(a[4], a[5]), fp::add(a[6], a[7])));
  for (index_t j = n / 8 * 8; j < n; ++j) {
    const double x = static_cast<double>(g[j]);
    s = fp::add(s, fp::mul(x, x));
  }
  return s;
}

}  // namespace graphmoe::detail
