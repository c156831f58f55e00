// graphmoe/inference/sampling.hpp: the next token from one row of logits (greedy, temperature,
// top-k, top-p), deterministic for a seed.
//
// SamplingOptions (validate() throws graphmoe::Error naming the field and the value):
//   greedy       true: the arg max of the logits, the smallest id among equal maxima; no random
//                word is drawn. This flag is the one way to ask for greedy decoding: a
//                temperature of 0 is an error, not a synonym. temperature, top_k and top_p are
//                still validated, and play no part.
//   temperature  finite and > 0
//   top_k        >= 0; 0 keeps every token, k > 0 the k most probable (k beyond the vocabulary
//                keeps all of it)
//   top_p        in (0, 1]; 1 keeps every token that top_k kept
//   seed         the Philox stream (core/rng.hpp) that the draws read
//
// The distribution a draw reads, in double whatever the logits' type (l: the row, V values):
//   1. w_i = exp((l_i - max_j l_j) / temperature)        (softmax up to 1 / sum w; no overflow)
//   2. order the ids by w descending, equal weights by id ascending; keep the first top_k
//   3. keep the shortest prefix of that order whose weight is >= top_p x the weight top_k kept
//      (the smallest set of the most probable tokens with a renormalised mass >= top_p)
//   4. u = Rng::uniform_double() (two 32-bit words of the stream per draw); the token drawn is the
//      first kept id, in increasing id order, whose cumulative kept weight exceeds u x the kept
//      weight
// The most probable token is always kept, so a draw never fails. The same seed gives the same
// tokens for the same logits on a given build (exp is the C library's, so another libm may round
// a weight differently). Logits that hold NaN or +-Inf, or an empty row, throw graphmoe::Error
// naming the position: a model whose output is not finite cannot be sampled.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/shape.hpp"

namespace graphmoe {

struct SamplingOptions {
  bool greedy = false;
  double temperature = 1.0;
  index_t top_k = 0;
  double top_p = 1.0;
  std::uint64_t seed = 0;

  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(temperature) && temperature > 0.0, "SamplingOptions",
                   "temperature must be finite and > 0, got ", temperature,
                   " (for greedy decoding set SamplingOptions::greedy; a temperature of 0 is not "
                   "greedy)");
    GRAPHMOE_CHECK(top_k >= 0, "SamplingOptions", "top_k must be >= 0 (0 keeps every token), got ",
                   top_k);
    GRAPHMOE_CHECK(top_p > 0.0 && top_p <= 1.0, "SamplingOptions",
                   "top_p must be in (0, 1] (1 keeps every token), got ", top_p);
  }
};

// Draws token ids from rows of logits with the options it was made with (validated by the
// constructor). Each non-greedy draw advances its stream by two words, a greedy one by none.
class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {
    opt_.validate();
  }

  const SamplingOptions& options() const { return opt_; }
  // The index of the next word of the stream (core/rng.hpp): with the seed, where draws resume.
  std::uint64_t position() const { return rng_.position(); }

  // A token id in [0, logits.size()) drawn from the row (see the header comment).
  std::int32_t sample(std::span<const float> logits) { return sample_row(logits); }
  std::int32_t sample(std::span<const double> logits) { return sample_row(logits); }

  // The distribution a draw reads (steps 1-3 of the header comment), normalised to sum 1: zero
  // for the tokens top_k and top_p leave out. Greedy: 1 at the arg max. Draws nothing.
  std::vector<double> distribution(std::span<const float> logits) const { return dist_row(logits); }
  std::vector<double> distribution(std::span<const double> logits) const { return dist_row(logits); }

 private:
  template <std::floating_point T>
  static void check_row(std::span<const T> logits) {
    GRAPHMOE_CHECK(!logits.empty(), "Sampler", "the row of logits is empty (no vocabulary)");
    GRAPHMOE_CHECK(logits.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                   "Sampler", "a row of ", logits.size(), " logits does not fit 32-bit token ids");
    for (std::size_t i = 0; i < logits.size(); ++i)
      GRAPHMOE_CHECK(std::isfinite(logits[i]), "Sampler", "logit ", i, " of ", logits.size(),
                     " is ", logits[i], ": the model's output is not finite and cannot be sampled");
  }

  template <std::floating_point T>
  static std::int32_t argmax(std::span<const T> logits) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[best]) best = i;  // strict: the smallest id among equal maxima
    return static_cast<std::int32_t>(best);
  }

  // Steps 1-3: the kept weights (unnormalised; zero for tokens left out) and their sum.
  template <std::floating_point T>
  double kept_weights(std::span<const T> logits, std::vector<double>& w) const {
    const std::size_t n = logits.size();
    double mx = static_cast<double>(logits[0]);
    for (std::size_t i = 1; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
    w.resize(n);
    // (l - mx) <= 0 and temperature > 0: each weight is in [0, 1], exactly 1 at the maximum
    for (std::size_t i = 0; i < n; ++i)
      w[i] = std::exp((static_cast<double>(logits[i]) - mx) / opt_.temperature);
    const bool cut_k = opt_.top_k > 0 && static_cast<std::size_t>(opt_.top_k) < n;
    const bool cut_p = opt_.top_p < 1.0;
    if (!cut_k && !cut_p) return std::accumulate(w.begin(), w.end(), 0.0);
    std::vector<std::int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    const auto by_weight = [&](std::int32_t a, std::int32_t b) {
      const double wa = w[static_cast<std::size_t>(a)], wb = w[static_cast<std::size_t>(b)];
      return wa > wb || (wa == wb && a < b);
    };
    std::size_t keep = cut_k ? static_cast<std::size_t>(opt_.top_k) : n;
    if (cut_k) {
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                        by_weight);
    } else {
      std::sort(order.begin(), order.end(), by_weight);
    }
    double total = 0;
    for (std::size_t j = 0; j < keep; ++j) total += w[static_cast<std::size_t>(order[j])];
    if (cut_p) {
      // the same summation order as total: the whole prefix reaches total exactly
      const double target = opt_.top_p * total;
      double cum = 0;
      std::size_t m = 0;
      while (m < keep) {
        cum += w[static_cast<std::size_t>(order[m])];
        ++m;
        if (cum >= target) break;
      }
      keep = m;
      total = cum;
    }
    for (std::size_t j = keep; j < n; ++j) w[static_cast<std::size_t>(order[j])] = 0.0;
    return total;
  }

  template <std::floating_point T>
  std::int32_t sample_row(std::span<const T> logits) {
    check_row(logits);
    if (opt_.greedy) return argmax(logits);
    const double total = kept_weights(logits, w_);
    const double target = rng_.uniform_double() * total;
    double cum = 0;
    std::int32_t last = -1;
    for (std::size_t i = 0; i < w_.size(); ++i) {
      if (w_[i] == 0.0) continue;
      cum += w_[i];
      last = static_cast<std::int32_t>(i);
      if (target < cum) return last;
    }
    return last;  // rounding: u x total at or beyond the summed weights; the last kept id
  }

  template <std::floating_point T>
  std::vector<double> dist_row(std::span<const T> logits) const {
    check_row(logits);
    std::vector<double> w;
    if (opt_.greedy) {
      w.assign(logits.size(), 0.0);
      w[static_cast<std::size_t>(argmax(logits))] = 1.0;
      return w;
    }
    const double total = kept_weights(logits, w);
    for (double& x : w) x /= total;
    return w;
  }

  SamplingOptions opt_;
  Rng rng_;
  std::vector<double> w_;  // sample's scratch weights
};

}  // namespace graphmoe
