// graphmoe/train/schedule.hpp: linear warmup then cosine decay of the learning rate.
//
// For step t (0-based: the learning rate of the (t+1)-th update), W = warmup_steps,
// S = total_steps:
//
//   t < W:        lr(t) = base_lr * (t + 1) / W                 (base_lr / W at t = 0, base_lr at
//                                                                 t = W - 1: no update at lr 0)
//   W <= t < S:   lr(t) = min_lr + (base_lr - min_lr) * (1 + cos(pi * (t - W) / (S - W))) / 2
//                                                               (base_lr at t = W, tending to
//                                                                 min_lr as t -> S)
//   t >= S:       lr(t) = min_lr
//
// warmup_steps = 0 gives a pure cosine decay; warmup_steps = total_steps a pure warmup that drops
// to min_lr at total_steps. Usage: LRSchedule{.base_lr = 3e-4, .warmup_steps = 100,
// .total_steps = 5000}.at(step).
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

#include "graphmoe/config.hpp"

namespace graphmoe {

struct LRSchedule {
  double base_lr = 0;
  double min_lr = 0;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;

  // Throws unless 0 <= min_lr <= base_lr (both finite), 0 <= warmup_steps <= total_steps and
  // total_steps >= 1.
  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(base_lr) && base_lr >= 0, "LRSchedule",
                   "base_lr must be finite and >= 0, got ", base_lr);
    GRAPHMOE_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= base_lr, "LRSchedule",
                   "min_lr must be in [0, base_lr = ", base_lr, "], got ", min_lr);
    GRAPHMOE_CHECK(total_steps >= 1, "LRSchedule", "total_steps must be >= 1, got ", total_steps);
    GRAPHMOE_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps, "LRSchedule",
                   "warmup_steps must be in [0, total_steps = ", total_steps, "], got ",
                   warmup_steps);
  }

  // The learning rate of step t >= 0 (validates the schedule first).
  double at(std::int64_t t) const {
    validate();
    GRAPHMOE_CHECK(t >= 0, "LRSchedule::at", "step must be >= 0, got ", t);
    if (t < warmup_steps)
      return base_lr * static_cast<double>(t + 1) / static_cast<double>(warmup_steps);
    if (t >= total_steps) return min_lr;
    const double progress =
        static_cast<double>(t - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace graphmoe
