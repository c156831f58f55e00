// graphmoe/inference/sampling.hpp: the next token from one row of logits (greedy, temperature,
// top-k, top-p, min-p, repetition penalties, banned tokens), deterministic for a seed.
//
// SamplingOptions (validate() throws graphmoe::Error naming the field and the value):
//   greedy       true: the arg max of the (penalised, unbanned) logits, the smallest id among
//                equal maxima; no random word is drawn. This flag is the one way to ask for greedy
//                decoding: a temperature of 0 is an error, not a synonym. temperature, top_k,
//                top_p and min_p are still validated, and play no part.
//   temperature  finite and > 0
//   top_k        >= 0; 0 keeps every token, k > 0 the k most probable (k beyond the vocabulary
//                keeps all of it)
//   top_p        in (0, 1]; 1 keeps every token that top_k kept
//   min_p        in [0, 1]; 0 keeps every token, p > 0 those whose probability is >= p x that of
//                the most probable token (after the temperature, as top_p reads it)
//   repeat_penalty     finite, > 0; 1 changes nothing (llama.cpp's --repeat-penalty)
//   frequency_penalty  finite; 0 changes nothing
//   presence_penalty   finite; 0 changes nothing
//   repeat_last_n      the window the penalties count in: the last n tokens of the history
//                      passed to sample() (prompt and generated tokens); 0 disables the
//                      penalties, -1 counts the whole history
//   banned       token ids never drawn (greedy included); each must be >= 0 and inside the row
//   seed         the Philox stream (core/rng.hpp) that the draws read
//
// The distribution a draw reads, in double whatever the logits' type (l: the row, V values;
// c_i: how many times id i occurs in the last repeat_last_n tokens of the history):
//   0. penalties, as llama.cpp's penalties sampler: for each i with c_i > 0,
//        l_i <- l_i > 0 ? l_i / repeat_penalty : l_i x repeat_penalty
//        l_i <- l_i - c_i x frequency_penalty - presence_penalty
//      then the banned ids are removed (weight 0, whatever their logit)
//   1. w_i = exp((l_i - max_j l_j) / temperature), the max over ids not banned (softmax up to
//      1 / sum w; no overflow)
//   2. order the ids by w descending, equal weights by id ascending; keep the first top_k
//   3. keep the shortest prefix of that order whose weight is >= top_p x the weight top_k kept
//      (the smallest set of the most probable tokens with a renormalised mass >= top_p)
//   4. min_p: keep only the ids with w_i >= min_p (w is 1 at the most probable token)
//   5. u = Rng::uniform_double() (two 32-bit words of the stream per draw); the token drawn is the
//      first kept id, in increasing id order, whose cumulative kept weight exceeds u x the kept
//      weight
// The most probable token not banned is always kept, so a draw never fails (a row whose every id
// is banned throws). llama.cpp's default chain applies min-p before its temperature; here every
// cut (top_k, top_p, min_p) reads the tempered distribution. The same seed gives the same tokens
// for the same logits and history on a given build (exp is the C library's, so another libm may
// round a weight differently). Logits that hold NaN or +-Inf, or an empty row, throw
// graphmoe::Error naming the position: a model whose output is not finite cannot be sampled; so
// does a penalty that makes a logit overflow.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <utility>
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
  double min_p = 0.0;
  double repeat_penalty = 1.0;
  double frequency_penalty = 0.0;
  double presence_penalty = 0.0;
  index_t repeat_last_n = 64;
  std::vector<std::int32_t> banned;
  std::uint64_t seed = 0;

  // Whether a draw reads the history at all (a penalty that changes something, over a window).
  bool penalises() const {
    return repeat_last_n != 0 &&
           (repeat_penalty != 1.0 || frequency_penalty != 0.0 || presence_penalty != 0.0);
  }

  void validate() const {
    GRAPHMOE_CHECK(std::isfinite(temperature) && temperature > 0.0, "SamplingOptions",
                   "temperature must be finite and > 0, got ", temperature,
                   " (for greedy decoding set SamplingOptions::greedy; a temperature of 0 is not "
                   "greedy)");
    GRAPHMOE_CHECK(top_k >= 0, "SamplingOptions", "top_k must be >= 0 (0 keeps every token), got ",
                   top_k);
    GRAPHMOE_CHECK(top_p > 0.0 && top_p <= 1.0, "SamplingOptions",
                   "top_p must be in (0, 1] (1 keeps every token), got ", top_p);
    GRAPHMOE_CHECK(min_p >= 0.0 && min_p <= 1.0, "SamplingOptions",
                   "min_p must be in [0, 1] (0 keeps every token), got ", min_p);
    GRAPHMOE_CHECK(std::isfinite(repeat_penalty) && repeat_penalty > 0.0, "SamplingOptions",
                   "repeat_penalty must be finite and > 0 (1 changes nothing), got ",
                   repeat_penalty);
    GRAPHMOE_CHECK(std::isfinite(frequency_penalty), "SamplingOptions",
                   "frequency_penalty must be finite (0 changes nothing), got ", frequency_penalty);
    GRAPHMOE_CHECK(std::isfinite(presence_penalty), "SamplingOptions",
                   "presence_penalty must be finite (0 changes nothing), got ", presence_penalty);
    GRAPHMOE_CHECK(repeat_last_n >= -1, "SamplingOptions",
                   "repeat_last_n must be >= -1 (0 disables the penalties, -1 counts the whole "
                   "history), got ", repeat_last_n);
    for (std::int32_t id : banned)
      GRAPHMOE_CHECK(id >= 0, "SamplingOptions", "banned token id ", id, " is negative");
  }
};

