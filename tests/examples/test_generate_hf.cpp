// examples/generate --hf on a Hugging Face model directory written by the test (nothing
// downloaded): a random OLMoE model of 2 layers saved with graphmoe/hf/writer.hpp beside a small
// byte-level BPE tokenizer.json written by hand (GPT-2's layout, a TemplateProcessing that adds
// <s>, </s> as eos). The program's stdout must be the text the same loaded model generates
// in-process (hf::load_lm + graphmoe::generate with the same options, decoded by the tokenizer),
// greedy and sampled; an eos id of config.json's list ends the output; and the command lines that
// do not apply are refused naming what is wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graphmoe/core/threads.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/hf/tokenizer.hpp"
#include "graphmoe/hf/writer.hpp"
#include "graphmoe/inference/generate.hpp"
#include "examples_routers.hpp"  // built_for_cpu<Policy>
#include "support/byte_level_tokenizer.hpp"
#include "support/deepseek_config.hpp"
#include "support/processes.hpp"

#if !defined(GRAPHMOE_GENERATE)
#error "GRAPHMOE_GENERATE (the executable) must be defined by CMake"
#endif

using namespace graphmoe;

namespace {

const std::string kGenerate = GRAPHMOE_GENERATE;
constexpr index_t kModelVocab = 320;  // above the tokenizer's ids: the rest must never be drawn
constexpr index_t kContext = 64;      // max_position_embeddings

using test::check_refused;
using test::Result;
using test::Scratch;

Result run(const Scratch& s, const std::vector<std::string>& args) {
  return test::run_program(s, "", kGenerate, args, 60);
}

// A byte-level BPE tokenizer.json whose post-processor puts <s> first, with a few words merged
// into one token each.
nlohmann::json tokenizer_json() {
  return test::byte_level_tokenizer_json(
      {" the", " king", " said", " and", " of", "the", " Lord", " \xc3\xa9"}, true);
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  REQUIRE(out.good());
}

using LM = TransformerLM<SoftmaxRouter, float, cpu>;

// A random OLMoE of 2 layers, d_model 32, 4 experts of top 2, vocabulary kModelVocab.
TransformerLMConfig olmoe_config() {
  TransformerLMConfig c = TransformerLMConfig::preset("olmoe", kModelVocab);
  c.num_layers = 2;
  c.d_model = 32;
  c.num_heads = 4;
  c.expert_d_ff = 16;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.max_seq_len = kContext;
  return c;
}

// Saves lm as OLMoE into dir with config.json's eos_token_id `eos`; with_tokenizer: the tokenizer
// files beside it.
void save_model(const LM& lm, const std::string& dir, const std::vector<std::int64_t>& eos,
                bool with_tokenizer) {
  hf::ModelConfig mc = hf::to_model_config(lm.config(), hf::Family::Olmoe);
  mc.bos_token_ids = {0};
  mc.eos_token_ids = eos;
  hf::save_lm(lm, mc, dir);
  if (!with_tokenizer) return;
  write(dir + "/tokenizer.json", tokenizer_json().dump());
  write(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
}

// What generate --hf should print for prompt under opt: the same model loaded in-process,
// graphmoe::generate, and the tokenizer's decode of the new text (special tokens skipped).
struct Expected {
  std::vector<std::int32_t> tokens;
  std::string text;
};
template <class Router = SoftmaxRouter>
Expected expected(const std::string& dir, const std::string& prompt, GenerateOptions opt) {
  set_num_threads(1);
  auto lm = hf::load_lm<Router, float>(dir);
  auto tok = hf::load_tokenizer(dir);
  const std::vector<std::int32_t> ids = tok->encode(prompt);
  REQUIRE(!ids.empty());
  CHECK(ids.front() == 0);  // <s>, from the post-processor
  const hf::ModelConfig mc = hf::Checkpoint::open(dir).config();
  for (std::int64_t e : mc.eos_token_ids) opt.stop_ids.push_back(static_cast<std::int32_t>(e));
  opt.stop_ids.push_back(*tok->eos_id());
  for (index_t id = tok->vocab_size(); id < kModelVocab; ++id) opt.sampling.banned.push_back(static_cast<std::int32_t>(id));
  const GenerateResult r = generate(*lm, ids, opt);
  std::vector<std::int32_t> all = ids;
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  const std::string before = tok->decode(ids, true), after = tok->decode(all, true);
  REQUIRE(after.compare(0, before.size(), before) == 0);
  return {r.tokens, after.substr(before.size())};
}

// A Llama-2-style tokenizer.json (Metaspace by normalizer, BPE with byte fallback, a decoder that
// fuses bytes) of 10 tokens: <unk> <s> </s> <0x1F> <0x9F> ▁ i r t ▁i. <0x1F> alone is a
// character; <0x1F> <0x9F> together are two U+FFFD: a stream that printed the first must not fail.
nlohmann::json byte_fallback_tokenizer_json() {
  const std::string sp = "\u2581";
  auto special = [](int id, const std::string& content) {
    return nlohmann::json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                          {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"<0x1F>", 3}, {"<0x9F>", 4},
                          {sp, 5}, {"i", 6}, {"r", 7}, {"t", 8}, {sp + "i", 9}};
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers", {{{"type", "Prepend"}, {"prepend", sp}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", sp}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", nullptr},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", sp}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"},
        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
        {"fuse_unk", true}, {"byte_fallback", true}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", nlohmann::json::array({sp + " i"})}}},
  };
}

