// graphmoe/inference/generate.hpp: text generation from a TransformerLM on the CPU.
//
// This is the O(t^2) full-forward decoder: every new token runs TransformerLM::forward over the
// whole context (the prompt and the tokens generated so far, at most max_seq_len of them), and
// samples from the last position's logits. It keeps no KV cache and no routing cache, so each
// step costs a full forward and generating n tokens costs O(n t) token-forwards, O(n t^2) for the
// attention and the token graphs. It is the reference that the incremental decoder (a KV cache
// per attention layer and a routing cache per MoE layer, a later part of issue 28, not built yet)
// must match token for token, and the baseline its speed is measured against.
//
//   GenerateOptions opt;
//   opt.max_new_tokens = 50;
//   opt.sampling.temperature = 0.8;            // inference/sampling.hpp
//   opt.sampling.top_k = 40;
//   opt.sampling.seed = 1;
//   opt.stop_ids = {eos};
//   GenerateResult r = generate(lm, prompt_ids, opt, [](std::int32_t id) { print(id); });
//
// The context: the prompt must hold 1 to max_seq_len ids. Once prompt + generated tokens exceed
// max_seq_len, each forward reads the last max_seq_len tokens only (a sliding window; their
// positions are 0..max_seq_len-1 again, as in training, where every sequence starts at position
// 0). The routers see exactly what they would in a training forward over that window: causal
// token graphs, the model's current step (set_step: SMoE-Dropout's scheduled k) and its capacity
// setting (capacity_factor <= 0, the default, is dropless).
//
// Each step: forward (1, t) -> the logits of position t-1 -> Sampler::sample -> on_token(id). A
// stop id is emitted (returned and passed to on_token) and then ends the generation. The model is
// put in Mode::Eval for the generation and its previous mode is restored on return, also when an
// error or the callback throws. Bad input throws graphmoe::Error before any forward: an empty
// prompt, a prompt longer than max_seq_len, a prompt or stop id outside [0, vocab_size), a
// negative max_new_tokens, bad SamplingOptions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "graphmoe/core/mode.hpp"
#include "graphmoe/inference/sampling.hpp"
#include "graphmoe/models/transformer_lm.hpp"

namespace graphmoe {

struct GenerateOptions {
  index_t max_new_tokens = 64;          // >= 0 tokens to generate at most
  SamplingOptions sampling;             // greedy, temperature, top_k, top_p, seed
  std::vector<std::int32_t> stop_ids;   // emitting one of these ends the generation
};

enum class StopReason {
  MaxNewTokens,  // max_new_tokens were generated
  StopToken,     // the last generated token is one of stop_ids
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  // the generated ids (the prompt is not repeated)
  StopReason reason = StopReason::MaxNewTokens;
};

namespace detail {
// Sets a model's mode for a scope and restores the previous one on leaving it.
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
}  // namespace detail

// Generates up to opt.max_new_tokens tokens after `prompt` (see the header comment). on_token
// (optional) is called with each generated id as soon as it is drawn, for streaming.
template <class Policy, class T>
GenerateResult generate(TransformerLM<Policy, T, cpu>& lm, std::span<const std::int32_t> prompt,
                        const GenerateOptions& opt,
                        const std::function<void(std::int32_t)>& on_token = {}) {
  const char* op = "generate";
  Sampler sampler(opt.sampling);  // validates the sampling options
  const TransformerLMConfig& cfg = lm.config();
  const index_t window = cfg.max_seq_len, vocab = cfg.vocab_size;
  GRAPHMOE_CHECK(opt.max_new_tokens >= 0, op, "max_new_tokens must be >= 0, got ",
                 opt.max_new_tokens);
  GRAPHMOE_CHECK(!prompt.empty(), op, "the prompt is empty: give at least one token");
  GRAPHMOE_CHECK(static_cast<index_t>(prompt.size()) <= window, op, "the prompt has ",
                 prompt.size(), " tokens, longer than the model's context of max_seq_len = ",
                 window, " tokens");
  for (std::size_t i = 0; i < prompt.size(); ++i)
    GRAPHMOE_CHECK(prompt[i] >= 0 && prompt[i] < vocab, op, "prompt token ", i, " is id ",
                   prompt[i], ", not in the model's vocabulary [0, ", vocab, ")");
  for (std::int32_t s : opt.stop_ids)
    GRAPHMOE_CHECK(s >= 0 && s < vocab, op, "stop id ", s, " is not in the model's vocabulary [0, ",
                   vocab, ")");

  detail::ModeScope<TransformerLM<Policy, T, cpu>> eval(lm, Mode::Eval);
  std::vector<std::int32_t> context(prompt.begin(), prompt.end());
  GenerateResult result;
  result.tokens.reserve(static_cast<std::size_t>(opt.max_new_tokens));
  const Tensor<std::int32_t, cpu> no_targets;
  for (index_t step = 0; step < opt.max_new_tokens; ++step) {
    const index_t t = std::min(static_cast<index_t>(context.size()), window);
    Tensor<std::int32_t, cpu> ids(Shape{1, t});
    std::copy(context.end() - t, context.end(), ids.data());
    lm.forward(ids, no_targets);
    const T* last = lm.logits().data() + (t - 1) * vocab;
    const std::int32_t next = sampler.sample(std::span<const T>(last, static_cast<std::size_t>(vocab)));
    context.push_back(next);
    result.tokens.push_back(next);
    if (on_token) on_token(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) {
      result.reason = StopReason::StopToken;
      return result;
    }
  }
  result.reason = StopReason::MaxNewTokens;
  return result;
}

// The same with the prompt as a vector (a braced list or a tokenizer's output).
template <class Policy, class T>
GenerateResult generate(TransformerLM<Policy, T, cpu>& lm, const std::vector<std::int32_t>& prompt,
                        const GenerateOptions& opt,
                        const std::function<void(std::int32_t)>& on_token = {}) {
  return generate(lm, std::span<const std::int32_t>(prompt), opt, on_token);
}

}  // namespace graphmoe
