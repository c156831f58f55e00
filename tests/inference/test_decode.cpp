// Incremental decoding (TransformerLM::decode, the KV and routing caches): for every causal router
// the logits of token t decoded one step at a time equal the full forward's logits at t (double:
// 1e-12; float: 2e-5 of the logits' scale), with the same experts chosen at every step, over 200+
// tokens and over several slots decoded together at different positions; a prompt fed in chunks
// of many tokens per step (Decoder::prefill) gives the same logits and experts at every position.
// Plus the routing cache's size and bad steps.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "support/decode_fixtures.hpp"

using namespace graphmoe;
using graphmoe::test::decode_config;
using graphmoe::test::random_ids;

namespace {

// The full forward over ids (1, T): logits (T, V) and, per MoE block, the experts of every token.
template <class LM>
struct Reference {
  std::vector<double> logits;
  std::vector<std::vector<std::int32_t>> experts;  // [block][t * m + j]
};
template <class LM>
Reference<LM> full_forward(LM& lm, const std::vector<std::int32_t>& ids) {
  const index_t t = static_cast<index_t>(ids.size());
  Tensor<std::int32_t> x(Shape{1, t});
  std::copy(ids.begin(), ids.end(), x.data());
  lm.forward(x, Tensor<std::int32_t>());
  Reference<LM> r;
  r.logits.assign(lm.logits().data(), lm.logits().data() + lm.logits().numel());
  for (index_t l = 0; l < lm.num_layers(); ++l) {
    if (!lm.block(l).is_moe()) continue;
    const auto& idx = lm.block(l).moe().routing().selection.indices;
    r.experts.emplace_back(idx.data(), idx.data() + idx.numel());
  }
  return r;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Decodes the sequences seqs[s] in slots s, all together: at step i every slot with a token i
// takes part (slots of different lengths drop out as they end), and checks each row against its
// sequence's full forward.
template <class Policy, class T>
void check_decode_matches_forward(TransformerLM<Policy, T>& lm,
                                  const std::vector<std::vector<std::int32_t>>& seqs, double tol) {
  std::vector<Reference<TransformerLM<Policy, T>>> ref;
  index_t longest = 0;
  for (const auto& s : seqs) {
    ref.push_back(full_forward(lm, s));
    longest = std::max(longest, static_cast<index_t>(s.size()));
  }
  const index_t v = lm.config().vocab_size, nslots = static_cast<index_t>(seqs.size());
  auto cache = lm.decode_cache(nslots);
  Tensor<T> logits;
  std::size_t rows_checked = 0;
  for (index_t i = 0; i < longest; ++i) {
    const auto [rows, ids] = test::decode_step_input(seqs, i);
    Tensor<std::int32_t> x(Shape{rows.size()});
    std::copy(ids.begin(), ids.end(), x.data());
    lm.decode(x, rows, cache, logits);
    for (index_t r = 0; r < rows.size(); ++r) {
      const auto& rf = ref[static_cast<std::size_t>(rows.slot[static_cast<std::size_t>(r)])];
      const double scale = std::max(1.0, max_abs(rf.logits));
      for (index_t c = 0; c < v; ++c) {
        const double want = rf.logits[static_cast<std::size_t>(i * v + c)];
        const double got = static_cast<double>(logits.data()[r * v + c]);
        if (std::abs(got - want) > tol * scale) {
          INFO("slot ", rows.slot[static_cast<std::size_t>(r)], " position ", i, " logit ", c);
          CHECK(got == doctest::Approx(want).epsilon(0).scale(0));
          return;
        }
      }
      // the same experts at every MoE block
      std::size_t moe = 0;
      for (index_t l = 0; l < lm.num_layers(); ++l) {
        if (!lm.block(l).is_moe()) continue;
        const auto& idx = lm.block(l).moe().routing().selection.indices;
        const index_t m = idx.dim(1);
        for (index_t j = 0; j < m; ++j)
          REQUIRE(idx.data()[r * m + j] == rf.experts[moe][static_cast<std::size_t>(i * m + j)]);
        ++moe;
      }
      ++rows_checked;
    }
  }
  std::size_t total = 0;
  for (const auto& s : seqs) total += s.size();
  CHECK(rows_checked == total);
}

// The logits and, per MoE block, the experts of every row of the decoder's last step.
template <class Policy, class T>
void append_step(Decoder<Policy, T>& dec, const Tensor<T>& logits, Reference<TransformerLM<Policy, T>>& out) {
  out.logits.insert(out.logits.end(), logits.data(), logits.data() + logits.numel());
  std::size_t moe = 0;
  for (index_t l = 0; l < dec.model().num_layers(); ++l) {
    if (!dec.model().block(l).is_moe()) continue;
    if (out.experts.size() <= moe) out.experts.emplace_back();
    const Tensor<std::int32_t> idx = dec.experts(l);
    out.experts[moe].insert(out.experts[moe].end(), idx.data(), idx.data() + idx.numel());
    ++moe;
  }
}

// Feeds ids into slot 0 of a fresh decoder in steps of at most `chunk` tokens (Decoder::step with
// the slot listed once per token) and returns every position's logits and experts.
template <class Policy, class T>
Reference<TransformerLM<Policy, T>> decode_in_chunks(TransformerLM<Policy, T>& lm,
                                                     const std::vector<std::int32_t>& ids,
                                                     index_t chunk) {
  Decoder<Policy, T> dec(lm, 1);
  Reference<TransformerLM<Policy, T>> out;
  const index_t len = static_cast<index_t>(ids.size());
  for (index_t at = 0; at < len; at += chunk) {
    const index_t m = std::min(chunk, len - at);
    const std::vector<index_t> slots(static_cast<std::size_t>(m), 0);
    const std::vector<std::int32_t> part(ids.begin() + at, ids.begin() + at + m);
    append_step(dec, dec.step(slots, part), out);
  }
  return out;
}

// got equals want: logits to tol of want's scale, the experts exactly.
template <class LM>
void check_same(const Reference<LM>& want, const Reference<LM>& got, index_t vocab, double tol) {
  REQUIRE(got.logits.size() == want.logits.size());
  const double scale = std::max(1.0, max_abs(want.logits));
  for (std::size_t j = 0; j < want.logits.size(); ++j)
    if (std::abs(got.logits[j] - want.logits[j]) > tol * scale) {
      INFO("position ", static_cast<index_t>(j) / vocab, " logit ", static_cast<index_t>(j) % vocab);
      CHECK(got.logits[j] == doctest::Approx(want.logits[j]).epsilon(0).scale(0));
      return;
    }
  REQUIRE(got.experts.size() == want.experts.size());
  for (std::size_t b = 0; b < want.experts.size(); ++b) CHECK(got.experts[b] == want.experts[b]);
}

// Decodes seqs[s] in slots s with the given schedule: plan[k] lists step k's rows as slots (a slot
// listed several times gets consecutive positions, in row order) and checks every row against its
// sequence's full forward (logits to tol, experts exactly).
template <class Policy, class T>
void check_schedule(TransformerLM<Policy, T>& lm, const std::vector<std::vector<std::int32_t>>& seqs,
                    const std::vector<std::vector<index_t>>& plan, double tol) {
  std::vector<Reference<TransformerLM<Policy, T>>> ref;
  for (const auto& sq : seqs) ref.push_back(full_forward(lm, sq));
  const index_t v = lm.config().vocab_size;
  Decoder<Policy, T> dec(lm, static_cast<index_t>(seqs.size()));
  for (const auto& slots : plan) {
    std::vector<std::int32_t> ids;
    std::vector<index_t> next(seqs.size());
    for (std::size_t s = 0; s < seqs.size(); ++s) next[s] = dec.length(static_cast<index_t>(s));
    for (index_t s : slots) ids.push_back(seqs[static_cast<std::size_t>(s)][static_cast<std::size_t>(next[static_cast<std::size_t>(s)]++)]);
    const Tensor<T>& logits = dec.step(slots, ids);
    for (index_t r = 0; r < dec.rows().size(); ++r) {
      const auto s = static_cast<std::size_t>(dec.rows().slot[static_cast<std::size_t>(r)]);
      const index_t t = dec.rows().pos[static_cast<std::size_t>(r)];
      const double scale = std::max(1.0, max_abs(ref[s].logits));
      for (index_t c = 0; c < v; ++c) {
        const double want = ref[s].logits[static_cast<std::size_t>(t * v + c)];
        const double got = static_cast<double>(logits.data()[r * v + c]);
        if (std::abs(got - want) > tol * scale) {
          INFO("row ", r, ": slot ", s, " position ", t, " logit ", c);
          REQUIRE(got == doctest::Approx(want).epsilon(0).scale(0));
        }
      }
      std::size_t moe = 0;
      for (index_t l = 0; l < lm.num_layers(); ++l) {
        if (!lm.block(l).is_moe()) continue;
        const Tensor<std::int32_t> idx = dec.experts(l);
        const index_t m = idx.dim(1);
        for (index_t j = 0; j < m; ++j)
          REQUIRE(idx.data()[r * m + j] == ref[s].experts[moe][static_cast<std::size_t>(t * m + j)]);
        ++moe;
      }
    }
  }
  for (std::size_t s = 0; s < seqs.size(); ++s)
    CHECK(dec.length(static_cast<index_t>(s)) == static_cast<index_t>(seqs[s].size()));
}

}  // namespace

TEST_CASE_TEMPLATE("prefill: a 210-token prompt in chunks of 1, 7, 64 and 210 gives the logits and "
                   "experts of step-by-step decoding and of the full forward, every causal router",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SimilarityXMoERouter, AttentionXMoERouter, SMoEDropoutRouter,
                   SimilaritySMoEDropoutRouter, AttentionSMoEDropoutRouter, SigmoidBiasRouter,
                   SimilaritySigmoidBiasRouter, AttentionSigmoidBiasRouter, BlendedSimilarityRouter,
                   BlendedAttentionRouter) {
  TransformerLMConfig cfg = decode_config(210);
  TransformerLM<Policy, double> lm(cfg, 3);
  lm.set_mode(Mode::Eval);
  // bias balancing: a non-zero selection bias, which decoding must apply as the forward does
  for (const auto& info : lm.arena().params())
    if (info.name.ends_with("expert_bias")) {
      Tensor<double> b = lm.arena().value(info.name);
      for (index_t e = 0; e < b.numel(); ++e) b.data()[e] = 0.01 * static_cast<double>((e * 3) % 5) - 0.02;
    }
  // a blended graph half mixed in (at its initial 0 it would route as the softmax router)
  for (const auto& info : lm.arena().params())
    if (info.name.ends_with("graph.blend")) lm.arena().value(info.name).data()[0] = 0.45;
  lm.set_step(4);  // SMoE-Dropout: k = 2 of its 1..3 schedule
  const auto ids = random_ids(210, cfg.vocab_size, 71);
  const auto forward = full_forward(lm, ids);
  const auto stepwise = decode_in_chunks(lm, ids, 1);
  check_same(forward, stepwise, cfg.vocab_size, 1e-12);
  for (index_t chunk : {7, 64, 210}) {
    CAPTURE(chunk);
    const auto chunked = decode_in_chunks(lm, ids, chunk);
    check_same(forward, chunked, cfg.vocab_size, 1e-12);
    check_same(stepwise, chunked, cfg.vocab_size, 1e-12);
    {
      // on 2 threads a chunk's rows run concurrently: a row reading its slot's cache before the
      // rows before it had appended (rather than after the op's append pass) would read stale
      // entries (zeros here)
      set_num_threads(2);
      struct OneThread {
        ~OneThread() { set_num_threads(1); }
      } one;
      check_same(forward, decode_in_chunks(lm, ids, chunk), cfg.vocab_size, 1e-12);
    }
    // Decoder::prefill: the last token's logits (V)
    Decoder<Policy, double> dec(lm, 2);
    (void)dec.step({0}, {ids[0]});  // another slot busy: prefill touches slot 1 only
    const Tensor<double>& last = dec.prefill(1, ids, chunk);
    REQUIRE(last.shape() == Shape{cfg.vocab_size});
    CHECK(dec.length(1) == 210);
    CHECK(dec.length(0) == 1);
    for (index_t c = 0; c < cfg.vocab_size; ++c)
      REQUIRE(std::abs(last.data()[c] - forward.logits[static_cast<std::size_t>(209 * cfg.vocab_size + c)]) <=
              1e-12 * std::max(1.0, max_abs(forward.logits)));
  }
}

TEST_CASE_TEMPLATE("prefill: several slots' chunks in one step, interleaved and mixed with single rows",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  TransformerLMConfig cfg = decode_config(60);
  TransformerLM<Policy, double> lm(cfg, 5);
  const std::vector<std::vector<std::int32_t>> seqs = {random_ids(60, 23, 81), random_ids(31, 23, 82),
                                                       random_ids(44, 23, 83)};
  // step 1: chunks of slots 0 and 2, slot 1's first token between them; step 2: the chunks'
  // rows interleaved (slot 0: 3 rows, slot 2: 2 rows) with single rows of slot 1; then slot 0's
  // chunk after slot 1 and 2's single rows, until every sequence is in
  std::vector<std::vector<index_t>> plan = {{0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2},
                                            {0, 2, 1, 0, 2, 0}};
  std::vector<index_t> fed = {8, 2, 9};
  for (bool more = true; more;) {
    more = false;
    std::vector<index_t> slots;
    for (index_t s : {1, 2, 0}) {
      const index_t room = static_cast<index_t>(seqs[static_cast<std::size_t>(s)].size()) -
                           fed[static_cast<std::size_t>(s)];
      const index_t m = std::min(room, s == 0 ? index_t{11} : index_t{1});
      for (index_t j = 0; j < m; ++j) slots.push_back(s);
      fed[static_cast<std::size_t>(s)] += m;
      more = more || m > 0;
    }
    if (!slots.empty()) plan.push_back(slots);
  }
  check_schedule(lm, seqs, plan, 1e-12);
}

TEST_CASE_TEMPLATE("prefill: a step's logit rows are those rows of its full logits", Policy,
                   SimilarityRouter, AttentionRouter) {
  TransformerLM<Policy, double> lm(decode_config(41), 6);  // 40 tokens and one more step
  const auto a = random_ids(40, 23, 91), b = random_ids(9, 23, 92);
  Decoder<Policy, double> all(lm, 2), some(lm, 2);
  (void)all.prefill(0, std::vector<std::int32_t>(a.begin(), a.begin() + 20), 8);
  (void)some.prefill(0, std::vector<std::int32_t>(a.begin(), a.begin() + 20), 8);
  // slot 0's next 20 tokens interleaved with slot 1's 9: rows 0..28
  std::vector<index_t> slots;
  std::vector<std::int32_t> ids;
  for (std::size_t j = 0; j < 20; ++j) {
    slots.push_back(0);
    ids.push_back(a[20 + j]);
    if (j < 9) {
      slots.push_back(1);
      ids.push_back(b[j]);
    }
  }
  const Tensor<double>& full = all.step(slots, ids);
  const std::vector<double> want(full.data(), full.data() + full.numel());
  const std::vector<index_t> pick = {28, 0, 17, 17};
  const Tensor<double>& got = some.step(slots, ids, false, pick);
  REQUIRE(got.shape() == Shape{4, 23});
  double scale = 1;
  for (double x : want) scale = std::max(scale, std::abs(x));
  for (std::size_t j = 0; j < pick.size(); ++j)
    for (index_t c = 0; c < 23; ++c)
      REQUIRE(std::abs(got.data()[static_cast<index_t>(j) * 23 + c] -
                       want[static_cast<std::size_t>(pick[j] * 23 + c)]) <= 1e-12 * scale);
  // the caches took every row either way: the next step agrees
  const Tensor<double>& next_all = all.step({0, 1}, {a[0], a[1]});
  const std::vector<double> want_next(next_all.data(), next_all.data() + next_all.numel());
  const Tensor<double>& next_some = some.step({0, 1}, {a[0], a[1]});
  for (std::size_t j = 0; j < want_next.size(); ++j)
    REQUIRE(std::abs(next_some.data()[j] - want_next[j]) <= 1e-12 * scale);
}

TEST_CASE("prefill: bad chunks and prompts are refused with a message naming the problem") {
  TransformerLM<SimilarityRouter, double> lm(decode_config(8), 1);
  auto cache = lm.decode_cache(2);
  Tensor<double> logits;
  Tensor<std::int32_t> two(Shape{2}), three(Shape{3});
  CHECK_THROWS_WITH_AS(lm.decode(two, DecodeRows{{1, 1}, {0, 0}}, cache, logits),
                       doctest::Contains("slot 1 has row 0 at position 0 and then row 1 at position 0"),
                       Error);
  CHECK_THROWS_WITH_AS(lm.decode(two, DecodeRows{{1, 1}, {3, 2}}, cache, logits),
                       doctest::Contains("consecutive increasing positions in row order (expected 4)"),
                       Error);
  CHECK_THROWS_WITH_AS(lm.decode(three, DecodeRows{{0, 1, 0}, {2, 0, 4}}, cache, logits),
                       doctest::Contains("slot 0 has row 0 at position 2 and then row 2 at position 4"),
                       Error);
  CHECK_THROWS_WITH_AS(lm.decode(two, DecodeRows{{0, 0}, {7, 8}}, cache, logits),
                       doctest::Contains("row 1 is at position 8, outside the cache's [0, 8)"), Error);
  Decoder<SimilarityRouter, double> dec(lm, 2);
  const std::vector<std::int32_t> five = {1, 2, 3, 4, 5};
  (void)dec.prefill(0, five);
  CHECK_THROWS_WITH_AS(dec.prefill(0, five), doctest::Contains("holds 5 tokens and has room for 3 more"),
                       Error);
  CHECK(dec.length(0) == 5);  // unchanged
  CHECK_THROWS_WITH_AS(dec.prefill(1, std::vector<std::int32_t>{}), doctest::Contains("no tokens"), Error);
  CHECK_THROWS_WITH_AS(dec.prefill(1, five, 0), doctest::Contains("chunk must be >= 1"), Error);
  CHECK_THROWS_WITH_AS(dec.prefill(1, std::vector<std::int32_t>{1, 23}),
                       doctest::Contains("token 1 is id 23, not in the model's vocabulary [0, 23)"),
                       Error);
  CHECK_THROWS_WITH_AS(dec.prefill(2, five), doctest::Contains("outside the decoder's [0, 2)"), Error);
  CHECK(dec.length(1) == 0);
  // a step that would overfill a slot: nothing is appended
  CHECK_THROWS_WITH_AS(dec.step({0, 0, 0, 1, 0}, {1, 1, 1, 1, 1}),
                       doctest::Contains("slot 0 is full (8 tokens, the decoder's max_len) at row 4"),
                       Error);
  CHECK(dec.length(0) == 5);
  CHECK(dec.length(1) == 0);
  CHECK_THROWS_WITH_AS(dec.step({1, 1}, {1, 2}, false, {0, 2}),
                       doctest::Contains("logit row 2 (entry 1) is outside the step's 2 rows"), Error);
  CHECK(dec.length(1) == 0);
}

TEST_CASE_TEMPLATE("decode: every causal router's decoded logits equal the full forward's, in double",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SimilarityXMoERouter, AttentionXMoERouter, SMoEDropoutRouter,
                   SimilaritySMoEDropoutRouter, AttentionSMoEDropoutRouter, SigmoidBiasRouter,
                   SimilaritySigmoidBiasRouter, AttentionSigmoidBiasRouter, BlendedSimilarityRouter,
                   BlendedAttentionRouter) {
  TransformerLMConfig cfg = decode_config(210);
  TransformerLM<Policy, double> lm(cfg, 3);
  lm.set_mode(Mode::Eval);
  // bias balancing: a non-zero selection bias, which decoding must apply as the forward does
  for (const auto& info : lm.arena().params())
    if (info.name.ends_with("expert_bias")) {
      Tensor<double> b = lm.arena().value(info.name);
      for (index_t e = 0; e < b.numel(); ++e) b.data()[e] = 0.01 * static_cast<double>((e * 3) % 5) - 0.02;
    }
  // a blended graph half mixed in (at its initial 0 it would route as the softmax router)
  for (const auto& info : lm.arena().params())
    if (info.name.ends_with("graph.blend")) lm.arena().value(info.name).data()[0] = 0.45;
  lm.set_step(4);  // SMoE-Dropout: k = 2 of its 1..3 schedule
  // three slots of different lengths decoded together, one of them 210 tokens (the full context)
  check_decode_matches_forward(lm, {random_ids(210, cfg.vocab_size, 1), random_ids(17, cfg.vocab_size, 2),
                                    random_ids(29, cfg.vocab_size, 3)},
                               1e-12);
}

TEST_CASE_TEMPLATE("decode: the GLaM layout, and float", Policy, SoftmaxRouter, SimilarityRouter,
                   AttentionRouter) {
  SUBCASE("the GLaM layout (dense blocks between MoE blocks)") {
    TransformerLMConfig cfg = decode_config(30);
    cfg.num_layers = 4;
    cfg.layout = MoELayout::GLaM;
    TransformerLM<Policy, double> lm(cfg, 8);
    check_decode_matches_forward(lm, {random_ids(30, 23, 12), random_ids(9, 23, 13)}, 1e-12);
  }
  SUBCASE("float, to 2e-5 of the logits' scale") {
    TransformerLM<Policy, float> lm(decode_config(64), 9);
    check_decode_matches_forward(lm, {random_ids(64, 23, 14), random_ids(31, 23, 15)}, 2e-5);
  }
}

TEST_CASE("decode: every option of the Similarity graph") {
  TransformerLMConfig cfg = decode_config(36);
  auto& o = cfg.router.options<Similarity>();
  SUBCASE("exclude_self") { o.exclude_self = true; }
  SUBCASE("a learned temperature") { o.tau_mode = TauMode::Learned; }
  SUBCASE("the temperature scaled by sqrt(D)") { o.tau_mode = TauMode::ScaledSqrtD; o.tau = 0.2; }
  SUBCASE("projection") { o.projection = true; }
  SUBCASE("detach and Recompute (forward-only options)") {
    o.detach = true;
    o.memory = GraphMemory::Recompute;
  }
  SUBCASE("all at once") {
    o.exclude_self = true;
    o.tau_mode = TauMode::Learned;
    o.projection = true;
  }
  TransformerLM<SimilarityRouter, double> lm(cfg, 21);
  // move the learned parameters off their initial values (log_tau = log tau, W_s = I)
  auto& arena = lm.arena();
  for (index_t id = 0; id < arena.size(); ++id) {
    const std::string& name = arena.params()[static_cast<std::size_t>(id)].name;
    if (name.find("log_tau") != std::string::npos) arena.value(id).data()[0] += 0.3;
    if (name.find("w_s") != std::string::npos) {
      Rng rng(5);
      Tensor<double> w = arena.value(id);
      for (index_t j = 0; j < w.numel(); ++j) w.data()[j] += 0.2 * rng.normal();
    }
  }
  check_decode_matches_forward(lm, {random_ids(36, 23, 31), random_ids(20, 23, 32)}, 1e-12);
}

TEST_CASE("decode: a capacity limit does not drop tokens in decoding (dropless)") {
  // The full forward of one token at a time never drops either: the reference is a dropless model.
  TransformerLMConfig cfg = decode_config(20);
  TransformerLM<SimilarityRouter, double> dropless(cfg, 4);
  cfg.router.capacity_factor = 0.5;
  TransformerLM<SimilarityRouter, double> capped(cfg, 4);
  const auto seqs = std::vector<std::vector<std::int32_t>>{random_ids(20, 23, 41), random_ids(20, 23, 42),
                                                           random_ids(20, 23, 43), random_ids(20, 23, 44)};
  auto c1 = dropless.decode_cache(4), c2 = capped.decode_cache(4);
  Tensor<double> l1, l2;
  for (index_t i = 0; i < 20; ++i) {
    DecodeRows rows;
    Tensor<std::int32_t> x(Shape{4});
    for (index_t s = 0; s < 4; ++s) {
      rows.slot.push_back(s);
      rows.pos.push_back(i);
      x.data()[s] = seqs[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)];
    }
    dropless.decode(x, rows, c1, l1);
    capped.decode(x, rows, c2, l2);
    CHECK(dropped_count(capped.block(0).moe().routing().selection) == 0);
    for (index_t j = 0; j < l1.numel(); ++j) REQUIRE(l1.data()[j] == l2.data()[j]);
  }
}

