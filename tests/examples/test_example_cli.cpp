// The example programs' command lines and checkpoints under hostile input (docs/reliability.md):
// each refusal is a non-zero exit with a message naming the option, the file or the field, before
// any work is done. The programs run as subprocesses on a tiny model and a tiny corpus written
// here (a few seconds in all); the paths of the four executables come from CMake.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "examples_routers.hpp"  // generated: built_for_cpu<Policy>, the examples' CPU routers
#include "graphmoe/core/threads.hpp"
#include "graphmoe/routing/registry.hpp"
#include "graphmoe/train/checkpoint.hpp"
#include "support/processes.hpp"

#ifndef GRAPHMOE_TRAIN_LM
#error "GRAPHMOE_TRAIN_LM (the train_lm executable) must be defined by CMake"
#endif

using namespace graphmoe;
namespace fs = std::filesystem;

namespace {

const std::string kTrainLM = GRAPHMOE_TRAIN_LM;
const std::string kTrainVision = GRAPHMOE_TRAIN_VISION;
const std::string kFinetune = GRAPHMOE_FINETUNE_CLASSIFIER;
const std::string kReport = GRAPHMOE_ROUTING_REPORT;

using test::check_refused;
using test::Result;
using test::Scratch;
using test::slurp;

// Runs `exe args...` with stdout and stderr captured, killed after two minutes (a refusal takes
// milliseconds; a command line wrongly accepted must not train for long).
Result run(const Scratch& s, const std::string& exe, const std::vector<std::string>& args) {
  return test::run_program(s, "", exe, args, 120);
}


// The tiny train_lm run every resume case starts from (about a second).
std::vector<std::string> lm_args(const std::string& corpus, const std::string& out, int steps) {
  return {"--train", corpus, "--test", "", "--valid-fraction", "0.5", "--router", "softmax",
          "--layers", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8", "--experts", "2",
          "--top-k", "1", "--seq", "8", "--batch", "2", "--steps", std::to_string(steps),
          "--warmup", "0", "--eval-every", "0", "--threads", "1", "--out", out};
}

// Rewrites the checkpoint `src` to `dst` after edit(tensors, metadata).
void rewrite(const std::string& src, const std::string& dst,
             const std::function<void(std::map<std::string, LoadedTensor>&,
                                      std::map<std::string, std::string>&)>& edit) {
  const SafetensorsFile f = load_safetensors(src);
  std::map<std::string, LoadedTensor> tensors = f.tensors;
  std::map<std::string, std::string> meta = f.metadata;
  edit(tensors, meta);
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : tensors) refs.push_back({name, t.dtype, t.shape, t.bytes.data()});
  save_safetensors(dst, refs, meta);
}

using Tensors = std::map<std::string, LoadedTensor>;
using Meta = std::map<std::string, std::string>;

// rewrite's edit that sets every F32 value of the "model." tensors whose names contain `only`
// (all of them when empty) to NaN when `value` is NaN, else multiplies it by `value` (hostile
// weights: 1e30, NaN).
std::function<void(Tensors&, Meta&)> scale_weights(float value, const std::string& only = "") {
  return [value, only](Tensors& t, Meta&) {
    for (auto& [name, x] : t) {
      if (name.rfind("model.", 0) != 0 || x.dtype != DType::F32) continue;
      if (!only.empty() && name.find(only) == std::string::npos) continue;
      for (std::size_t i = 0; i + 4 <= x.bytes.size(); i += 4) {
        float v;
        std::memcpy(&v, x.bytes.data() + i, 4);
        v = std::isnan(value) ? value : v * value;
        std::memcpy(x.bytes.data() + i, &v, 4);
      }
    }
  };
}

// SST-2 in miniature under dir/sst2: 8 training and 4 test sentences of the corpus' words.
void write_sst2(const std::string& dir) {
  fs::create_directories(dir + "/sst2");
  for (const char* split : {"train", "dev"}) {
    std::ofstream out(dir + "/sst2/" + split + ".tsv");
    out << "sentence\tlabel\n";
    for (int i = 0; i < (split[0] == 't' ? 8 : 4); ++i)
      out << (i % 2 ? "a good film" : "the film was bad") << "\t" << i % 2 << "\n";
  }
}

}  // namespace

