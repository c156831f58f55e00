// graphmoe/routing/registry.hpp: run-time names for the compiled router policies, so that a
// command line (--router similarity) picks a compile-time Router<...>.
//
//   with_router("similarity", [&]<class Policy>() { return train<Policy>(...); });
#pragma once

#include <string>
#include <vector>

#include "graphmoe/routing/router.hpp"

namespace graphmoe {

inline const std::vector<std::string>& router_names() {
  static const std::vector<std::string> names = {
      "softmax",      "similarity",   "attention",   "xmoe",
      "xmoe-similarity", "xmoe-attention", "smoe-dropout", "smoe-dropout-similarity",
      "smoe-dropout-attention", "sigmoid-bias", "sigmoid-bias-similarity",
      "sigmoid-bias-attention", "blended-similarity", "blended-attention"};
  return names;
}

// Calls fn.template operator()<Policy>() for the router named `name`; throws graphmoe::Error
// listing the valid names otherwise.
template <class Fn>
decltype(auto) with_router(const std::string& name, Fn&& fn) {
  if (name == "softmax") return fn.template operator()<SoftmaxRouter>();
  if (name == "similarity") return fn.template operator()<SimilarityRouter>();
  if (name == "attention") return fn.template operator()<AttentionRouter>();
  if (name == "xmoe") return fn.template operator()<XMoERouter>();
  if (name == "xmoe-similarity") return fn.template operator()<SimilarityXMoERouter>();
  if (name == "xmoe-attention") return fn.template operator()<AttentionXMoERouter>();
  if (name == "smoe-dropout") return fn.template operator()<SMoEDropoutRouter>();
  if (name == "smoe-dropout-similarity") return fn.template operator()<SimilaritySMoEDropoutRouter>();
  if (name == "smoe-dropout-attention") return fn.template operator()<AttentionSMoEDropoutRouter>();
  if (name == "sigmoid-bias") return fn.template operator()<SigmoidBiasRouter>();
  if (name == "sigmoid-bias-similarity") return fn.template operator()<SimilaritySigmoidBiasRouter>();
  if (name == "sigmoid-bias-attention") return fn.template operator()<AttentionSigmoidBiasRouter>();
  if (name == "blended-similarity") return fn.template operator()<BlendedSimilarityRouter>();
  if (name == "blended-attention") return fn.template operator()<BlendedAttentionRouter>();
  std::string valid;
  for (const auto& n : router_names()) valid += (valid.empty() ? "" : ", ") + n;
  detail::throw_error("with_router", "unknown router '", name, "'; valid: ", valid);
}

}  // namespace graphmoe
