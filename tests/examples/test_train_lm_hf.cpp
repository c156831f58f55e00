// examples/train_lm --hf on a Hugging Face model directory written by the test (nothing
// downloaded): a random OLMoE of 2 layers saved with graphmoe/hf/writer.hpp beside a small
// byte-level BPE tokenizer.json written by hand (<s> 0, </s> 1 the eos, the 256 bytes, a few
// merged words), and a corpus of a few dozen lines. Seconds in all.
//
//   the loaded model          --lr 1e-30 (far below float's resolution): the first validation
//                             loss is the directory's model's own loss on the same tokens,
//                             computed here (hf::Checkpoint::load + forward), bit for bit
//   graph upcycling           --router blended-similarity (a = 0): the same loss, bit for bit
//   --save-hf                 a directory that hf::load_lm reads back to the trained parameters
//                             (the checkpoint's), bit for bit in F32, with the tokenizer files;
//                             --resume continues an --hf run
//   refusals                  --hf with a model-shape flag, --save-hf with a graph router without
//                             --save-hf-drop-graph, a directory that does not load (exit 1)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples_routers.hpp"
#include "graphmoe/core/threads.hpp"
#include "graphmoe/hf/reader.hpp"
#include "graphmoe/hf/tokenizer.hpp"
#include "graphmoe/hf/writer.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/training_state.hpp"
#include "support/byte_level_tokenizer.hpp"
#include "support/deepseek_config.hpp"
#include "support/processes.hpp"

#if !defined(GRAPHMOE_TRAIN_LM)
#error "GRAPHMOE_TRAIN_LM (the executable) must be defined by CMake"
#endif

using namespace graphmoe;
namespace fs = std::filesystem;

namespace {

const std::string kTrainLM = GRAPHMOE_TRAIN_LM;
constexpr index_t kModelVocab = 300;  // above the tokenizer's ids
constexpr index_t kContext = 64;      // max_position_embeddings
constexpr index_t kSeq = 16, kBatch = 2;

using test::check_refused;
using test::Result;
using test::Scratch;
using test::slurp;

Result run(const Scratch& s, const std::vector<std::string>& args) {
  return test::run_program(s, "", kTrainLM, args, 90);
}

const std::vector<std::string> kWords = {"the", "king", "said", "and", "of", "land", "came", "to"};

// A byte-level BPE tokenizer.json: <s> 0 and </s> 1 (special), the 256 bytes, and the merges that
// make each of kWords with a leading space one token.
nlohmann::json tokenizer_json() {
  std::vector<std::string> words;
  for (const std::string& w : kWords) words.push_back(" " + w);
  return test::byte_level_tokenizer_json(words, false);
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  REQUIRE(out.good());
}

// `lines` lines of 6 to 9 words of kWords (a leading space before each but the first).
void write_corpus(const std::string& path, int lines, unsigned seed) {
  std::ofstream out(path);
  unsigned x = seed;
  for (int l = 0; l < lines; ++l) {
    x = x * 1103515245u + 12345u;
    const int n = 6 + static_cast<int>((x >> 16) % 4);
    for (int w = 0; w < n; ++w) {
      x = x * 1103515245u + 12345u;
      out << (w ? " " : "") << kWords[(x >> 16) % kWords.size()];
    }
    out << "\n";
    if (l % 7 == 3) out << "\n";  // empty lines are skipped
  }
}

using LM = TransformerLM<SoftmaxRouter, float, cpu>;

// A random OLMoE: 2 layers, d_model 32, 4 experts of top 2, vocabulary kModelVocab, saved F32
// with the tokenizer files beside it.
void write_model(const std::string& dir) {
  TransformerLMConfig c = TransformerLMConfig::preset("olmoe", kModelVocab);
  c.num_layers = 2;
  c.d_model = 32;
  c.num_heads = 4;
  c.expert_d_ff = 16;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.max_seq_len = kContext;
  const LM lm(c, 11);
  hf::ModelConfig mc = hf::to_model_config(lm.config(), hf::Family::Olmoe);
  mc.bos_token_ids = {0};
  mc.eos_token_ids = {1};
  hf::save_lm(lm, mc, dir);
  write(dir + "/tokenizer.json", tokenizer_json().dump());
  write(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
}

// The text as train_lm --hf reads it: every non-empty line without special tokens, then </s>.
std::vector<std::int32_t> encode_lines(const hf::Tokenizer& tok, const std::string& path) {
  std::vector<std::int32_t> ids;
  std::istringstream in(slurp(path));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto l = tok.encode(line, false);
    ids.insert(ids.end(), l.begin(), l.end());
    ids.push_back(1);
  }
  return ids;
}

// The directory's model (declared with --seq's context) on the validation text: the mean over
// kBatch x kSeq batches of the cross-entropy, as train_lm evaluates.
double loaded_model_loss(const std::string& dir, const std::string& valid) {
  set_num_threads(1);
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  TransformerLMConfig cfg = ck.config().lm;
  cfg.max_seq_len = kSeq;
  LM lm(cfg, LM::NoInit{});
  ck.load(lm);
  const auto tok = hf::load_tokenizer(dir);
  const std::vector<std::int32_t> ids = encode_lines(*tok, valid);
  const LMBatcher batches(ids, kBatch, kSeq);
  REQUIRE(batches.num_batches() >= 2);
  ModeScope<LM> eval(lm, Mode::Eval);
  double sum = 0;
  for (index_t i = 0; i < batches.num_batches(); ++i) {
    const LMBatch b = batches.batch(i);
    sum += lm.forward(b.inputs, b.targets).task;
  }
  return sum / static_cast<double>(batches.num_batches());
}

// metrics.csv's val_loss column, as written (full precision).
std::vector<std::string> val_losses(const std::string& csv) {
  std::istringstream in(slurp(csv));
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  for (std::istringstream h(line); std::getline(h, line, ',');) header.push_back(line);
  const auto col = static_cast<std::size_t>(
      std::find(header.begin(), header.end(), "val_loss") - header.begin());
  std::vector<std::string> out;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    for (std::istringstream l(line); std::getline(l, line, ',');) f.push_back(line);
    if (col < f.size()) out.push_back(f[col]);
  }
  return out;
}

