// graphmoe/backend/cpu/cross_entropy.hpp: softmax cross-entropy over class logits.
//
//   log_probs = log_softmax(logits)                                     (N, C)
//   loss      = -(1 / n) * sum_{i : t_i != ignore} log_probs[i, t_i],   n = #{i : t_i != ignore}
//   dlogits   = dloss / n * (softmax(logits) - onehot(t))  on rows with t_i != ignore, 0 elsewhere
//
// logits may have any rank >= 1: all dimensions but the last are rows (e.g. (B, T, V) for a
// language model) and targets has the logits' shape without the last dimension ((B, T)). The mean
// is taken over the rows whose target is not ignore_index; the loss is 0 (and dlogits all zero)
// when every row is ignored. A target outside [0, C) that is not ignore_index throws, naming the
// row and the value. The log-softmax is max-subtracted, so the loss is exact for logits of any
// finite magnitude.
#pragma once

#include <cmath>
#include <cstdint>

#include "graphmoe/backend/common/checks.hpp"
#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/backend/cpu/softmax.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

namespace detail {

// Checks (`what`, named in the message: "logits" or "log_probs") and the targets, and returns the
// number of rows not ignored.
template <class T>
index_t cross_entropy_check_targets(const char* op, const char* what, const Tensor<T, cpu>& logits,
                                    const Tensor<std::int32_t, cpu>& targets,
                                    std::int32_t ignore_index) {
  cross_entropy_check_shapes(op, what, logits, targets);
  const index_t rows = logits.rows();
  const index_t classes = logits.cols();
  const std::int32_t* t = targets.data();
  index_t count = 0;
  for (index_t i = 0; i < rows; ++i) {
    if (t[i] == ignore_index) continue;
    if (cross_entropy_bad_target(t[i], classes, ignore_index))
      cross_entropy_throw_bad_target(op, i, t[i], classes, ignore_index);
    ++count;
  }
  return count;
}

}  // namespace detail

// Fills log_probs (the logits' shape; the cache for backward) with log_softmax(logits) and
// returns the mean negative log-likelihood of the targets over the rows not ignored.
template <class T>
T cross_entropy_forward(const Tensor<T, cpu>& logits, const Tensor<std::int32_t, cpu>& targets,
                        Tensor<T, cpu>& log_probs, std::int32_t ignore_index = -100) {
  constexpr const char* op = "cross_entropy_forward";
  const index_t count =
      detail::cross_entropy_check_targets(op, "logits", logits, targets, ignore_index);
  detail::softmax_forward_impl(op, "logits", true, logits, log_probs);
  if (count == 0) return T(0);
  const index_t rows = logits.rows(), classes = logits.cols();
  const std::int32_t* t = targets.data();
  const T* lp = log_probs.data();
  double nll = 0;
  for (index_t i = 0; i < rows; ++i)
    if (t[i] != ignore_index) nll -= static_cast<double>(lp[i * classes + t[i]]);
  return static_cast<T>(nll / static_cast<double>(count));
}

// dlogits = dloss / n * (exp(log_probs) - onehot(targets)), zero rows where the target is
// ignore_index. dlogits is assigned (it may alias log_probs).
template <class T>
void cross_entropy_backward(const Tensor<T, cpu>& log_probs,
                            const Tensor<std::int32_t, cpu>& targets, T dloss,
                            Tensor<T, cpu>& dlogits, std::int32_t ignore_index = -100) {
  constexpr const char* op = "cross_entropy_backward";
  const index_t count =
      detail::cross_entropy_check_targets(op, "log_probs", log_probs, targets, ignore_index);
  prepare_output(op, "dlogits", dlogits, log_probs.shape());
  const index_t rows = log_probs.rows(), classes = log_probs.cols();
  const T scale =
      count == 0 ? T(0) : static_cast<T>(static_cast<double>(dloss) / static_cast<double>(count));
  const std::int32_t* t = targets.data();
  const T* lp = log_probs.data();
  T* d = dlogits.data();
  parallel_for(
      0, rows,
      [&](index_t i) {
        const T* lpr = lp + i * classes;
        T* dr = d + i * classes;
        if (t[i] == ignore_index || count == 0) {
          for (index_t j = 0; j < classes; ++j) dr[j] = T(0);
          return;
        }
        detail::for_exp_blocks(lpr, T(0), classes, [&](index_t j0, const T* e, index_t m) {
          for (index_t j = 0; j < m; ++j) dr[j0 + j] = e[j] * scale;
        });
        dr[t[i]] -= scale;
      },
      detail::softmax_row_grain(classes));
}

}  // namespace graphmoe