TEST_CASE("examples: --threads beyond 4 x the hardware threads is refused by every example") {
  Scratch s("threads");
  const std::string file = s / "any.txt";
  std::ofstream(file) << "x\n";
  const std::string limit = "the limit is " + std::to_string(max_num_threads()) + " = 4 x the " +
                            std::to_string(hardware_threads()) + " hardware threads";
  const std::vector<std::pair<std::string, std::vector<std::string>>> programs = {
      {kTrainLM, {}},
      {kTrainVision, {}},
      {kFinetune, {"--checkpoint", file, "--vocab", file}},
      {kReport, {"--checkpoint", file}}};
  for (const auto& [exe, base] : programs) {
    // 100000 crashed in GOMP_parallel, 40000 aborted, 5000 crawled
    for (const std::string& n : std::vector<std::string>{"100000", "40000", "5000",
                                                          std::to_string(max_num_threads() + 1)}) {
      CAPTURE(exe);
      CAPTURE(n);
      std::vector<std::string> args = base;
      args.insert(args.end(), {"--threads", n});
      check_refused(run(s, exe, args), {"--threads: value " + n + " is out of range", limit});
    }
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--threads", "0"});
    check_refused(run(s, exe, args), {"--threads: value 0 is out of range; expected an integer in [1, "});
  }
}

TEST_CASE("examples: every numeric option refuses out-of-range and malformed numbers") {
  Scratch s("ranges");
  const std::string file = s / "any.txt";
  std::ofstream(file) << "x\n";
  const std::string huge = "99999999999999999999";  // clamped to 2^63 - 1 by CLI11 2.1
  struct Case {
    std::string option, value, message;
  };
  // Integers: the 2^63 - 1 clamp, out of the sane range, negative, not a number, not an integer.
  const std::vector<std::string> lm_ints = {
      "--max-vocab", "--layers", "--d-model", "--heads", "--d-ff", "--experts", "--top-k",
      "--seq", "--k-min", "--k-max", "--steps", "--batch", "--warmup", "--eval-every",
      "--eval-batches", "--checkpoint-every", "--seed", "--attack-seed", "--threads"};
  const std::vector<std::string> lm_reals = {"--valid-fraction", "--tau", "--sigma",
                                             "--load-balance", "--z-loss", "--lr", "--min-lr",
                                             "--weight-decay", "--clip", "--attack-rate",
                                             "--divergence-factor", "--capacity-factor"};
  const std::vector<std::string> vision_ints = {
      "--moe-last", "--patch", "--layers", "--d-model", "--heads", "--d-ff", "--experts",
      "--top-k", "--epochs", "--batch", "--train-limit", "--warmup", "--eval-every", "--seed",
      "--threads", "--severity", "--corrupt-seed"};
  const std::vector<std::string> vision_reals = {"--tau", "--sigma", "--load-balance", "--lr",
                                                 "--divergence-factor"};
  const std::vector<std::string> ft_ints = {"--epochs", "--batch", "--warmup", "--train-limit",
                                            "--max-len", "--seed", "--threads"};
  const std::vector<std::string> ft_reals = {"--lr", "--divergence-factor"};
  const std::vector<std::string> report_ints = {"--probe-batches", "--batch", "--threads"};
  struct Program {
    std::string exe;
    std::vector<std::string> base, ints, reals;
  };
  const std::vector<Program> programs = {
      {kTrainLM, {}, lm_ints, lm_reals},
      {kTrainVision, {}, vision_ints, vision_reals},
      {kFinetune, {"--checkpoint", file, "--vocab", file}, ft_ints, ft_reals},
      {kReport, {"--checkpoint", file}, report_ints, {}}};
  for (const Program& p : programs) {
    for (const std::string& opt : p.ints) {
      std::vector<Case> cases = {
          {opt, huge, "value '" + huge + "' is out of range (it does not fit a "},
          {opt, "12abc", "value '12abc' is not a decimal integer"},
          {opt, "1.5", "value '1.5' is not a decimal integer"},
          {opt, "0x10", "value '0x10' is not a decimal integer"}};
      // above the sane range (a seed may be any 64-bit value)
      if (opt.find("seed") == std::string::npos)
        cases.push_back({opt, "1000000000001", "value 1000000000001 is out of range; expected an integer in ["});
      for (const Case& c : cases) {
        CAPTURE(p.exe);
        CAPTURE(c.option);
        CAPTURE(c.value);
        std::vector<std::string> args = p.base;
        args.insert(args.end(), {c.option, c.value});
        check_refused(run(s, p.exe, args), {c.option + ": " + c.message});
      }
      // negative: below every range (seeds: "-1" used to become 2^64 - 1)
      std::vector<std::string> args = p.base;
      args.insert(args.end(), {opt, "-1"});
      const Result r = run(s, p.exe, args);
      CAPTURE(p.exe);
      CAPTURE(opt);
      check_refused(r, {opt + ": value "});
      CHECK((r.err.find("is negative") != std::string::npos ||
             r.err.find("is out of range") != std::string::npos));
    }
    for (const std::string& opt : p.reals) {
      for (const Case& c : std::vector<Case>{
               {opt, "nan", "value 'nan' is out of range; expected a finite number in "},
               {opt, "inf", "value 'inf' is out of range; expected a finite number in "},
               {opt, "1e400", "value '1e400' is out of range"},
               {opt, "1e7", "value 1e7 is out of range; expected a number in "},
               {opt, "-0.5", "value -0.5 is out of range; expected a number in "},
               {opt, "0.1x", "value '0.1x' is not a number"}}) {
        CAPTURE(p.exe);
        CAPTURE(c.option);
        CAPTURE(c.value);
        std::vector<std::string> args = p.base;
        args.insert(args.end(), {c.option, c.value});
        check_refused(run(s, p.exe, args), {c.option + ": " + c.message});
      }
    }
  }
  // the command line: refused at once, never clamped to 2^63 - 1 steps
  check_refused(run(s, kTrainLM, {"--steps", huge}),
                {"--steps: value '99999999999999999999' is out of range (it does not fit a 64-bit "
                 "integer); expected an integer in [1, 1000000000]"});
  check_refused(run(s, kTrainLM, {"--tau", "0"}), {"--tau: value 0 is out of range; expected a number in (0, "});
  check_refused(run(s, kTrainVision, {"--severity", "6"}), {"--severity: value 6 is out of range; expected an integer in [1, 5]"});
}

