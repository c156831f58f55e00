// The examples' divergence options (graphmoe/train/divergence.hpp; docs/reliability.md,
// "Divergence"), the same three in train_lm, train_vision and finetune_classifier:
//
//   --divergence-factor F   stop when the smoothed training loss exceeds F x its lowest value
//                           (and that value + 1 nat); default 3, 0 = off
//   --max-grad-norm G       stop when the gradient norm before clipping exceeds G; default 1e6,
//                           0 = no limit
//   --max-loss L            stop when a training or evaluation loss exceeds L; default 0 = the
//                           larger of 3 ln(C) and ln(C) + 5, for C classes (the vocabulary for a
//                           language model; ln(C) is the loss of guessing uniformly)
// Non-finite losses, gradient norms and evaluation results always stop the run. The options
// themselves: add_divergence_options in common/cli_checks.hpp (main.cpp only, for compile time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "graphmoe/train/divergence.hpp"

namespace examples {

struct DivergenceOptions {
  double factor = 3.0;
  double max_grad_norm = 1e6;
  double max_loss = 0.0;  // 0: max(3 ln C, ln C + 5)
};

// The guard's settings for a model over `classes` classes (tokens for a language model).
inline graphmoe::DivergenceConfig divergence_config(const DivergenceOptions& o, double classes) {
  graphmoe::DivergenceConfig c;
  c.loss_factor = o.factor;
  c.max_grad_norm = o.max_grad_norm;
  const double uniform = std::log(std::max(2.0, classes));
  c.loss_ceiling = o.max_loss > 0 ? o.max_loss : std::max(3.0 * uniform, uniform + 5.0);
  return c;
}

// clip_checked with the clipping function given (e.g. the global norm over ranks,
// common/data_parallel.hpp).
template <class Arena, class Clip>
double clip_checked(graphmoe::DivergenceGuard& guard, std::int64_t step, Arena& arena, double clip,
                    Clip&& clip_fn) {
  double norm = 0;
  try {
    norm = clip_fn(arena, clip);
  } catch (const graphmoe::Error&) {
    norm = std::numeric_limits<double>::quiet_NaN();
  }
  guard.check_grad_norm(step, norm);
  return norm;
}

// clip_grad_norm(arena, clip) with its norm checked by the guard before the optimizer step.
// clip_grad_norm refuses a NaN or Inf norm with an Error before it changes anything; here (an
// allocated arena, a checked clip) that is the only Error it raises, so it becomes the guard's
// DivergenceError naming the step.
template <class Arena>
double clip_checked(graphmoe::DivergenceGuard& guard, std::int64_t step, Arena& arena, double clip) {
  return clip_checked(guard, step, arena, clip,
                      [](Arena& a, double c) { return clip_grad_norm(a, c); });  // the backend's
}

// Runs the part of training step `step` before the optimizer step (forward, the guard's checks,
// backward, clipping). A graphmoe::Error from it that is not the guard's (e.g. a layer refusing
// NaN activations, which weights of 1e30 produce) is rethrown naming the program and the step:
// like the guard's errors, it comes before the optimizer step and before any save.
template <class Body>
void before_optimizer_step(const char* program, std::int64_t step, Body&& body) {
  try {
    body();
  } catch (const graphmoe::DivergenceError&) {
    throw;
  } catch (const graphmoe::Error& e) {
    throw graphmoe::Error(std::string(program) + ": step " + std::to_string(step) + " failed: " +
                          e.what() + ". Stopped before the optimizer step and before any save: "
                          "the last checkpoint written, if any, is kept as it was.");
  }
}

}  // namespace examples
