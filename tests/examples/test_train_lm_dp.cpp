// train_lm --dp N under mpiexec (docs/distributed.md, "Running data parallel from the command
// line"): a tiny model on a tiny corpus written here, each case a few seconds.
//
//   dp2 equals one process     mpiexec -n 2 train_lm --dp 2 --batch 4 trains like train_lm
//                              --batch 4 (--load-balance 0): the same training and validation
//                              losses at every step, to 1e-5 relative; rank 0 alone writes
//   resume across world sizes  a checkpoint written under --dp 4 (-n 4 --oversubscribe) resumes
//                              with --dp 1 and with --dp 2 to the same next losses, which are
//                              also those of one uninterrupted process
//   expert parallel            --dp 2 --ep 2 (one expert per rank) trains like one process, and
//                              its checkpoint (experts gathered to rank 0) resumes in one process
//   command-line errors        --dp 0, --dp -3, --dp 3 under a world of 2, --batch not a multiple
//                              of --dp, --dp 2 without a launcher, -n 2 without --dp, --ep other
//                              than 1 or --dp, --experts not a multiple of --ep: a message and a
//                              non-zero exit
// A failing comparison prints both runs' output and metrics.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "graphmoe/train/checkpoint.hpp"
#include "support/dp_programs.hpp"
#include "support/processes.hpp"

#if !defined(GRAPHMOE_TRAIN_LM) || !defined(GRAPHMOE_MPIEXEC)
#error "GRAPHMOE_TRAIN_LM and GRAPHMOE_MPIEXEC must be defined by CMake"
#endif

namespace fs = std::filesystem;

namespace {

const std::string kTrainLM = GRAPHMOE_TRAIN_LM;

using graphmoe::cpu;
using graphmoe::index_t;
using graphmoe::load_safetensors;
using graphmoe::SafetensorsFile;
using graphmoe::Tensor;
using graphmoe::test::check_refused;
using graphmoe::test::check_same_metrics;
using graphmoe::test::metrics_rows;
using graphmoe::test::set;
using graphmoe::test::with;
using graphmoe::test::Result;
using graphmoe::test::Scratch;
using graphmoe::test::slurp;

// `ranks` = 0: train_lm alone; otherwise under mpiexec -n ranks. Killed after 90 s.
Result run(const Scratch& s, int ranks, const std::vector<std::string>& args) {
  return graphmoe::test::run_program(s, graphmoe::test::mpiexec_prefix(ranks), kTrainLM, args, 90);
}

// A word-level corpus of 240 lines of 10 words from a 12-word vocabulary.
void write_corpus(const std::string& path) {
  const char* words[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"};
  std::ofstream out(path);
  std::uint32_t x = 12345;
  for (int line = 0; line < 240; ++line) {
    for (int w = 0; w < 10; ++w) {
      x = x * 1664525u + 1013904223u;
      out << (w ? " " : "") << words[(x >> 20) % 12];
    }
    out << "\n";
  }
}

// A tiny model, a constant learning rate (so that a resumed run with more --steps continues the
// same schedule), an evaluation (a metrics row) after every step, one thread per rank.
std::vector<std::string> lm_args(const std::string& corpus, const std::string& out, int steps) {
  return {"--train", corpus, "--test", "", "--valid-fraction", "0.5", "--router", "softmax",
          "--layers", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8", "--experts", "2",
          "--top-k", "1", "--seq", "8", "--batch", "4", "--load-balance", "0",
          "--steps", std::to_string(steps), "--lr", "0.01", "--min-lr", "0.01", "--warmup", "0",
          "--eval-every", "1", "--threads", "1", "--out", out};
}

}  // namespace

TEST_CASE("train_lm --dp 2 under mpiexec -n 2 trains like one process with the same global batch") {
  Scratch s("dp_equal");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  const Result one = run(s, 0, lm_args(corpus, s / "one", 5));
  const Result two = run(s, 2, with(lm_args(corpus, s / "two", 5), {"--dp", "2"}));
  check_same_metrics(one, slurp(s / "one/metrics.csv"), two, slurp(s / "two/metrics.csv"), 1, 5);
  INFO(two.text());
  // rank 0 alone prints and writes: one result line, one progress report, the usual files
  CHECK(two.out.find("router=softmax") == two.out.rfind("router=softmax"));
  CHECK(two.out.find("router=softmax") != std::string::npos);
  CHECK(two.err.find("step 5  train loss") == two.err.rfind("step 5  train loss"));
  CHECK(two.err.find("train_lm: data parallel over 2 ranks: parameters identical on every rank") !=
        std::string::npos);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(s / "two")) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  CHECK(files == std::vector<std::string>{"checkpoint.safetensors", "metrics.csv", "vocab.txt"});
}