TEST_CASE("examples: train_lm --precision bf16 is refused on the CPU naming the option, and checkpoints record the precision") {
  Scratch s("precision");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string dir = s / "bf16";
  std::vector<std::string> args = lm_args(corpus, dir, 2);
  args.insert(args.end(), {"--precision", "bf16"});
  check_refused(run(s, kTrainLM, args), {"--precision bf16 needs --device cuda"});
  CHECK(!fs::exists(dir + "/metrics.csv"));  // refused before any work
  args.back() = "fp16";
  check_refused(run(s, kTrainLM, args), {"--precision: fp16 not in {fp32,bf16}"});
  const std::string fp32 = s / "fp32";
  const Result r = run(s, kTrainLM, lm_args(corpus, fp32, 2));
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  CHECK(load_safetensors(fp32 + "/checkpoint.safetensors").metadata.at("precision") == "fp32");
}

TEST_CASE("examples: train_lm --expert-layout padded needs --capacity-factor, and trains with one") {
  Scratch s("padded");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string dir = s / "padded";
  std::vector<std::string> args = lm_args(corpus, dir, 2);
  args.insert(args.end(), {"--expert-layout", "padded"});
  check_refused(run(s, kTrainLM, args), {"--expert-layout padded needs --capacity-factor > 0"});
  CHECK(!fs::exists(dir + "/metrics.csv"));
  args.insert(args.end(), {"--capacity-factor", "1.25"});
  const Result r = run(s, kTrainLM, args);
  CAPTURE(r.err);
  CHECK(r.status == 0);
  CHECK(fs::exists(dir + "/checkpoint.safetensors"));
  args.insert(args.end(), {"--expert-layout", "sparse"});
  check_refused(run(s, kTrainLM, args), {"--expert-layout: sparse not in {compact,padded}"});
}

TEST_CASE("examples: train_lm --cuda-graph is refused where a graph cannot replay the step") {
  Scratch s("cuda_graph");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string dir = s / "graph";
  std::vector<std::string> args = lm_args(corpus, dir, 2);
  args.push_back("--cuda-graph");
  check_refused(run(s, kTrainLM, args), {"--cuda-graph needs --device cuda"});
  CHECK(!fs::exists(dir + "/metrics.csv"));  // refused before any work
  // checked before a device is looked for: these run without a GPU too
  args.insert(args.end(), {"--device", "cuda"});
  check_refused(run(s, kTrainLM, args), {"--cuda-graph needs --expert-layout padded"});
  args.insert(args.end(), {"--expert-layout", "padded", "--capacity-factor", "1.25"});
  *std::find(args.begin(), args.end(), "softmax") = "smoe-dropout";  // lm_args' --router
  // a router this binary lacks is refused by --router's own check, naming it
  const bool built = with_router("smoe-dropout", []<class P>() { return examples::built_for_cpu<P>; });
  check_refused(run(s, kTrainLM, args), {built ? "--cuda-graph needs a router with a fixed k"
                                               : "--router: smoe-dropout not in {"});
  CHECK(!fs::exists(dir + "/metrics.csv"));
}