std::vector<std::string> hf_args(const std::string& dir, const std::string& train,
                                 const std::string& valid, const std::string& out,
                                 std::vector<std::string> extra) {
  std::vector<std::string> a = {"--hf", dir, "--train", train, "--valid", valid, "--test", "",
                                "--seq", std::to_string(kSeq), "--batch", std::to_string(kBatch),
                                "--warmup", "0", "--eval-every", "1", "--threads", "1",
                                "--out", out};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::vector<float> values_of(const ParameterArena<float>& a) {
  const auto& v = a.values();
  return std::vector<float>(v.data(), v.data() + v.numel());
}

}  // namespace

TEST_CASE("train_lm --hf: the first validation loss is the loaded model's own, bit for bit, blended-similarity starts from the same") {
  Scratch s("train_lm_hf");
  const std::string dir = s / "olmoe", train = s / "train.txt", valid = s / "valid.txt";
  write_model(dir);
  write_corpus(train, 60, 3);
  write_corpus(valid, 20, 5);
  const double expected = loaded_model_loss(dir, valid);

  const std::vector<std::string> tiny_lr = {"--steps", "1", "--lr", "1e-30", "--min-lr", "1e-30"};
  const Result a = run(s, hf_args(dir, train, valid, s / "softmax", tiny_lr));
  INFO(a.text());
  REQUIRE(a.status == 0);
  CHECK(a.err.find("OlmoeForCausalLM") != std::string::npos);
  CHECK(a.err.find("(lines end with id") != std::string::npos);
  CHECK(a.err.find(" )") == std::string::npos);  // the separator's ids, no space before ')'
  CHECK(a.out.find("sample: ") != std::string::npos);  // decoded by the tokenizer
  const std::vector<std::string> va = val_losses(s / "softmax/metrics.csv");
  REQUIRE(va.size() == 1);
  CHECK(std::stod(va[0]) == expected);

  if constexpr (examples::built_for_cpu<BlendedSimilarityRouter>) {
    const Result b = run(s, hf_args(dir, train, valid, s / "blended",
                                    {"--steps", "1", "--lr", "1e-30", "--min-lr", "1e-30",
                                     "--router", "blended-similarity"}));
    INFO(b.text());
    REQUIRE(b.status == 0);
    const std::vector<std::string> vb = val_losses(s / "blended/metrics.csv");
    REQUIRE(vb.size() == 1);
    CHECK(vb[0] == va[0]);  // a = 0: the same model, bit for bit
  }
}