TEST_CASE("a train_lm checkpoint written under --dp 4 resumes with --dp 1 and --dp 2 alike") {
  Scratch s("dp_resume");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  // 3 steps under 4 ranks (one sequence each), then 3 more from its checkpoint under 1 and 2
  const Result four = run(s, 4, with(lm_args(corpus, s / "four", 3), {"--dp", "4"}));
  INFO(four.text());
  REQUIRE(four.status == 0);
  for (const std::string dir : {"r1", "r2"}) fs::copy(s / "four", s / dir);
  const Result r1 = run(s, 0, with(lm_args(corpus, s / "r1", 6), {"--resume"}));
  const Result r2 = run(s, 2, with(lm_args(corpus, s / "r2", 6), {"--resume", "--dp", "2"}));
  CHECK(r1.err.find("resumed from") != std::string::npos);
  CHECK(r2.err.find("resumed from") == r2.err.rfind("resumed from"));  // rank 0 says it once
  check_same_metrics(r1, slurp(s / "r1/metrics.csv"), r2, slurp(s / "r2/metrics.csv"), 1, 6);
  // and both continue the run one process would have made uninterrupted
  const Result whole = run(s, 0, lm_args(corpus, s / "whole", 6));
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), r2, slurp(s / "r2/metrics.csv"), 1, 6);
}

TEST_CASE("train_lm --dp 2 --ep 2 (experts split over the ranks) trains like one process, and "
          "its checkpoint resumes in one process") {
  Scratch s("dp_ep");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  const Result whole = run(s, 0, lm_args(corpus, s / "whole", 6));
  const Result ep = run(s, 2, with(lm_args(corpus, s / "ep", 3), {"--dp", "2", "--ep", "2"}));
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), ep, slurp(s / "ep/metrics.csv"), 1, 3);
  {
    INFO(ep.text());
    CHECK(ep.err.find("parameters identical on every rank") != std::string::npos);
  }
  fs::copy(s / "ep", s / "r1");
  const Result r1 = run(s, 0, with(lm_args(corpus, s / "r1", 6), {"--resume"}));
  CHECK(r1.err.find("resumed from") != std::string::npos);
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), r1, slurp(s / "r1/metrics.csv"), 1, 6);
}

