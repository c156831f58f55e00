// DivergenceGuard (train/divergence.hpp): each test of the policy against a naive re-evaluation
// of the smoothed loss, healthy runs left alone, every check's message, a failed check changes
// nothing, bad configurations refused.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/core/rng.hpp"
#include "graphmoe/train/divergence.hpp"

using namespace graphmoe;

namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// The message of the DivergenceError that f throws ("" when it throws none).
template <class F>
std::string divergence_message(F&& f) {
  try {
    f();
  } catch (const DivergenceError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The first step (1-based) at which the exploding test fires for `losses`, recomputed naively:
// the EMA of the first t losses, its running minimum, the conditions as documented. -1: never.
std::int64_t naive_first_explosion(const std::vector<double>& losses, const DivergenceConfig& c) {
  double ema = 0, lowest = 0;
  for (std::size_t t = 0; t < losses.size(); ++t) {
    ema = t == 0 ? losses[0] : c.ema_decay * ema + (1 - c.ema_decay) * losses[t];
    lowest = t == 0 ? ema : std::min(lowest, ema);
    if (static_cast<std::int64_t>(t) >= c.warmup_steps && ema > c.loss_factor * lowest &&
        ema > lowest + c.loss_margin)
      return static_cast<std::int64_t>(t) + 1;
  }
  return -1;
}

// Feeds losses to a guard (steps 1, 2, ...); the step at which it threw, or -1.
std::int64_t first_throw(DivergenceGuard& g, const std::vector<double>& losses) {
  for (std::size_t t = 0; t < losses.size(); ++t) {
    try {
      g.check_loss(static_cast<std::int64_t>(t) + 1, losses[t]);
    } catch (const DivergenceError&) {
      return static_cast<std::int64_t>(t) + 1;
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("divergence: a healthy, noisy, decreasing loss is never flagged") {
  Rng rng(3);
  for (double start : {10.4, 5.6, 0.7}) {
    CAPTURE(start);
    DivergenceGuard g(DivergenceConfig{}, "run");
    std::vector<double> losses;
    for (int t = 0; t < 2000; ++t) {
      const double trend = 0.05 * start + 0.95 * start * std::exp(-t / 300.0);
      losses.push_back(trend * (1 + 0.3 * rng.uniform(-1.0, 1.0)));  // +-30% batch noise
    }
    CHECK(first_throw(g, losses) == -1);
    CHECK(g.checked_steps() == 2000);
    CHECK(g.lowest_smoothed_loss() <= g.smoothed_loss());
  }
}

TEST_CASE("divergence: an exploding loss is stopped at the step the documented test names") {
  // 5.6 for 40 steps, then growing 10% a step (the --lr 10 run of the issue: 5.6 -> 509)
  std::vector<double> losses(40, 5.6);
  for (int t = 0; t < 200; ++t) losses.push_back(losses.back() * 1.1);
  for (const double factor : {1.5, 3.0, 10.0}) {
    for (const std::int64_t warmup : {std::int64_t{0}, std::int64_t{20}, std::int64_t{100}}) {
      CAPTURE(factor);
      CAPTURE(warmup);
      DivergenceConfig c;
      c.loss_factor = factor;
      c.warmup_steps = warmup;
      DivergenceGuard g(c, "train_lm");
      const std::int64_t want = naive_first_explosion(losses, c);
      REQUIRE(want > 40);
      CHECK(first_throw(g, losses) == want);
      // the failed check changed nothing: the state is that of the step before
      std::vector<double> prefix(losses.begin(), losses.begin() + (want - 1));
      DivergenceGuard h(c, "train_lm");
      CHECK(first_throw(h, prefix) == -1);
      CHECK(g.smoothed_loss() == h.smoothed_loss());
      CHECK(g.lowest_smoothed_loss() == h.lowest_smoothed_loss());
      CHECK(g.checked_steps() == h.checked_steps());
    }
  }
  DivergenceGuard g(DivergenceConfig{}, "train_lm");
  const std::string msg = divergence_message([&] { first_throw(g, losses); g.check_loss(999, 1e9); });
  CHECK(has(msg, "train_lm: training diverged at step"));
  CHECK(has(msg, "exploding"));
  CHECK(has(msg, "last checkpoint"));
}

TEST_CASE("divergence: the margin keeps a small loss that doubles from being flagged") {
  std::vector<double> losses(100, 0.01);
  losses.insert(losses.end(), 400, 0.05);  // 5x the lowest, but only 0.04 nats above it
  DivergenceGuard g;
  CHECK(first_throw(g, losses) == -1);
  DivergenceConfig c;
  c.loss_margin = 0;
  DivergenceGuard h(c);
  CHECK(first_throw(h, losses) == naive_first_explosion(losses, c));
  CHECK(naive_first_explosion(losses, c) > 100);
  // factor 0 turns the test off
  c.loss_factor = 0;
  DivergenceGuard off(c);
  std::vector<double> rising;
  for (int t = 0; t < 300; ++t) rising.push_back(1.0 + t);
  CHECK(first_throw(off, rising) == -1);
}

TEST_CASE("divergence: non-finite losses and gradient norms, the ceiling and the gradient limit") {
  DivergenceConfig c;
  c.loss_ceiling = 30;
  c.max_grad_norm = 1e3;
  DivergenceGuard g(c, "finetune_classifier");
  g.check_loss(1, 5.0);
  std::string msg = divergence_message([&] { g.check_loss(7, kNaN); });
  CHECK(has(msg, "finetune_classifier: training diverged at step 7: the training loss is nan"));
  CHECK(has(divergence_message([&] { g.check_loss(8, kInf); }), "the training loss is inf"));
  msg = divergence_message([&] { g.check_loss(9, 31.0); });
  CHECK(has(msg, "step 9: the training loss 31 is above the ceiling 30"));
  CHECK(g.checked_steps() == 1);  // the refused losses changed nothing
  CHECK(g.smoothed_loss() == 5.0);
  g.check_loss(10, 30.0);         // at the ceiling: allowed

  g.check_grad_norm(11, 999.0);
  CHECK(has(divergence_message([&] { g.check_grad_norm(12, 1001.0); }),
            "step 12: the gradient norm 1001 (before clipping) is above the limit 1000"));
  CHECK(has(divergence_message([&] { g.check_grad_norm(13, kNaN); }), "the gradient norm is nan"));
  CHECK(has(divergence_message([&] { g.check_grad_norm(14, kInf); }), "the gradient norm is inf"));
  DivergenceGuard unlimited;  // max_grad_norm 0: no limit, but non-finite still refused
  unlimited.check_grad_norm(1, 1e300);
  CHECK(!divergence_message([&] { unlimited.check_grad_norm(2, kInf); }).empty());

  g.check_eval(15, "validation loss", 29.0);
  CHECK(has(divergence_message([&] { g.check_eval(16, "validation loss", kInf); }),
            "step 16: the validation loss is inf"));
  CHECK(has(divergence_message([&] { g.check_eval(17, "test loss", kNaN); }),
            "the test loss is nan"));
  CHECK(has(divergence_message([&] { g.check_eval(18, "validation loss", 40.0); }),
            "the validation loss 40 is above the ceiling 30"));
  // a DivergenceError is a graphmoe::Error
  CHECK_THROWS_AS(g.check_loss(19, kNaN), Error);
}

TEST_CASE("divergence: bad configurations are refused") {
  auto refused = [](auto edit, const char* part) {
    DivergenceConfig c;
    edit(c);
    try {
      DivergenceGuard g(c);
    } catch (const Error& e) {
      CAPTURE(e.what());
      CHECK(has(e.what(), part));
      return;
    }
    FAIL("accepted");
  };
  refused([](DivergenceConfig& c) { c.loss_factor = 1.0; }, "loss_factor");
  refused([](DivergenceConfig& c) { c.loss_factor = -2; }, "loss_factor");
  refused([](DivergenceConfig& c) { c.loss_factor = kNaN; }, "loss_factor");
  refused([](DivergenceConfig& c) { c.loss_margin = -1; }, "loss_margin");
  refused([](DivergenceConfig& c) { c.ema_decay = 1.0; }, "ema_decay");
  refused([](DivergenceConfig& c) { c.ema_decay = kNaN; }, "ema_decay");
  refused([](DivergenceConfig& c) { c.warmup_steps = -1; }, "warmup_steps");
  refused([](DivergenceConfig& c) { c.loss_ceiling = 0; }, "loss_ceiling");
  refused([](DivergenceConfig& c) { c.loss_ceiling = kNaN; }, "loss_ceiling");
  refused([](DivergenceConfig& c) { c.max_grad_norm = -1; }, "max_grad_norm");
  refused([](DivergenceConfig& c) { c.max_grad_norm = kInf; }, "max_grad_norm");
}
