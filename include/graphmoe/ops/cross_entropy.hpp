// graphmoe/ops/cross_entropy.hpp: softmax cross-entropy over class logits.
//
//   log_probs = log_softmax(logits)                                     (N, C)
//   loss      = -(1 / n) * sum_{i : t_i != ignore} log_probs[i, t_i],   n = #{i : t_i != ignore}
//   dlogits   = dloss / n * (softmax(logits) - onehot(t))  on rows with t_i != ignore, 0 elsewhere
//
// logits may have any rank >= 1: all dimensions but the last are rows (e.g. (B, T, V) for a
// language model) and targets has the logits' shape without the last dimension ((B, T)). The mean
// is taken over the rows whose target is not ignore_index; the loss is 0 (and dlogits all zero)
// when every row is ignored. A target outside [0, C) that is not ignore_index throws, naming the
// first such row and its value. The log-softmax is max-subtracted, so the loss is exact for logits
// of any finite magnitude; a row of logits without a finite maximum throws the softmax's message
// (with "logits" named).
//
// log_probs (the cache for backward) follows prepare_output under the log-softmax's name "y";
// dlogits is assigned and may alias log_probs.
//
// The forward can report n (count), and the backward can take it instead of scanning the targets
// again (the forward checked them): a model keeps it between the two, which on a GPU saves the
// backward's read back to the host.
//
// Op layer: the arguments are checked and the outputs prepared here, once for every backend; the
// backend's cross_entropy_scan_targets(B{}, ...) returns the number of rows not ignored and the
// first bad target (core/cross_entropy.hpp), which throws here; then cross_entropy_forward(B{},
// ...) / cross_entropy_backward(B{}, ...) run the backend's system (a backend with
// cross_entropy_forward_scanned(B{}, ...) scans and runs the forward in one call) (backend/cpu/cross_entropy.hpp,
// backend/cuda/cross_entropy.cuh, or a user backend's overloads found by argument-dependent
// lookup).
#pragma once

#include <cstdint>

#include "graphmoe/backend/cpu/cross_entropy.hpp"
#include "graphmoe/core/backend.hpp"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/core/cross_entropy.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/ops/softmax.hpp"