TEST_CASE("examples: train_lm --resume refuses broken and malformed checkpoints, naming the file and field") {
  Scratch s("resume");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string run_dir = s / "run";
  // a stale temporary file of a killed save (pid 2^31 - 1 runs nowhere) and a look-alike
  fs::create_directories(run_dir);
  const std::string stale = run_dir + "/checkpoint.safetensors.tmp.2147483647";
  const std::string lookalike = run_dir + "/checkpoint.safetensors.tmp.2147483647.keep";
  std::ofstream(stale) << "partial";
  std::ofstream(lookalike) << "keep";
  Result r = run(s, kTrainLM, lm_args(corpus, run_dir, 2));
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  CHECK(r.err.find("removed the stale temporary file '" + stale + "'") != std::string::npos);
  CHECK(!fs::exists(stale));
  CHECK(fs::exists(lookalike));
  const std::string ckpt = run_dir + "/checkpoint.safetensors";
  REQUIRE(fs::exists(ckpt));

  // a genuine resume continues
  r = run(s, kTrainLM, lm_args(corpus, run_dir, 3));  // without --resume: from scratch
  CHECK(r.status == 0);
  CHECK(r.err.find("resumed from") == std::string::npos);
  std::vector<std::string> resume = lm_args(corpus, run_dir, 4);
  resume.push_back("--resume");
  r = run(s, kTrainLM, resume);
  CAPTURE(r.err);
  CHECK(r.status == 0);
  CHECK(r.err.find("resumed from " + ckpt + " at step 3") != std::string::npos);

  // Each case: a crafted copy of the checkpoint in its own folder, then --resume.
  const std::string genuine = s / "genuine.safetensors";
  fs::copy_file(ckpt, genuine);
  auto resume_from = [&](const std::string& name, const auto& edit) {
    const std::string dir = s / name;
    fs::create_directories(dir);
    fs::copy_file(run_dir + "/vocab.txt", dir + "/vocab.txt");
    rewrite(genuine, dir + "/checkpoint.safetensors", edit);
    std::vector<std::string> args = lm_args(corpus, dir, 6);
    args.push_back("--resume");
    return std::make_pair(dir + "/checkpoint.safetensors", run(s, kTrainLM, args));
  };
  using Tensors = std::map<std::string, LoadedTensor>;
  using Meta = std::map<std::string, std::string>;
  {
    // was: "error: stoll"
    auto [path, res] = resume_from("step_text", [](Tensors&, Meta& m) { m["step"] = "three"; });
    check_refused(res, {"'" + path + "': metadata field 'step' is 'three', not a decimal integer"});
  }
  {
    // was: "error: map::at"
    auto [path, res] = resume_from("no_step", [](Tensors&, Meta& m) { m.erase("step"); });
    check_refused(res, {"'" + path + "' has no metadata field 'step'"});
  }
  {
    auto [path, res] = resume_from("no_config", [](Tensors&, Meta& m) { m.erase("config"); });
    check_refused(res, {"'" + path + "' has no metadata field 'config'"});
  }
  {
    // was: a raw nlohmann::json parse_error without the file
    auto [path, res] = resume_from("bad_config", [](Tensors&, Meta& m) { m["config"] = "{\"d_model\": 8,"; });
    check_refused(res, {"'" + path + "': metadata field 'config' is not valid JSON: "});
  }
  {
    auto [path, res] = resume_from("negative_step", [](Tensors&, Meta& m) { m["step"] = "-4"; });
    check_refused(res, {"'" + path + "': metadata field 'step' is -4, out of the range [0, "});
  }
  {
    // an optimizer-state tensor of the right size and the wrong shape used to load
    std::string name;
    auto [path, res] = resume_from("state_shape", [&](Tensors& t, Meta&) {
      for (auto& [n, x] : t)
        if (n.rfind("adamw.m.", 0) == 0 && x.shape.rank() == 2 && x.shape[0] != x.shape[1]) {
          name = n;
          x.shape = Shape{x.shape[1], x.shape[0]};
          break;
        }
    });
    REQUIRE(!name.empty());
    check_refused(res, {"'" + path + "': optimizer-state tensor '" + name + "' has shape ("});
  }
  {
    auto [path, res] = resume_from("model_extra", [](Tensors& t, Meta&) {
      t.emplace("model.extra.weight", t.at("model.ln_f.weight"));
    });
    check_refused(res, {"'" + path + "' has the tensor 'model.extra.weight' that matches no parameter"});
  }
  {
    // a broken symbolic link at the checkpoint path used to start from scratch silently
    const std::string dir = s / "broken_link";
    fs::create_directories(dir);
    const std::string link = dir + "/checkpoint.safetensors";
    fs::create_symlink(dir + "/gone.safetensors", link);
    std::vector<std::string> args = lm_args(corpus, dir, 6);
    args.push_back("--resume");
    check_refused(run(s, kTrainLM, args),
                  {"--resume: '" + link + "' is a broken symbolic link (to '" + dir + "/gone.safetensors'"});
    CHECK(fs::is_symlink(link));  // left alone, nothing written
    CHECK(!fs::exists(dir + "/metrics.csv"));
  }
}

