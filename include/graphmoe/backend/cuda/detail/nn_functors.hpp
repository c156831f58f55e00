// graphmoe/backend/cuda/detail/nn_functors.hpp: the element-wise bodies of the CUDA backend's
// neural-network ops (gelu, dropout, cross_entropy, embedding, layernorm) as host/device functors,
// and the Thrust algorithms of embedding_backward, templated on the execution policy (internal).
//
// Like dispatch_plan_thrust.hpp, this header includes nothing of CUDA itself and marks its
// functions GRAPHMOE_HOST_DEVICE, so it compiles in two ways:
//   - by nvcc, from backend/cuda/{gelu,dropout,cross_entropy,embedding,layernorm}.cuh, which run
//     each functor over [0, n) in a grid-stride kernel (detail/nn_launch.cuh) and the Thrust
//     algorithms with thrust::cuda::par_nosync(alloc);
//   - by g++ alone, with -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP: tests/cuda/
//     test_host_nn_ops.cpp runs the same functors through thrust::for_each on host memory and
//     compares them with the CPU ops, on machines without a GPU.
//
// Every functor is a plain aggregate of raw pointers and scalars (copied to the device by value)
// whose operator()(i) handles index i of its range. Element i never reads an entry another index
// writes, so outputs may alias inputs wherever the ops allow it (y = x, dx = dy).
//
// The formulas are the CPU ops' own, written with the same operations in the same order: with
// the same libm (host) they give bit-identical results; on the GPU, CUDA's expf / erfcf (within
// 2 ulp) and fused multiply-adds make them differ in the last bits.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <thrust/copy.h>
#include <thrust/find.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>

#include "graphmoe/config.hpp"
#include "graphmoe/core/cross_entropy.hpp"
#include "graphmoe/core/gelu.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe::detail {

// ---- math in T's precision (expf for float, never a silent promotion to double) ----------------

GRAPHMOE_HOST_DEVICE inline float nn_exp(float x) { return ::expf(x); }
GRAPHMOE_HOST_DEVICE inline double nn_exp(double x) { return ::exp(x); }
GRAPHMOE_HOST_DEVICE inline float nn_erfc(float x) { return ::erfcf(x); }
GRAPHMOE_HOST_DEVICE inline double nn_erfc(double x) { return ::erfc(x); }
GRAPHMOE_HOST_DEVICE inline float nn_sqrt(float x) { return ::sqrtf(x); }
GRAPHMOE_HOST_DEVICE inline double nn_sqrt(double x) { return ::sqrt(x); }

// ---- gelu (backend/cpu/gelu.hpp) ---------------------------------------------------------------

template <class T>
GRAPHMOE_HOST_DEVICE T gelu_value_of(GeluForm form, T x) {
  if (form == GeluForm::Erf) return x * (T(0.5) * nn_erfc(-x * T(kGeluInvSqrt2)));
  const T u = T(kGeluSqrt2OverPi) * (x + T(kGeluCubic) * x * x * x);
  return x / (T(1) + nn_exp(T(-2) * u));
}

template <class T>
GRAPHMOE_HOST_DEVICE T gelu_derivative_of(GeluForm form, T x) {
  if (form == GeluForm::Erf) {
    const T cdf = T(0.5) * nn_erfc(-x * T(kGeluInvSqrt2));
    const T pdf = T(kGeluInvSqrt2Pi) * nn_exp(T(-0.5) * x * x);
    return pdf == T(0) ? cdf : cdf + x * pdf;
  }
  const T u = T(kGeluSqrt2OverPi) * (x + T(kGeluCubic) * x * x * x);
  const T s = T(1) / (T(1) + nn_exp(T(-2) * u));  // 0.5 (1 + tanh u)
  const T sech2_quarter = s * (T(1) - s);           // 0.25 (1 - tanh^2 u)
  if (sech2_quarter == T(0)) return s;
  const T du = T(kGeluSqrt2OverPi) * (T(1) + T(3 * kGeluCubic) * x * x);
  return s + T(2) * x * sech2_quarter * du;
}

