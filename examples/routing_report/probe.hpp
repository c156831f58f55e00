// routing_report: the probe of one train_lm checkpoint (one function template, instantiated per
// router in its own translation unit, examples/CMakeLists.txt, from probe_impl.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/routing_report.hpp"

namespace routing_report {

struct ProbeInput {
  const graphmoe::SafetensorsFile* file = nullptr;  // a train_lm checkpoint ("model.<name>")
  graphmoe::TransformerLMConfig config;             // from its metadata
  std::int64_t step = 0;                            // its training step (SMoE-Dropout's k)
  std::vector<graphmoe::LMBatch> batches;           // the probe set
};

// Loads the model of `in.file` with router Policy (float, CPU), runs every probe batch and records
// every MoE layer's routing. Defined in probe_impl.hpp.
template <class Policy>
graphmoe::RoutingProbe probe(const ProbeInput& in);

}  // namespace routing_report