TEST_CASE("examples: a diverged run stops naming the step, and its last checkpoint is kept") {
  Scratch s("diverge");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string run_dir = s / "run";
  Result r = run(s, kTrainLM, lm_args(corpus, run_dir, 4));
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  const std::string ckpt = run_dir + "/checkpoint.safetensors";
  const std::string saved = slurp(ckpt);
  REQUIRE(!saved.empty());

  // a gradient-norm limit that no step meets: stopped at step 5, before its optimizer step and
  // before any save (the checkpoint of step 4 is untouched)
  std::vector<std::string> args = lm_args(corpus, run_dir, 8);
  args.insert(args.end(), {"--resume", "--max-grad-norm", "1e-12"});
  check_refused(run(s, kTrainLM, args),
                {"train_lm: training diverged at step 5: the gradient norm",
                 "(before clipping) is above the limit 1e-12", "last checkpoint"});
  CHECK(slurp(ckpt) == saved);

  // a loss ceiling below the first loss
  args = lm_args(corpus, run_dir, 8);
  args.insert(args.end(), {"--resume", "--max-loss", "0.01"});
  check_refused(run(s, kTrainLM, args), {"at step 5: the training loss", "is above the ceiling 0.01"});
  CHECK(slurp(ckpt) == saved);

  // weights of 1e30 and NaN weights in the checkpoint (both used to load and "train"): NaN is
  // refused on load, naming the tensor; 1e30 overflows in the first step's forward pass, whose
  // error names the step
  for (const float value : {1e30f, std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(value);
    const std::string dir = s / (std::isnan(value) ? "nan_weights" : "huge_weights");
    fs::create_directories(dir);
    fs::copy_file(run_dir + "/vocab.txt", dir + "/vocab.txt");
    const std::string path = dir + "/checkpoint.safetensors";
    rewrite(ckpt, path, scale_weights(value));
    const std::string hostile = slurp(path);
    args = lm_args(corpus, dir, 8);
    args.push_back("--resume");
    if (std::isnan(value))
      check_refused(run(s, kTrainLM, args),
                    {"'" + path + "': model tensor '", "' holds nan at element 0 (a training "
                     "checkpoint's weights must be finite)"});
    else
      check_refused(run(s, kTrainLM, args),
                    {"train_lm: step 5 failed: ", "before any save: the last checkpoint"});
    CHECK(slurp(path) == hostile);
  }

  // the options are checked like every other
  args = lm_args(corpus, s / "bad", 2);
  args.insert(args.end(), {"--divergence-factor", "0.5"});
  check_refused(run(s, kTrainLM, args), {"--divergence-factor", "must be 0 (off) or > 1"});
  args = lm_args(corpus, s / "bad", 2);
  args.insert(args.end(), {"--max-grad-norm", "-1"});
  check_refused(run(s, kTrainLM, args), {"--max-grad-norm"});
}

TEST_CASE("examples: finetune_classifier and routing_report apply the same checkpoint rules") {
  Scratch s("finetune");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string run_dir = s / "run";
  REQUIRE(run(s, kTrainLM, lm_args(corpus, run_dir, 2)).status == 0);
  const std::string ckpt = run_dir + "/checkpoint.safetensors", vocab = run_dir + "/vocab.txt";
  const std::string data = s / "data";
  write_sst2(data);
  auto finetune = [&](const std::string& checkpoint) {
    return run(s, kFinetune, {"--checkpoint", checkpoint, "--vocab", vocab, "--task", "sst2",
                              "--data-dir", data, "--epochs", "1", "--batch", "2", "--threads",
                              "1", "--out", s / "ft_out"});
  };
  Result r = finetune(ckpt);
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("test_accuracy=") != std::string::npos);
  // the divergence options of train_lm, with the same message
  check_refused(run(s, kFinetune, {"--checkpoint", ckpt, "--vocab", vocab, "--task", "sst2",
                                   "--data-dir", data, "--epochs", "1", "--batch", "2",
                                   "--threads", "1", "--out", s / "ft_out", "--max-grad-norm",
                                   "1e-12"}),
                {"finetune_classifier: training diverged at step 1: the gradient norm"});

  using Tensors = std::map<std::string, LoadedTensor>;
  using Meta = std::map<std::string, std::string>;
  auto crafted = [&](const std::string& name, const auto& edit) {
    const std::string path = s / name;
    rewrite(ckpt, path, edit);
    return path;
  };
  // one rule with train_lm --resume: an unexpected "model." tensor is refused by name
  std::string path = crafted("extra.safetensors", [](Tensors& t, Meta&) {
    t.emplace("model.extra.weight", t.at("model.ln_f.weight"));
  });
  check_refused(finetune(path), {"'" + path + "' has the tensor 'model.extra.weight' that matches no parameter"});
  path = crafted("cls_head.safetensors", [](Tensors& t, Meta&) {
    t.emplace("model.cls_head.bias", t.at("model.ln_f.weight"));
  });
  check_refused(finetune(path), {"has the tensor 'model.cls_head.bias' that matches no parameter"});
  // the config: not JSON, a field missing, a field of the wrong type (each named with the file)
  path = crafted("config_text.safetensors", [](Tensors&, Meta& m) { m["config"] = "not json"; });
  check_refused(finetune(path), {"'" + path + "': metadata field 'config' is not valid JSON"});
  path = crafted("config_missing.safetensors", [](Tensors&, Meta& m) {
    nlohmann::json j = nlohmann::json::parse(m.at("config"));
    j.erase("d_model");
    m["config"] = j.dump();
  });
  check_refused(finetune(path), {"'" + path + "': config field 'd_model' is missing"});
  path = crafted("config_type.safetensors", [](Tensors&, Meta& m) {
    nlohmann::json j = nlohmann::json::parse(m.at("config"));
    j["num_experts"] = "two";
    m["config"] = j.dump();
  });
  check_refused(finetune(path), {"'" + path + "': config field 'num_experts' is \"two\", expected an integer"});
  path = crafted("config_array.safetensors", [](Tensors&, Meta& m) { m["config"] = "[1, 2]"; });
  check_refused(finetune(path), {"'" + path + "': config field 'vocab_size' cannot be read: the config is not a JSON object (array)"});

  // routing_report: the step and the config
  path = crafted("report_step.safetensors", [](Tensors&, Meta& m) { m["step"] = "2.5"; });
  check_refused(run(s, kReport, {"--checkpoint", path, "--vocab", vocab, "--text", corpus, "--out", s / "r.csv"}),
                {"'" + path + "': metadata field 'step' is '2.5', not a decimal integer"});
  path = crafted("report_config.safetensors", [](Tensors&, Meta& m) {
    nlohmann::json j = nlohmann::json::parse(m.at("config"));
    j["tau"] = nullptr;
    m["config"] = j.dump();
  });
  check_refused(run(s, kReport, {"--checkpoint", path, "--vocab", vocab, "--text", corpus, "--out", s / "r.csv"}),
                {"'" + path + "': config field 'tau' is null, expected a number"});
  r = run(s, kReport, {"--checkpoint", ckpt, "--vocab", vocab, "--text", corpus, "--out", s / "r.csv",
                       "--probe-batches", "1", "--batch", "2"});
  CAPTURE(r.err);
  CHECK(r.status == 0);
}

