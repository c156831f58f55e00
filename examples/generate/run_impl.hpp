// generate: the definition of run<Policy> (included by the generated per-router units).
#pragma once

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/device.hpp"
#include "generate/run.hpp"
#include "graphmoe/train/training_state.hpp"
#if !defined(__CUDACC__)
#include "graphmoe/hf/reader.hpp"  // --hf: the CPU SoftmaxRouter unit loads it (main.cpp refuses cuda)
#endif

namespace generate_cli {

namespace detail {
// One output line of a batch: line breaks as \n, backslashes as \\.
inline std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\\') out += "\\\\";
    else out += c;
  }
  return out;
}
}  // namespace detail

template <class Policy, class B>
int run(const Input& in) {
  using namespace graphmoe;
  using Clock = std::chrono::steady_clock;
  examples::require_device<B>("generate");
  using LM = TransformerLM<Policy, float, B>;
  std::unique_ptr<LM> owned;
  if (in.hf != nullptr) {
#if !defined(__CUDACC__)
    if constexpr (std::is_same_v<B, cpu> && (std::is_same_v<Policy, SoftmaxRouter> ||
                                             std::is_same_v<Policy, SigmoidBiasRouter>)) {
      owned = std::make_unique<LM>(in.config, typename LM::NoInit{});
      in.hf->load(*owned);  // every tensor checked (finite, shapes) before any is written
    }
#endif
    GRAPHMOE_CHECK(owned != nullptr, "generate", "--hf runs the family's own router "
                   "(SoftmaxRouter; DeepSeek-V3: SigmoidBiasRouter) on the CPU only");
  } else {
    owned = std::make_unique<LM>(in.config, 0);
    LM& m = *owned;
    if constexpr (std::is_same_v<B, cpu>) {
      load_arena(*in.file, m.arena(), "model.");  // strict: every parameter, no stray tensor
    } else {  // read into a host arena of the same layout, then one copy to the device
      ParameterArena<float, cpu> host = graphmoe::detail::host_mirror(m.arena());
      load_arena(*in.file, host, "model.");
      copy_from_host(m.arena().values(), host.values());
      m.arena().mark_values_written();
    }
  }
  LM& lm = *owned;
  lm.set_step(in.step);  // the router as trained up to its checkpoint (SMoE-Dropout's k)
  const std::size_t nseq = in.prompts.size();
  std::size_t prompt_tokens = 0;
  for (const auto& p : in.prompts) prompt_tokens += p.size();
  const std::string model = !in.model_name.empty()
                                ? in.model_name
                                : in.router + " model (step " + std::to_string(in.step) + ")";
  std::fprintf(stderr, "generate: %s, %zu prompt tokens%s, up to %lld new tokens%s\n",
               model.c_str(), prompt_tokens,
               nseq > 1 ? (" in " + std::to_string(nseq) + " outputs").c_str() : "",
               static_cast<long long>(in.options.max_new_tokens), nseq > 1 ? " each" : "");
  const bool explain = in.options.explain;
  if (explain)
    std::fprintf(stderr, "generate: explain: %s[position] \"token\" | block b: experts e (gate) ...; "
                 "alone e ... (graph routers: the experts its own scores would choose); from "
                 "[position] \"token\" weight ... (its largest weights in the token graph)\n",
                 in.batch ? "output: " : "");
  std::vector<std::vector<std::int32_t>> context = in.prompts;  // the --explain lines' sources
  std::vector<Printer> print;
  std::vector<StopStrings> stops;
  std::vector<std::string> texts(nseq);  // a batch's outputs
  for (const auto& p : in.prompts) {
    print.push_back(in.printer(p));
    stops.emplace_back(in.stop);
  }
  GenerateOptions options = in.options;
  // the text of each token, cut at the end of a stop text: matched on what would be printed
  if (!in.stop.empty())
    options.stop_when = [&](index_t b, std::int32_t) { return stops[static_cast<std::size_t>(b)].stopped(); };
  std::size_t generated = 0;
  std::optional<Clock::time_point> first, last;
  const auto start = Clock::now();
  const std::vector<GenerateResult> results = generate_batch(
      lm, in.prompts, options,
      [&](index_t b, std::int32_t id) {
        last = Clock::now();
        if (!first) first = last;
        ++generated;
        const auto ub = static_cast<std::size_t>(b);
        context[ub].push_back(id);
        std::string s = print[ub].step(id);
        s.resize(stops[ub].feed(s));
        if (explain) return;  // the routing line shows it
        if (in.batch) {
          texts[ub] += s;
          return;
        }
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);  // streamed: each token as soon as it is drawn
      },
      [&](const RoutedToken& t) {
        // position, token, then per MoE block: experts:gates, the token's own choice and the
        // graph's largest sources
        std::string line = in.batch ? std::to_string(t.sequence) + ": " : "";
        line += "[" + std::to_string(t.position) + "] " +
                in.label(context[static_cast<std::size_t>(t.sequence)][static_cast<std::size_t>(t.position)]);
        char buf[64];
        for (const auto& l : t.layers) {
          line += " | block " + std::to_string(l.block) + ": experts";
          for (std::size_t j = 0; j < l.experts.size(); ++j) {
            std::snprintf(buf, sizeof buf, " %d (%.2f)", l.experts[j], l.gates[j]);
            line += buf;
          }
          if (!l.own_experts.empty()) {
            line += "; alone";
            for (std::int32_t e : l.own_experts) line.append(" ").append(std::to_string(e));
          }
          if (!l.sources.empty()) {
            line += "; from";
            const auto& ctx = context[static_cast<std::size_t>(t.sequence)];
            for (const auto& src : l.sources) {
              std::snprintf(buf, sizeof buf, " %.2f ", src.weight);
              line += " [" + std::to_string(src.position) + "] " +
                      in.label(ctx[static_cast<std::size_t>(src.position)]) + buf;
              line.pop_back();
            }
          }
        }
        line += "\n";
        std::fwrite(line.data(), 1, line.size(), stdout);
        std::fflush(stdout);
      });
  const auto end = Clock::now();
  // what the printers held back (bytes that never completed a character), through the stop texts
  for (std::size_t b = 0; b < nseq; ++b) {
    if (!print[b].finish) continue;
    std::string s = print[b].finish();
    s.resize(stops[b].feed(s));
    if (explain || s.empty()) continue;
    if (in.batch) texts[b] += s;
    else std::fwrite(s.data(), 1, s.size(), stdout);
  }
  if (in.batch && !explain)
    for (const std::string& t : texts) {
      const std::string l = detail::one_line(t) + "\n";
      std::fwrite(l.data(), 1, l.size(), stdout);
    }
  else if (!explain)
    std::fputc('\n', stdout);
  std::fflush(stdout);
  // microsecond resolution: the prompt's forward up to the first token drawn, then the rest
  const auto secs = [](Clock::duration d) {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(d).count()) * 1e-6;
  };
  const double total = secs(end - start);
  const double ttft = first ? secs(*first - start) : total;
  const double decode = first ? secs(*last - *first) : 0.0;
  // the first token of each output comes with its prompt's forward; the others are decoded
  const std::size_t decoded = generated > nseq ? generated - nseq : 0;
  std::fprintf(stderr, "generate: prompt %zu tokens, time to first token %.6f s (%.1f prompt tokens/s)\n",
               prompt_tokens, ttft, ttft > 0 ? static_cast<double>(prompt_tokens) / ttft : 0.0);
  std::size_t stopped = 0, ended = 0;  // at a --stop text; at an end-of-text id (--hf)
  std::string matched;
  for (std::size_t b = 0; b < nseq; ++b)
    if (results[b].reason == StopReason::StopToken) {
      ++ended;
    } else if (results[b].reason != StopReason::MaxNewTokens) {
      ++stopped;
      if (matched.empty()) matched = stops[b].matched();
    }
  std::string reason = "reached --max-new-tokens";
  if (nseq == 1 && stopped == 1) reason = "stopped at --stop '" + matched + "'";
  else if (nseq == 1 && ended == 1)
    reason = "stopped at the end-of-text token " + in.label(results[0].tokens.back());
  else if (stopped > 0 || ended > 0) {
    reason.clear();
    if (stopped > 0) reason = std::to_string(stopped) + " of " + std::to_string(nseq) + " outputs stopped at a --stop text";
    if (ended > 0)
      reason += (reason.empty() ? "" : ", ") + std::to_string(ended) + " of " + std::to_string(nseq) +
                " at an end-of-text token";
  }
  std::fprintf(stderr, "generate: %zu tokens in %.6f s (decode %.1f tokens/s after the first%s, %s), %s\n",
               generated, total, decode > 0 ? static_cast<double>(decoded) / decode : 0.0,
               nseq > 1 ? " of each output" : "",
               in.options.decoding == Decoding::Incremental ? "incremental: KV and routing caches"
                                                            : "a full forward per token",
               reason.c_str());
  return 0;
}

}  // namespace generate_cli
