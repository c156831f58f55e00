// graphmoe/backend/common/checks.hpp: argument checks shared by the CPU and CUDA versions of the
// neural-network ops (layernorm, gelu, cross_entropy, embedding, dropout).
//
// Every backend's op validates its arguments with the same helper, so that both throw the same
// graphmoe::Error message for the same bad input (tests/cuda/test_cuda_nn_ops.cu compares the
// strings). The helpers read only shapes, emptiness and scalar arguments, never tensor contents,
// so they take tensors of any backend B. Checks of tensor contents (ids in range, targets in
// range) run where the data lives: each backend finds the first offending entry its own way and
// then throws through the shared *_throw_* function below, which owns the message.
//
// The *_prepare_* helpers also apply the output convention (prepare_output: an empty output is
// allocated, a non-empty one must have the expected shape) in the order the ops always used.
// GeluForm and the GELU formula's constants live here too, so that both backends take and
// evaluate the same thing (backend/cpu/gelu.hpp, backend/cuda/detail/nn_functors.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/shape.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// The two usual forms of the GELU activation (backend/cpu/gelu.hpp defines both). Declared here
// because every backend's gelu_forward / gelu_backward takes it and validates it.
enum class GeluForm { Tanh, Erf };

namespace detail {

// The constants of the GELU formulas, shared so that every backend evaluates the same formula.
inline constexpr double kGeluSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
inline constexpr double kGeluInvSqrt2 = 0.70710678118654752440;     // 1 / sqrt(2)
inline constexpr double kGeluInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)
inline constexpr double kGeluCubic = 0.044715;

// ---- layernorm ---------------------------------------------------------------------------------

// Rows and columns (N, D) of layernorm's x, read as an (N, D) matrix.
struct LayernormDims {
  index_t n;
  index_t d;
};

template <class T, class B>
LayernormDims layernorm_check_x(const char* op, const Tensor<T, B>& x) {
  GRAPHMOE_CHECK(!x.empty() && x.rank() >= 1, op, "x must be a non-empty tensor of rank >= 1, got ",
                 (x.empty() ? "an empty tensor" : x.shape().str()));
  const index_t n = x.rows(), d = x.cols();
  GRAPHMOE_CHECK(d >= 1, op, "x has shape ", x.shape(), ": the normalised dimension is empty");
  return {n, d};
}

// Checks layernorm_forward's arguments and prepares y (x's shape), mean and rstd (N).
template <class T, class B>
LayernormDims layernorm_prepare_forward(const char* op, const Tensor<T, B>& x,
                                        const Tensor<T, B>& gamma, const Tensor<T, B>& beta, T eps,
                                        Tensor<T, B>& y, Tensor<T, B>& mean, Tensor<T, B>& rstd) {
  const LayernormDims s = layernorm_check_x(op, x);
  check_shape(op, "gamma", gamma, Shape{s.d});
  check_shape(op, "beta", beta, Shape{s.d});
  GRAPHMOE_CHECK(eps > T(0) && std::isfinite(eps), op, "eps must be positive and finite, got ",
                 eps);
  prepare_output(op, "y", y, x.shape());
  prepare_output(op, "mean", mean, Shape{s.n});
  prepare_output(op, "rstd", rstd, Shape{s.n});
  return s;
}

// Checks layernorm_backward's arguments and prepares dx (x's shape), dgamma and dbeta (D; an
// empty one is allocated as zeros, since they accumulate).
template <class T, class B>
LayernormDims layernorm_prepare_backward(const char* op, const Tensor<T, B>& x,
                                         const Tensor<T, B>& gamma, const Tensor<T, B>& mean,
                                         const Tensor<T, B>& rstd, const Tensor<T, B>& dy,
                                         Tensor<T, B>& dx, Tensor<T, B>& dgamma,
                                         Tensor<T, B>& dbeta) {
  const LayernormDims s = layernorm_check_x(op, x);
  check_shape(op, "gamma", gamma, Shape{s.d});
  check_shape(op, "mean", mean, Shape{s.n});
  check_shape(op, "rstd", rstd, Shape{s.n});
  check_shape(op, "dy", dy, x.shape());
  prepare_output(op, "dx", dx, x.shape());
  prepare_output(op, "dgamma", dgamma, Shape{s.d});
  prepare_output(op, "dbeta", dbeta, Shape{s.d});
  return s;
}

// ---- gelu --------------------------------------------------------------------------------------

inline void gelu_check_form(const char* op, GeluForm form) {
  GRAPHMOE_CHECK(form == GeluForm::Tanh || form == GeluForm::Erf, op, "unknown GeluForm ",
                 static_cast<int>(form));
}

// Checks gelu_forward's arguments and prepares y (x's shape).
template <class T, class B>
void gelu_prepare_forward(const char* op, GeluForm form, const Tensor<T, B>& x, Tensor<T, B>& y) {
  gelu_check_form(op, form);
  GRAPHMOE_CHECK(!x.empty(), op, "x is empty");
  prepare_output(op, "y", y, x.shape());
}

// Checks gelu_backward's arguments and prepares dx (x's shape).
template <class T, class B>
void gelu_prepare_backward(const char* op, GeluForm form, const Tensor<T, B>& x,
                           const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  gelu_check_form(op, form);
  GRAPHMOE_CHECK(!x.empty() && !dy.empty(), op, "x or dy is empty");
  GRAPHMOE_CHECK(dy.shape() == x.shape(), op, "dy has shape ", dy.shape(), ", expected x's shape ",
                 x.shape());
  prepare_output(op, "dx", dx, x.shape());
}

// ---- cross_entropy -----------------------------------------------------------------------------

