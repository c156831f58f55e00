// generate (graphmoe/inference/generate.hpp), the full-forward decoder, on a tiny randomly
// initialised TransformerLM: greedy decoding is the arg max of the full forward's last logits at
// every step (sliding window included), stop tokens, streaming, seeds, the model's mode, bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "graphmoe/inference/generate.hpp"

using namespace graphmoe;

namespace {

TransformerLMConfig tiny_config() {
  TransformerLMConfig c;
  c.vocab_size = 11;
  c.max_seq_len = 8;
  c.d_model = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 6;
  c.router.num_experts = 3;
  c.router.k = 2;
  c.router.allow_unused_options = true;
  c.router.options<Similarity>().tau = 2.0;
  c.init_std = 0.4;  // logits far apart, so that no arg max is a near tie
  return c;
}

// The arg max of row `row` of the (1, t, V) logits the last forward left.
template <class LM>
std::int32_t argmax_row(const LM& lm, index_t row) {
  const index_t v = lm.config().vocab_size;
  const auto* p = lm.logits().data() + row * v;
  return static_cast<std::int32_t>(std::max_element(p, p + v) - p);
}

template <class LM>
void forward_on(LM& lm, const std::vector<std::int32_t>& ids) {
  Tensor<std::int32_t> t(Shape{1, static_cast<index_t>(ids.size())});
  std::copy(ids.begin(), ids.end(), t.data());
  lm.forward(t, Tensor<std::int32_t>());
}

GenerateOptions greedy_options(index_t n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.sampling.greedy = true;
  return o;
}

}  // namespace

TEST_CASE_TEMPLATE("generate: greedy decoding is the arg max of the full forward's last logits at each step",
                   Policy, SoftmaxRouter, SimilarityRouter) {
  TransformerLM<Policy, double> lm(tiny_config(), 5);
  const index_t window = lm.config().max_seq_len;
  const std::vector<std::int32_t> prompt = {3, 1, 4};
  // 12 tokens: the context passes max_seq_len = 8 after 5, then the window slides
  const GenerateResult r = generate(lm, prompt, greedy_options(12));
  REQUIRE(r.tokens.size() == 12);
  CHECK(r.reason == StopReason::MaxNewTokens);
  std::vector<std::int32_t> context = prompt;
  for (std::size_t i = 0; i < r.tokens.size(); ++i) {
    CAPTURE(i);
    const std::size_t t = std::min(context.size(), static_cast<std::size_t>(window));
    forward_on(lm, std::vector<std::int32_t>(context.end() - static_cast<std::ptrdiff_t>(t), context.end()));
    CHECK(r.tokens[i] == argmax_row(lm, static_cast<index_t>(t) - 1));
    context.push_back(r.tokens[i]);
  }
  // within the window the model is causal: one forward over prompt + the first 5 generated
  // tokens gives, at each position, the logits the step that drew the next token saw
  std::vector<std::int32_t> all = prompt;
  all.insert(all.end(), r.tokens.begin(), r.tokens.begin() + 5);
  REQUIRE(static_cast<index_t>(all.size()) == window);
  forward_on(lm, all);
  for (std::size_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(r.tokens[i] == argmax_row(lm, static_cast<index_t>(prompt.size() + i) - 1));
  }
  // not a constant sequence (the check above could pass for a model that ignores its input)
  CHECK(std::adjacent_find(r.tokens.begin(), r.tokens.end(), std::not_equal_to<>()) != r.tokens.end());
}