TEST_CASE("train_lm --dp 2 and --dp 2 --ep 2 with the modern blocks and bias balancing train like "
          "one process") {
  // the olmoe preset's blocks (RMSNorm, RoPE, QK-norm, SwiGLU) with grouped-query attention and
  // heads wider than d_model / heads (--head-dim), a shared expert and the sigmoid-bias router: the
  // expert biases follow the loads all-reduced over the ranks, so every rank's bias, and the
  // losses, are one process's
  Scratch s("dp_modern");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  auto modern = [&](const std::string& out, int steps) {
    auto a = set(set(set(lm_args(corpus, out, steps), "--router", "sigmoid-bias"), "--experts", "4"),
                 "--top-k", "2");
    return with(a, {"--arch", "olmoe", "--kv-heads", "1", "--head-dim", "6", "--expert-d-ff", "8",
                    "--shared-d-ff", "8", "--bias-update-rate", "0.05"});
  };
  const Result whole = run(s, 0, modern(s / "whole", 4));
  const Result dp = run(s, 2, with(modern(s / "dp", 4), {"--dp", "2"}));
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), dp, slurp(s / "dp/metrics.csv"), 1, 4);
  const Result ep = run(s, 2, with(modern(s / "ep", 4), {"--dp", "2", "--ep", "2"}));
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), ep, slurp(s / "ep/metrics.csv"), 1, 4);
  // the biases moved, and the data-parallel checkpoint holds the one-process values
  const SafetensorsFile a = load_safetensors(s / "whole/checkpoint.safetensors");
  const SafetensorsFile b = load_safetensors(s / "dp/checkpoint.safetensors");
  const std::string bias = "model.blocks.0.moe.router.selector.expert_bias";
  REQUIRE(a.contains(bias));
  REQUIRE(b.contains(bias));
  // 2 query heads of 6 on d_model 8, one key/value head of 6
  CHECK(a.at("model.blocks.0.attn.q_proj.weight").to_tensor<float>().shape() == (graphmoe::Shape{12, 8}));
  CHECK(a.at("model.blocks.0.attn.k_proj.weight").to_tensor<float>().shape() == (graphmoe::Shape{6, 8}));
  CHECK(a.at("model.blocks.0.attn.out_proj.weight").to_tensor<float>().shape() == (graphmoe::Shape{8, 12}));
  const Tensor<float, cpu> ba = a.at(bias).to_tensor<float>(), bb = b.at(bias).to_tensor<float>();
  float moved = 0;
  for (index_t e = 0; e < ba.numel(); ++e) {
    CHECK(ba.data()[e] == bb.data()[e]);
    moved = std::max(moved, std::abs(ba.data()[e]));
  }
  CHECK(moved > 0);
}

TEST_CASE("train_lm with multi-head latent attention: --dp 2 trains like one process, the "
          "checkpoint resumes, and its config rebuilds the layer") {
  Scratch s("dp_mla");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  auto mla = [&](const std::string& out, int steps) {
    return with(lm_args(corpus, out, steps),
                {"--norm", "rmsnorm", "--rope-theta", "10000", "--qkv-bias", "false",
                 "--kv-lora-rank", "4", "--q-lora-rank", "6", "--qk-nope-head-dim", "2",
                 "--qk-rope-head-dim", "2", "--v-head-dim", "3"});
  };
  const Result whole = run(s, 0, mla(s / "whole", 6));
  const Result dp = run(s, 2, with(mla(s / "dp", 3), {"--dp", "2"}));
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), dp, slurp(s / "dp/metrics.csv"), 1, 3);
  const SafetensorsFile f = load_safetensors(s / "whole/checkpoint.safetensors");
  CHECK(f.at("model.blocks.0.attn.kv_a_proj_with_mqa.weight").to_tensor<float>().shape() ==
        (graphmoe::Shape{4 + 2, 8}));
  CHECK(f.at("model.blocks.0.attn.q_b_proj.weight").to_tensor<float>().shape() ==
        (graphmoe::Shape{2 * 4, 6}));
  CHECK(f.at("model.blocks.0.attn.out_proj.weight").to_tensor<float>().shape() ==
        (graphmoe::Shape{8, 2 * 3}));
  CHECK_FALSE(f.contains("model.blocks.0.attn.k_proj.weight"));
  // resumed from the data-parallel checkpoint: the rest of the uninterrupted run
  fs::copy(s / "dp", s / "r1");
  const Result r1 = run(s, 0, with(mla(s / "r1", 6), {"--resume"}));
  CHECK(r1.err.find("resumed from") != std::string::npos);
  check_same_metrics(whole, slurp(s / "whole/metrics.csv"), r1, slurp(s / "r1/metrics.csv"), 1, 6);
  // a resume with other latent widths is refused by the checkpoint's config
  fs::copy(s / "dp", s / "r2");
  const Result other = run(s, 0, set(with(mla(s / "r2", 6), {"--resume"}), "--kv-lora-rank", "5"));
  check_refused(other, {"kv_lora_rank"});
}

