// graphmoe/inference/generate.hpp: text generation from a TransformerLM (every backend).
//
// Two decoders, chosen by GenerateOptions::decoding, that give the same tokens:
//   Decoding::Incremental (the default)  inference/decoder.hpp: a KV cache per attention layer and
//       a routing cache per MoE layer; each token costs O(t). The prompt is fed through the same
//       caches in chunks of up to opt.prefill_chunk tokens per step (Decoder::prefill: GEMMs of
//       many rows instead of one step per token); the chunks of several prompts share a step.
//   Decoding::FullForward  the O(t^2) reference: every new token runs TransformerLM::forward over
//       the whole context and samples from the last position's logits.
// Both read exactly the logits of a training forward over the context (up to rounding), so greedy
// decoding gives the same tokens (tests/inference/test_generate.cpp).
//
//   GenerateOptions opt;
//   opt.max_new_tokens = 50;
//   opt.sampling.temperature = 0.8;            // inference/sampling.hpp
//   opt.sampling.top_k = 40;
//   opt.sampling.seed = 1;
//   opt.sampling.repeat_penalty = 1.1;         // over the last repeat_last_n tokens
//   opt.sampling.banned = {unk};
//   opt.stop_ids = {eos};
//   GenerateResult r = generate(lm, prompt_ids, opt, [](std::int32_t id) { print(id); });
//   // several prompts of different lengths, decoded together (one row per sequence and step once
//   // the prompts are in):
//   std::vector<GenerateResult> rs = generate_batch(lm, {p0, p1, p2}, opt);
//
// The context: each prompt must hold 1 to max_seq_len ids. Once prompt + generated tokens exceed
// max_seq_len, each further token reads the last max_seq_len tokens only (a sliding window; their
// positions are 0..max_seq_len-1 again, as in training, where every sequence starts at position
// 0). Sliding moves every position, so no cache survives it: from then on both decoders run a full
// forward over the window per token. The routers see what they would in a training forward over
// the context: causal token graphs and the model's current step (set_step: SMoE-Dropout's
// scheduled k); routing is dropless (the incremental decoder ignores capacity_factor, and the full
// forward of one context has no capacity to exceed unless capacity_factor is set, in which case
// the two decoders may differ: see inference/decoder.hpp).
//
// Each step: the logits of the context's last position -> Sampler::sample (the context so far as
// its history, for the penalties) -> on_token(id). A stop id is emitted (returned and passed to
// on_token) and then ends that sequence; so does a token for which opt.stop_when is true.
// Sequence i of a batch samples with seed opt.sampling.seed + i, so it draws what generate() would
// draw for that prompt alone with that seed. The model is put in Mode::Eval for the generation and
// its previous mode is restored on return, also when an error or a callback throws. Bad input
// throws graphmoe::Error before any forward: an empty prompt, a prompt longer than max_seq_len, a
// prompt, stop or banned id outside [0, vocab_size), a negative max_new_tokens, bad
// SamplingOptions.
//
// opt.explain (incremental decoding only): on_routed reports how every generated token was routed
// as an input (RoutedToken: per MoE block its experts and gates and, for graph routers, the
// earlier positions with the largest graph weights and the experts the token's own scores would
// have chosen without the graph); the last generated token is fed once more at the end for it.
// Past the context the window's forward runs through the decoder (reset per token), so a token's
// sources are positions of the slid window (reported as positions of the sequence). With
// opt.explain_prompt the prompt's tokens are reported too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "graphmoe/core/mode.hpp"
#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/inference/sampling.hpp"
#include "graphmoe/models/transformer_lm.hpp"

