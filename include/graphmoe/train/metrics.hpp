// graphmoe/train/metrics.hpp: routing-stability metrics and a CSV log for them.
//
//   routing_fluctuation(a, b)     how many probe tokens change experts between two routings
//                                 (the seed paper's Figure 3 left; LibMoE's expert change rate)
//   mean_entropy(probs)           mean over tokens of -sum_e p log p (torchscale's router entropy)
//   mean_score_entropy(s)         the same for scores that need not sum to 1 (sigmoid scores):
//                                 each row normalised by its sum
//   mean_normalized_entropy(p)    the same divided by log E            (LibMoE)
//   expert_load(indices, E)       tokens routed to each expert
//   selection_change(r, indices)  how often the selected set differs from the top-k of r (what
//                                 the token graph changed)
//   CsvLog                        one metrics row per call, flushed, full precision
//   metric_text(v, decimals)      a metric for a summary line: "n/a" when it cannot be computed
//
// A metric that cannot be computed (yet) is NaN where it is held: routing fluctuation before a
// second evaluation or without a --compare checkpoint, an entropy ratio without a baseline. It is
// shown as "n/a" in summary lines and reports (metric_text) and written as an empty CSV field
// (CsvLog::row_or_missing), so that a healthy run never prints "nan".
//
// Routings are the (N, k) expert indices of Selection::indices (RouterOutput::selection): N probe
// tokens, k distinct experts per token. Two routings are compared as sets per token, so the order
// of a token's k experts (by score) does not matter.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// Over the N tokens of two routings a, b of shape (N, k):
//   changed_tokens  = (1/N) #{i : set(a_i) != set(b_i)}           the paper's (top-k) fluctuation
//   switch_fraction = (1/N) sum_i #{j : a_ij not in set(b_i)} / k  LibMoE's average_switch_fraction
//   top1_changed    = (1/N) #{i : a_i0 != b_i0}                   top-1 fluctuation
// All are 0 for identical routings and 1 for routings with no expert in common on any token;
// switch_fraction <= changed_tokens. Since each row holds k distinct experts, all are symmetric
// in a and b. top1_changed reads slot 0 as the token's first choice, as Selection::indices is
// ordered (descending score); for k = 1 it equals changed_tokens.
struct Fluctuation {
  double changed_tokens = 0;
  double switch_fraction = 0;
  double top1_changed = 0;
};

namespace detail {
inline void check_routing(const char* op, const char* what, const Tensor<std::int32_t, cpu>& x) {
  GRAPHMOE_CHECK(x.rank() == 2, op, what, " must have shape (N, k), got ", x.shape());
  const index_t n = x.dim(0), k = x.dim(1);
  for (index_t i = 0; i < n; ++i) {
    const std::int32_t* row = x.data() + i * k;
    for (index_t j = 0; j < k; ++j) {
      GRAPHMOE_CHECK(row[j] >= 0, op, what, " holds the negative expert id ", row[j],
                     " at token ", i, ", slot ", j);
      for (index_t l = 0; l < j; ++l)
        GRAPHMOE_CHECK(row[l] != row[j], op, what, " lists expert ", row[j],
                       " twice for token ", i, " (slots ", l, " and ", j, ")");
    }
  }
}
}  // namespace detail