TEST_CASE("generate: a stop id ends the generation, is returned and streamed, and max_new_tokens bounds it") {
  TransformerLM<SoftmaxRouter, double> lm(tiny_config(), 7);
  const std::vector<std::int32_t> prompt = {2, 9};
  const GenerateResult full = generate(lm, prompt, greedy_options(10));
  REQUIRE(full.tokens.size() == 10);
  // stop at the first occurrence of the token drawn at step 3
  const std::int32_t stop = full.tokens[3];
  const std::size_t first =
      static_cast<std::size_t>(std::find(full.tokens.begin(), full.tokens.end(), stop) - full.tokens.begin());
  GenerateOptions o = greedy_options(10);
  o.stop_ids = {stop, 10};
  std::vector<std::int32_t> streamed;
  const GenerateResult r = generate(lm, prompt, o, [&](std::int32_t id) { streamed.push_back(id); });
  CHECK(r.reason == StopReason::StopToken);
  CHECK(r.tokens.size() == first + 1);
  CHECK(r.tokens.back() == stop);
  CHECK(std::equal(r.tokens.begin(), r.tokens.end(), full.tokens.begin()));
  CHECK(streamed == r.tokens);
  // a stop id never drawn changes nothing; max_new_tokens = 0 draws nothing
  GenerateOptions never = greedy_options(10);
  for (std::int32_t id = 0; id < 11; ++id)
    if (std::find(full.tokens.begin(), full.tokens.end(), id) == full.tokens.end()) never.stop_ids.push_back(id);
  CHECK(generate(lm, prompt, never).tokens == full.tokens);
  const GenerateResult none = generate(lm, prompt, greedy_options(0));
  CHECK(none.tokens.empty());
  CHECK(none.reason == StopReason::MaxNewTokens);
}

TEST_CASE("generate: sampling is deterministic for a seed, the model is in eval mode during, its mode restored after") {
  TransformerLM<SoftmaxRouter, float> lm(tiny_config(), 3);
  GenerateOptions o;
  o.max_new_tokens = 20;
  o.sampling.temperature = 1.5;
  o.sampling.top_k = 6;
  o.sampling.seed = 12;
  const std::vector<std::int32_t> prompt = {1};
  REQUIRE(lm.mode() == Mode::Train);
  bool all_eval = true;
  const GenerateResult a = generate(lm, prompt, o, [&](std::int32_t) { all_eval = all_eval && lm.mode() == Mode::Eval; });
  CHECK(all_eval);
  CHECK(lm.mode() == Mode::Train);
  CHECK(generate(lm, prompt, o).tokens == a.tokens);
  o.sampling.seed = 13;
  CHECK(generate(lm, prompt, o).tokens != a.tokens);
  // restored also when the callback throws, and after an eval-mode model's generation
  CHECK_THROWS_AS(generate(lm, prompt, o, [](std::int32_t) { throw std::runtime_error("stop"); }),
                  std::runtime_error);
  CHECK(lm.mode() == Mode::Train);
  lm.set_mode(Mode::Eval);
  (void)generate(lm, prompt, o);
  CHECK(lm.mode() == Mode::Eval);
}

TEST_CASE("generate: bad input is refused before any forward (empty prompt, too long, unknown ids, bad options)") {
  TransformerLM<SoftmaxRouter, float> lm(tiny_config(), 3);
  const GenerateOptions o = greedy_options(4);
  auto refused = [&](const std::vector<std::int32_t>& prompt, const GenerateOptions& opt,
                     const char* message) {
    CAPTURE(message);
    bool called = false;
    CHECK_THROWS_WITH_AS(generate(lm, prompt, opt, [&](std::int32_t) { called = true; }),
                         doctest::Contains(message), Error);
    CHECK_FALSE(called);
    CHECK(lm.mode() == Mode::Train);
  };
  refused({}, o, "graphmoe::generate: the prompt is empty");
  refused(std::vector<std::int32_t>(9, 1), o,
          "the prompt has 9 tokens, longer than the model's context of max_seq_len = 8 tokens");
  refused({1, 11}, o, "prompt token 1 is id 11, not in the model's vocabulary [0, 11)");
  refused({-1, 2}, o, "prompt token 0 is id -1, not in the model's vocabulary [0, 11)");
  GenerateOptions bad_stop = o;
  bad_stop.stop_ids = {1, 42};
  refused({1}, bad_stop, "stop id 42 is not in the model's vocabulary [0, 11)");
  GenerateOptions negative = o;
  negative.max_new_tokens = -1;
  refused({1}, negative, "max_new_tokens must be >= 0, got -1");
  GenerateOptions cold = o;
  cold.sampling.greedy = false;
  cold.sampling.temperature = 0.0;
  refused({1}, cold, "temperature must be finite and > 0");
  GenerateOptions top_p = o;
  top_p.sampling.top_p = 0.0;
  refused({1}, top_p, "top_p must be in (0, 1]");
  GenerateOptions no_chunk = o;
  no_chunk.prefill_chunk = 0;
  refused({1}, no_chunk, "prefill_chunk must be >= 1, got 0");
  // a prompt of exactly max_seq_len tokens is accepted
  CHECK(generate(lm, std::vector<std::int32_t>(8, 1), o).tokens.size() == 4);
}

