// graphmoe/layers/linear.hpp: y = x W^T + b (PyTorch nn.Linear layout: W (out, in), b (out)).
//
// Layer contract (every layer in layers/): declare(arena, prefix, ...) registers parameters,
// bind(arena) takes views of values and gradients, init(rng) sets initial values; forward(x, y)
// caches what backward needs; backward(dy, dx) ASSIGNS dx (skipped when dx is nullptr) and
// ACCUMULATES (+=) the parameter gradients.
//
// Layers are written once for every backend: their bodies call the op layer (ops/: gemm,
// add_row_vector, ...), which checks the arguments and runs the tensors' backend (backend/cpu/,
// backend/cuda/, or a user's). A .cu translation unit that instantiates a layer with
// graphmoe::cuda includes graphmoe/cuda.cuh.
//
// Compute type C (default T), as in ExpertBank (layers/expert_bank.hpp): with T = float and C =
// __nv_bfloat16 (or __half) on graphmoe::cuda, W, b, their gradients, y and dx stay fp32; forward
// converts x and W to C once (kept for backward), and the three products (y = x W^T, dx = dy W,
// dW += dy^T x, dy converted to C once) read C operands, accumulate in fp32 and write fp32
// (backend/cuda/gemm.cuh's mixed gemm). The bias and its gradient stay fp32. With C = T the layer
// is exactly the plain one (the same calls, no conversion). With a compute mirror attached
// (attach_mirror, layers/compute_mirror.hpp; TransformerLM attaches its own) forward reads W in C
// from the mirror (refreshed first if stale) instead of converting it: the same values.
#pragma once

#include <string>
#include <type_traits>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/layers/compute_mirror.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gemm.hpp"

namespace graphmoe {

template <class T, class B = cpu, class C = T>
class Linear {
  static_assert(std::is_same_v<C, T> || backend_mixed_precision<B>,
                "graphmoe::Linear: a compute type other than T needs a backend with mixed_precision (graphmoe::cuda)");

 public:
  void declare(ParameterArena<T, B>& arena, const std::string& prefix, index_t in, index_t out,
               bool bias = true) {
    GRAPHMOE_CHECK(in >= 1 && out >= 1, "Linear", "sizes must be >= 1, got in = ", in,
                   ", out = ", out);
    in_ = in;
    out_ = out;
    bias_ = bias;
    id_w_ = arena.add(prefix + "weight", Shape{out, in});
    if (bias) id_b_ = arena.add(prefix + "bias", Shape{out});
  }
  void bind(const ParameterArena<T, B>& arena) {
    w_ = arena.value(id_w_);
    dw_ = arena.grad(id_w_);
    if (bias_) {
      b_ = arena.value(id_b_);
      db_ = arena.grad(id_b_);
    }
    bound_ = true;
  }
  void init(Rng& rng, double stddev) {
    fill_normal(w_, rng, stddev);
    if (bias_) b_.zero();
  }
  // x (..., in) -> y (..., out)
  void forward(const Tensor<T, B>& x, Tensor<T, B>& y) { forward_impl(x, nullptr, y); }
  // The same, C != T, with x already converted to C by the caller (xc = convert(x), x's shape):
  // layers that feed one input to several projections (attention's q, k, v) convert it once.
  // The layer keeps xc for its backward, so the caller must not overwrite it before then.
  void forward(const Tensor<T, B>& x, const Tensor<C, B>& xc, Tensor<T, B>& y)
    requires(!std::is_same_v<C, T>)
  {
    GRAPHMOE_CHECK(xc.shape() == x.shape(), "Linear", "the converted input has shape ",
                   xc.shape(), ", expected the input's ", x.shape());
    forward_impl(x, &xc, y);
  }