inline Fluctuation routing_fluctuation(const Tensor<std::int32_t, cpu>& a,
                                       const Tensor<std::int32_t, cpu>& b) {
  constexpr const char* op = "routing_fluctuation";
  GRAPHMOE_CHECK(a.rank() == 2 && b.rank() == 2, op, "routings must have shape (N, k), got ",
                 a.shape(), " and ", b.shape());
  GRAPHMOE_CHECK(a.dim(1) == b.dim(1), op, "the routings select different numbers of experts (k = ",
                 a.dim(1), " and k = ", b.dim(1), ")");
  GRAPHMOE_CHECK(a.dim(0) == b.dim(0), op, "the routings cover different numbers of tokens (",
                 a.dim(0), " and ", b.dim(0), "): route the same probe tokens twice");
  GRAPHMOE_CHECK(a.dim(0) > 0 && a.dim(1) > 0, op, "no tokens or no experts to compare (shape ",
                 a.shape(), ")");
  detail::check_routing(op, "the first routing", a);
  detail::check_routing(op, "the second routing", b);
  const index_t n = a.dim(0), k = a.dim(1);
  index_t changed = 0, switched = 0, top1 = 0;
  for (index_t i = 0; i < n; ++i) {
    const std::int32_t* ra = a.data() + i * k;
    const std::int32_t* rb = b.data() + i * k;
    top1 += ra[0] != rb[0] ? 1 : 0;
    index_t missing = 0;
    for (index_t j = 0; j < k; ++j) {
      bool found = false;
      for (index_t l = 0; l < k; ++l) found = found || ra[j] == rb[l];
      missing += found ? 0 : 1;
    }
    changed += missing > 0 ? 1 : 0;
    switched += missing;
  }
  Fluctuation f;
  f.changed_tokens = static_cast<double>(changed) / static_cast<double>(n);
  f.switch_fraction =
      static_cast<double>(switched) / (static_cast<double>(n) * static_cast<double>(k));
  f.top1_changed = static_cast<double>(top1) / static_cast<double>(n);
  return f;
}

namespace detail {
// sum over rows of -sum_e p log p (0 log 0 = 0), after checking that each row is a distribution:
// entries finite and >= 0, summing to 1 within 1e-3.
template <class T>
double total_entropy(const char* op, const Tensor<T, cpu>& probs, bool normalize = false) {
  static_assert(std::is_floating_point_v<T>,
                "graphmoe: entropy needs floating-point probabilities");
  GRAPHMOE_CHECK(probs.rank() >= 1 && probs.numel() > 0, op,
                 "probabilities must be a non-empty (..., E) tensor, got shape ", probs.shape());
  const index_t rows = probs.rows(), e = probs.cols();
  double total = 0;
  for (index_t i = 0; i < rows; ++i) {
    const T* p = probs.data() + i * e;
    double h = 0, sum = 0;
    for (index_t j = 0; j < e; ++j) {
      const double x = static_cast<double>(p[j]);
      GRAPHMOE_CHECK(std::isfinite(x) && x >= 0, op, "row ", i, " holds ", x, " at expert ", j,
                     ": probabilities must be finite and >= 0");
      sum += x;
      if (x > 0) h -= x * std::log(x);
    }
    if (normalize && std::abs(sum - 1.0) > 1e-3) {
      // the entropy of p / sum: log(sum) - (sum_e p log p) / sum, with h = -sum_e p log p
      GRAPHMOE_CHECK(sum > 0, op, "row ", i, " sums to ", sum,
                     ": scores must have a positive sum to be normalised");
      h = std::log(sum) + h / sum;
    } else {
      GRAPHMOE_CHECK(std::abs(sum - 1.0) <= 1e-3, op, "row ", i, " sums to ", sum,
                     ", not 1: pass probabilities (softmax outputs), not logits");
    }
    total += h;
  }
  return total;
}
}  // namespace detail

// Mean over the rows of probs (..., E) of the entropy -sum_e p log p, in nats.
template <class T>
double mean_entropy(const Tensor<T, cpu>& probs) {
  const double total = detail::total_entropy("mean_entropy", probs);
  return total / static_cast<double>(probs.rows());
}

// mean_entropy of scores that need not sum to 1 (a sigmoid scorer's, SigmoidScorer): each row
// is normalised by its sum first (finite, >= 0, a positive sum). A row that sums to 1 within
// mean_entropy's tolerance (1e-3) is taken as it is, so that softmax outputs give mean_entropy's
// value exactly.
template <class T>
double mean_score_entropy(const Tensor<T, cpu>& scores) {
  const double total = detail::total_entropy("mean_score_entropy", scores, true);
  return total / static_cast<double>(scores.rows());
}

// mean_entropy / log(E): 1 for uniform rows, 0 for one-hot rows. Needs E >= 2.
template <class T>
double mean_normalized_entropy(const Tensor<T, cpu>& probs) {
  GRAPHMOE_CHECK(probs.rank() >= 1 && probs.cols() >= 2, "mean_normalized_entropy",
                 "needs at least 2 experts (log E > 0), got shape ", probs.shape());
  const double total = detail::total_entropy("mean_normalized_entropy", probs);
  return total / static_cast<double>(probs.rows()) / std::log(static_cast<double>(probs.cols()));
}