TEST_CASE("train_lm --hf --save-hf: the saved directory loads back to the trained parameters, with the tokenizer, --resume continues") {
  Scratch s("train_lm_hf_save");
  const std::string dir = s / "olmoe", train = s / "train.txt", valid = s / "valid.txt";
  write_model(dir);
  write_corpus(train, 60, 3);
  write_corpus(valid, 20, 5);
  const std::string out = s / "run", saved = s / "saved";
  const Result r = run(s, hf_args(dir, train, valid, out,
                                  {"--steps", "3", "--lr", "1e-2", "--sample-tokens", "0",
                                   "--save-hf", saved, "--save-hf-dtype", "f32"}));
  INFO(r.text());
  REQUIRE(r.status == 0);
  CHECK(r.err.find("saved the model to") != std::string::npos);

  // the trained parameters: train_lm's checkpoint, into the directory's model
  const hf::Checkpoint ck = hf::Checkpoint::open(dir);
  TransformerLMConfig cfg = ck.config().lm;
  cfg.max_seq_len = kSeq;
  LM trained(cfg, LM::NoInit{});
  load_arena(load_safetensors(out + "/checkpoint.safetensors"), trained.arena(), "model.");
  auto back = hf::load_lm<SoftmaxRouter, float>(saved);
  CHECK(back->config().max_seq_len == kContext);  // config.json's, not --seq
  CHECK(values_of(back->arena()) == values_of(trained.arena()));
  auto original = hf::load_lm<SoftmaxRouter, float>(dir);
  CHECK(values_of(original->arena()) != values_of(trained.arena()));  // it did train
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    CHECK(slurp(fs::path(saved) / f) == slurp(fs::path(dir) / f));
  const nlohmann::json in = nlohmann::json::parse(slurp(dir + "/config.json"));
  const nlohmann::json outj = nlohmann::json::parse(slurp(saved + "/config.json"));
  CHECK(outj == in);  // the same keys and values (F32 in, F32 out)
  const auto tok = hf::load_tokenizer(saved);
  CHECK(tok->eos_id() == std::optional<std::int32_t>(1));

  // --resume continues the --hf run (its checkpoint records the tokenizer), to step 4
  const Result again = run(s, hf_args(dir, train, valid, out,
                                      {"--steps", "4", "--lr", "1e-2", "--sample-tokens", "0",
                                       "--resume"}));
  INFO(again.text());
  REQUIRE(again.status == 0);
  CHECK(again.err.find("resumed from") != std::string::npos);
  CHECK(val_losses(out + "/metrics.csv").size() == 4);
  // ... but not with another tokenizer
  const std::string other = s / "other";
  fs::copy(dir, other);
  write(other + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "<s>"})");
  check_refused(run(s, hf_args(other, train, valid, out, {"--steps", "5", "--resume"})),
                {"train_lm --resume", "tokenizer", "token ids would differ"});
  // ... nor without --hf
  check_refused(run(s, {"--train", train, "--valid", valid, "--test", "", "--seq", "16",
                        "--batch", "2", "--steps", "5", "--resume", "--out", out}),
                {"train_lm --resume"});
}

