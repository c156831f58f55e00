// generate: the definition of run<Policy> (included by the generated per-router units).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "generate/run.hpp"

namespace generate_cli {

template <class Policy>
int run(const Input& in) {
  using namespace graphmoe;
  TransformerLM<Policy, float> lm(in.config, 0);
  load_arena(*in.file, lm.arena(), "model.");  // strict: every parameter, no stray tensor
  lm.set_step(in.step);  // the router as trained up to its checkpoint (SMoE-Dropout's k)
  std::fprintf(stderr, "generate: %s model (step %lld), %lld prompt tokens, up to %lld new tokens\n",
               in.router.c_str(), static_cast<long long>(in.step),
               static_cast<long long>(in.prompt.size()),
               static_cast<long long>(in.options.max_new_tokens));
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult r = generate(lm, in.prompt, in.options, [&](std::int32_t id) {
    const std::string s = in.text(id);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);  // streamed: each token as soon as it is drawn
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double n = static_cast<double>(r.tokens.size());
  std::fprintf(stderr, "generate: %zu tokens in %.3f s (%.1f tokens/s, a full forward per token), %s\n",
               r.tokens.size(), seconds, seconds > 0 ? n / seconds : 0.0,
               r.reason == StopReason::StopToken ? "stopped at a --stop token"
                                                 : "reached --max-new-tokens");
  return 0;
}

}  // namespace generate_cli