// y[i] = gelu(x[i])
template <class T>
struct GeluForwardOp {
  GeluForm form;
  const T* x;
  T* y;
  GRAPHMOE_HOST_DEVICE void operator()(index_t i) const { y[i] = gelu_value_of(form, x[i]); }
};

// dx[i] = dy[i] * gelu'(x[i])
template <class T>
struct GeluBackwardOp {
  GeluForm form;
  const T* x;
  const T* dy;
  T* dx;
  GRAPHMOE_HOST_DEVICE void operator()(index_t i) const {
    dx[i] = dy[i] * gelu_derivative_of(form, x[i]);
  }
};

// ---- dropout (backend/cpu/dropout.hpp) ---------------------------------------------------------

// Element i of a call with (seed, offset) uses word w = offset + i of the Philox stream, word
// w % 4 of block w / 4. One call of DropoutForwardOp draws one Philox block and handles the (up
// to four) elements whose words it holds: call b handles block offset / 4 + b, for b in
// [0, dropout_blocks(offset, n)).
GRAPHMOE_HOST_DEVICE inline index_t dropout_blocks(std::uint64_t offset, index_t n) {
  return n == 0 ? 0 : static_cast<index_t>((offset % 4 + static_cast<std::uint64_t>(n) + 3) / 4);
}

// y = x * mask / (1 - p), mask = !(uniform_float(word) < p); p = 0: y = x, mask = 1.
template <class T>
struct DropoutForwardOp {
  T p;
  T scale;  // 1 / (1 - p), computed on the host as the CPU op does
  std::uint64_t seed;
  std::uint64_t offset;
  index_t n;
  const T* x;
  T* y;
  std::uint8_t* mask;
  GRAPHMOE_HOST_DEVICE void operator()(index_t b) const {
    const std::uint64_t block = offset / 4 + static_cast<std::uint64_t>(b);
    const std::uint64_t first_word = block * 4;
    if (p == T(0)) {
      for (std::uint64_t k = 0; k < 4; ++k) {
        if (first_word + k < offset) continue;
        const index_t i = static_cast<index_t>(first_word + k - offset);
        if (i >= n) break;
        y[i] = x[i];
        mask[i] = 1;
      }
      return;
    }
    const std::array<std::uint32_t, 4> words = philox4x32_10(block, seed);
    for (std::uint64_t k = 0; k < 4; ++k) {
      if (first_word + k < offset) continue;
      const index_t i = static_cast<index_t>(first_word + k - offset);
      if (i >= n) break;
      const bool keep = !(static_cast<T>(uniform_float(words[k])) < p);
      mask[i] = keep ? 1 : 0;
      y[i] = keep ? x[i] * scale : T(0);
    }
  }
};

// dx[i] = mask[i] ? dy[i] / (1 - p) : 0
template <class T>
struct DropoutBackwardOp {
  T scale;
  const std::uint8_t* mask;
  const T* dy;
  T* dx;
  GRAPHMOE_HOST_DEVICE void operator()(index_t i) const { dx[i] = mask[i] ? dy[i] * scale : T(0); }
};

// ---- cross_entropy (backend/cpu/cross_entropy.hpp) ---------------------------------------------

// The negative log-likelihood of row i's target, 0 for an ignored row (targets already checked).
template <class T>
struct CrossEntropyNllOp {
  const T* log_probs;  // (rows, classes)
  const std::int32_t* targets;
  index_t classes;
  std::int32_t ignore_index;
  GRAPHMOE_HOST_DEVICE double operator()(index_t i) const {
    const std::int32_t t = targets[i];  // a bad target (reported by the scan) adds nothing
    return t == ignore_index || cross_entropy_bad_target(t, classes, ignore_index)
               ? 0.0
               : -static_cast<double>(log_probs[i * classes + t]);
  }
};

// dlogits[i, j] = scale * exp(log_probs[i, j]) - (j == t_i ? scale : 0), 0 on ignored rows and
// when every row is ignored; scale = dloss / (rows not ignored).
template <class T>
struct CrossEntropyBackwardOp {
  T scale;
  bool all_ignored;
  index_t classes;
  std::int32_t ignore_index;
  const T* log_probs;
  const std::int32_t* targets;
  T* dlogits;
  GRAPHMOE_HOST_DEVICE void operator()(index_t e) const {
    const index_t i = e / classes, j = e % classes;
    const std::int32_t t = targets[i];
    if (t == ignore_index || all_ignored) {
      dlogits[e] = T(0);
      return;
    }
    T v = nn_exp(log_probs[e]) * scale;
    if (j == t) v -= scale;
    dlogits[e] = v;
  }
};

