// graphmoe/core/mode.hpp: training or evaluation, as a model passes it down to every part.
//
// `model.set_mode(Mode::Eval)` reaches every block, MoE layer and router, and every router policy
// that declares `void set_mode(graphmoe::Mode)` (optional: routing/concepts.hpp): a noisy scorer
// stops drawing noise, a stochastic selector becomes deterministic. Models start in Mode::Train.
// graphmoe's own layers hold no mode-dependent behaviour (no dropout in the blocks), so the mode
// changes nothing but what user policies do with it.
#pragma once

namespace graphmoe {

enum class Mode { Train, Eval };

inline const char* mode_name(Mode m) { return m == Mode::Train ? "train" : "eval"; }

}  // namespace graphmoe