TEST_CASE_TEMPLATE("decode: a slot reset or rewound continues as if its later tokens were never decoded",
                   Policy, SimilarityRouter, AttentionRouter) {
  TransformerLM<Policy, double> lm(decode_config(25), 5);  // 24 tokens and one more step
  Decoder<Policy, double> dec(lm, 1);
  const auto a = random_ids(24, 23, 51), b = random_ids(15, 23, 52);
  Decoder<Policy, double> fresh(lm, 1);
  auto run_on = [&](Decoder<Policy, double>& d, const std::vector<std::int32_t>& ids, std::size_t from) {
    for (std::size_t i = from; i < ids.size(); ++i) (void)d.step({0}, {ids[i]});
    const Tensor<double>& l = d.step({0}, {ids[0]});  // one more step: the logits after ids
    std::vector<double> out(l.data(), l.data() + l.numel());
    d.rewind(0, static_cast<index_t>(ids.size()));
    return out;
  };
  auto run = [&](const std::vector<std::int32_t>& ids, std::size_t from) { return run_on(dec, ids, from); };
  (void)run(a, 0);
  dec.reset(0);
  const std::vector<double> after_reset = run(b, 0);
  // a's first 10 tokens, then b's from 10 on, rewound onto a's 24
  dec.reset(0);
  (void)run(a, 0);
  dec.rewind(0, 10);
  std::vector<std::int32_t> mixed(a.begin(), a.begin() + 10);
  mixed.insert(mixed.end(), b.begin() + 10, b.end());
  const std::vector<double> rewound = run(mixed, 10);
  const std::vector<double> alone_b = run_on(fresh, b, 0);
  fresh.reset(0);
  const std::vector<double> alone_mixed = run_on(fresh, mixed, 0);
  for (std::size_t j = 0; j < alone_b.size(); ++j) {
    CHECK(after_reset[j] == alone_b[j]);
    CHECK(rewound[j] == alone_mixed[j]);
  }
  CHECK_THROWS_WITH_AS(dec.rewind(0, 99), doctest::Contains("can be rewound to 0..15"), Error);
}