// ---- embedding (backend/cpu/embedding.hpp) -----------------------------------------------------

// out[i, c] = table[ids[i], c], one call per entry of out (n, d).
template <class T>
struct EmbeddingGatherOp {
  const std::int32_t* ids;
  const T* table;
  index_t d;
  index_t vocab;  // an id outside [0, vocab) gives a zero row (its deferred check reports it)
  T* out;
  GRAPHMOE_HOST_DEVICE void operator()(index_t e) const {
    const index_t i = e / d, c = e % d;
    const index_t id = static_cast<index_t>(ids[i]);
    out[e] = id >= 0 && id < vocab ? table[id * d + c] : T(0);
  }
};

struct IdOutsideRange {
  index_t vocab;
  GRAPHMOE_HOST_DEVICE bool operator()(std::int32_t id) const { return id < 0 || id >= vocab; }
};

// Flat position of the first id outside [0, vocab), or -1 when all are inside.
template <class Policy>
index_t first_bad_id(const Policy& policy, const std::int32_t* ids, index_t n, index_t vocab) {
  const std::int32_t* it = thrust::find_if(policy, ids, ids + n, IdOutsideRange{vocab});
  const index_t i = it - ids;
  return i == n ? -1 : i;
}

// Whether sorted position s starts a run of equal ids.
struct SegmentHead {
  const std::uint32_t* keys;
  GRAPHMOE_HOST_DEVICE bool operator()(index_t s) const { return s == 0 || keys[s] != keys[s - 1]; }
};

// dtable[id_u, c] += dout[order[s], c] for the sorted positions s of segment u (one id), added in
// increasing s, i.e. in increasing position i of ids, as the CPU op adds them: one call per
// (segment u, column c), u = e / d.
template <class T>
struct EmbeddingSegmentAddOp {
  const std::uint32_t* keys;   // sorted ids (n)
  const index_t* order;        // order[s]: the position in ids of sorted entry s (n)
  const index_t* starts;       // starts[u]: the first sorted position of segment u (segments)
  index_t segments;
  index_t n;
  index_t d;
  const T* dout;               // (n, d)
  T* dtable;                   // (V, d)
  GRAPHMOE_HOST_DEVICE void operator()(index_t e) const {
    const index_t u = e / d, c = e % d;
    const index_t s0 = starts[u], s1 = u + 1 < segments ? starts[u + 1] : n;
    T* dst = dtable + static_cast<index_t>(keys[s0]) * d + c;
    T acc = *dst;
    for (index_t s = s0; s < s1; ++s) acc += dout[order[s] * d + c];
    *dst = acc;
  }
};

// dtable[ids[i], :] += dout[i, :] for ids[0, n), all in [0, V), without atomics: the positions are
// sorted by id (a stable radix sort on the GPU, so equal ids keep their order), the runs of equal
// ids found, and each (run, column) pair summed by one thread in position order. The result is
// bit-identical to the CPU op's. Scratch, in the policy's memory: keys (n), order (n), starts (n).
template <class Policy, class T>
void embedding_backward_sorted(const Policy& policy, const std::int32_t* ids, index_t n,
                               const T* dout, index_t d, T* dtable, std::uint32_t* keys,
                               index_t* order, index_t* starts) {
  if (n == 0 || d == 0) return;
  thrust::copy(policy, ids, ids + n, keys);
  thrust::sequence(policy, order, order + n);
  thrust::stable_sort_by_key(policy, keys, keys + n, order);
  index_t* starts_end = thrust::copy_if(policy, thrust::counting_iterator<index_t>(0),
                                        thrust::counting_iterator<index_t>(n), starts,
                                        SegmentHead{keys});
  const index_t segments = starts_end - starts;
  thrust::for_each(policy, thrust::counting_iterator<index_t>(0),
                   thrust::counting_iterator<index_t>(segments * d),
                   EmbeddingSegmentAddOp<T>{keys, order, starts, segments, n, d, dout, dtable});
}