TEST_CASE("train_lm: evaluations do not count towards a bias-balancing router's loads") {
  // validation batches and the routing-metrics probe run in Mode::Eval: a run that evaluates after
  // every step trains exactly as one that evaluates once at the end (the same biases, bit for bit)
  Scratch s("eval_loads");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  auto modern = [&](const std::string& out, const std::string& every) {
    auto a = set(set(set(set(lm_args(corpus, out, 4), "--router", "sigmoid-bias"), "--experts", "4"),
                     "--top-k", "2"), "--eval-every", every);
    return with(a, {"--arch", "olmoe", "--kv-heads", "1", "--expert-d-ff", "8", "--shared-d-ff", "8",
                    "--bias-update-rate", "0.05"});
  };
  const Result each = run(s, 0, modern(s / "each", "1"));
  const Result end = run(s, 0, modern(s / "end", "0"));
  REQUIRE_MESSAGE(each.status == 0, each.err);
  REQUIRE_MESSAGE(end.status == 0, end.err);
  const SafetensorsFile a = load_safetensors(s / "each/checkpoint.safetensors");
  const SafetensorsFile b = load_safetensors(s / "end/checkpoint.safetensors");
  const std::string bias = "model.blocks.0.moe.router.selector.expert_bias";
  REQUIRE(a.contains(bias));
  REQUIRE(b.contains(bias));
  const Tensor<float, cpu> ba = a.at(bias).to_tensor<float>(), bb = b.at(bias).to_tensor<float>();
  for (index_t e = 0; e < ba.numel(); ++e) CHECK(ba.data()[e] == bb.data()[e]);
  const auto la = metrics_rows(slurp(s / "each/metrics.csv"));
  const auto lb = metrics_rows(slurp(s / "end/metrics.csv"));
  REQUIRE(la.count(4));
  REQUIRE(lb.count(4));
  CHECK(la.at(4).val_loss == lb.at(4).val_loss);  // the same model at the end
}

// The validation loss of the last metrics row.
double last_val_loss(const std::string& csv) {
  const auto rows = metrics_rows(csv);
  REQUIRE_FALSE(rows.empty());
  return rows.rbegin()->second.val_loss;
}

// A run that cannot change its weights (the learning rate far below float's resolution): its first
// evaluation is the starting model's.
std::vector<std::string> frozen(std::vector<std::string> args) {
  return set(set(set(args, "--lr", "1e-30"), "--min-lr", "1e-30"), "--steps", "1");
}

TEST_CASE("train_lm --upcycle-from: a dense model into an MoE one, the same model at step 0") {
  Scratch s("upcycle");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  const auto base = [&](const std::string& out, int steps) {
    return set(set(lm_args(corpus, out, steps), "--experts", "4"), "--top-k", "2");
  };
  const Result dense = run(s, 0, with(base(s / "dense", 3), {"--layout", "dense"}));
  REQUIRE_MESSAGE(dense.status == 0, dense.text());
  const Result up = run(s, 0, with(frozen(base(s / "up", 1)),
                                   {"--upcycle-from", s / "dense/checkpoint.safetensors"}));
  REQUIRE_MESSAGE(up.status == 0, up.text());
  CHECK(up.err.find("upcycled from") != std::string::npos);
  const double want = last_val_loss(slurp(s / "dense/metrics.csv"));
  const double got = last_val_loss(slurp(s / "up/metrics.csv"));
  CHECK(std::abs(got - want) <= 1e-5 * std::abs(want));
  // unnormalised gates would not sum the copies to the dense FFN: refused before training
  check_refused(run(s, 0, with(frozen(base(s / "bad", 1)),
                               {"--upcycle-from", s / "dense/checkpoint.safetensors",
                                "--norm-topk-prob", "false"})),
                {"upcycle: block 0: the gates are not renormalised (norm_topk_prob = false)"});
  // another vocabulary: refused
  const std::string other = s / "other.txt";
  {
    std::ofstream o(other);
    for (int i = 0; i < 200; ++i) o << "x y z w\n";
  }
  check_refused(run(s, 0, with(set(frozen(base(s / "bad2", 1)), "--train", other),
                               {"--upcycle-from", s / "dense/checkpoint.safetensors"})),
                {"train_lm --upcycle-from: '", "' was trained with the vocabulary "});
}

