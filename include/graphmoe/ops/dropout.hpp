// graphmoe/ops/dropout.hpp: inverted dropout with a counter-based mask.
//
// Element i (flat, row-major) of a call with (seed, offset) is dropped iff
//     uniform_float(philox_word(seed, offset + i)) < p
// and kept elements are scaled by 1 / (1 - p), so E[y] = x. The mask is a pure function of
// (seed, offset + i, p): every backend draws the same mask (core/rng.hpp's Philox stream), any
// thread count gives the same mask, and backward needs only the stored mask (1 = kept,
// 0 = dropped).
//
// Callers must give every call its own range of the stream: advance offset by x.numel() after
// each call, which is what Rng::skip does:
//     const std::uint64_t offset = rng.skip(static_cast<std::uint64_t>(x.numel()));
//     dropout_forward(p, rng.seed(), offset, x, y, mask);
// Reusing an offset reuses the mask.
//
// p must lie in [0, 1); p = 0 is the identity (mask all ones). Outputs follow prepare_output
// (empty: allocated; otherwise the shape must match); y may alias x and dx may alias dy.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// dropout_forward(B{}, ...) / dropout_backward(B{}, ...) runs the backend's system
// (backend/cpu/dropout.hpp, backend/cuda/dropout.cuh, or a user backend's overload found by
// argument-dependent lookup).
#pragma once

#include <cstdint>

#include "graphmoe/backend/cpu/dropout.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

template <class T>
void dropout_check_p(const char* op, T p) {
  GRAPHMOE_CHECK(p >= T(0) && p < T(1), op, "drop probability p must lie in [0, 1), got ", p);
}

}  // namespace detail

// y = x * mask / (1 - p) with mask_i = !(uniform_float(philox_word(seed, offset + i)) < p).
// Fills mask (x's shape, 1 = kept).
template <class T, Backend B>
void dropout_forward(T p, std::uint64_t seed, std::uint64_t offset, const Tensor<T, B>& x,
                     Tensor<T, B>& y, Tensor<std::uint8_t, B>& mask) {
  constexpr const char* op = "dropout_forward";
  detail::dropout_check_p(op, p);
  GRAPHMOE_CHECK(!x.empty(), op, "x is empty");
  prepare_output(op, "y", y, x.shape());
  prepare_output(op, "mask", mask, x.shape());
  dropout_forward(B{}, p, seed, offset, x, y, mask);
}

// dx = dy * mask / (1 - p), with the mask of the forward call. dx is assigned.
template <class T, Backend B>
void dropout_backward(T p, const Tensor<std::uint8_t, B>& mask, const Tensor<T, B>& dy,
                      Tensor<T, B>& dx) {
  constexpr const char* op = "dropout_backward";
  detail::dropout_check_p(op, p);
  GRAPHMOE_CHECK(!mask.empty() && !dy.empty(), op, "mask or dy is empty");
  GRAPHMOE_CHECK(mask.shape() == dy.shape(), op, "mask has shape ", mask.shape(),
                 ", expected dy's shape ", dy.shape());
  prepare_output(op, "dx", dx, dy.shape());
  dropout_backward(B{}, p, mask, dy, dx);
}

}  // namespace graphmoe
