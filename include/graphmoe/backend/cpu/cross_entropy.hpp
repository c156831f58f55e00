// graphmoe/backend/cpu/cross_entropy.hpp: the CPU system's softmax cross-entropy (contract and
// argument checks: ops/cross_entropy.hpp, which calls these through the backend tag).
//
// The log-softmax is the CPU softmax's (backend/cpu/softmax.hpp: max-subtracted, row sums in
// double, rows over the threads); a row without a finite maximum is returned (CrossEntropyValue,
// core/cross_entropy.hpp) for the op layer to throw the softmax's message.
// The loss is summed in double over the rows in order. dlogits is written row by row over the
// threads, with the vectorised exp of detail/vexp.hpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "graphmoe/backend/cpu/detail/vexp.hpp"
#include "graphmoe/backend/cpu/softmax.hpp"
#include "graphmoe/core/cross_entropy.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/core/threads.hpp"

namespace graphmoe {

// The number of rows of targets (rows) not ignored, and the first row whose target is neither
// ignore_index nor in [0, classes) (the count then covers the rows before it).
inline TargetScan cross_entropy_scan_targets(cpu, const Tensor<std::int32_t, cpu>& targets,
                                             index_t classes, std::int32_t ignore_index) {
  const index_t rows = targets.numel();
  const std::int32_t* t = targets.data();
  TargetScan scan;
  for (index_t i = 0; i < rows; ++i) {
    if (t[i] == ignore_index) continue;
    if (detail::cross_entropy_bad_target(t[i], classes, ignore_index)) {
      scan.bad = {i, static_cast<double>(t[i])};
      return scan;
    }
    ++scan.count;
  }
  return scan;
}

// log_probs (prepared by ops/cross_entropy.hpp) = log_softmax(logits); returns the mean negative
// log-likelihood over the `count` rows not ignored (targets checked), or the first row of logits
// without a finite maximum.
template <class T>
CrossEntropyValue<T> cross_entropy_forward(cpu, const Tensor<T, cpu>& logits,
                                           const Tensor<std::int32_t, cpu>& targets,
                                           Tensor<T, cpu>& log_probs, index_t count,
                                           std::int32_t ignore_index) {
  const BadRow bad = detail::softmax_rows(true, logits, log_probs);
  if (bad.found()) return {T(0), bad};
  if (count == 0) return {};
  const index_t rows = logits.rows(), classes = logits.cols();
  const std::int32_t* t = targets.data();
  const T* lp = log_probs.data();
  double nll = 0;
  for (index_t i = 0; i < rows; ++i)
    if (t[i] != ignore_index) nll -= static_cast<double>(lp[i * classes + t[i]]);
  return {static_cast<T>(nll / static_cast<double>(count)), {}};
}

// dlogits (prepared by ops/cross_entropy.hpp) = dloss / count * (exp(log_probs) - onehot), zero
// rows where the target is ignore_index (all zero when count = 0).
template <class T>
void cross_entropy_backward(cpu, const Tensor<T, cpu>& log_probs,
                            const Tensor<std::int32_t, cpu>& targets, T dloss, index_t count,
                            Tensor<T, cpu>& dlogits, std::int32_t ignore_index) {
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
        if (t[i] >= 0 && t[i] < classes) dr[t[i]] -= scale;  // checked, unless count was given
      },
      detail::softmax_row_grain(classes));
}

}  // namespace graphmoe