TEST_CASE("train_lm --upcycle-from into a graph router: the softmax model's loss, bit for bit") {
  Scratch s("upcycle_graph");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  const auto base = [&](const std::string& out, int steps) {
    return set(set(lm_args(corpus, out, steps), "--experts", "4"), "--top-k", "2");
  };
  const Result moe = run(s, 0, base(s / "moe", 3));
  REQUIRE_MESSAGE(moe.status == 0, moe.text());
  const Result graph = run(s, 0, with(set(frozen(base(s / "graph", 1)), "--router", "blended-similarity"),
                                      {"--upcycle-from", s / "moe/checkpoint.safetensors"}));
  REQUIRE_MESSAGE(graph.status == 0, graph.text());
  CHECK(last_val_loss(slurp(s / "graph/metrics.csv")) == last_val_loss(slurp(s / "moe/metrics.csv")));
  // the graph router's checkpoint holds the mixing weights
  const SafetensorsFile f = load_safetensors(s / "graph/checkpoint.safetensors");
  CHECK(f.contains("model.blocks.0.moe.router.graph.blend"));
}

TEST_CASE("train_lm --dp: bad values and worlds of the wrong size are refused with a message") {
  Scratch s("dp_errors");
  const std::string corpus = s / "corpus.txt";
  write_corpus(corpus);
  const auto args = [&](const std::vector<std::string>& more) {
    return with(lm_args(corpus, s / "out", 2), more);
  };
  check_refused(run(s, 2, args({"--dp", "0"})),
                {"--dp: value 0 is out of range; expected an integer in [1, "});
  check_refused(run(s, 2, args({"--dp", "-3"})),
                {"--dp: value -3 is out of range; expected an integer in [1, "});
  check_refused(run(s, 2, set(args({"--dp", "3"}), "--batch", "6")),
                {"train_lm: error: graphmoe::train_lm: --dp 3 must equal the number of MPI "
                 "processes, which is 2: launch with mpirun -n 3"});
  const Result odd = run(s, 2, set(args({"--dp", "2"}), "--batch", "5"));
  check_refused(odd, {"graphmoe::train_lm: --batch 5 is not a multiple of --dp 2: --batch is the "
                      "global batch"});
  CHECK(odd.err.find("is not a multiple") == odd.err.rfind("is not a multiple"));  // rank 0 only
  check_refused(run(s, 0, args({"--dp", "2"})),
                {"--dp 2 must equal the number of MPI processes, which is 1"});
  check_refused(run(s, 2, args({})),
                {"this is one of 2 processes started by an MPI launcher, but --dp is 1", "Pass --dp 2"});
  check_refused(run(s, 2, args({"--dp", "2", "--ep", "3"})),
                {"graphmoe::train_lm: --ep 3 must be 1 or equal --dp 2"});
  check_refused(run(s, 0, args({"--ep", "2"})), {"--ep 2 must be 1 or equal --dp 1"});
  check_refused(run(s, 2, set(args({"--dp", "2", "--ep", "2"}), "--experts", "3")),
                {"--experts 3 is not a multiple of --ep 2"});
  CHECK(!fs::exists(s / "out"));  // nothing was written
}
