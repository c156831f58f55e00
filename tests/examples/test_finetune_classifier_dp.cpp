// finetune_classifier --dp N under mpiexec (docs/distributed.md, "Running data parallel from the
// command line"): a tiny train_lm checkpoint (pretrained here, --load-balance 0) fine-tuned on
// SST-2 in miniature, each case a few seconds.
//
//   dp2 equals one process     mpiexec -n 2 finetune_classifier --dp 2 --batch 4 trains like
//                              finetune_classifier --batch 4: the same training loss at every
//                              step, to 1e-5 relative, and the same (sharded) test accuracy;
//                              rank 0 alone prints and writes
//   command-line errors        --batch not a multiple of --dp, --dp 3 under a world of 2, --dp 1
//                              under a launcher: a message and a non-zero exit
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
#include <vector>

#include "support/dp_programs.hpp"
#include "support/processes.hpp"

#if !defined(GRAPHMOE_FINETUNE_CLASSIFIER) || !defined(GRAPHMOE_TRAIN_LM) || !defined(GRAPHMOE_MPIEXEC)
#error "GRAPHMOE_FINETUNE_CLASSIFIER, GRAPHMOE_TRAIN_LM and GRAPHMOE_MPIEXEC must be defined by CMake"
#endif

namespace fs = std::filesystem;

namespace {

const std::string kFinetune = GRAPHMOE_FINETUNE_CLASSIFIER;
const std::string kTrainLM = GRAPHMOE_TRAIN_LM;

using graphmoe::test::check_dp_refusals;
using graphmoe::test::check_same_metrics;
using graphmoe::test::Result;
using graphmoe::test::Scratch;
using graphmoe::test::slurp;
using graphmoe::test::with;

// `ranks` = 0: `program` alone; otherwise under mpiexec -n ranks. Killed after 90 s.
Result run(const Scratch& s, const std::string& program, int ranks, const std::vector<std::string>& args) {
  return graphmoe::test::run_program(s, graphmoe::test::mpiexec_prefix(ranks), program, args, 90);
}

// The tiny pretrained LM every case fine-tunes (the recipe of test_example_cli's fine-tuning
// case): a word-level corpus of 300 lines over 15 words, a one-block MoE LM trained 2 steps with
// --load-balance 0 (the classifier takes the coefficient from the checkpoint: the balancing loss
// is per shard, so it would make --dp 2 differ from one process). Returns the run folder
// (checkpoint.safetensors, vocab.txt).
std::string pretrain(const Scratch& s) {
  const std::string corpus = s / "corpus.txt", dir = s / "lm";
  graphmoe::test::write_word_corpus(corpus);
  const Result r = run(s, kTrainLM, 0,
                       {"--train", corpus, "--test", "", "--valid-fraction", "0.5", "--router",
                        "softmax", "--layers", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8",
                        "--experts", "2", "--top-k", "1", "--seq", "8", "--batch", "2", "--steps",
                        "2", "--warmup", "0", "--eval-every", "0", "--load-balance", "0",
                        "--threads", "1", "--out", dir});
  INFO(r.text());
  REQUIRE(r.status == 0);
  return dir;
}

// SST-2 in miniature: 4 training sentences of different lengths (one batch of 4: an epoch is one
// step) and 5 test sentences (shards of 2 and 3 under --dp 2).
std::string write_sst2(const Scratch& s) {
  const std::string data = s / "data";
  fs::create_directories(data + "/sst2");
  const std::vector<std::pair<std::string, int>> train = {
      {"the film was bad", 0}, {"a good film", 1}, {"not a very good film the dog ran far", 0},
      {"very good", 1}};
  const std::vector<std::pair<std::string, int>> dev = {
      {"a bad film", 0}, {"the cat sat on a mat", 1}, {"good", 1}, {"the film was not good", 0},
      {"a very bad dog", 0}};
  for (const auto& [split, rows] : {std::pair{std::string("train"), train}, std::pair{std::string("dev"), dev}}) {
    std::ofstream out(data + "/sst2/" + split + ".tsv");
    out << "sentence\tlabel\n";
    for (const auto& [text, label] : rows) out << text << "\t" << label << "\n";
  }
  return data;
}

// 5 epochs of one step each (a metrics row after every step), one thread per rank.
std::vector<std::string> finetune_args(const std::string& lm, const std::string& data,
                                       const std::string& out) {
  return {"--checkpoint", lm + "/checkpoint.safetensors", "--vocab", lm + "/vocab.txt",
          "--task", "sst2", "--data-dir", data, "--epochs", "5", "--batch", "4", "--lr", "0.01",
          "--threads", "1", "--out", out};
}

}  // namespace

TEST_CASE("finetune_classifier --dp 2 under mpiexec -n 2 trains like one process with the same global batch") {
  Scratch s("ftdp_equal");
  const std::string lm = pretrain(s), data = write_sst2(s);
  const Result one = run(s, kFinetune, 0, finetune_args(lm, data, s / "one"));
  const Result two = run(s, kFinetune, 2, with(finetune_args(lm, data, s / "two"), {"--dp", "2"}));
  // the training loss's EMA, each step's own loss, the (sharded: counts summed) test accuracy
  check_same_metrics(one, slurp(s / "one/metrics.csv"), two, slurp(s / "two/metrics.csv"), 1, 5,
                     /*step_losses=*/true);
  INFO(two.text());
  // rank 0 alone prints and writes: the initial and final accuracies once each (the same as one
  // process's), one report per epoch, metrics.csv only
  CHECK(two.out == one.out);
  CHECK(two.out.find("initial_test_accuracy=") == two.out.rfind("initial_test_accuracy="));
  CHECK(two.out.find(" test_accuracy=") != std::string::npos);
  CHECK(two.err.find("epoch 5  train loss") != std::string::npos);
  CHECK(two.err.find("epoch 5  train loss") == two.err.rfind("epoch 5  train loss"));
  CHECK(two.err.find("finetune_classifier: sst2,") == two.err.rfind("finetune_classifier: sst2,"));
  CHECK(two.err.find("finetune_classifier: data parallel over 2 ranks: parameters identical on every rank") !=
        std::string::npos);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(s / "two")) files.push_back(e.path().filename().string());
  CHECK(files == std::vector<std::string>{"metrics.csv"});
}

TEST_CASE("finetune_classifier --dp: a batch not a multiple of --dp and worlds of the wrong size are refused") {
  Scratch s("ftdp_errors");
  const std::string lm = pretrain(s), data = write_sst2(s);
  const auto args = [&](const std::vector<std::string>& more) {
    return with(finetune_args(lm, data, s / "out"), more);
  };
  check_dp_refusals("finetune_classifier",
                    [&](const std::vector<std::string>& a) { return run(s, kFinetune, 2, a); }, args,
                    "3", "3", s / "out");
}