// counts[e] = number of entries of indices (e.g. Selection::indices, (N, k)) equal to e: the
// tokens routed to expert e. Entries must lie in [0, num_experts).
inline std::vector<index_t> expert_load(const Tensor<std::int32_t, cpu>& indices,
                                        index_t num_experts) {
  GRAPHMOE_CHECK(num_experts >= 1, "expert_load", "num_experts must be >= 1, got ", num_experts);
  GRAPHMOE_CHECK(indices.rank() >= 1, "expert_load",
                 "indices must be an (N, k) tensor, got shape ", indices.shape());
  std::vector<index_t> counts(static_cast<std::size_t>(num_experts), 0);
  for (index_t i = 0; i < indices.numel(); ++i) {
    const std::int32_t e = indices.data()[i];
    GRAPHMOE_CHECK(e >= 0 && e < num_experts, "expert_load", "expert id ", e, " at flat index ",
                   i, " is out of range [0, ", num_experts, ")");
    ++counts[static_cast<std::size_t>(e)];
  }
  return counts;
}

// Fraction of the N tokens whose selected experts (indices (N, k), e.g. Selection::indices of p)
// differ as a set from the k largest entries of the scores r (N, E) before the token graph: how
// often the graph changed the routing decision. Ties in r go to the lower expert id (the library's
// top-k rule), so an exactly tied row can count as changed; with continuous scores ties do not
// occur. 0 for a router without a graph (p = r).
template <class T>
double selection_change(const Tensor<T, cpu>& r, const Tensor<std::int32_t, cpu>& indices) {
  constexpr const char* op = "selection_change";
  GRAPHMOE_CHECK(r.rank() == 2 && indices.rank() == 2 && r.dim(0) == indices.dim(0), op,
                 "scores must be (N, E) and indices (N, k) with the same N, got ", r.shape(),
                 " and ", indices.shape());
  const index_t n = r.dim(0), e = r.dim(1), k = indices.dim(1);
  GRAPHMOE_CHECK(n > 0 && k >= 1 && k <= e, op, "need N > 0 tokens and 1 <= k <= E, got N = ", n,
                 ", k = ", k, ", E = ", e);
  detail::check_routing(op, "indices", indices);
  index_t changed = 0;
  std::vector<char> chosen(static_cast<std::size_t>(e));
  for (index_t i = 0; i < n; ++i) {
    const T* row = r.data() + i * e;
    for (index_t j = 0; j < e; ++j)
      GRAPHMOE_CHECK(std::isfinite(static_cast<double>(row[j])), op, "scores row ", i,
                     " holds ", static_cast<double>(row[j]), " at expert ", j);
    std::fill(chosen.begin(), chosen.end(), 0);
    bool differs = false;
    for (index_t j = 0; j < k; ++j) {
      const std::int32_t x = indices.data()[i * k + j];
      GRAPHMOE_CHECK(x < e, op, "expert id ", x, " of token ", i, " is out of range [0, ", e, ")");
      chosen[static_cast<std::size_t>(x)] = 1;
    }
    // The top-k of r is the chosen set iff every chosen score beats (or ties with a higher-id
    // loser) every unchosen one: compare the weakest chosen with the strongest unchosen.
    index_t weakest = -1, strongest = -1;
    for (index_t j = 0; j < e; ++j) {
      if (chosen[static_cast<std::size_t>(j)]) {
        if (weakest < 0 || row[j] < row[weakest] || (row[j] == row[weakest] && j > weakest))
          weakest = j;
      } else if (strongest < 0 || row[j] > row[strongest]) {
        strongest = j;
      }
    }
    if (strongest >= 0)
      differs = row[strongest] > row[weakest] || (row[strongest] == row[weakest] && strongest < weakest);
    changed += differs ? 1 : 0;
  }
  return static_cast<double>(changed) / static_cast<double>(n);
}

// How a summary line or report shows a metric that cannot be computed (a NaN).
inline constexpr const char* kNotAvailable = "n/a";

