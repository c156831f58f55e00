// graphmoe/ops/rope.hpp: rotary position embeddings (RoPE), applied to the heads of a row.
//
// x (N, H dh) is read as N rows of num_heads = H heads of dh entries (dh even); positions (N)
// holds each row's position p >= 0. Pair i = 0 .. dh/2 - 1 of every head, entries (a, b) in the
// RopeLayout's order (core/rope.hpp: HalfSplit (i, i + dh/2), Interleaved (2i, 2i + 1)), is
// rotated by the angle p inv_freq_i, inv_freq_i = 1 / theta^(2i / dh):
//
//   forward:   y_a = x_a cos - x_b sin        y_b = x_b cos + x_a sin
//   backward:  dx_a = dy_a cos + dy_b sin     dx_b = dy_b cos - dy_a sin   (the inverse rotation)
//
// which is Hugging Face's q * cos + rotate_half(q) * sin for HalfSplit. The frequency, the angle,
// its cosine and sine are computed in double, then cast to T for the rotation (in T, or on the
// CUDA system in acc_t<T>). x may have any rank >= 1 (all dimensions but the last are the rows);
// positions is (N) or x's shape without its last dimension.
//
// A negative position throws naming the op, the first bad flat position and its value (reported
// through report_check: a backend may defer it, core/deferred_check.hpp); the output is then
// unspecified. Outputs follow prepare_output and may alias the input (y may be x, dx may be dy).
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; then
// rope_forward(B{}, ...) / rope_backward(B{}, ...) runs the backend's system
// (backend/cpu/rope.hpp, backend/cuda/rope.cuh, or a user backend's overload found by
// argument-dependent lookup), which returns the first negative position (core/offender.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "graphmoe/backend/cpu/rope.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/decode.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/rope.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/elementwise.hpp"

namespace graphmoe {

namespace detail {

// Checks x, positions, num_heads, theta and layout; returns dh.
template <class T, class B>
index_t rope_check_args(const char* op, const char* xname, const Tensor<T, B>& x,
                        const Tensor<std::int32_t, B>& positions, index_t num_heads, double theta,
                        RopeLayout layout) {
  GRAPHMOE_CHECK(layout == RopeLayout::HalfSplit || layout == RopeLayout::Interleaved, op,
                 "unknown RopeLayout ", static_cast<int>(layout));
  GRAPHMOE_CHECK(!x.empty() && x.rank() >= 1, op, xname,
                 " must be a non-empty tensor of rank >= 1, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  GRAPHMOE_CHECK(num_heads >= 1, op, "num_heads must be >= 1, got ", num_heads);
  const index_t cols = x.cols();
  GRAPHMOE_CHECK(cols % num_heads == 0, op, xname, " has shape ", x.shape(), ": its last dimension ",
                 cols, " is not a multiple of num_heads = ", num_heads);
  const index_t dh = cols / num_heads;
  GRAPHMOE_CHECK(dh % 2 == 0, op, "the head dimension dh = ", dh, " (", xname, " shape ", x.shape(),
                 ", num_heads = ", num_heads, ") must be even");
  GRAPHMOE_CHECK(theta > 0.0 && std::isfinite(theta), op, "theta must be positive and finite, got ",
                 theta);
  bool leading = positions.rank() == x.rank() - 1 && x.rank() >= 2;
  for (index_t k = 0; leading && k < positions.rank(); ++k) leading = positions.dim(k) == x.dim(k);
  GRAPHMOE_CHECK(!positions.empty() &&
                     ((positions.rank() == 1 && positions.dim(0) == x.rows()) || leading),
                 op, "positions has shape ",
                 (positions.empty() ? std::string("(empty)") : positions.shape().str()),
                 ", expected (", x.rows(), ") (one position per row of ", xname, " ", x.shape(),
                 ")");
  return dh;
}

inline void rope_check_positions(const char* op, const Shape& shape, const Offender& bad) {
  GRAPHMOE_CHECK(!bad.found(), op, "position ", static_cast<std::int64_t>(bad.value),
                 " at flat position ", bad.index, " of positions ", shape, " is negative");
}

}  // namespace detail

// The positions RoPE reads for a (batch, seq) batch of rows: row i is at i % seq in its sequence.
// positions is rebuilt only when it does not hold them already (seq_of: the seq it was built for).
template <Backend B>
void sequence_positions(index_t batch, index_t seq, Tensor<std::int32_t, B>& positions,
                        index_t& seq_of) {
  if (positions.shape() == Shape{batch * seq} && seq_of == seq) return;
  Tensor<std::int32_t, cpu> host(Shape{batch * seq});
  for (index_t i = 0; i < batch * seq; ++i) host.data()[i] = static_cast<std::int32_t>(i % seq);
  positions = Tensor<std::int32_t, B>(Shape{batch * seq});
  copy_from_host(positions, host);
  seq_of = seq;
}

// The positions of a decode step's rows (rows.pos), on B.
template <Backend B>
Tensor<std::int32_t, B> decode_positions(const DecodeRows& rows) {
  const index_t n = rows.size();
  Tensor<std::int32_t, cpu> host(Shape{n});
  for (index_t i = 0; i < n; ++i)
    host.data()[i] = static_cast<std::int32_t>(rows.pos[static_cast<std::size_t>(i)]);
  Tensor<std::int32_t, B> pos(Shape{n});
  copy_from_host(pos, host);
  return pos;
}

// y = x with every head's pairs rotated by position * inv_freq.
template <class T, Backend B>
void rope_forward(const Tensor<T, B>& x, const Tensor<std::int32_t, B>& positions,
                  index_t num_heads, double theta, RopeLayout layout, Tensor<T, B>& y) {
  constexpr const char* op = "rope_forward";
  detail::rope_check_args(op, "x", x, positions, num_heads, theta, layout);
  prepare_output(op, "y", y, x.shape());
  report_check(rope_forward(B{}, x, positions, num_heads, theta, layout, y),
               [shape = positions.shape()](const Offender& bad) {
                 detail::rope_check_positions("rope_forward", shape, bad);
               });
}

// dx = dy rotated back (the transpose of the forward's rotation). dx is assigned.
template <class T, Backend B>
void rope_backward(const Tensor<T, B>& dy, const Tensor<std::int32_t, B>& positions,
                   index_t num_heads, double theta, RopeLayout layout, Tensor<T, B>& dx) {
  constexpr const char* op = "rope_backward";
  detail::rope_check_args(op, "dy", dy, positions, num_heads, theta, layout);
  prepare_output(op, "dx", dx, dy.shape());
  report_check(rope_backward(B{}, dy, positions, num_heads, theta, layout, dx),
               [shape = positions.shape()](const Offender& bad) {
                 detail::rope_check_positions("rope_backward", shape, bad);
               });
}

}  // namespace graphmoe
