// tests/support/dp_programs.hpp: what the data-parallel tests of the example programs share
// (test_train_lm_dp, test_train_vision_dp, test_finetune_classifier_dp): editing a command line,
// reading metrics.csv, "--dp 2 trains like one process" and the launcher refusals every
// program's --dp gives.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/processes.hpp"

namespace graphmoe::test {

inline std::vector<std::string> with(std::vector<std::string> args,
                                     const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// args with the value of `option` (which must be there) replaced: CLI11 refuses an option twice.
inline std::vector<std::string> set(std::vector<std::string> args, const std::string& option,
                                    const std::string& value) {
  const auto it = std::find(args.begin(), args.end(), option);
  REQUIRE(it != args.end());
  *(it + 1) = value;
  return args;
}

// One row of a program's metrics.csv. train_loss is what the file holds (train_lm: the step's
// whole-batch loss; train_vision and finetune_classifier: an EMA, 0.98 old + 0.02 new, the first
// step's loss at step 1); step_loss is the step's own loss recovered from two consecutive EMA
// values (NaN without the previous row). val_loss and test_accuracy are NaN when the file has no
// such column.
struct MetricsRow {
  double train_loss = 0, step_loss = 0;
  double val_loss = std::numeric_limits<double>::quiet_NaN();
  double test_accuracy = std::numeric_limits<double>::quiet_NaN();
};

// metrics.csv: step -> its row (empty when the file has no step or train_loss column).
inline std::map<long, MetricsRow> metrics_rows(const std::string& csv) {
  std::istringstream in(csv);
  std::string line;
  std::getline(in, line);
  std::vector<std::string> header;
  for (std::istringstream h(line); std::getline(h, line, ',');) header.push_back(line);
  const auto column = [&](const char* name) {
    return static_cast<std::size_t>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  const std::size_t n = header.size(), step_col = column("step"), train_col = column("train_loss"),
                    val_col = column("val_loss"), acc_col = column("test_accuracy");
  std::map<long, MetricsRow> out;
  if (step_col == n || train_col == n) return out;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    for (std::istringstream l(line); std::getline(l, line, ',');) f.push_back(line);
    if (f.size() != n) continue;
    const long step = std::stol(f[step_col]);
    MetricsRow r;
    r.train_loss = std::stod(f[train_col]);
    if (val_col != n) r.val_loss = std::stod(f[val_col]);
    if (acc_col != n) r.test_accuracy = std::stod(f[acc_col]);
    r.step_loss = step == 1 ? r.train_loss
                  : out.count(step - 1) != 0
                      ? (r.train_loss - 0.98 * out.at(step - 1).train_loss) / 0.02
                      : std::numeric_limits<double>::quiet_NaN();
    out[step] = r;
  }
  return out;
}

inline bool close_rel(double a, double b, double rel = 1e-5) {
  return std::isfinite(a) && std::isfinite(b) &&
         std::abs(a - b) <= rel * std::max(std::abs(a), std::abs(b));
}

// The rows of `got` at the steps in [first, last] equal `want`'s: train_loss (and, with
// step_losses, each step's own loss) and val_loss where the file has it to 1e-5 relative,
// test_accuracy where it has it exactly (a sharded evaluation sums the counts). On failure the
// message shows both runs.
inline void check_same_metrics(const Result& want_run, const std::string& want_csv,
                               const Result& got_run, const std::string& got_csv, long first,
                               long last, bool step_losses = false) {
  INFO("reference run:\n" << want_run.text() << "metrics.csv:\n" << want_csv);
  INFO("data-parallel run:\n" << got_run.text() << "metrics.csv:\n" << got_csv);
  REQUIRE(want_run.status == 0);
  REQUIRE(got_run.status == 0);
  const auto want = metrics_rows(want_csv), got = metrics_rows(got_csv);
  for (long step = first; step <= last; ++step) {
    CAPTURE(step);
    REQUIRE(want.count(step) == 1);
    REQUIRE(got.count(step) == 1);
    const MetricsRow &w = want.at(step), &g = got.at(step);
    CHECK(close_rel(w.train_loss, g.train_loss));
    if (step_losses) CHECK(close_rel(w.step_loss, g.step_loss));
    CHECK(std::isnan(w.val_loss) == std::isnan(g.val_loss));
    if (!std::isnan(w.val_loss)) CHECK(close_rel(w.val_loss, g.val_loss));
    CHECK(std::isnan(w.test_accuracy) == std::isnan(g.test_accuracy));
    if (!std::isnan(w.test_accuracy)) CHECK(w.test_accuracy == g.test_accuracy);
  }
}

// The refusals every program's --dp gives under `mpiexec -n 2` (run2: the program under two
// ranks with these arguments): --dp 3 in a world of 2 (with --batch dp3_batch, a multiple of 3),
// --batch odd_batch under --dp 2 (reported by rank 0 only), and no --dp at all; nothing is
// written to out_dir. args(more): the program's arguments plus `more`.
inline void check_dp_refusals(const std::string& program,
                              const std::function<Result(const std::vector<std::string>&)>& run2,
                              const std::function<std::vector<std::string>(
                                  const std::vector<std::string>&)>& args,
                              const std::string& dp3_batch, const std::string& odd_batch,
                              const std::filesystem::path& out_dir) {
  check_refused(run2(set(args({"--dp", "3"}), "--batch", dp3_batch)),
                {program + ": error: graphmoe::" + program +
                 ": --dp 3 must equal the number of MPI processes, which is 2: launch with mpirun "
                 "-n 3"});
  const Result odd = run2(set(args({"--dp", "2"}), "--batch", odd_batch));
  check_refused(odd, {"graphmoe::" + program + ": --batch " + odd_batch +
                      " is not a multiple of --dp 2: --batch is the global batch"});
  CHECK(odd.err.find("is not a multiple") == odd.err.rfind("is not a multiple"));  // rank 0 only
  check_refused(run2(args({})),
                {"this is one of 2 processes started by an MPI launcher, but --dp is 1", "Pass --dp 2"});
  CHECK(!std::filesystem::exists(out_dir));  // nothing was written
}

}  // namespace graphmoe::test