// `v` with `decimals` digits after the point, as printf's "%.<decimals>f" writes it; "n/a"
// (kNotAvailable) when v is NaN, a metric that cannot be computed. Infinities stay "inf".
inline std::string metric_text(double v, int decimals) {
  GRAPHMOE_CHECK(decimals >= 0 && decimals <= 17, "metric_text", "decimals must be in [0, 17], got ",
                 decimals);
  if (std::isnan(v)) return kNotAvailable;
  char buf[512];  // %.17f of the largest double: 309 digits, the point and 17 decimals
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// A CSV file of metrics rows. The header (the column names) is written once: when the file is
// created or truncated (append = false), or when append = true finds it missing or empty; with
// append = true and an existing header, that header must equal this one. Every row is flushed as
// soon as it is written, so a crashed run keeps its rows. Numbers are written in the shortest form
// that reads back to the same double (std::to_chars), "nan"/"inf" for non-finite values; fields
// holding a comma, quote or newline are quoted (RFC 4180). row_or_missing writes a NaN as an empty
// field instead: a metric that cannot be computed (yet), as plotting tools and pandas read it.
class CsvLog {
 public:
  CsvLog(const std::string& path, std::vector<std::string> columns, bool append = false)
      : path_(path), columns_(std::move(columns)) {
    GRAPHMOE_CHECK(!columns_.empty(), "CsvLog", "no columns given for '", path_, "'");
    const std::string header = join(columns_);
    bool need_header = true;
    if (append) {
      std::ifstream in(path_, std::ios::binary);
      std::string first;
      if (in && std::getline(in, first)) {
        if (!first.empty() && first.back() == '\r') first.pop_back();
        GRAPHMOE_CHECK(first == header, "CsvLog", "'", path_, "' has the header '", first,
                       "', not '", header, "': refusing to append rows of other columns");
        need_header = false;
      }
    }
    out_.open(path_, append ? std::ios::app : std::ios::trunc);
    GRAPHMOE_CHECK(out_.is_open(), "CsvLog", "cannot open '", path_, "' for writing");
    if (need_header) write_line(header);
  }

  const std::string& path() const { return path_; }
  const std::vector<std::string>& columns() const { return columns_; }

  // One row of numbers, one per column.
  void row(const std::vector<double>& values) {
    std::vector<std::string> fields;
    fields.reserve(values.size());
    for (double v : values) fields.push_back(format(v));
    check_width(fields.size());
    write_line(join(fields));
  }
  // One row of numbers in which NaN means "cannot be computed": written as an empty field.
  void row_or_missing(const std::vector<double>& values) {
    std::vector<std::string> fields;
    fields.reserve(values.size());
    for (double v : values) fields.push_back(std::isnan(v) ? std::string() : format(v));
    check_width(fields.size());
    write_line(join(fields));
  }
  // One row of text fields (use format() for numbers mixed with text).
  void row(const std::vector<std::string>& fields) {
    check_width(fields.size());
    write_line(join(fields));
  }

  // The shortest decimal form of v that reads back as exactly v.
  static std::string format(double v) {
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof(buf), v);
    GRAPHMOE_CHECK(res.ec == std::errc(), "CsvLog::format", "cannot format ", v);
    return std::string(buf, res.ptr);
  }

 private:
  static std::string quote(const std::string& s) {
    if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) {
      if (c == '"') q += '"';
      q += c;
    }
    return q + '"';
  }
  static std::string join(const std::vector<std::string>& fields) {
    std::string line;
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (i) line += ',';
      line += quote(fields[i]);
    }
    return line;
  }
  void check_width(std::size_t n) const {
    GRAPHMOE_CHECK(n == columns_.size(), "CsvLog::row", n, " values given for ", columns_.size(),
                   " columns of '", path_, "'");
  }
  void write_line(const std::string& line) {
    out_ << line << '\n';
    out_.flush();
    GRAPHMOE_CHECK(out_.good(), "CsvLog", "writing to '", path_, "' failed");
  }

  std::string path_;
  std::vector<std::string> columns_;
  std::ofstream out_;
};

}  // namespace graphmoe
