// graphmoe/backend/cuda/cross_entropy.cuh: softmax cross-entropy over class logits, on the GPU.
//
// The CUDA system's cross-entropy (contract and argument checks: ops/cross_entropy.hpp, which
// calls these through the backend tag), on Tensor<T, cuda>:
//
//   log_probs = log_softmax(logits)                                     (N, C)
//   loss      = -(1 / n) * sum_{i : t_i != ignore} log_probs[i, t_i],   n = #{i : t_i != ignore}
//   dlogits   = dloss / n * (softmax(logits) - onehot(t))  on rows with t_i != ignore, 0 elsewhere
//
// The targets are scanned by a kernel that flags the first row whose target is out of range and
// counts the rows not ignored. The forward (cross_entropy_forward_scanned) queues that scan, the
// log-softmax and the loss sum, and reads the four words {bad target, bad logits row, count, loss}
// back in one copy: one synchronisation per forward (the loss kernel adds nothing for a bad
// target, so it is safe to run before the scan is known). A model hands the count to the
// backward, which then reads nothing; cross_entropy_scan_targets (one copy) serves a backward
// without it. A row of logits without a finite maximum is returned (CrossEntropyValue) for the
// op layer to throw the softmax's message, as on the CPU.
//
// The log-softmax is backend/cuda/softmax.cuh's kernel (one block per row, row sums in T). The
// loss is summed in double by one block of a fixed size, in a fixed order, so it is
// deterministic; the backends agree to about 1e-6 relative for float. dlogits is written by one
// thread per entry (asynchronous) and may alias log_probs.
#pragma once

#include <cstdint>
#include <cstring>

#include "graphmoe/backend/cuda/detail/kernel.cuh"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "graphmoe/backend/cuda/detail/nn_launch.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/core/cross_entropy.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

namespace detail {

inline constexpr int kCrossEntropyLossThreads = 1024;  // the one block that sums the loss

// Flags the first row whose target is out of range; adds the number of rows not ignored (among
// the rows in range) to *count.
template <class I>
__global__ void cross_entropy_targets_kernel(const I* targets, index_t rows, index_t classes,
                                             I ignore_index, unsigned long long* bad_row,
                                             unsigned long long* count) {
  unsigned long long c = 0;
  GRAPHMOE_CUDA_GRID_STRIDE(i, rows) {
    const I t = targets[i];
    if (t == ignore_index) continue;
    if (cross_entropy_bad_target(t, classes, ignore_index))
      flag_index(bad_row, i);
    else
      ++c;
  }
  c = block_reduce(c, SumOp{}, 0ull);
  if (threadIdx.x == 0 && c != 0) atomicAdd(count, c);  // integers: the order does not matter
}

// *loss = sum_i nll(i) in double, by one block in a fixed order.
template <class T>
__global__ void cross_entropy_loss_kernel(CrossEntropyNllOp<T> nll, index_t rows, double* loss) {
  double s = 0;
  for (index_t i = threadIdx.x; i < rows; i += blockDim.x) s += nll(i);
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) *loss = s;
}

// The deferred forward's last step, one block: *loss = (T)(sum_i nll(i) / count) (0 when every row
// is ignored), *count_value = count, with count the targets kernel's word.
template <class T>
__global__ void cross_entropy_loss_mean_kernel(CrossEntropyNllOp<T> nll, index_t rows,
                                               const unsigned long long* count, double* loss,
                                               double* count_value) {
  double s = 0;
  for (index_t i = threadIdx.x; i < rows; i += blockDim.x) s += nll(i);
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) {
    const unsigned long long c = *count;
    *loss = c == 0 ? 0.0 : static_cast<double>(static_cast<T>(s / static_cast<double>(c)));
    *count_value = static_cast<double>(c);
  }
}

// CrossEntropyBackwardOp with the count read on the device: scale = dloss / count.
template <class T>
struct CrossEntropyBackwardCountedOp {
  T dloss;
  const unsigned long long* count;
  index_t classes;
  std::int32_t ignore_index;
  const T* log_probs;
  const std::int32_t* targets;
  T* dlogits;
  __device__ void operator()(index_t e) const {
    const unsigned long long c = *count;
    const T scale = c == 0 ? T(0)
                           : static_cast<T>(static_cast<double>(dloss) / static_cast<double>(c));
    CrossEntropyBackwardOp<T>{scale, c == 0, classes, ignore_index, log_probs, targets, dlogits}(e);
  }
};

}  // namespace detail