TEST_CASE("examples: finetune_classifier refuses a checkpoint with weights of 1e30 or NaN, naming the tensor") {
  Scratch s("finetune_hostile");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  const std::string run_dir = s / "run";
  REQUIRE(run(s, kTrainLM, lm_args(corpus, run_dir, 2)).status == 0);
  const std::string ckpt = run_dir + "/checkpoint.safetensors", vocab = run_dir + "/vocab.txt";
  const std::string data = s / "data";
  write_sst2(data);
  auto finetune = [&](const std::string& checkpoint, const std::string& out) {
    return run(s, kFinetune, {"--checkpoint", checkpoint, "--vocab", vocab, "--task", "sst2",
                              "--data-dir", data, "--epochs", "1", "--batch", "2", "--threads",
                              "1", "--out", out});
  };
  const std::string rule =
      " (a pretrained backbone's weights must be finite and at most 1e+06 in magnitude)";
  struct Case {
    std::string name;
    float value;
    std::string only;      // the tensors scaled ("": every model tensor)
    std::string expected;  // in the message, after the file's path
  };
  const std::vector<Case> cases = {
      // used to fail in the first forward pass with "graphmoe::Router: u ... holds -nan"
      {"huge", 1e30f, "", "': model tensor 'model."},
      // used to train the new head alone, to chance accuracy, and exit 0: LayerNorm normalises
      // the huge embeddings, and the loss stays finite and small
      {"huge_embedding", 1e30f, "tok_emb", "': model tensor 'model.tok_emb.weight' holds "},
      {"nan", std::numeric_limits<float>::quiet_NaN(), "",
       "': model tensor 'model.blocks.0.attn.k_proj.bias' holds nan at element 0"}};
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const std::string path = s / (c.name + ".safetensors");
    rewrite(ckpt, path, scale_weights(c.value, c.only));
    const std::string hostile = slurp(path);
    const std::string out = s / ("ft_" + c.name);
    check_refused(finetune(path, out), {"finetune_classifier: '" + path + c.expected, rule});
    CHECK(slurp(path) == hostile);               // the checkpoint is left alone
    CHECK(!fs::exists(out + "/metrics.csv"));    // refused before any work
  }
  // the genuine checkpoint still fine-tunes
  const Result r = finetune(ckpt, s / "ft_genuine");
  CAPTURE(r.err);
  CHECK(r.status == 0);
  CHECK(r.out.find("test_accuracy=") != std::string::npos);
}