TEST_CASE("decode: the routing cache holds what each graph declares, beside the KV cache's 2D") {
  TransformerLMConfig cfg = decode_config(16);  // D = 12, E = 5, H = 3, 2 blocks
  TransformerLM<SoftmaxRouter, double> soft(cfg, 1);
  TransformerLM<SimilarityRouter, double> sim(cfg, 1);
  TransformerLM<AttentionRouter, double> att(cfg, 1);
  CHECK(soft.decode_cache(2).kv_values_per_token() == 2 * 2 * 12);
  CHECK(soft.decode_cache(2).routing_values_per_token() == 0);
  CHECK(sim.decode_cache(2).routing_values_per_token() == 2 * (12 + 5));  // u and r
  CHECK(att.decode_cache(2).routing_values_per_token() == 2 * (5 + 2 * 3));  // r, two per head
}

TEST_CASE("decode: bad steps are refused with a message naming the problem") {
  TransformerLM<SimilarityRouter, double> lm(decode_config(8), 1);
  auto cache = lm.decode_cache(2);
  Tensor<double> logits;
  Tensor<std::int32_t> one(Shape{1}), two(Shape{2});
  CHECK_THROWS_WITH_AS(lm.decode(one, DecodeRows{{2}, {0}}, cache, logits),
                       doctest::Contains("outside the cache's [0, 2)"), Error);
  CHECK_THROWS_WITH_AS(lm.decode(one, DecodeRows{{0}, {8}}, cache, logits),
                       doctest::Contains("position 8"), Error);
  CHECK_THROWS_WITH_AS(lm.decode(two, DecodeRows{{1, 1}, {0, 0}}, cache, logits),
                       doctest::Contains("consecutive increasing positions"), Error);
  CHECK_THROWS_WITH_AS(lm.decode(two, DecodeRows{{0}, {0}}, cache, logits),
                       doctest::Contains("ids must be (1)"), Error);
  one.data()[0] = 99;
  CHECK_THROWS_AS(lm.decode(one, DecodeRows{{0}, {0}}, cache, logits), Error);
  CHECK_THROWS_WITH_AS(lm.decode_cache(1, 9), doctest::Contains("max_len in [1, max_seq_len = 8]"),
                       Error);
}