// Checks that `logits` (named `what`: "logits" or "log_probs") is non-empty with rank >= 1 and
// that targets has the logits' shape without the last dimension.
template <class T, class B>
void cross_entropy_check_shapes(const char* op, const char* what, const Tensor<T, B>& logits,
                                const Tensor<std::int32_t, B>& targets) {
  GRAPHMOE_CHECK(!logits.empty(), op, what, " is empty");
  GRAPHMOE_CHECK(logits.rank() >= 1, op, "logits must have rank >= 1 (rows, classes), got shape ",
                 logits.shape());
  GRAPHMOE_CHECK(!targets.empty(), op, "targets is empty");
  const Shape expected = Shape::from_range(logits.shape().begin(), logits.shape().end() - 1);
  GRAPHMOE_CHECK(targets.shape() == expected, op, "targets has shape ", targets.shape(),
                 ", expected ", expected, " for logits of shape ", logits.shape());
}

// Whether target t of a row is neither ignore_index nor a class in [0, classes).
GRAPHMOE_HOST_DEVICE inline bool cross_entropy_bad_target(std::int32_t t, index_t classes,
                                                          std::int32_t ignore_index) {
  return t != ignore_index && (t < 0 || t >= classes);
}

// The error for row `row`, the first whose target `t` is out of range.
[[noreturn]] inline void cross_entropy_throw_bad_target(const char* op, index_t row,
                                                        std::int32_t t, index_t classes,
                                                        std::int32_t ignore_index) {
  throw_error(op, "target of row ", row, " is ", t, ", outside the class range [0, ", classes,
              ") and not ignore_index (", ignore_index, ")");
}

// ---- embedding ---------------------------------------------------------------------------------

// The first id at flat position i of ids (shape `ids_shape`) is outside [0, vocab).
[[noreturn]] inline void embedding_throw_bad_id(const char* op, const Shape& ids_shape, index_t i,
                                                std::int32_t id, index_t vocab) {
  throw_error(op, "id ", id, " at flat position ", i, " of ids ", ids_shape,
              " is out of range [0, ", vocab, ")");
}

// The shape (ids.shape..., d) of embedding's output.
inline Shape embedding_output_shape(const char* op, const Shape& ids_shape, index_t d) {
  GRAPHMOE_CHECK(ids_shape.rank() < Shape::kMaxRank, op, "ids of shape ", ids_shape, " have rank ",
                 ids_shape.rank(), "; the output would exceed the maximum rank ",
                 Shape::kMaxRank);
  std::vector<index_t> dims(ids_shape.begin(), ids_shape.end());
  dims.push_back(d);
  return Shape::from_range(dims.begin(), dims.end());
}

struct EmbeddingDims {
  index_t vocab;
  index_t d;
};

// Checks embedding_forward's ids and table (V, D) (not the id values); returns {V, D}.
template <class T, class B>
EmbeddingDims embedding_check_table(const char* op, const Tensor<std::int32_t, B>& ids,
                                    const Tensor<T, B>& table) {
  GRAPHMOE_CHECK(!ids.empty(), op, "ids are empty");
  GRAPHMOE_CHECK(!table.empty() && table.rank() == 2, op, "table must be a (V, D) matrix, got ",
                 (table.empty() ? "an empty tensor" : table.shape().str()));
  return {table.dim(0), table.dim(1)};
}

// Checks embedding_backward's ids, dtable (V, D) and dout (ids.shape..., D) (not the id values);
// returns {V, D}.
template <class T, class B>
EmbeddingDims embedding_check_backward(const char* op, const Tensor<std::int32_t, B>& ids,
                                       const Tensor<T, B>& dout, const Tensor<T, B>& dtable) {
  GRAPHMOE_CHECK(!ids.empty(), op, "ids are empty");
  GRAPHMOE_CHECK(!dtable.empty() && dtable.rank() == 2, op,
                 "dtable must be an allocated (V, D) matrix (it accumulates), got ",
                 (dtable.empty() ? "an empty tensor" : dtable.shape().str()));
  const index_t vocab = dtable.dim(0), d = dtable.dim(1);
  check_shape(op, "dout", dout, embedding_output_shape(op, ids.shape(), d));
  return {vocab, d};
}

// ---- dropout -----------------------------------------------------------------------------------

template <class T>
void dropout_check_p(const char* op, T p) {
  GRAPHMOE_CHECK(p >= T(0) && p < T(1), op, "drop probability p must lie in [0, 1), got ", p);
}

// Checks dropout_forward's arguments and prepares y and mask (x's shape).
template <class T, class B>
void dropout_prepare_forward(const char* op, T p, const Tensor<T, B>& x, Tensor<T, B>& y,
                             Tensor<std::uint8_t, B>& mask) {
  dropout_check_p(op, p);
  GRAPHMOE_CHECK(!x.empty(), op, "x is empty");
  prepare_output(op, "y", y, x.shape());
  prepare_output(op, "mask", mask, x.shape());
}

// Checks dropout_backward's arguments and prepares dx (dy's shape).
template <class T, class B>
void dropout_prepare_backward(const char* op, T p, const Tensor<std::uint8_t, B>& mask,
                              const Tensor<T, B>& dy, Tensor<T, B>& dx) {
  dropout_check_p(op, p);
  GRAPHMOE_CHECK(!mask.empty() && !dy.empty(), op, "mask or dy is empty");
  GRAPHMOE_CHECK(mask.shape() == dy.shape(), op, "mask has shape ", mask.shape(),
                 ", expected dy's shape ", dy.shape());
  prepare_output(op, "dx", dx, dy.shape());
}

}  // namespace detail

}  // namespace graphmoe