namespace graphmoe {

enum class Decoding {
  Incremental,  // KV and routing caches (inference/decoder.hpp), O(t) per token
  FullForward,  // a full forward over the context per token, O(t^2): the reference
};

struct GenerateOptions {
  index_t max_new_tokens = 64;          // >= 0 tokens to generate at most
  SamplingOptions sampling;             // greedy, temperature, top_k, top_p, seed
  std::vector<std::int32_t> stop_ids;   // emitting one of these ends the generation
  Decoding decoding = Decoding::Incremental;
  bool explain = false;                 // report each generated token's routing (on_routed)
  index_t explain_sources = 3;          // earlier positions reported per graph row (>= 1)
  bool explain_prompt = false;          // explain the prompt's tokens too
  index_t prefill_chunk = 256;          // prompt tokens per sequence and step (>= 1), incremental
  // Called with (sequence, id) after each generated token (after on_token); true ends that
  // sequence there (StopReason::StopCondition). StopStrings below makes one from stop texts.
  std::function<bool(index_t, std::int32_t)> stop_when;
};

enum class StopReason {
  MaxNewTokens,  // max_new_tokens were generated
  StopToken,     // the last generated token is one of stop_ids
  StopCondition, // stop_when returned true for the last generated token
};

// Stop strings over streamed text: feed() each generated token's text, in order; once the text
// fed so far contains one of the strings, feed() returns how many bytes of the last piece reach
// the end of its first occurrence (the text to keep: everything before, and that prefix), and
// stopped() is true. A string may span any number of pieces; the earliest end wins. Empty
// strings are refused.
class StopStrings {
 public:
  StopStrings() = default;
  explicit StopStrings(std::vector<std::string> stops) : stops_(std::move(stops)) {
    for (const std::string& s : stops_) {
      GRAPHMOE_CHECK(!s.empty(), "StopStrings", "a stop string is empty: it would match anywhere");
      longest_ = std::max(longest_, s.size());
    }
  }
  bool empty() const { return stops_.empty(); }
  bool stopped() const { return matched_ >= 0; }
  // The string matched (stopped() only).
  const std::string& matched() const { return stops_.at(static_cast<std::size_t>(matched_)); }

  // The bytes of piece up to the end of the first stop string completed in it, or piece.size()
  // when none is (then stopped() stays false). Once stopped, every further piece keeps 0 bytes.
  std::size_t feed(std::string_view piece) {
    if (stopped()) return 0;
    const std::size_t tail = tail_.size();
    tail_.append(piece);
    std::size_t best = std::string::npos;
    for (std::size_t i = 0; i < stops_.size(); ++i) {
      // an occurrence that ends inside piece starts at or after tail - (size - 1)
      const std::string& s = stops_[i];
      const std::size_t from = tail + 1 > s.size() ? tail + 1 - s.size() : 0;
      const std::size_t at = tail_.find(s, from);
      if (at != std::string::npos && (best == std::string::npos || at + s.size() < best)) {
        best = at + s.size();
        matched_ = static_cast<std::ptrdiff_t>(i);
      }
    }
    if (best != std::string::npos) return best - tail;
    // keep the bytes a later match could start in (all but the last longest - 1 are settled)
    if (tail_.size() >= longest_) tail_.erase(0, tail_.size() - (longest_ - 1));
    return piece.size();
  }