TEST_CASE("decode: a model reloaded from a checkpoint rebuilds the same routing caches") {
  // the learned temperature and W_s live in the checkpoint; the caches are rebuilt from them
  TransformerLMConfig cfg = decode_config(24);
  cfg.router.options<Similarity>().tau_mode = TauMode::Learned;
  cfg.router.options<Similarity>().projection = true;
  TransformerLM<SimilarityRouter, double> a(cfg, 61);
  for (index_t id = 0; id < a.arena().size(); ++id) {  // parameters off their initial values
    Tensor<double> w = a.arena().value(id);
    Rng rng(static_cast<std::uint64_t>(id) + 1);
    for (index_t j = 0; j < w.numel(); ++j) w.data()[j] += 0.05 * rng.normal();
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("graphmoe_decode_" + std::to_string(::getpid()) + ".safetensors")).string();
  std::vector<TensorRef> refs;
  append_arena(refs, a.arena());
  save_safetensors(path, refs, {});
  TransformerLM<SimilarityRouter, double> b(cfg, 62);  // another init, then the checkpoint
  load_arena(load_safetensors(path), b.arena());
  std::filesystem::remove(path);
  Decoder<SimilarityRouter, double> da(a, 1), db(b, 1);
  const auto ids = random_ids(24, 23, 63);
  for (std::int32_t id : ids) {
    const Tensor<double>& la = da.step({0}, {id});
    const std::vector<double> want(la.data(), la.data() + la.numel());
    const Tensor<double>& lb = db.step({0}, {id});
    for (std::size_t j = 0; j < want.size(); ++j) REQUIRE(lb.data()[j] == want[j]);
  }
}

TEST_CASE("decode: a backward after a decode step is refused (the forward caches were overwritten)") {
  TransformerLM<SoftmaxRouter, double> lm(decode_config(8), 1);
  Tensor<std::int32_t> ids(Shape{1, 4}), targets(Shape{1, 4});
  (void)lm.forward(ids, targets);
  auto cache = lm.decode_cache(1);
  Tensor<double> logits;
  lm.decode(Tensor<std::int32_t>(Shape{1}), DecodeRows{{0}, {0}}, cache, logits);
  CHECK_THROWS_WITH_AS(lm.backward(), doctest::Contains("call forward with targets first"), Error);
}