TEST_CASE("examples: a metric not computable yet prints n/a, never nan (one evaluation, no --compare)") {
  Scratch s("not_available");
  const std::string corpus = s / "corpus.txt";
  test::write_word_corpus(corpus);
  // the field of `column` in line `line` (1: the first row after the header) of a CSV file
  auto csv_field = [](const std::string& text, const std::string& column, int line) {
    std::istringstream in(text);
    std::vector<std::vector<std::string>> rows;
    for (std::string l; std::getline(in, l);) {
      std::vector<std::string> fields;
      std::istringstream ls(l + ",");
      for (std::string f; std::getline(ls, f, ',');) fields.push_back(f);
      rows.push_back(fields);
    }
    REQUIRE(rows.size() > static_cast<std::size_t>(line));
    const auto& header = rows[0];
    const auto at = std::find(header.begin(), header.end(), column);
    REQUIRE(at != header.end());
    const auto& row = rows[static_cast<std::size_t>(line)];
    REQUIRE(row.size() == header.size());
    return row[static_cast<std::size_t>(at - header.begin())];
  };

  // one evaluation (--eval-every 0: only at the end): the fluctuation between two evaluations
  // cannot be computed yet
  const std::string one = s / "one";
  Result r = run(s, kTrainLM, lm_args(corpus, one, 2));
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("fluctuation=n/a") != std::string::npos);
  CHECK(r.out.find("nan") == std::string::npos);
  const std::string metrics = slurp(one + "/metrics.csv");
  CAPTURE(metrics);
  CHECK(metrics.find("nan") == std::string::npos);
  CHECK(csv_field(metrics, "layer0_fluctuation", 1).empty());

  // two evaluations: a number, in the summary and in the second row
  std::vector<std::string> args = lm_args(corpus, s / "two", 2);
  const auto every = std::find(args.begin(), args.end(), "--eval-every");
  REQUIRE(every + 1 < args.end());
  *(every + 1) = "1";
  r = run(s, kTrainLM, args);
  CAPTURE(r.out);
  REQUIRE(r.status == 0);
  const std::size_t at = r.out.find("fluctuation=");
  REQUIRE(at != std::string::npos);
  CHECK(std::isdigit(static_cast<unsigned char>(r.out[at + 12])));
  CHECK(r.out.find("n/a") == std::string::npos);
  const std::string two_metrics = slurp(s / "two/metrics.csv");
  CAPTURE(two_metrics);
  CHECK(csv_field(two_metrics, "layer0_fluctuation", 1).empty());
  CHECK(!csv_field(two_metrics, "layer0_fluctuation", 2).empty());
  CHECK(two_metrics.find("nan") == std::string::npos);

  // routing_report without --baseline and --compare: the ratio and the fluctuation are n/a on
  // stdout and empty in the CSV
  const std::string ckpt = one + "/checkpoint.safetensors";
  const std::vector<std::string> report = {"--checkpoint", ckpt, "--text", corpus,
                                           "--probe-batches", "1", "--batch", "2"};
  args = report;
  args.insert(args.end(), {"--out", s / "alone.csv"});
  r = run(s, kReport, args);
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("n/a") != std::string::npos);
  CHECK(r.out.find("nan") == std::string::npos);
  const std::string alone = slurp(s / "alone.csv");
  CAPTURE(alone);
  CHECK(alone.find("nan") == std::string::npos);
  for (const char* column : {"entropy_r_ratio", "entropy_p_ratio", "fluct_top1", "fluct_topk"})
    CHECK(csv_field(alone, column, 1).empty());
  // with both: numbers (the same checkpoint: no fluctuation, ratio 1)
  args = report;
  args.insert(args.end(), {"--compare", ckpt, "--baseline", ckpt, "--out", s / "both.csv"});
  r = run(s, kReport, args);
  CAPTURE(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("n/a") == std::string::npos);
  const std::string both = slurp(s / "both.csv");
  CHECK(csv_field(both, "fluct_topk", 1) == "0");
  CHECK(csv_field(both, "entropy_p_ratio", 1) == "1");
}

