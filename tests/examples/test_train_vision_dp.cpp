// train_vision --dp N under mpiexec (docs/distributed.md, "Running data parallel from the command
// line"): a tiny ViT on a tiny idx image set written here, each case a few seconds.
//
//   dp2 equals one process     mpiexec -n 2 train_vision --dp 2 --batch 4 trains like
//                              train_vision --batch 4 (--load-balance 0): the same training loss
//                              at every step, to 1e-5 relative, and the same (sharded) test
//                              accuracy; rank 0 alone prints and writes
//   command-line errors        --batch not a multiple of --dp, --dp 3 under a world of 2: a
//                              message and a non-zero exit
// A failing comparison prints both runs' output and metrics.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

#if !defined(GRAPHMOE_TRAIN_VISION) || !defined(GRAPHMOE_MPIEXEC)
#error "GRAPHMOE_TRAIN_VISION and GRAPHMOE_MPIEXEC must be defined by CMake"
#endif

namespace fs = std::filesystem;

namespace {

const std::string kTrainVision = GRAPHMOE_TRAIN_VISION;

using graphmoe::test::check_dp_refusals;
using graphmoe::test::check_same_metrics;
using graphmoe::test::Result;
using graphmoe::test::Scratch;
using graphmoe::test::slurp;
using graphmoe::test::with;

// `ranks` = 0: train_vision alone; otherwise under mpiexec -n ranks. Killed after 90 s.
Result run(const Scratch& s, int ranks, const std::vector<std::string>& args) {
  return graphmoe::test::run_program(s, graphmoe::test::mpiexec_prefix(ranks), kTrainVision, args, 90);
}

std::string be32(std::uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// A Fashion-MNIST directory in miniature: plain (not gzipped) idx files under Debian's .gz names
// (read_idx_images reads both), 8x8 pseudo-random images with labels 0..9; 40 train, 20 test.
void write_images(const std::string& dir) {
  fs::create_directories(dir);
  std::uint32_t x = 12345;
  for (const auto& [prefix, count] : {std::pair<std::string, std::uint32_t>{"train", 40}, {"t10k", 20}}) {
    std::string img = be32(2051) + be32(count) + be32(8) + be32(8), lab = be32(2049) + be32(count);
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::uint32_t label = i % 10;
      lab += static_cast<char>(label);
      for (int p = 0; p < 64; ++p) {
        x = x * 1664525u + 1013904223u;
        // a label-dependent stripe plus noise, so that the classes differ
        const std::uint32_t v = (p % 8 == static_cast<int>(label % 8) ? 160u : 0u) + ((x >> 24) % 96u);
        img += static_cast<char>(v);
      }
    }
    std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte.gz", std::ios::binary) << img;
    std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte.gz", std::ios::binary) << lab;
  }
}

// A tiny model (8x8 images in 4 patches of 4x4, one MoE block), 20 training images in batches of
// 4 (5 steps), an evaluation (a metrics row) after every step, one thread per rank.
std::vector<std::string> vision_args(const std::string& data, const std::string& out) {
  return {"--data-dir", data, "--router", "softmax", "--patch", "4", "--layers", "1",
          "--moe-last", "1", "--d-model", "8", "--heads", "2", "--d-ff", "8", "--experts", "2",
          "--top-k", "1", "--batch", "4", "--load-balance", "0", "--epochs", "1",
          "--train-limit", "20", "--lr", "0.01", "--warmup", "0", "--eval-every", "1",
          "--threads", "1", "--out", out};
}

}  // namespace

TEST_CASE("train_vision --dp 2 under mpiexec -n 2 trains like one process with the same global batch") {
  Scratch s("visdp_equal");
  const std::string data = s / "data";
  write_images(data);
  const Result one = run(s, 0, vision_args(data, s / "one"));
  const Result two = run(s, 2, with(vision_args(data, s / "two"), {"--dp", "2"}));
  // the training loss's EMA, each step's own loss, the (sharded: counts summed) test accuracy
  check_same_metrics(one, slurp(s / "one/metrics.csv"), two, slurp(s / "two/metrics.csv"), 1, 5,
                     /*step_losses=*/true);
  INFO(two.text());
  // rank 0 alone prints and writes: one result line, one progress report, the usual files
  CHECK(two.out.find("router=softmax") == two.out.rfind("router=softmax"));
  CHECK(two.out.find("router=softmax") != std::string::npos);
  // the same final test accuracy (the result line; the last line's timings differ)
  auto result_line = [](const std::string& out) {
    const std::size_t at = out.find("router=");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  CHECK(result_line(two.out) == result_line(one.out));
  CHECK(two.out.find("\ntrain_vision: 5 steps in ") == two.out.rfind("\ntrain_vision: "));  // rank 0's
  CHECK(two.err.find("step 5  train loss") == two.err.rfind("step 5  train loss"));
  CHECK(two.err.find("train_vision: data parallel over 2 ranks: parameters identical on every rank") !=
        std::string::npos);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(s / "two")) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  CHECK(files == std::vector<std::string>{"checkpoint.safetensors", "load.csv", "metrics.csv",
                                          "robustness.csv"});
}

TEST_CASE("train_vision --dp: a batch not a multiple of --dp and worlds of the wrong size are refused") {
  Scratch s("visdp_errors");
  const std::string data = s / "data";
  write_images(data);
  const auto args = [&](const std::vector<std::string>& more) {
    return with(vision_args(data, s / "out"), more);
  };
  check_dp_refusals("train_vision", [&](const std::vector<std::string>& a) { return run(s, 2, a); },
                    args, "6", "5", s / "out");
}
