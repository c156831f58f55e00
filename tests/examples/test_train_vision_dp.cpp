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

#include "support/processes.hpp"

#if !defined(GRAPHMOE_TRAIN_VISION) || !defined(GRAPHMOE_MPIEXEC)
#error "GRAPHMOE_TRAIN_VISION and GRAPHMOE_MPIEXEC must be defined by CMake"
#endif

namespace fs = std::filesystem;

namespace {

const std::string kTrainVision = GRAPHMOE_TRAIN_VISION;

using graphmoe::test::check_refused;
using graphmoe::test::Result;
using graphmoe::test::Scratch;
using graphmoe::test::slurp;

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

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// args with the value of `option` (which must be there) replaced: CLI11 refuses an option twice.
std::vector<std::string> set(std::vector<std::string> args, const std::string& option,
                             const std::string& value) {
  const auto it = std::find(args.begin(), args.end(), option);
  REQUIRE(it != args.end());
  *(it + 1) = value;
  return args;
}

struct Row {
  double ema = 0, loss = 0, accuracy = 0;  // loss: the step's own, recovered from the EMA
};

// metrics.csv: step -> its row. train_loss is an EMA (0.98 old + 0.02 new, the first step's loss
// at step 1); with a row every step, each step's own loss is recovered from two consecutive ones.
std::map<long, Row> rows(const std::string& csv) {
  std::istringstream in(csv);
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  for (std::istringstream h(line); std::getline(h, line, ',');) header.push_back(line);
  std::size_t step_col = header.size(), train_col = header.size(), acc_col = header.size();
  for (std::size_t i = 0; i < header.size(); ++i) {
    if (header[i] == "step") step_col = i;
    if (header[i] == "train_loss") train_col = i;
    if (header[i] == "test_accuracy") acc_col = i;
  }
  std::map<long, Row> out;
  if (step_col == header.size() || train_col == header.size() || acc_col == header.size())
    return out;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    for (std::istringstream l(line); std::getline(l, line, ',');) f.push_back(line);
    if (f.size() != header.size()) continue;
    const long step = std::stol(f[step_col]);
    Row r;
    r.ema = std::stod(f[train_col]);
    r.accuracy = std::stod(f[acc_col]);
    r.loss = step == 1 ? r.ema : out.count(step - 1) ? (r.ema - 0.98 * out.at(step - 1).ema) / 0.02 : std::nan("");
    out[step] = r;
  }
  return out;
}

bool close(double a, double b, double rel = 1e-5) {
  return std::isfinite(a) && std::isfinite(b) && std::abs(a - b) <= rel * std::max(std::abs(a), std::abs(b));
}


}  // namespace

TEST_CASE("train_vision --dp 2 under mpiexec -n 2 trains like one process with the same global batch") {
  Scratch s("visdp_equal");
  const std::string data = s / "data";
  write_images(data);
  const Result one = run(s, 0, vision_args(data, s / "one"));
  const Result two = run(s, 2, with(vision_args(data, s / "two"), {"--dp", "2"}));
  const std::string one_csv = slurp(s / "one/metrics.csv"), two_csv = slurp(s / "two/metrics.csv");
  INFO("reference run:\n" << one.text() << "metrics.csv:\n" << one_csv);
  INFO("data-parallel run:\n" << two.text() << "metrics.csv:\n" << two_csv);
  REQUIRE(one.status == 0);
  REQUIRE(two.status == 0);
  const auto want = rows(one_csv), got = rows(two_csv);
  for (long step = 1; step <= 5; ++step) {
    CAPTURE(step);
    REQUIRE(want.count(step) == 1);
    REQUIRE(got.count(step) == 1);
    CHECK(close(want.at(step).ema, got.at(step).ema));    // the metrics' EMA of the whole batch's loss
    CHECK(close(want.at(step).loss, got.at(step).loss));  // the step's own loss
    CHECK(want.at(step).accuracy == got.at(step).accuracy);  // sharded: the counts are summed
  }
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
  check_refused(run(s, 2, set(args({"--dp", "3"}), "--batch", "6")),
                {"train_vision: error: graphmoe::train_vision: --dp 3 must equal the number of MPI "
                 "processes, which is 2: launch with mpirun -n 3"});
  const Result odd = run(s, 2, set(args({"--dp", "2"}), "--batch", "5"));
  check_refused(odd, {"graphmoe::train_vision: --batch 5 is not a multiple of --dp 2: --batch is "
                      "the global batch"});
  CHECK(odd.err.find("is not a multiple") == odd.err.rfind("is not a multiple"));  // rank 0 only
  check_refused(run(s, 2, args({})),
                {"this is one of 2 processes started by an MPI launcher, but --dp is 1", "Pass --dp 2"});
  CHECK(!fs::exists(s / "out"));  // nothing was written
}