namespace graphmoe {

namespace detail {

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

inline void cross_entropy_check_scan(const char* op, const TargetScan& scan, index_t classes,
                                     std::int32_t ignore_index) {
  GRAPHMOE_CHECK(!scan.bad.found(), op, "target of row ", scan.bad.index, " is ",
                 static_cast<std::int32_t>(scan.bad.value), ", outside the class range [0, ",
                 classes, ") and not ignore_index (", ignore_index, ")");
}

// Checks the shapes of `logits` (named `what`) and targets, then the targets (by the backend's
// scan); returns the number of rows not ignored.
template <class T, class B>
index_t cross_entropy_count_targets(const char* op, const char* what, const Tensor<T, B>& logits,
                                    const Tensor<std::int32_t, B>& targets,
                                    std::int32_t ignore_index) {
  cross_entropy_check_shapes(op, what, logits, targets);
  const index_t classes = logits.cols();
  const TargetScan scan = cross_entropy_scan_targets(B{}, targets, classes, ignore_index);
  cross_entropy_check_scan(op, scan, classes, ignore_index);
  return scan.count;
}

}  // namespace detail

// Fills log_probs (the logits' shape; the cache for backward) with log_softmax(logits) and
// returns the mean negative log-likelihood of the targets over the rows not ignored; *count (if
// given) = the number of those rows.
template <class T, Backend B>
T cross_entropy_forward(const Tensor<T, B>& logits, const Tensor<std::int32_t, B>& targets,
                        Tensor<T, B>& log_probs, std::int32_t ignore_index = -100,
                        index_t* count = nullptr) {
  constexpr const char* op = "cross_entropy_forward";
  if constexpr (requires {
                  cross_entropy_forward_scanned(B{}, logits, targets, log_probs, ignore_index);
                }) {
    detail::cross_entropy_check_shapes(op, "logits", logits, targets);
    prepare_output(op, "y", log_probs, logits.shape());
    const CrossEntropyScanned<T> r =
        cross_entropy_forward_scanned(B{}, logits, targets, log_probs, ignore_index);
    detail::cross_entropy_check_scan(op, r.scan, logits.cols(), ignore_index);
    if (r.value.bad.found()) detail::throw_softmax_bad_row(op, "logits", logits.shape(), r.value.bad);
    if (count != nullptr) *count = r.scan.count;
    return r.value.loss;
  } else {
    const index_t n =
        detail::cross_entropy_count_targets(op, "logits", logits, targets, ignore_index);
    prepare_output(op, "y", log_probs, logits.shape());  // the log-softmax's name for it
    const CrossEntropyValue<T> v =
        cross_entropy_forward(B{}, logits, targets, log_probs, n, ignore_index);
    if (v.bad.found()) detail::throw_softmax_bad_row(op, "logits", logits.shape(), v.bad);
    if (count != nullptr) *count = n;
    return v.loss;
  }
}

// cross_entropy_forward, with its outcome in `result` (core/cross_entropy.hpp) instead of the
// return value: inside with_deferred_checks on a backend with cross_entropy_forward_deferred (CUDA)
// nothing is read back (the target and logits checks are deferrable, loss and count deferred
// values: a language model's forward then reads nothing before the scope ends, and a CUDA graph can
// hold it); elsewhere the same as cross_entropy_forward. The errors are cross_entropy_forward's.
template <class T, Backend B>
void cross_entropy_forward_into(const Tensor<T, B>& logits, const Tensor<std::int32_t, B>& targets,
                                Tensor<T, B>& log_probs, std::int32_t ignore_index,
                                CrossEntropyResult<B>& result) {
  constexpr const char* op = "cross_entropy_forward";
  result.loss = 0;
  result.count = -1;
  result.device = Tensor<unsigned long long, B>();
  if constexpr (requires {
                  cross_entropy_forward_deferred(B{}, logits, targets, log_probs, ignore_index,
                                                 result);
                }) {
    detail::cross_entropy_check_shapes(op, "logits", logits, targets);
    prepare_output(op, "y", log_probs, logits.shape());
    const CrossEntropyChecks c =
        cross_entropy_forward_deferred(B{}, logits, targets, log_probs, ignore_index, result);
    // in program order: the targets first, as cross_entropy_forward checks them
    report_check(c.target, [classes = logits.cols(), ignore_index](const Offender& bad) {
      detail::cross_entropy_check_scan("cross_entropy_forward", TargetScan{0, bad}, classes,
                                       ignore_index);
    });
    report_check(c.row, [shape = logits.shape()](const BadRow& bad) {
      detail::throw_softmax_bad_row("cross_entropy_forward", "logits", shape, bad);
    });
  } else {
    index_t count = -1;
    result.loss = static_cast<double>(
        cross_entropy_forward(logits, targets, log_probs, ignore_index, &count));
    result.count = static_cast<double>(count);
  }
}

// dlogits = dloss / n * (exp(log_probs) - onehot(targets)), zero rows where the target is
// ignore_index. dlogits is assigned (it may alias log_probs). count >= 0: n as the forward of
// these targets reported it (the targets are then not scanned again); -1: scanned here.
template <class T, Backend B>
void cross_entropy_backward(const Tensor<T, B>& log_probs, const Tensor<std::int32_t, B>& targets,
                            T dloss, Tensor<T, B>& dlogits, std::int32_t ignore_index = -100,
                            index_t count = -1) {
  constexpr const char* op = "cross_entropy_backward";
  if (count < 0) {
    count = detail::cross_entropy_count_targets(op, "log_probs", log_probs, targets, ignore_index);
  } else {
    detail::cross_entropy_check_shapes(op, "log_probs", log_probs, targets);
    GRAPHMOE_CHECK(count <= targets.numel(), op, "count = ", count, " exceeds the ",
                   targets.numel(), " rows of targets");
  }
  prepare_output(op, "dlogits", dlogits, log_probs.shape());
  cross_entropy_backward(B{}, log_probs, targets, dloss, count, dlogits, ignore_index);
}

// The backward of cross_entropy_forward_into: n from `forward` (on the device when the backend
// kept it there: nothing read back; else its count, or a scan when the forward did not finish).
template <class T, Backend B>
void cross_entropy_backward(const Tensor<T, B>& log_probs, const Tensor<std::int32_t, B>& targets,
                            T dloss, Tensor<T, B>& dlogits, std::int32_t ignore_index,
                            const CrossEntropyResult<B>& forward) {
  constexpr const char* op = "cross_entropy_backward";
  if constexpr (requires {
                  cross_entropy_backward_counted(B{}, log_probs, targets, dloss,
                                                 forward.device.data(), dlogits, ignore_index);
                }) {
    if (!forward.device.empty()) {
      detail::cross_entropy_check_shapes(op, "log_probs", log_probs, targets);
      prepare_output(op, "dlogits", dlogits, log_probs.shape());
      cross_entropy_backward_counted(B{}, log_probs, targets, dloss, forward.device.data(),
                                     dlogits, ignore_index);
      return;
    }
  }
  cross_entropy_backward(log_probs, targets, dloss, dlogits, ignore_index,
                         forward.count < 0 ? index_t(-1) : static_cast<index_t>(forward.count));
}

}  // namespace graphmoe
