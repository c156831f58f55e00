// The classification accuracy of train_vision and finetune_classifier, with --dp: rank r
// classifies examples [r n / N, (r + 1) n / N) of the n, in eval mode (a bias-balancing router
// counts no loads), and the counts are summed over the ranks (a collective: every rank calls it).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <vector>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/mode.hpp"
#include "graphmoe/core/tensor.hpp"
#include "common/data_parallel.hpp"
#include "common/device.hpp"

namespace examples {

// The share of n examples whose largest logit is their label. forward(order, s, b, y) runs the
// model on examples order[s], ..., order[s + b - 1] and writes their labels into y (host); the
// model's logits() then holds their (b, classes) logits.
template <class Model, class Forward>
double sharded_accuracy(Model& m, graphmoe::index_t n, graphmoe::index_t batch,
                        const DataParallel& dp, Forward&& forward) {
  using graphmoe::index_t;
  std::vector<index_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), index_t{0});
  const index_t begin = n * dp.rank() / dp.size(), end = n * (dp.rank() + 1) / dp.size();
  index_t correct = 0;
  graphmoe::ModeScope<Model> eval(m, graphmoe::Mode::Eval);
  for (index_t s = begin; s < end; s += batch) {
    const index_t b = std::min(batch, end - s);
    graphmoe::Tensor<std::int32_t, graphmoe::cpu> y;
    forward(order, s, b, y);
    const auto logits = host_values(m.logits());
    const auto L = graphmoe::as_matrix(logits);
    for (index_t i = 0; i < b; ++i) {
      Eigen::Index arg;
      L.row(i).maxCoeff(&arg);
      correct += arg == y.data()[i];
    }
  }
  if (dp.active()) {
    std::array<double, 1> total{static_cast<double>(correct)};  // exact: integers below 2^53
    dp.comm->all_reduce_sum(total);
    return total[0] / static_cast<double>(n);
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace examples