TEST_CASE_TEMPLATE("generate: the incremental decoder draws the full-forward decoder's tokens, past the window too",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  TransformerLM<Policy, double> lm(tiny_config(), 11);
  GenerateOptions o;
  o.max_new_tokens = 14;  // the context of max_seq_len = 8 is passed after 6
  o.sampling.temperature = 1.3;
  o.sampling.top_k = 6;
  o.sampling.seed = 17;
  const std::vector<std::int32_t> prompt = {5, 2};
  o.decoding = Decoding::FullForward;
  const GenerateResult full = generate(lm, prompt, o);
  o.decoding = Decoding::Incremental;
  const GenerateResult inc = generate(lm, prompt, o);
  REQUIRE(full.tokens.size() == 14);
  CHECK(inc.tokens == full.tokens);
  // the draws are not all the same token (the comparison above could not fail otherwise)
  CHECK(std::adjacent_find(inc.tokens.begin(), inc.tokens.end(), std::not_equal_to<>()) != inc.tokens.end());
}

TEST_CASE_TEMPLATE("generate_batch: prompts of different lengths decoded together draw what each draws alone",
                   Policy, SimilarityRouter, AttentionRouter) {
  TransformerLMConfig cfg = tiny_config();
  cfg.max_seq_len = 16;
  TransformerLM<Policy, double> lm(cfg, 12);
  GenerateOptions o;
  o.max_new_tokens = 9;
  o.sampling.seed = 40;
  const std::vector<std::vector<std::int32_t>> prompts = {{1}, {4, 4, 2, 7, 9, 1}, {3, 8, 0}};
  std::vector<std::vector<std::int32_t>> streamed(3);
  const auto batch = generate_batch(lm, prompts, o, [&](index_t b, std::int32_t id) {
    streamed[static_cast<std::size_t>(b)].push_back(id);
  });
  REQUIRE(batch.size() == 3);
  for (std::size_t b = 0; b < 3; ++b) {
    CAPTURE(b);
    GenerateOptions alone = o;
    alone.sampling.seed = o.sampling.seed + b;
    CHECK(generate(lm, prompts[b], alone).tokens == batch[b].tokens);
    CHECK(streamed[b] == batch[b].tokens);
  }
  CHECK(batch[0].tokens != batch[1].tokens);
  // the prompts fed in chunks of 1 (one token per step, as before Decoder::prefill) or 2 tokens
  // per sequence and step (prompt 1's 6 tokens in 3 steps beside prompt 2's 2 and 1) draw the
  // same tokens as in one chunk each (the default 256)
  for (index_t chunk : {1, 2}) {
    CAPTURE(chunk);
    GenerateOptions chunked = o;
    chunked.prefill_chunk = chunk;
    const auto again = generate_batch(lm, prompts, chunked);
    for (std::size_t b = 0; b < 3; ++b) CHECK(again[b].tokens == batch[b].tokens);
  }
}