 private:
  std::vector<std::string> stops_;
  std::size_t longest_ = 1;
  std::string tail_;  // the last longest - 1 bytes fed, at most, before the piece
  std::ptrdiff_t matched_ = -1;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  // the generated ids (the prompt is not repeated)
  StopReason reason = StopReason::MaxNewTokens;
};

// How one generated token was routed (GenerateOptions::explain).
struct RoutedToken {
  struct Source {
    index_t position = 0;  // an earlier (or this) position of the sequence
    double weight = 0;     // its weight in the token's row of S or A^p
  };
  struct Layer {
    index_t block = 0;                  // the MoE block
    std::vector<std::int32_t> experts;  // chosen experts, by descending score
    std::vector<double> gates;          // their gates
    std::vector<Source> sources;        // graph routers: the largest weights, descending
    // graph routers: the experts the token's own scores (softmax(gamma), before the graph) would
    // have chosen, as many as were chosen, by descending score
    std::vector<std::int32_t> own_experts;
  };
  index_t sequence = 0;  // the prompt's index in the batch
  index_t position = 0;  // the token's position in its sequence (prompt included, from 0)
  std::int32_t id = 0;
  std::vector<Layer> layers;  // one per MoE block
};

namespace detail {

inline void check_generate_input(const TransformerLMConfig& cfg,
                                 const std::vector<std::vector<std::int32_t>>& prompts,
                                 const GenerateOptions& opt) {
  const char* op = "generate";
  const index_t window = cfg.max_seq_len, vocab = cfg.vocab_size;
  opt.sampling.validate();
  GRAPHMOE_CHECK(opt.max_new_tokens >= 0, op, "max_new_tokens must be >= 0, got ",
                 opt.max_new_tokens);
  GRAPHMOE_CHECK(!prompts.empty(), op, "no prompt given");
  GRAPHMOE_CHECK(!opt.explain || opt.decoding == Decoding::Incremental, op,
                 "explain needs the incremental decoder (its routing caches hold the graph weights)");
  GRAPHMOE_CHECK(opt.explain_sources >= 1, op, "explain_sources must be >= 1, got ",
                 opt.explain_sources);
  GRAPHMOE_CHECK(opt.prefill_chunk >= 1, op, "prefill_chunk must be >= 1, got ",
                 opt.prefill_chunk);
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    const auto& prompt = prompts[b];
    std::string which;
    if (prompts.size() > 1) which.append(" ").append(std::to_string(b));
    GRAPHMOE_CHECK(!prompt.empty(), op, "the prompt", which, " is empty: give at least one token");
    GRAPHMOE_CHECK(static_cast<index_t>(prompt.size()) <= window, op, "the prompt", which, " has ",
                   prompt.size(), " tokens, longer than the model's context of max_seq_len = ",
                   window, " tokens");
    for (std::size_t i = 0; i < prompt.size(); ++i)
      GRAPHMOE_CHECK(prompt[i] >= 0 && prompt[i] < vocab, op, "prompt", which, " token ", i,
                     " is id ", prompt[i], ", not in the model's vocabulary [0, ", vocab, ")");
  }
  for (std::int32_t s : opt.sampling.banned)
    GRAPHMOE_CHECK(s < vocab, op, "banned id ", s, " is not in the model's vocabulary [0, ", vocab,
                   ")");
  for (std::int32_t s : opt.stop_ids)
    GRAPHMOE_CHECK(s >= 0 && s < vocab, op, "stop id ", s, " is not in the model's vocabulary [0, ",
                   vocab, ")");
}

// The logits of the last position of a forward over the last max_seq_len tokens of context.
template <class Policy, class T, class B, class C>
Tensor<T, cpu> last_logits_full_forward(TransformerLM<Policy, T, B, C>& lm,
                                        const std::vector<std::int32_t>& context) {
  const index_t window = lm.config().max_seq_len, vocab = lm.config().vocab_size;
  const index_t t = std::min(static_cast<index_t>(context.size()), window);
  Tensor<std::int32_t, cpu> ids(Shape{1, t});
  std::copy(context.end() - t, context.end(), ids.data());
  Tensor<std::int32_t, B> dev(Shape{1, t});
  copy_from_host(dev, ids);
  lm.forward(dev, Tensor<std::int32_t, B>());
  const Tensor<T, cpu> all = host_values(lm.logits());
  Tensor<T, cpu> last(Shape{vocab});
  std::copy_n(all.data() + (t - 1) * vocab, vocab, last.data());
  return last;
}

// The largest `count` weights of row (len values), descending (ties: the earlier position).
template <class T>
std::vector<RoutedToken::Source> top_sources(const T* row, index_t len, index_t count) {
  std::vector<RoutedToken::Source> all;
  for (index_t j = 0; j < len; ++j) all.push_back({j, static_cast<double>(row[j])});
  const auto k = static_cast<std::size_t>(std::min(count, len));
  std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k), all.end(),
                    [](const RoutedToken::Source& a, const RoutedToken::Source& b) {
                      return a.weight > b.weight || (a.weight == b.weight && a.position < b.position);
                    });
  all.resize(k);
  return all;
}
}  // namespace detail

