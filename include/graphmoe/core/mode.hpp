// graphmoe/core/mode.hpp: training or evaluation, as a model passes it down to every part.
//
// `model.set_mode(Mode::Eval)` reaches every block, MoE layer and router, and every router policy
// that declares `void set_mode(graphmoe::Mode)` (optional: routing/concepts.hpp): a noisy scorer
// stops drawing noise, a stochastic selector becomes deterministic. Models start in Mode::Train.
// graphmoe's own layers hold no mode-dependent behaviour (no dropout in the blocks), so the mode
// changes nothing but what user policies do with it, and whether a router with an after_step
// policy (bias balancing) counts its expert loads: evaluation forwards run in Mode::Eval so that
// they do not count towards the next optimizer step's loads.
//
// `ModeScope scope(model, Mode::Eval);` sets a model's mode for a scope and restores the previous
// one on leaving it (generate(), the example programs' evaluations).
#pragma once

namespace graphmoe {

enum class Mode { Train, Eval };

inline const char* mode_name(Mode m) { return m == Mode::Train ? "train" : "eval"; }

template <class Model>
class ModeScope {
 public:
  ModeScope(Model& m, Mode mode) : m_(m), saved_(m.mode()) { m_.set_mode(mode); }
  ~ModeScope() { m_.set_mode(saved_); }
  ModeScope(const ModeScope&) = delete;
  ModeScope& operator=(const ModeScope&) = delete;

 private:
  Model& m_;
  Mode saved_;
};

}  // namespace graphmoe
