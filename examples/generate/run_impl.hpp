// generate: the definition of run<Policy> (included by the generated per-router units).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "common/device.hpp"
#include "generate/run.hpp"
#include "graphmoe/train/training_state.hpp"

namespace generate_cli {

template <class Policy, class B>
int run(const Input& in) {
  using namespace graphmoe;
  examples::require_device<B>("generate");
  TransformerLM<Policy, float, B> lm(in.config, 0);
  if constexpr (std::is_same_v<B, cpu>) {
    load_arena(*in.file, lm.arena(), "model.");  // strict: every parameter, no stray tensor
  } else {  // read into a host arena of the same layout, then one copy to the device
    ParameterArena<float, cpu> host = detail::host_mirror(lm.arena());
    load_arena(*in.file, host, "model.");
    copy_from_host(lm.arena().values(), host.values());
    lm.arena().mark_values_written();
  }
  lm.set_step(in.step);  // the router as trained up to its checkpoint (SMoE-Dropout's k)
  std::fprintf(stderr, "generate: %s model (step %lld), %lld prompt tokens, up to %lld new tokens\n",
               in.router.c_str(), static_cast<long long>(in.step),
               static_cast<long long>(in.prompt.size()),
               static_cast<long long>(in.options.max_new_tokens));
  std::vector<std::int32_t> context = in.prompt;  // for the --explain lines' sources
  const auto start = std::chrono::steady_clock::now();
  const bool explain = in.options.explain;
  GenerateOptions options = in.options;
  StopStrings stops(in.stop);
  // the text of each token, cut at the end of a stop text: matched on what would be printed
  if (!stops.empty()) options.stop_when = [&](index_t, std::int32_t) { return stops.stopped(); };
  const GenerateResult r = generate(
      lm, in.prompt, options,
      [&](std::int32_t id) {
        context.push_back(id);
        std::string s = in.text(id);
        s.resize(stops.feed(s));
        if (explain) return;  // the routing line shows it
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);  // streamed: each token as soon as it is drawn
      },
      [&](const RoutedToken& t) {
        // position, token, then per MoE block: experts:gates and the graph's largest sources
        std::string line = "[" + std::to_string(t.position) + "] " + in.label(t.id);
        char buf[64];
        for (const auto& l : t.layers) {
          line += " | block " + std::to_string(l.block) + ": experts";
          for (std::size_t j = 0; j < l.experts.size(); ++j) {
            std::snprintf(buf, sizeof buf, " %d (%.2f)", l.experts[j], l.gates[j]);
            line += buf;
          }
          if (!l.sources.empty()) {
            line += "; from";
            for (const auto& src : l.sources) {
              std::snprintf(buf, sizeof buf, " %.2f ", src.weight);
              line += " [" + std::to_string(src.position) + "] " +
                      in.label(context[static_cast<std::size_t>(src.position)]) + buf;
              line.pop_back();
            }
          }
        }
        line += "\n";
        std::fwrite(line.data(), 1, line.size(), stdout);
        std::fflush(stdout);
      });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!explain) std::fputc('\n', stdout);
  std::fflush(stdout);
  const double n = static_cast<double>(r.tokens.size());
  std::fprintf(stderr, "generate: %zu tokens in %.3f s (%.1f tokens/s, %s), %s\n",
               r.tokens.size(), seconds, seconds > 0 ? n / seconds : 0.0,
               in.options.decoding == Decoding::Incremental ? "incremental: KV and routing caches"
                                                            : "a full forward per token",
               r.reason == StopReason::MaxNewTokens
                   ? "reached --max-new-tokens"
                   : ("stopped at --stop '" + stops.matched() + "'").c_str());
  return 0;
}

}  // namespace generate_cli