TEST_CASE("generate: explain reports how each generated token was routed") {
  TransformerLMConfig cfg = tiny_config();
  cfg.max_seq_len = 12;
  SUBCASE("the Similarity graph's sources") {
    TransformerLM<SimilarityRouter, double> lm(cfg, 13);
    GenerateOptions o;
    o.max_new_tokens = 5;
    o.sampling.greedy = true;
    o.explain = true;
    o.explain_sources = 2;
    const std::vector<std::int32_t> prompt = {1, 2, 3};
    std::vector<RoutedToken> seen;
    const GenerateResult r = generate(lm, prompt, o, {}, [&](const RoutedToken& t) { seen.push_back(t); });
    REQUIRE(seen.size() == 5);
    for (std::size_t i = 0; i < seen.size(); ++i) {
      CAPTURE(i);
      CHECK(seen[i].position == static_cast<index_t>(prompt.size() + i));
      CHECK(seen[i].id == r.tokens[i]);
      REQUIRE(seen[i].layers.size() == 2);
      for (const auto& l : seen[i].layers) {
        CHECK(l.experts.size() == 2);
        CHECK(l.gates[0] + l.gates[1] == doctest::Approx(1.0));
        REQUIRE(l.sources.size() == 2);
        CHECK(l.sources[0].weight >= l.sources[1].weight);
        CHECK(l.sources[0].weight + l.sources[1].weight <= 1.0 + 1e-12);
        CHECK(l.sources[0].position <= seen[i].position);
      }
    }
    // explaining changes nothing that is drawn
    o.explain = false;
    CHECK(generate(lm, prompt, o).tokens == r.tokens);
  }
  SUBCASE("the softmax router has experts, no graph") {
    TransformerLM<SoftmaxRouter, double> lm(cfg, 13);
    GenerateOptions o;
    o.max_new_tokens = 3;
    o.explain = true;
    std::size_t n = 0;
    (void)generate(lm, std::vector<std::int32_t>{4}, o, {}, [&](const RoutedToken& t) {
      ++n;
      for (const auto& l : t.layers) {
        CHECK(l.experts.size() == 2);
        CHECK(l.sources.empty());
      }
    });
    CHECK(n == 3);
  }
  SUBCASE("explain needs the incremental decoder") {
    TransformerLM<SoftmaxRouter, double> lm(cfg, 13);
    GenerateOptions o;
    o.explain = true;
    o.decoding = Decoding::FullForward;
    CHECK_THROWS_WITH_AS(generate(lm, std::vector<std::int32_t>{4}, o),
                         doctest::Contains("explain needs the incremental decoder"), Error);
  }
}

TEST_CASE("generate: penalties read the prompt and the generated tokens, as a naive greedy loop over the full forward does") {
  TransformerLM<SoftmaxRouter, double> lm(tiny_config(), 21);
  GenerateOptions o = greedy_options(12);  // past the window of 8 too
  o.sampling.repeat_penalty = 1.8;
  o.sampling.presence_penalty = 0.4;
  o.sampling.frequency_penalty = 0.3;
  o.sampling.repeat_last_n = 5;
  o.sampling.banned = {0};
  const std::vector<std::int32_t> prompt = {3, 3, 7};
  const GenerateResult r = generate(lm, prompt, o);
  // naive: the full forward over the last 8 tokens, the penalties over the last 5, no id 0
  std::vector<std::int32_t> ctx = prompt, naive;
  const index_t v = lm.config().vocab_size, window = lm.config().max_seq_len;
  for (int step = 0; step < 12; ++step) {
    const std::vector<std::int32_t> in(ctx.end() - std::min<std::ptrdiff_t>(window, ctx.size()), ctx.end());
    forward_on(lm, in);
    const double* row = lm.logits().data() + (static_cast<index_t>(in.size()) - 1) * v;
    std::int32_t best = -1;
    double best_l = 0;
    for (std::int32_t id = 1; id < v; ++id) {
      int c = 0;
      for (std::size_t j = ctx.size() - std::min<std::size_t>(5, ctx.size()); j < ctx.size(); ++j) c += ctx[j] == id;
      double l = row[id];
      if (c > 0) l = (l > 0 ? l / 1.8 : l * 1.8) - 0.3 * c - 0.4;
      if (best < 0 || l > best_l) best = id, best_l = l;
    }
    ctx.push_back(best);
    naive.push_back(best);
  }
  CHECK(r.tokens == naive);
  CHECK(std::find(r.tokens.begin(), r.tokens.end(), 0) == r.tokens.end());
  // the penalties changed the text (else the comparison proves little)
  o.sampling = SamplingOptions{};
  o.sampling.greedy = true;
  CHECK(generate(lm, prompt, o).tokens != r.tokens);
  // a banned id outside the vocabulary is refused before any forward
  o.sampling.banned = {11};
  CHECK_THROWS_WITH_AS(generate(lm, prompt, o), doctest::Contains("banned id 11 is not in the model's vocabulary"), Error);
}

