// routing_report: the definition of probe<Policy> (included by the generated per-router units).
#pragma once

#include "routing_report/probe.hpp"

namespace routing_report {

// Loads the model of `in.file` with router Policy (float, CPU), runs every probe batch and records
// every MoE layer's routing.
template <class Policy>
graphmoe::RoutingProbe probe(const ProbeInput& in) {
  using namespace graphmoe;
  TransformerLM<Policy, float> lm(in.config, 0);
  load_arena(*in.file, lm.arena(), "model.");
  lm.set_step(in.step);
  RoutingProbe out;
  for (const LMBatch& b : in.batches) {
    lm.forward(b.inputs, b.targets);
    index_t slot = 0;
    for (index_t l = 0; l < in.config.num_layers; ++l) {
      auto& block = lm.block(l);
      if (!block.is_moe()) continue;
      const auto& r = block.moe().routing();
      out.record(slot++, l, r.r, r.p, r.selection.indices, block.moe().router().graph_entropy(),
                 block.moe().router().graph().mean_self_weight());
    }
  }
  return out;
}

}  // namespace routing_report
