// Incremental decoding (TransformerLM::decode, the KV and routing caches): for every causal router
// the logits of token t decoded one step at a time equal the full forward's logits at t (double:
// 1e-12; float: 2e-5 of the logits' scale), with the same experts chosen at every step, over 200+
// tokens and over several slots decoded together at different positions. Plus the routing cache's
// size and bad steps.
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

}  // namespace

TEST_CASE_TEMPLATE("decode: every causal router's decoded logits equal the full forward's, in double",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SimilarityXMoERouter, AttentionXMoERouter, SMoEDropoutRouter,
                   SimilaritySMoEDropoutRouter, AttentionSMoEDropoutRouter) {
  TransformerLMConfig cfg = decode_config(210);
  TransformerLM<Policy, double> lm(cfg, 3);
  lm.set_mode(Mode::Eval);
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
    CHECK(capped.block(0).moe().routing().selection.dropped == 0);
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
                       doctest::Contains("appears twice"), Error);
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