TEST_CASE("generate: stop_when with StopStrings ends at the token that completes a stop string spanning tokens") {
  TransformerLM<SoftmaxRouter, double> lm(tiny_config(), 7);
  const std::vector<std::int32_t> prompt = {2, 9};
  const GenerateResult full = generate(lm, prompt, greedy_options(10));
  REQUIRE(full.tokens.size() == 10);
  // each id's text is two letters: a stop string of the last letter of token 4 and the first of 5
  auto text = [](std::int32_t id) { return std::string{static_cast<char>('a' + id), static_cast<char>('A' + id)}; };
  std::string all;
  for (std::int32_t id : full.tokens) all += text(id);
  const std::string stop = all.substr(9, 2);
  // where it first ends in the whole text: the token that holds that byte
  const std::size_t end = all.find(stop) + stop.size();
  const std::size_t last = (end - 1) / 2;
  GenerateOptions o = greedy_options(10);
  StopStrings matcher({stop});
  std::string kept;
  o.stop_when = [&](index_t, std::int32_t id) {
    const std::string piece = text(id);
    kept += piece.substr(0, matcher.feed(piece));
    return matcher.stopped();
  };
  const GenerateResult r = generate(lm, prompt, o);
  CHECK(r.reason == StopReason::StopCondition);
  CHECK(r.tokens.size() == last + 1);
  CHECK(std::equal(r.tokens.begin(), r.tokens.end(), full.tokens.begin()));
  CHECK(kept == all.substr(0, end));
  CHECK(kept.size() % 2 == 1);  // it stopped in the middle of a token's text
}

TEST_CASE_TEMPLATE("generate: explain reports every generated token past the context window, and the prompt on request", Policy,
                   SimilarityRouter, SoftmaxRouter) {
  TransformerLM<Policy, double> lm(tiny_config(), 13);  // max_seq_len 8
  const index_t window = lm.config().max_seq_len;
  for (const std::vector<std::int32_t>& prompt : {std::vector<std::int32_t>{1, 2, 3},
                                                  std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7, 8}}) {
    for (bool with_prompt : {false, true}) {
      CAPTURE(prompt.size());
      CAPTURE(with_prompt);
      GenerateOptions o;
      o.max_new_tokens = 12;
      o.sampling.seed = 3;
      o.sampling.temperature = 1.2;
      o.explain = true;
      o.explain_prompt = with_prompt;
      o.explain_sources = 2;
      std::vector<RoutedToken> seen;
      const GenerateResult r = generate(lm, prompt, o, {}, [&](const RoutedToken& t) { seen.push_back(t); });
      REQUIRE(r.tokens.size() == 12);
      const std::size_t first = with_prompt ? 0 : prompt.size();
      REQUIRE(seen.size() == prompt.size() + 12 - first);
      for (std::size_t i = 0; i < seen.size(); ++i) {
        CAPTURE(i);
        const index_t pos = static_cast<index_t>(first + i);
        CHECK(seen[i].position == pos);
        CHECK(seen[i].id == (static_cast<std::size_t>(pos) < prompt.size() ? prompt[static_cast<std::size_t>(pos)]
                                                                            : r.tokens[static_cast<std::size_t>(pos) - prompt.size()]));
        REQUIRE(seen[i].layers.size() == 2);
        for (const auto& l : seen[i].layers) {
          CHECK(l.experts.size() == 2);
          if (std::is_same_v<Policy, SimilarityRouter>) {
            REQUIRE(l.sources.size() == static_cast<std::size_t>(std::min<index_t>(2, pos + 1)));
            CHECK(l.own_experts.size() == 2);
            for (const auto& src : l.sources) {
              // a position of the window the token was read in
              CHECK(src.position <= pos);
              CHECK(src.position > pos - window);
            }
          } else {
            CHECK(l.sources.empty());
            CHECK(l.own_experts.empty());
          }
        }
      }
      // explaining changes nothing that is drawn
      GenerateOptions plain = o;
      plain.explain = false;
      CHECK(generate(lm, prompt, plain).tokens == r.tokens);
    }
  }
}