// A batch line as generate prints it: line breaks as \n, backslashes as \\.
std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\\') out += "\\\\";
    else out += c;
  }
  return out;
}

std::vector<std::string> hf_args(const std::string& dir, const std::string& prompt,
                                 std::vector<std::string> extra) {
  std::vector<std::string> a = {"--hf", dir, "--prompt", prompt, "--threads", "1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("generate --hf: stdout is the text the same model generates in-process, greedy and sampled, and an eos of config.json's list ends it") {
  Scratch s("generate_hf");
  const std::string dir = s / "olmoe";
  const LM lm(olmoe_config(), 7);
  save_model(lm, dir, {1}, true);
  const std::string prompt = " the king said é";

  GenerateOptions greedy;
  greedy.max_new_tokens = 20;
  greedy.sampling.greedy = true;
  const Expected g = expected(dir, prompt, greedy);
  CHECK(g.tokens.size() == 20);  // </s> is not drawn by this model in 20 tokens
  const Result a = run(s, hf_args(dir, prompt, {"--greedy", "--max-new-tokens", "20"}));
  INFO(a.text());
  REQUIRE(a.status == 0);
  CHECK(a.out == g.text + "\n");
  CHECK(a.err.find("generate: prompt (") != std::string::npos);
  CHECK(a.err.find("<s> the king said é") != std::string::npos);  // the prompt as read, with <s>
  CHECK(a.err.find("OlmoeForCausalLM") != std::string::npos);
  CHECK(a.err.find("name no token of") != std::string::npos);  // the ids past the tokenizer
  CHECK(a.err.find("20 tokens in ") != std::string::npos);

  GenerateOptions sampled;
  sampled.max_new_tokens = 16;
  sampled.sampling.seed = 5;
  sampled.sampling.temperature = 0.8;
  sampled.sampling.top_k = 40;
  sampled.sampling.repeat_penalty = 1.2;
  sampled.sampling.repeat_last_n = 8;
  const Expected t = expected(dir, prompt, sampled);
  const Result b = run(s, hf_args(dir, prompt, {"--max-new-tokens", "16", "--seed", "5", "--temperature", "0.8",
                                                "--top-k", "40", "--repeat-penalty", "1.2", "--repeat-last-n", "8"}));
  INFO(b.text());
  REQUIRE(b.status == 0);
  CHECK(b.out == t.text + "\n");

  // config.json's eos_token_id as a list [</s>, the third greedy token]: the output ends with it
  REQUIRE(g.tokens.size() >= 3);
  const std::int32_t stop = g.tokens[2];
  const std::string dir2 = s / "olmoe_eos";
  save_model(lm, dir2, {1, stop}, true);
  const Expected e = expected(dir2, prompt, greedy);
  const auto first = std::find(g.tokens.begin(), g.tokens.end(), stop);
  CHECK(e.tokens == std::vector<std::int32_t>(g.tokens.begin(), first + 1));
  const Result c = run(s, hf_args(dir2, prompt, {"--greedy", "--max-new-tokens", "20"}));
  INFO(c.text());
  REQUIRE(c.status == 0);
  CHECK(c.out == e.text + "\n");
  CHECK(c.err.find("stopped at the end-of-text token") != std::string::npos);

  // --ban of one token's text; --explain shows the tokens' text
  const Result d = run(s, hf_args(dir, prompt, {"--greedy", "--max-new-tokens", "4", "--ban", " the", "--explain"}));
  INFO(d.text());
  REQUIRE(d.status == 0);
  std::size_t lines = 0;
  for (std::size_t at = 0; (at = d.out.find('\n', at)) != std::string::npos; ++at) ++lines;
  CHECK(lines == 4);
  CHECK(d.out.rfind("[5] \"", 0) == 0);  // <s> and 4 prompt tokens: the first new one is at 5
  CHECK(d.out.find(" | block 0: experts ") != std::string::npos);
}

TEST_CASE("generate --hf: byte tokens that regroup into replacement characters do not stop the stream") {
  Scratch s("generate_hf_bytes");
  const std::string dir = s / "llama";
  TransformerLMConfig c = TransformerLMConfig::preset("llama", 10);
  c.num_layers = 1;
  c.d_model = 16;
  c.num_heads = 2;
  c.attention.num_kv_heads = 1;
  c.d_ff = 16;
  c.max_seq_len = kContext;
  const LM lm(c, 3);
  hf::ModelConfig mc = hf::to_model_config(lm.config(), hf::Family::Llama);
  mc.eos_token_ids = {2};
  hf::save_lm(lm, mc, dir);
  write(dir + "/tokenizer.json", byte_fallback_tokenizer_json().dump());

  // in-process: 48 samples (output j draws with seed 11 + j), </s> banned; some must make
  // hf::StreamDecoder refuse an id (the case generate recovers from)
  set_num_threads(1);
  auto loaded = hf::load_lm<SoftmaxRouter, float>(dir);
  auto tok = hf::load_tokenizer(dir);
  const std::vector<std::int32_t> prompt = tok->encode("it");
  REQUIRE(prompt == std::vector<std::int32_t>{1, 9, 8});
  GenerateOptions opt;
  opt.max_new_tokens = 20;
  opt.sampling.seed = 11;
  opt.sampling.temperature = 1.5;
  opt.sampling.banned = {2};
  opt.stop_ids = {2};
  const std::size_t n = 48;
  const std::vector<GenerateResult> rs =
      generate_batch(*loaded, std::vector<std::vector<std::int32_t>>(n, prompt), opt);
  // regrouped[j]: the stream refuses an id, or its text is not the decode of all the ids
  const std::string before = tok->decode(prompt, true);
  std::vector<std::string> texts(n);
  std::vector<bool> regrouped(n, false);
  std::size_t refused = 0;
  for (std::size_t j = 0; j < n; ++j) {
    std::vector<std::int32_t> all = prompt;
    all.insert(all.end(), rs[j].tokens.begin(), rs[j].tokens.end());
    texts[j] = tok->decode(all, true).substr(before.size());
    hf::StreamDecoder d(*tok, true);
    std::string streamed;
    try {
      for (std::int32_t id : prompt) d.step(id);
      for (std::int32_t id : rs[j].tokens) streamed += d.step(id);
      streamed += d.finish();
    } catch (const Error&) {
      ++refused;
      regrouped[j] = true;
    }
    if (streamed != texts[j]) regrouped[j] = true;
  }
  REQUIRE(refused >= 1);

  const Result r = run(s, hf_args(dir, "it", {"--num-samples", std::to_string(n), "--max-new-tokens", "20",
                                              "--seed", "11", "--temperature", "1.5", "--ban", "</s>"}));
  INFO(r.text());
  REQUIRE(r.status == 0);
  std::vector<std::string> lines;
  std::size_t at = 0;
  for (std::size_t nl; (nl = r.out.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(r.out.substr(at, nl - at));
  REQUIRE(lines.size() == n);
  std::size_t same = 0;
  for (std::size_t j = 0; j < n; ++j) {
    CAPTURE(j);
    if (regrouped[j]) {
      CHECK(!lines[j].empty());
    } else {
      CHECK(lines[j] == one_line(texts[j]));
      ++same;
    }
  }
  CHECK(same >= n / 2);
}

TEST_CASE("generate --hf: what does not apply is refused by name, with exit status 1") {
  Scratch s("generate_hf_refused");
  const std::string dir = s / "olmoe";
  const LM lm(olmoe_config(), 7);
  save_model(lm, dir, {1}, true);
  const std::string bare = s / "no_tokenizer";
  save_model(lm, bare, {1}, false);
  write(s / "ckpt.safetensors", "x");

  check_refused(run(s, {"--hf", dir, "--checkpoint", s / "ckpt.safetensors", "--prompt", "the"}),
                {"--checkpoint excludes --hf"});
  check_refused(run(s, {"--prompt", "the"}), {"give the model: --checkpoint FILE with --vocab FILE", "--hf DIR"});
  check_refused(run(s, {"--checkpoint", s / "ckpt.safetensors", "--prompt", "the"}), {"--checkpoint needs --vocab"});
  const Result nt = run(s, hf_args(bare, "the", {}));
  check_refused(nt, {bare, "has neither tokenizer.json nor tokenizer.model"});
  CHECK(nt.status == 1);
  const Result nd = run(s, hf_args(s / "nowhere", "the", {}));
  check_refused(nd, {"nowhere", "is not a directory"});
  CHECK(nd.status == 1);
  std::string long_prompt;
  for (int i = 0; i < 70; ++i) long_prompt += " the";  // 70 tokens and <s>
  check_refused(run(s, hf_args(dir, long_prompt, {})),
                {"--prompt is 71 tokens, longer than the model's context of max_position_embeddings = 64"});
  check_refused(run(s, hf_args(dir, "the", {"--ban", " the king"})),
                {"--ban ' the king' is 2 tokens", "\" the\" \" king\"", "one token"});
  check_refused(run(s, hf_args(dir, "the", {"--device", "cuda"})), {"--hf with --device cuda", "CPU only"});
}

TEST_CASE("generate --hf: a DeepSeek-V3 model runs with its own router (SigmoidBiasRouter)") {
  if constexpr (!examples::built_for_cpu<SigmoidBiasRouter>) return;
  Scratch s("generate_hf_deepseek");
  const std::string dir = s / "deepseek";
  const hf::ModelConfig mc = test::deepseek_v3_config(kModelVocab, kContext);
  TransformerLM<SigmoidBiasRouter, float, cpu> lm(mc.lm, 7);
  // a selection bias of its own, so that a model routed without it would choose otherwise
  Tensor<float> bias = lm.arena().value(lm.arena().find("blocks.1.moe.router.selector.expert_bias"));
  for (index_t e = 0; e < bias.numel(); ++e) bias.data()[e] = 0.05f * static_cast<float>(e % 3) - 0.05f;
  hf::save_lm(lm, mc, dir);
  write(dir + "/tokenizer.json", tokenizer_json().dump());
  write(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  const std::string prompt = " the king said";
  GenerateOptions greedy;
  greedy.max_new_tokens = 12;
  greedy.sampling.greedy = true;
  const Expected g = expected<SigmoidBiasRouter>(dir, prompt, greedy);
  const Result a = run(s, hf_args(dir, prompt, {"--greedy", "--max-new-tokens", "12"}));
  INFO(a.text());
  REQUIRE(a.status == 0);
  CHECK(a.out == g.text + "\n");
  CHECK(a.err.find("DeepseekV3ForCausalLM") != std::string::npos);
  CHECK(a.err.find("SigmoidBiasRouter") != std::string::npos);
}