// ---- layernorm (backend/cpu/layernorm.hpp) -----------------------------------------------------

// Rows per chunk of the parameter-gradient partial sums: the CPU op's kLayernormBlockRows, so
// that both reduce in the same order. Fixed, so the result depends on neither the device nor the
// launch shape.
inline constexpr index_t kLayernormChunkRows = 64;

GRAPHMOE_HOST_DEVICE inline index_t layernorm_chunks(index_t n) {
  return (n + kLayernormChunkRows - 1) / kLayernormChunkRows;
}

// y = (x - mean) rstd gamma + beta
template <class T>
GRAPHMOE_HOST_DEVICE T layernorm_y(T x, T mean, T rstd, T gamma, T beta) {
  return (x - mean) * rstd * gamma + beta;
}

// a * b rounded once, never fused into a neighbouring add. nvcc contracts a * b + c into one FMA
// by default (-fmad=true), which keeps the product unrounded: then g - mean_g with g = dy gamma is
// the product's rounding error instead of 0 when the row's mean is that same (rounded) product.
// Host compilers without -mfma (and the CUDA emulation) never fuse, so only a GPU shows it.
template <class T>
GRAPHMOE_HOST_DEVICE inline T mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    return __fmul_rn(a, b);
  } else if constexpr (std::is_same_v<T, double>) {
    return __dmul_rn(a, b);
  } else {
    return a * b;
  }
#else
  return a * b;
#endif
}

// dx = rstd ((g - mean_g) - xhat mean_gx), g = dy gamma, xhat = (x - mean) rstd. g is rounded
// before the subtraction, as in the sum that made mean_g (mul_rn), so that a row of one entry
// (D = 1: g = mean_g, xhat = 0) gets dx = 0 exactly, as on the CPU.
template <class T>
GRAPHMOE_HOST_DEVICE T layernorm_dx(T x, T dy, T gamma, T mean, T rstd, T mean_g, T mean_gx) {
  const T xhat = (x - mean) * rstd;
  const T g = mul_rn(dy, gamma);
  return rstd * ((g - mean_g) - xhat * mean_gx);
}

// partial[g, j] = sum_{i in chunk g} dy_ij xhat_ij, partial[g, d + j] = sum_{i in chunk g} dy_ij,
// accumulated in A in row order: one call per (chunk g, column j), g = e / d. partial is
// (chunks, 2 d).
template <class T, class A>
struct LayernormParamPartialOp {
  const T* x;     // (n, d)
  const T* dy;    // (n, d)
  const T* mean;  // (n)
  const T* rstd;  // (n)
  index_t n;
  index_t d;
  A* partial;
  GRAPHMOE_HOST_DEVICE void operator()(index_t e) const {
    const index_t g = e / d, j = e % d;
    const index_t end = (g + 1) * kLayernormChunkRows < n ? (g + 1) * kLayernormChunkRows : n;
    A sg = A(0), sb = A(0);
    for (index_t i = g * kLayernormChunkRows; i < end; ++i) {
      const T xhat = (x[i * d + j] - mean[i]) * rstd[i];
      const T g_ij = dy[i * d + j];
      sg += static_cast<A>(g_ij) * static_cast<A>(xhat);
      sb += static_cast<A>(g_ij);
    }
    partial[g * 2 * d + j] = sg;
    partial[g * 2 * d + d + j] = sb;
  }
};

// dgamma[j] += sum_g partial[g, j], dbeta[j] += sum_g partial[g, d + j], summed in chunk order:
// one call per j in [0, 2 d).
template <class T, class A>
struct LayernormParamReduceOp {
  const A* partial;
  index_t chunks;
  index_t d;
  T* dgamma;
  T* dbeta;
  GRAPHMOE_HOST_DEVICE void operator()(index_t j) const {
    A total = A(0);
    for (index_t g = 0; g < chunks; ++g) total += partial[g * 2 * d + j];
    if (j < d)
      dgamma[j] += static_cast<T>(total);
    else
      dbeta[j - d] += static_cast<T>(total);
  }
};

}  // namespace graphmoe::detail