// The number of rows of targets (rows) not ignored, and the first row whose target is neither
// ignore_index nor in [0, classes). Synchronises the stream once: the flag and the count sit side
// by side and come back in one copy.
inline TargetScan cross_entropy_scan_targets(cuda, const Tensor<std::int32_t, cuda>& targets,
                                             index_t classes, std::int32_t ignore_index) {
  const index_t rows = targets.numel();
  if (rows == 0) return {};
  auto words = Tensor<unsigned long long, cuda>::uninitialized(Shape{2});  // {first bad row, count}
  unsigned long long* bad = words.data();
  unsigned long long* count = words.data() + 1;
  GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(bad, 0xFF, sizeof(unsigned long long), cuda_stream()));
  GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned long long), cuda_stream()));
  detail::launch_kernel<detail::cross_entropy_targets_kernel<std::int32_t>>(
      detail::grid_for(rows), detail::kThreads, targets.data(), rows, classes, ignore_index, bad,
      count);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  const auto got = detail::read_device_values<unsigned long long, 2>(words.data());
  if (got[0] != detail::FirstIndexFlag::kNone) {
    const auto r = static_cast<index_t>(got[0]);
    return {0, {r, static_cast<double>(detail::read_device_value(targets.data() + r))}};
  }
  return {static_cast<index_t>(got[1]), {}};
}

// The scan and the forward in one pass (core/cross_entropy.hpp): log_probs (prepared by
// ops/cross_entropy.hpp) = log_softmax(logits); one copy back to the host.
template <class T>
CrossEntropyScanned<T> cross_entropy_forward_scanned(cuda, const Tensor<T, cuda>& logits,
                                                     const Tensor<std::int32_t, cuda>& targets,
                                                     Tensor<T, cuda>& log_probs,
                                                     std::int32_t ignore_index) {
  const index_t rows = logits.rows(), classes = logits.cols();
  if (rows == 0) return {};
  // {first bad target row, first row without a finite maximum, count, the loss sum (a double's
  // bits)}: the flags start at ~0, the count at 0; the loss kernel writes its word
  static_assert(sizeof(double) == sizeof(unsigned long long));
  auto words = Tensor<unsigned long long, cuda>::uninitialized(Shape{4});
  unsigned long long* w = words.data();
  GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(w, 0xFF, 2 * sizeof(unsigned long long), cuda_stream()));
  GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(w + 2, 0, sizeof(unsigned long long), cuda_stream()));
  detail::launch_kernel<detail::cross_entropy_targets_kernel<std::int32_t>>(
      detail::grid_for(rows), detail::kThreads, targets.data(), rows, classes, ignore_index, w,
      w + 2);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::softmax_forward_kernel<T, true>>(
      detail::grid_for_rows(rows), detail::threads_for_row(classes), logits.data(),
      log_probs.data(), rows, classes, w + 1);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::cross_entropy_loss_kernel<T>>(
      1, detail::kCrossEntropyLossThreads,
      detail::CrossEntropyNllOp<T>{log_probs.data(), targets.data(), classes, ignore_index}, rows,
      reinterpret_cast<double*>(w + 3));
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  const auto got = detail::read_device_values<unsigned long long, 4>(w);
  CrossEntropyScanned<T> out;
  if (got[0] != detail::FirstIndexFlag::kNone) {
    const auto r = static_cast<index_t>(got[0]);
    out.scan.bad = {r, static_cast<double>(detail::read_device_value(targets.data() + r))};
    return out;
  }
  out.scan.count = static_cast<index_t>(got[2]);
  if (got[1] != detail::FirstIndexFlag::kNone) {
    out.value.bad = detail::softmax_bad_row(logits, static_cast<index_t>(got[1]));
    return out;
  }
  if (out.scan.count > 0) {
    double sum = 0;
    std::memcpy(&sum, &got[3], sizeof(double));
    out.value.loss = static_cast<T>(sum / static_cast<double>(out.scan.count));
  }
  return out;
}