TEST_CASE("train_lm --hf: refusals") {
  Scratch s("train_lm_hf_refusals");
  const std::string dir = s / "olmoe", train = s / "train.txt", valid = s / "valid.txt";
  write_model(dir);
  write_corpus(train, 60, 3);
  write_corpus(valid, 20, 5);
  const std::vector<std::string> one = {"--steps", "1"};
  check_refused(run(s, hf_args(dir, train, valid, s / "a", {"--steps", "1", "--layers", "3"})),
                {"--layers is not an option of --hf", "fixes the model's shape"});
  check_refused(run(s, hf_args(dir, train, valid, s / "a", {"--steps", "1", "--arch", "qwen3-moe"})),
                {"--arch is not an option of --hf"});
  std::vector<std::string> long_seq = hf_args(dir, train, valid, s / "a", one);
  *(std::find(long_seq.begin(), long_seq.end(), "--seq") + 1) = "65";
  check_refused(run(s, long_seq), {"--seq 65", "max_position_embeddings"});
  check_refused(run(s, {"--train", train, "--steps", "1", "--save-hf", s / "x", "--out", s / "a"}),
                {"--save-hf needs --hf"});
  check_refused(run(s, hf_args(dir, train, valid, s / "a", {"--steps", "1", "--save-hf", dir})),
                {"--save-hf", "exists and is not an empty directory"});
  if constexpr (examples::built_for_cpu<BlendedSimilarityRouter>) {
    const Result g = run(s, hf_args(dir, train, valid, s / "a",
                                    {"--steps", "1", "--router", "blended-similarity",
                                     "--save-hf", s / "x"}));
    check_refused(g, {"--save-hf with --router blended-similarity", "--save-hf-drop-graph",
                      "without the graph"});
    CHECK(!fs::exists(s / "a"));  // refused before anything was read or written
    // with the flag: the linear router's weights, the graph dropped
    const Result d = run(s, hf_args(dir, train, valid, s / "a",
                                    {"--steps", "1", "--router", "blended-similarity",
                                     "--save-hf", s / "x", "--save-hf-drop-graph",
                                     "--sample-tokens", "0"}));
    INFO(d.text());
    CHECK(d.status == 0);
    CHECK(d.err.find("the token graph dropped") != std::string::npos);
    CHECK(fs::exists(s / "x/config.json"));
  }
  // a directory that does not load: the reader's error, exit 1
  const Result none = run(s, hf_args(s / "nowhere", train, valid, s / "b", one));
  check_refused(none, {"hf::Checkpoint::open", "is not a directory"});
  CHECK(none.status == 1);
  const std::string bad = s / "bad";
  fs::copy(dir, bad);
  nlohmann::json cj = nlohmann::json::parse(slurp(bad + "/config.json"));
  cj["hidden_act"] = "gelu";
  write(bad + "/config.json", cj.dump());
  const Result b = run(s, hf_args(bad, train, valid, s / "b", one));
  check_refused(b, {"config.json", "hidden_act"});
  CHECK(b.status == 1);
}

#if defined(GRAPHMOE_FINETUNE_CLASSIFIER)
// SST-2 in miniature under dir/sst2: sentences of kWords, the label whether "king" is in it.
void write_sst2(const std::string& dir) {
  fs::create_directories(dir + "/sst2");
  unsigned x = 7;
  for (const std::string split : {"train", "dev"}) {
    std::ofstream out(dir + "/sst2/" + split + ".tsv");
    out << "sentence\tlabel\n";
    for (int i = 0; i < (split == "train" ? 12 : 6); ++i) {
      std::string text;
      bool king = false;
      for (int w = 0; w < 5; ++w) {
        x = x * 1103515245u + 12345u;
        const std::string& word = kWords[(x >> 16) % kWords.size()];
        king |= word == "king";
        text += (w ? " " : "") + word;
      }
      out << text << "\t" << (king ? 1 : 0) << "\n";
    }
  }
}