// Generates up to opt.max_new_tokens tokens after each prompt (see the header comment), decoding
// the prompts together. on_token (optional) is called with (sequence, id) as soon as each id is
// drawn, for streaming; on_routed (optional, with opt.explain) with each generated token's routing.
template <class Policy, class T, class B, class C>
std::vector<GenerateResult> generate_batch(
    TransformerLM<Policy, T, B, C>& lm, const std::vector<std::vector<std::int32_t>>& prompts,
    const GenerateOptions& opt,
    const std::function<void(index_t, std::int32_t)>& on_token = {},
    const std::function<void(const RoutedToken&)>& on_routed = {}) {
  detail::check_generate_input(lm.config(), prompts, opt);
  const index_t nseq = static_cast<index_t>(prompts.size());
  const index_t window = lm.config().max_seq_len, vocab = lm.config().vocab_size;
  std::vector<Sampler> samplers;
  for (index_t b = 0; b < nseq; ++b) {
    SamplingOptions so = opt.sampling;
    so.seed = opt.sampling.seed + static_cast<std::uint64_t>(b);
    samplers.emplace_back(so);
  }
  ModeScope<TransformerLM<Policy, T, B, C>> eval(lm, Mode::Eval);
  std::vector<std::vector<std::int32_t>> context(prompts.begin(), prompts.end());
  std::vector<GenerateResult> results(static_cast<std::size_t>(nseq));
  std::vector<char> done(static_cast<std::size_t>(nseq), opt.max_new_tokens == 0);
  // Draws sequence b's next token from its logits; false once b is done.
  auto emit = [&](index_t b, const T* logits) {
    const auto ub = static_cast<std::size_t>(b);
    const std::int32_t next = samplers[ub].sample(
        std::span<const T>(logits, static_cast<std::size_t>(vocab)), context[ub]);
    context[ub].push_back(next);
    results[ub].tokens.push_back(next);
    if (on_token) on_token(b, next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) {
      results[ub].reason = StopReason::StopToken;
      done[ub] = 1;
    } else if (opt.stop_when && opt.stop_when(b, next)) {
      results[ub].reason = StopReason::StopCondition;
      done[ub] = 1;
    } else if (static_cast<index_t>(results[ub].tokens.size()) == opt.max_new_tokens) {
      done[ub] = 1;
    }
  };
  if (opt.decoding == Decoding::FullForward) {
    for (index_t b = 0; b < nseq; ++b)
      while (!done[static_cast<std::size_t>(b)])
        emit(b, detail::last_logits_full_forward(lm, context[static_cast<std::size_t>(b)]).data());
    return results;
  }
  Decoder<Policy, T, B, C> dec(lm, nseq, window);
  // fed[b]: the tokens of context[b] in the cache; the logits of the last one predict the next
  std::vector<index_t> fed(static_cast<std::size_t>(nseq), 0);
  // explain: on_routed for rows of the last step (only_row >= 0: that row alone); offset: the
  // sequence position of the step's position 0 (past the context the step is the slid window)
  auto report = [&](const DecodeRows& rows, index_t offset, index_t only_row) {
    if (!opt.explain || !on_routed) return;
    struct Block {
      index_t l;
      Tensor<std::int32_t, cpu> ex;
      Tensor<T, cpu> g, sc;
    };
    std::vector<Block> blocks;
    for (index_t l = 0; l < lm.num_layers(); ++l)
      if (lm.block(l).is_moe()) {
        const bool graph = !dec.weights()[static_cast<std::size_t>(l)].empty();
        blocks.push_back({l, dec.experts(l), dec.gates(l), graph ? dec.scores(l) : Tensor<T, cpu>()});
      }
    for (index_t r = 0; r < rows.size(); ++r) {
      if (only_row >= 0 && r != only_row) continue;
      const index_t b = rows.slot[static_cast<std::size_t>(r)];
      const index_t wpos = rows.pos[static_cast<std::size_t>(r)], pos = wpos + offset;
      const auto ub = static_cast<std::size_t>(b);
      if (pos < static_cast<index_t>(prompts[ub].size()) && !opt.explain_prompt) continue;
      RoutedToken rt;
      rt.sequence = b;
      rt.position = pos;
      rt.id = context[ub][static_cast<std::size_t>(pos)];
      for (const Block& blk : blocks) {
        RoutedToken::Layer layer;
        layer.block = blk.l;
        const index_t m = blk.ex.dim(1);
        for (index_t j = 0; j < m; ++j) {
          layer.experts.push_back(blk.ex.data()[r * m + j]);
          layer.gates.push_back(static_cast<double>(blk.g.data()[r * m + j]));
        }
        const Tensor<T, cpu>& w = dec.weights()[static_cast<std::size_t>(blk.l)];
        if (!w.empty()) {
          layer.sources = detail::top_sources(w.data() + r * w.dim(1), wpos + 1, opt.explain_sources);
          for (auto& src : layer.sources) src.position += offset;
          const index_t e = blk.sc.dim(1);
          for (const auto& o : detail::top_sources(blk.sc.data() + r * e, e, m))
            layer.own_experts.push_back(static_cast<std::int32_t>(o.position));
        }
        rt.layers.push_back(std::move(layer));
      }
      on_routed(rt);
    }
  };
  // explain past the context: the slid window ending at context[b][upto - 1] through the decoder
  // (slot b reset: positions 0..window-1, as a full forward reads them), its last row reported;
  // the logits of that row
  std::vector<index_t> window_slots;
  auto slid_step = [&](index_t b, index_t upto) -> const T* {
    const auto ub = static_cast<std::size_t>(b);
    dec.reset(b);
    window_slots.assign(static_cast<std::size_t>(window), b);
    const std::vector<std::int32_t> win(context[ub].begin() + (upto - window), context[ub].begin() + upto);
    const index_t last = window - 1;
    const Tensor<T, cpu>& lg = dec.step(std::span<const index_t>(window_slots),
                                        std::span<const std::int32_t>(win), true,
                                        std::span<const index_t>(&last, 1));
    report(dec.rows(), upto - window, last);
    return lg.data();
  };
  std::vector<index_t> slots;
  std::vector<std::int32_t> ids;
  // per step: the sequences in it and the row of each one's last token
  std::vector<index_t> stepped, last_row;
  for (;;) {
    slots.clear();
    ids.clear();
    stepped.clear();
    last_row.clear();
    bool any = false;
    for (index_t b = 0; b < nseq; ++b) {
      const auto ub = static_cast<std::size_t>(b);
      if (done[ub]) continue;
      any = true;
      const index_t have = static_cast<index_t>(context[ub].size());
      if (have > window) {
        // past the context: the window slides, a full forward per token (the header comment);
        // with explain the same forward through the decoder, whose routing caches hold the graph
        if (opt.explain && on_routed) emit(b, slid_step(b, have));
        else emit(b, detail::last_logits_full_forward(lm, context[ub]).data());
        continue;
      }
      // what is not fed yet: the prompt (in chunks, as Decoder::prefill feeds it), then one token
      const index_t m = std::min(have - fed[ub], opt.prefill_chunk);
      for (index_t j = 0; j < m; ++j) {
        slots.push_back(b);
        ids.push_back(context[ub][static_cast<std::size_t>(fed[ub] + j)]);
      }
      stepped.push_back(b);
      last_row.push_back(static_cast<index_t>(slots.size()) - 1);
    }
    if (!any) break;
    if (slots.empty()) continue;
    // the logits of each sequence's last row only (row j: sequence stepped[j])
    const Tensor<T, cpu>& logits = dec.step(slots, ids, opt.explain, last_row);
    report(dec.rows(), 0, -1);
    for (std::size_t j = 0; j < stepped.size(); ++j) {
      const auto ub = static_cast<std::size_t>(stepped[j]);
      fed[ub] = dec.length(stepped[j]);
      if (fed[ub] == static_cast<index_t>(context[ub].size()))
        emit(stepped[j], logits.data() + static_cast<index_t>(j) * vocab);
    }
  }
  // explain: the last generated token of each sequence has not been fed; feed it to report it
  if (opt.explain && on_routed) {
    slots.clear();
    ids.clear();
    for (index_t b = 0; b < nseq; ++b) {
      const auto ub = static_cast<std::size_t>(b);
      const index_t have = static_cast<index_t>(context[ub].size());
      if (have > window) {
        (void)slid_step(b, have);  // past the context: its own slid window
      } else if (fed[ub] < have) {
        slots.push_back(b);
        ids.push_back(context[ub][static_cast<std::size_t>(fed[ub])]);
      }
    }
    if (!slots.empty()) {
      (void)dec.step(slots, ids, true);
      report(dec.rows(), 0, -1);
    }
  }
  return results;
}

// One prompt (see generate_batch). on_token (optional) is called with each generated id as soon
// as it is drawn, for streaming.
template <class Policy, class T, class B, class C>
GenerateResult generate(TransformerLM<Policy, T, B, C>& lm, std::span<const std::int32_t> prompt,
                        const GenerateOptions& opt,
                        const std::function<void(std::int32_t)>& on_token = {},
                        const std::function<void(const RoutedToken&)>& on_routed = {}) {
  std::function<void(index_t, std::int32_t)> each;
  if (on_token) each = [&](index_t, std::int32_t id) { on_token(id); };
  return generate_batch(lm, {std::vector<std::int32_t>(prompt.begin(), prompt.end())}, opt, each,
                        on_routed)[0];
}

// The same with the prompt as a vector (a braced list or a tokenizer's output).
template <class Policy, class T, class B, class C>
GenerateResult generate(TransformerLM<Policy, T, B, C>& lm, const std::vector<std::int32_t>& prompt,
                        const GenerateOptions& opt,
                        const std::function<void(std::int32_t)>& on_token = {},
                        const std::function<void(const RoutedToken&)>& on_routed = {}) {
  return generate(lm, std::span<const std::int32_t>(prompt), opt, on_token, on_routed);
}

}  // namespace graphmoe