 private:
  void forward_impl(const Tensor<T, B>& x, const Tensor<C, B>* xc, Tensor<T, B>& y) {
    check_bound("forward");
    GRAPHMOE_CHECK(x.cols() == in_, "Linear", "input has shape ", x.shape(), ", expected last dim ",
                   in_);
    x_ = x;
    std::vector<index_t> dims(x.shape().begin(), x.shape().end());
    dims.back() = out_;
    prepare_output("Linear", "y", y, Shape::from_range(dims.begin(), dims.end()));
    if constexpr (std::is_same_v<C, T>) {
      gemm(Trans::N, Trans::T, T(1), x, w_, T(0), y);
    } else {
      if (xc != nullptr) {
        xc_ = *xc;
        xc_shared_ = true;
      } else {
        if (xc_shared_) xc_ = Tensor<C, B>();  // never convert into the caller's buffer
        xc_shared_ = false;
        to_compute(x, xc_);
      }
      if (mirror_ != nullptr) {
        mirror_->ensure_current();
        wc_ = mirror_->value(id_w_);
      } else {
        to_compute(w_, wc_);
      }
      gemm(Trans::N, Trans::T, T(1), xc_, wc_, T(0), y);
    }
    if (bias_) add_row_vector(b_, y);
  }

 public:
  // accumulate_dx: dx += dy W instead of dx = dy W (one GEMM with beta = 1 where a caller would
  // otherwise add a temporary: the attention layer's three input projections).
  void backward(const Tensor<T, B>& dy, Tensor<T, B>* dx, bool accumulate_dx = false) {
    check_bound("backward");
    GRAPHMOE_CHECK(!accumulate_dx || (dx != nullptr && !dx->empty()), "Linear",
                   "backward with accumulate_dx needs an allocated dx to add to");
    Tensor<T, B> none;
    const T beta_dx = accumulate_dx ? T(1) : T(0);
    if constexpr (std::is_same_v<C, T>) {
      gemm_backward(Trans::N, Trans::T, T(1), x_, w_, dy, beta_dx, dx ? *dx : none, T(1), dw_);
    } else {
      // gemm_backward's two products with C operands: dx = dy W (skipped for an empty dx, as
      // there), dW += dy^T x
      const index_t rows = x_.rows();
      GRAPHMOE_CHECK(dy.rows() == rows && dy.cols() == out_, "gemm_backward", "dC has shape ",
                     dy.shape(), ", expected (", rows, ", ", out_, ") for A ", x_.shape(),
                     " and B ", w_.shape());
      to_compute(dy, dyc_);
      if (dx != nullptr && !dx->empty()) {
        check_shape("gemm_backward", "dA", *dx, x_.shape());
        gemm(Trans::N, Trans::N, T(1), dyc_, wc_, beta_dx, *dx);
      }
      gemm(Trans::T, Trans::N, T(1), dyc_, xc_, T(1), dw_);
    }
    if (bias_) accumulate_column_sums(dy, db_);
  }
  // W in C read from mirror (of the arena this layer is bound to) from the next forward on;
  // nullptr: converted per forward again. C != T only.
  void attach_mirror(ComputeMirror<T, C, B>* mirror) {
    static_assert(!std::is_same_v<C, T>, "graphmoe::Linear::attach_mirror: C = T has no mirror");
    mirror_ = mirror;
    wc_ = Tensor<C, B>();  // never convert into the mirror's storage
  }
  const Tensor<T, B>& weight() const { return w_; }
  const Tensor<T, B>& bias() const { return b_; }
  const Tensor<T, B>& dweight() const { return dw_; }
  const Tensor<T, B>& dbias() const { return db_; }
  index_t in() const { return in_; }
  index_t out() const { return out_; }

 private:
  // Set by bind(): a layer used before it is bound has no parameters to read.
  bool bound_ = false;
  void check_bound(const char* op) const { detail::require_bound(bound_, "Linear", op); }
  // dst = src in the compute type C (dst reallocated when its shape differs); C != T only.
  static void to_compute(const Tensor<T, B>& src, Tensor<C, B>& dst) {
    if (dst.empty() || dst.shape() != src.shape()) dst = Tensor<C, B>(src.shape());
    convert(src, dst);
  }
  index_t in_ = 0, out_ = 0;
  bool bias_ = true;
  index_t id_w_ = -1, id_b_ = -1;
  Tensor<T, B> w_, dw_, b_, db_;
  Tensor<T, B> x_;
  // C != T: x and W of the last forward and dy of the last backward in C (empty when C = T)
  Tensor<C, B> xc_, wc_, dyc_;
  bool xc_shared_ = false;  // xc_ is a caller's converted input (forward(x, xc, y))
  ComputeMirror<T, C, B>* mirror_ = nullptr;  // C != T: W's C view from here when set
};

}  // namespace graphmoe