// Draws token ids from rows of logits with the options it was made with (validated by the
// constructor). Each non-greedy draw advances its stream by two words, a greedy one by none.
// history: the tokens before the one drawn (the prompt and what was generated), which the
// penalties count in (its last repeat_last_n ids); ignored without penalties.
class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {
    opt_.validate();
  }

  const SamplingOptions& options() const { return opt_; }
  // The index of the next word of the stream (core/rng.hpp): with the seed, where draws resume.
  std::uint64_t position() const { return rng_.position(); }

  // A token id in [0, logits.size()) drawn from the row (see the header comment).
  std::int32_t sample(std::span<const float> logits, std::span<const std::int32_t> history = {}) {
    return sample_row(logits, history);
  }
  std::int32_t sample(std::span<const double> logits, std::span<const std::int32_t> history = {}) {
    return sample_row(logits, history);
  }

  // The distribution a draw reads (steps 0-4 of the header comment), normalised to sum 1: zero
  // for the tokens banned or left out by top_k, top_p and min_p. Greedy: 1 at the arg max.
  // Draws nothing.
  std::vector<double> distribution(std::span<const float> logits,
                                   std::span<const std::int32_t> history = {}) const {
    return dist_row(logits, history);
  }
  std::vector<double> distribution(std::span<const double> logits,
                                   std::span<const std::int32_t> history = {}) const {
    return dist_row(logits, history);
  }

 private:
  // The row as a draw reads it after step 0: l (double) and allowed (0: banned).
  struct Row {
    std::vector<double> l;
    std::vector<char> allowed;
  };

  template <std::floating_point T>
  void prepare(std::span<const T> logits, std::span<const std::int32_t> history, Row& row) const {
    GRAPHMOE_CHECK(!logits.empty(), "Sampler", "the row of logits is empty (no vocabulary)");
    GRAPHMOE_CHECK(logits.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                   "Sampler", "a row of ", logits.size(), " logits does not fit 32-bit token ids");
    const std::size_t n = logits.size();
    row.l.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      GRAPHMOE_CHECK(std::isfinite(logits[i]), "Sampler", "logit ", i, " of ", n, " is ", logits[i],
                     ": the model's output is not finite and cannot be sampled");
      row.l[i] = static_cast<double>(logits[i]);
    }
    row.allowed.assign(n, 1);
    for (std::int32_t id : opt_.banned) {
      GRAPHMOE_CHECK(static_cast<std::size_t>(id) < n, "Sampler", "banned token id ", id,
                     " is not in the row of ", n, " logits");
      row.allowed[static_cast<std::size_t>(id)] = 0;
    }
    GRAPHMOE_CHECK(std::find(row.allowed.begin(), row.allowed.end(), char{1}) != row.allowed.end(),
                   "Sampler", "every one of the ", n, " token ids is banned: nothing can be drawn");
    if (!opt_.penalises() || history.empty()) return;
    std::size_t from = 0;
    if (opt_.repeat_last_n > 0 && history.size() > static_cast<std::size_t>(opt_.repeat_last_n))
      from = history.size() - static_cast<std::size_t>(opt_.repeat_last_n);
    std::vector<std::pair<std::int32_t, std::int64_t>> counts;  // (id, count), sorted by id
    counts.reserve(history.size() - from);
    for (std::size_t j = from; j < history.size(); ++j) {
      const std::int32_t id = history[j];
      GRAPHMOE_CHECK(id >= 0 && static_cast<std::size_t>(id) < n, "Sampler", "history token ", j,
                     " is id ", id, ", not in the row of ", n, " logits");
      counts.emplace_back(id, 1);
    }
    std::sort(counts.begin(), counts.end());
    std::size_t k = 0;
    for (std::size_t j = 0; j < counts.size();) {  // merge equal ids
      std::size_t e = j;
      while (e < counts.size() && counts[e].first == counts[j].first) ++e;
      counts[k++] = {counts[j].first, static_cast<std::int64_t>(e - j)};
      j = e;
    }
    counts.resize(k);
    for (const auto& [id, c] : counts) {
      double& x = row.l[static_cast<std::size_t>(id)];
      x = x > 0 ? x / opt_.repeat_penalty : x * opt_.repeat_penalty;
      x -= static_cast<double>(c) * opt_.frequency_penalty + opt_.presence_penalty;
      GRAPHMOE_CHECK(std::isfinite(x), "Sampler", "the penalties made logit ", id,
                     " non-finite (repeat_penalty ", opt_.repeat_penalty, ", frequency_penalty ",
                     opt_.frequency_penalty, ", presence_penalty ", opt_.presence_penalty, ")");
    }
  }

  static std::int32_t argmax(const Row& row) {
    std::size_t best = row.l.size();
    for (std::size_t i = 0; i < row.l.size(); ++i)
      if (row.allowed[i] && (best == row.l.size() || row.l[i] > row.l[best]))
        best = i;  // strict: the smallest id among equal maxima
    return static_cast<std::int32_t>(best);
  }

  // Steps 1-4: the kept weights (unnormalised; zero for tokens left out) and their sum.
  double kept_weights(const Row& row, std::vector<double>& w) const {
    const std::size_t n = row.l.size();
    const double mx = row.l[static_cast<std::size_t>(argmax(row))];
    w.resize(n);
    // (l - mx) <= 0 and temperature > 0: each weight is in [0, 1], exactly 1 at the maximum
    for (std::size_t i = 0; i < n; ++i)
      w[i] = row.allowed[i] ? std::exp((row.l[i] - mx) / opt_.temperature) : 0.0;
    const bool cut_k = opt_.top_k > 0 && static_cast<std::size_t>(opt_.top_k) < n;
    const bool cut_p = opt_.top_p < 1.0;
    if (!cut_k && !cut_p) return cut_min_p(w, std::accumulate(w.begin(), w.end(), 0.0));
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
    return cut_min_p(w, total);
  }

  // Step 4: the weights below min_p dropped (the maximum's weight is 1 >= min_p: it stays).
  double cut_min_p(std::vector<double>& w, double total) const {
    if (opt_.min_p <= 0.0) return total;
    total = 0;
    for (double& x : w) {
      if (x < opt_.min_p) x = 0.0;
      total += x;
    }
    return total;
  }

  template <std::floating_point T>
  std::int32_t sample_row(std::span<const T> logits, std::span<const std::int32_t> history) {
    prepare(logits, history, row_);
    if (opt_.greedy) return argmax(row_);
    const double total = kept_weights(row_, w_);
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
  std::vector<double> dist_row(std::span<const T> logits, std::span<const std::int32_t> history) const {
    Row row;
    prepare(logits, history, row);
    std::vector<double> w;
    if (opt_.greedy) {
      w.assign(logits.size(), 0.0);
      w[static_cast<std::size_t>(argmax(row))] = 1.0;
      return w;
    }
    const double total = kept_weights(row, w);
    for (double& x : w) x /= total;
    return w;
  }

  SamplingOptions opt_;
  Rng rng_;
  Row row_;                // sample's scratch row
  std::vector<double> w_;  // sample's scratch weights
};

}  // namespace graphmoe
