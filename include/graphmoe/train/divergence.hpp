// graphmoe/train/divergence.hpp: stop a training run that has diverged, with an error that names
// the step, before the diverged state reaches the optimizer or a checkpoint.
//
//   DivergenceGuard guard(DivergenceConfig{}, "train_lm");
//   for (step ...) {
//     loss = model.forward(...);
//     guard.check_loss(step, loss);          // non-finite, above the ceiling, or exploding
//     model.backward();
//     guard.check_grad_norm(step, clip_grad_norm(arena, clip));   // before the optimizer step
//     opt.step(arena);
//     ...
//     guard.check_eval(step, "validation loss", vloss);            // before saving
//     save(...);
//   }
//
// The policy (docs/reliability.md, "Divergence"), each test off where its setting says so:
//   - a training loss or gradient norm that is NaN or Inf: always an error;
//   - a training loss above loss_ceiling (default: none; the examples pass 3 ln(C), three times
//     the loss of guessing uniformly among C classes or tokens): an error;
//   - exploding: the loss smoothed over steps (an exponential moving average, decay ema_decay)
//     above loss_factor times the lowest smoothed loss seen so far AND above it by more than
//     loss_margin (so that a loss near 0 that doubles is not flagged); after warmup_steps checked
//     steps, so that the average has settled. loss_factor = 0 turns this test off;
//   - a gradient norm (before clipping) above max_grad_norm: an error (0 = no limit);
//   - an evaluation result (check_eval) that is NaN or Inf, or above loss_ceiling: an error.
// Each throws DivergenceError (a graphmoe::Error) naming the run, the step, the value and the
// test; nothing is changed by a check. A training loop that checks before its optimizer step and
// before each save never updates parameters from a diverged step and never overwrites its last
// checkpoint with one: that file stays what it was, from the last step that passed.
//
// The smoothed loss starts from the first checked loss of this guard: after a resume it restarts
// (the guard's state is not part of a checkpoint), which only delays the exploding test.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "graphmoe/config.hpp"

namespace graphmoe {

// A run stopped because its loss, gradient norm or evaluation diverged.
class DivergenceError : public Error {
 public:
  using Error::Error;
};

struct DivergenceConfig {
  double loss_factor = 3.0;     // exploding: smoothed loss > factor x lowest smoothed (0 = off)
  double loss_margin = 1.0;     // ... and > lowest smoothed + margin (nats)
  double ema_decay = 0.98;      // smoothing: ema = decay ema + (1 - decay) loss
  std::int64_t warmup_steps = 20;  // checked steps before the exploding test starts
  double loss_ceiling = std::numeric_limits<double>::infinity();  // any loss above it: an error
  double max_grad_norm = 0.0;   // pre-clip gradient norm limit (0 = none)

  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(loss_factor) && (loss_factor == 0 || loss_factor > 1),
                   "DivergenceConfig", "loss_factor must be 0 (off) or a finite number > 1, got ",
                   loss_factor);
    GRAPHMOE_CHECK(std::isfinite(loss_margin) && loss_margin >= 0, "DivergenceConfig",
                   "loss_margin must be finite and >= 0, got ", loss_margin);
    GRAPHMOE_CHECK(ema_decay >= 0 && ema_decay < 1, "DivergenceConfig",
                   "ema_decay must be in [0, 1), got ", ema_decay);
    GRAPHMOE_CHECK(warmup_steps >= 0, "DivergenceConfig", "warmup_steps must be >= 0, got ",
                   warmup_steps);
    GRAPHMOE_CHECK(!std::isnan(loss_ceiling) && loss_ceiling > 0, "DivergenceConfig",
                   "loss_ceiling must be > 0 (infinity: none), got ", loss_ceiling);
    GRAPHMOE_CHECK(std::isfinite(max_grad_norm) && max_grad_norm >= 0, "DivergenceConfig",
                   "max_grad_norm must be finite and >= 0 (0: no limit), got ", max_grad_norm);
  }
};

class DivergenceGuard {
 public:
  explicit DivergenceGuard(const DivergenceConfig& cfg = {}, std::string run = "training")
      : cfg_(cfg), run_(std::move(run)) {
    cfg_.validate();
  }

  const DivergenceConfig& config() const { return cfg_; }
  // The smoothed training loss and its lowest value so far (NaN before the first check).
  double smoothed_loss() const { return ema_; }
  double lowest_smoothed_loss() const { return lowest_; }
  std::int64_t checked_steps() const { return checked_; }

  // `step` is how the run numbers the step in its messages (the examples: 1-based, as in
  // metrics.csv and the checkpoints' "step").

  // The training loss of `step`, before backward and the optimizer step.
  void check_loss(std::int64_t step, double loss) {
    if (!std::isfinite(loss))
      fail(step, "the training loss is " + text(loss));
    if (loss > cfg_.loss_ceiling)
      fail(step, "the training loss " + text(loss) + " is above the ceiling " +
                     text(cfg_.loss_ceiling));
    const double ema = checked_ == 0 ? loss : cfg_.ema_decay * ema_ + (1 - cfg_.ema_decay) * loss;
    const double lowest = checked_ == 0 ? ema : std::min(lowest_, ema);
    if (cfg_.loss_factor > 0 && checked_ >= cfg_.warmup_steps &&
        ema > cfg_.loss_factor * lowest && ema > lowest + cfg_.loss_margin)
      fail(step, "the smoothed training loss " + text(ema) + " (this step's: " + text(loss) +
                     ") is more than " + text(cfg_.loss_factor) + " times its lowest value " +
                     text(lowest) + " (the loss is exploding)");
    ema_ = ema;
    lowest_ = lowest;
    ++checked_;
  }

  // The gradient norm of `step` before clipping (clip_grad_norm's result), before the optimizer
  // step.
  void check_grad_norm(std::int64_t step, double norm) const {
    if (!std::isfinite(norm))
      fail(step, "the gradient norm is " + text(norm));
    if (cfg_.max_grad_norm > 0 && norm > cfg_.max_grad_norm)
      fail(step, "the gradient norm " + text(norm) + " (before clipping) is above the limit " +
                     text(cfg_.max_grad_norm));
  }

  // An evaluation result after `step` steps (a mean loss: non-finite or above the ceiling is an
  // error), before anything is saved.
  void check_eval(std::int64_t step, const std::string& what, double value) const {
    if (!std::isfinite(value)) fail(step, "the " + what + " is " + text(value));
    if (value > cfg_.loss_ceiling)
      fail(step, "the " + what + " " + text(value) + " is above the ceiling " +
                     text(cfg_.loss_ceiling));
  }

 private:
  static std::string text(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    std::ostringstream os;
    os.precision(6);
    os << v;
    return os.str();
  }
  [[noreturn]] void fail(std::int64_t step, const std::string& what) const {
    throw DivergenceError(run_ + ": training diverged at step " + std::to_string(step) + ": " +
                          what + ". Stopped before the optimizer step and before any save: the "
                          "last checkpoint written, if any, is kept as it was. Lower the learning "
                          "rate, or check the data and the initial weights.");
  }

  DivergenceConfig cfg_;
  std::string run_;
  double ema_ = std::nan("");
  double lowest_ = std::nan("");
  std::int64_t checked_ = 0;
};

}  // namespace graphmoe