// cross_entropy_forward_into's hook (ops/cross_entropy.hpp). Inside a deferred scope (or a CUDA
// graph capture): the target scan, the log-softmax and the loss queued, nothing read; the two
// checks are deferrable flags, loss and count deferred values, and the count stays on the device
// (result.device) for cross_entropy_backward_counted. Outside a scope: the scanned forward (one
// read), result.device left empty.
template <class T>
CrossEntropyChecks cross_entropy_forward_deferred(cuda, const Tensor<T, cuda>& logits,
                                                  const Tensor<std::int32_t, cuda>& targets,
                                                  Tensor<T, cuda>& log_probs,
                                                  std::int32_t ignore_index,
                                                  CrossEntropyResult<cuda>& result) {
  const index_t rows = logits.rows(), classes = logits.cols();
  detail::DeviceCheckBatch* batch = detail::active_device_checks();
  CrossEntropyChecks out;
  if (batch == nullptr || rows == 0) {
    const CrossEntropyScanned<T> r =
        cross_entropy_forward_scanned(cuda{}, logits, targets, log_probs, ignore_index);
    out.target = r.scan.bad;
    out.row = r.value.bad;
    if (!out.target.found() && !out.row.found()) {
      result.loss = static_cast<double>(r.value.loss);
      result.count = static_cast<double>(r.scan.count);
    }
    return out;
  }
  result.device = Tensor<unsigned long long, cuda>::uninitialized(Shape{1});
  unsigned long long* count = result.device.data();
  GRAPHMOE_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned long long), cuda_stream()));
  detail::FirstIndexFlag bad_target{detail::FirstIndexFlag::Deferrable{}};
  detail::FirstIndexFlag bad_row{detail::FirstIndexFlag::Deferrable{}};
  detail::launch_kernel<detail::cross_entropy_targets_kernel<std::int32_t>>(
      detail::grid_for(rows), detail::kThreads, targets.data(), rows, classes, ignore_index,
      bad_target.get(), count);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  detail::launch_kernel<detail::softmax_forward_kernel<T, true>>(
      detail::grid_for_rows(rows), detail::threads_for_row(classes), logits.data(),
      log_probs.data(), rows, classes, bad_row.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  // the two values: the batch's deferred slots (or, the batch full, scratch words read at once)
  detail::DeferredDouble loss(result.loss), count_value(result.count);
  detail::launch_kernel<detail::cross_entropy_loss_mean_kernel<T>>(
      1, detail::kCrossEntropyLossThreads,
      detail::CrossEntropyNllOp<T>{log_probs.data(), targets.data(), classes, ignore_index}, rows,
      count, loss.get(), count_value.get());
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  out.target = bad_target.result<Offender>(
      "cross_entropy_forward", [targets](index_t r) { return detail::offender_at(targets, r); });
  out.row = bad_row.result<BadRow>("cross_entropy_forward",
                                   [logits](index_t r) { return detail::softmax_bad_row(logits, r); });
  loss.finish();
  count_value.finish();
  return out;
}

// dlogits = dloss / count * (exp(log_probs) - onehot) with the count read on the device (the
// deferred forward's result.device): no read back.
template <class T>
void cross_entropy_backward_counted(cuda, const Tensor<T, cuda>& log_probs,
                                    const Tensor<std::int32_t, cuda>& targets, T dloss,
                                    const unsigned long long* count, Tensor<T, cuda>& dlogits,
                                    std::int32_t ignore_index) {
  detail::for_each_index(
      log_probs.numel(),
      detail::CrossEntropyBackwardCountedOp<T>{dloss, count, log_probs.cols(), ignore_index,
                                               log_probs.data(), targets.data(), dlogits.data()});
}

// dlogits (prepared by ops/cross_entropy.hpp) = dloss / count * (exp(log_probs) - onehot), zero
// rows where the target is ignore_index (all zero when count = 0).
template <class T>
void cross_entropy_backward(cuda, const Tensor<T, cuda>& log_probs,
                            const Tensor<std::int32_t, cuda>& targets, T dloss, index_t count,
                            Tensor<T, cuda>& dlogits, std::int32_t ignore_index) {
  const T scale =
      count == 0 ? T(0) : static_cast<T>(static_cast<double>(dloss) / static_cast<double>(count));
  detail::for_each_index(
      log_probs.numel(),
      detail::CrossEntropyBackwardOp<T>{scale, count == 0, log_probs.cols(), ignore_index,
                                        log_probs.data(), targets.data(), dlogits.data()});
}

}  // namespace graphmoe