TEST_CASE("finetune_classifier --hf: the backbone and the tokenizer from a Hugging Face directory") {
  Scratch s("finetune_hf");
  const std::string dir = s / "olmoe", data = s / "data";
  write_model(dir);
  write_sst2(data);
  auto finetune = [&](const std::vector<std::string>& more, const std::string& out) {
    std::vector<std::string> a = {"--task", "sst2", "--data-dir", data, "--epochs", "1",
                                  "--batch", "2", "--threads", "1", "--out", out};
    a.insert(a.end(), more.begin(), more.end());
    return test::run_program(s, "", GRAPHMOE_FINETUNE_CLASSIFIER, a, 90);
  };
  const Result hf = finetune({"--hf", dir}, s / "ft");
  REQUIRE_MESSAGE(hf.status == 0, hf.text());
  CHECK(hf.out.find("test_accuracy=") != std::string::npos);
  // the loaded backbone, not a fresh one: the same run from scratch trains another model
  const Result scratch = finetune({"--hf", dir, "--from-scratch"}, s / "ft_scratch");
  REQUIRE_MESSAGE(scratch.status == 0, scratch.text());
  CHECK(slurp(s / "ft/metrics.csv") != slurp(s / "ft_scratch/metrics.csv"));
  // refusals
  check_refused(finetune({"--hf", dir, "--checkpoint", dir + "/config.json"}, s / "x"),
                {"excludes"});
  check_refused(finetune({}, s / "x"), {"give the model: --checkpoint FILE with --vocab FILE",
                                        "or --hf DIR"});
  const std::string bare = s / "bare";
  fs::create_directories(bare);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(dir + "/" + f, bare + "/" + f);
  const Result none = finetune({"--hf", bare}, s / "x");
  CHECK(none.status == 1);
  CHECK(none.err.find("tokenizer") != std::string::npos);
}
#endif

TEST_CASE("train_lm --hf: a DeepSeek-V3 model fine-tunes with its own router, its selection bias keeps balancing, --save-hf writes it back") {
  if constexpr (!examples::built_for_cpu<SigmoidBiasRouter>) return;
  Scratch s("train_lm_hf_deepseek");
  const std::string dir = s / "deepseek", train = s / "train.txt", valid = s / "valid.txt";
  const hf::ModelConfig mc = test::deepseek_v3_config(kModelVocab, kContext);
  using DS = TransformerLM<SigmoidBiasRouter, float, cpu>;
  const DS lm(mc.lm, 11);
  hf::save_lm(lm, mc, dir);
  write(dir + "/tokenizer.json", tokenizer_json().dump());
  write(dir + "/tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  write_corpus(train, 60, 3);
  write_corpus(valid, 20, 5);
  const std::string out = s / "run", saved = s / "saved";
  // no --router: the family's own, sigmoid-bias
  const Result r = run(s, hf_args(dir, train, valid, out,
                                  {"--steps", "3", "--lr", "1e-2", "--sample-tokens", "0",
                                   "--bias-update-rate", "0.01", "--save-hf", saved,
                                   "--save-hf-dtype", "f32"}));
  INFO(r.text());
  REQUIRE(r.status == 0);
  CHECK(r.err.find("DeepseekV3ForCausalLM") != std::string::npos);
  CHECK(r.err.find("into --router sigmoid-bias") != std::string::npos);
  auto back = hf::load_lm<SigmoidBiasRouter, float>(saved);
  TransformerLMConfig cfg = mc.lm;
  cfg.max_seq_len = kSeq;
  DS trained(cfg, DS::NoInit{});
  load_arena(load_safetensors(out + "/checkpoint.safetensors"), trained.arena(), "model.");
  CHECK(values_of(back->arena()) == values_of(trained.arena()));
  // the selection bias moved: 3 steps of +-0.01 per expert
  const std::string bias = "blocks.1.moe.router.selector.expert_bias";
  const Tensor<float> b = back->arena().value(back->arena().find(bias));
  index_t moved = 0;
  for (index_t e = 0; e < b.numel(); ++e) moved += std::abs(b.data()[e]) > 0.005f ? 1 : 0;
  CHECK(moved > 0);
  const nlohmann::json sj = nlohmann::json::parse(slurp(saved + "/config.json"));
  CHECK(sj["architectures"][0] == "DeepseekV3ForCausalLM");
  // a router of the other kind is refused by name
  check_refused(run(s, hf_args(dir, train, valid, s / "softmax", {"--steps", "1", "--router", "softmax"})),
                {"--router softmax cannot load the DeepseekV3ForCausalLM", "sigmoid scores",
                 "sigmoid-bias"});
}