namespace {

std::string be32(std::uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// A Fashion-MNIST folder in miniature (plain idx files under Debian's .gz names): 8x8 images,
// labels 0..9, 40 train and 20 test.
void write_images(const std::string& dir) {
  fs::create_directories(dir);
  std::uint32_t x = 12345;
  for (const auto& [prefix, count] : {std::pair<std::string, std::uint32_t>{"train", 40}, {"t10k", 20}}) {
    std::string img = be32(2051) + be32(count) + be32(8) + be32(8), lab = be32(2049) + be32(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      lab += static_cast<char>(i % 10);
      for (int p = 0; p < 64; ++p) {
        x = x * 1664525u + 1013904223u;
        img += static_cast<char>((p % 8 == static_cast<int>(i % 8) ? 160u : 0u) + ((x >> 24) % 96u));
      }
    }
    std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte.gz", std::ios::binary) << img;
    std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte.gz", std::ios::binary) << lab;
  }
}

}  // namespace

TEST_CASE("examples: train_vision ends with a line of time, images/s and the checkpoint, and routing_report needs --text") {
  Scratch s("last_lines");
  const std::string data = s / "images", out = s / "vision";
  write_images(data);
  const Result r = run(s, kTrainVision, {"--data-dir", data, "--router", "softmax", "--patch", "4", "--layers", "1",
                                         "--moe-last", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8",
                                         "--experts", "2", "--top-k", "1", "--batch", "4", "--epochs", "1",
                                         "--train-limit", "20", "--warmup", "0", "--threads", "1", "--out", out});
  INFO(r.text());
  REQUIRE(r.status == 0);
  REQUIRE(r.out.size() > 1);
  const std::string line = r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1);
  CAPTURE(line);
  CHECK(line.rfind("train_vision: 5 steps in ", 0) == 0);
  CHECK(line.find(" s in all), ") != std::string::npos);
  CHECK(line.find(" images/s, checkpoint " + out + "/checkpoint.safetensors (step 5)\n") != std::string::npos);
  CHECK(r.out.find("router=softmax test_accuracy=") != std::string::npos);
  // routing_report: no default probe text
  const std::string file = s / "any.txt";
  std::ofstream(file) << "x\n";
  check_refused(run(s, kReport, {"--checkpoint", file}), {"--text is required"});
}
