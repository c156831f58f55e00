// graphmoe/core/gate_scaling.hpp: how a token-choice selector turns its chosen scores into gates.
//
//   normalize (norm_topk_prob):  gates = scale * keep * v / sum_j v_j   (the k chosen scores v)
//   otherwise:                   gates = scale * keep * v
//   scale (routed_scaling_factor)
//
// The defaults (normalize, scale 1) are the paper's Renormalize(TopK^0(p)) (Appendix C.3); Hugging
// Face's `norm_topk_prob` and `routed_scaling_factor` name the two fields (Qwen2/Qwen3-MoE, OLMoE,
// DeepSeek-V3). Read by ops/gates.hpp and every backend's gate kernels.
#pragma once

namespace graphmoe {

struct GateScaling {
  bool normalize = true;  // divide by the sum of the chosen scores (dropped choices included)
  double scale = 1.0;     // multiply every gate
};

}  // namespace graphmoe
