// graphmoe/train/routing_report.hpp: what a router did on a fixed probe set, per MoE layer, and
// how that compares with another checkpoint of the same model and with a baseline model.
//
//   RoutingProbe          one model's routing of the probe tokens: per MoE layer the selected
//                         experts, the scores r and p, the graph's mean row entropy and self-weight
//   RoutingProbe::record  appends one forward's RouterOutput (call once per probe batch)
//   routing_report(m, compare, baseline)   one LayerReport per MoE layer:
//       tokens                  probe tokens routed
//       entropy_r, entropy_p    mean entropy (nats) of r = softmax(gamma) and of p = G r
//       entropy_*_ratio         the same over the baseline model's (the seed paper's Figure 3 right:
//                               a graph-aware router's routing entropy over SMoE's); NaN without one
//                               (not computable: "n/a" in reports, an empty CSV field)
//       graph_entropy           mean row entropy of the token graph (0 = the identity, no mixing)
//       self_weight             mean S[i,i] (1 = the identity)
//       graph_changed_selection share of tokens whose selected set differs from top-k(r): how often
//                               the graph changed a routing decision (0 without a graph)
//       fluct_top1, fluct_topk  share of tokens whose first expert / expert set differs in the
//                               compare model (the paper's Figure 3 left: two checkpoints of one
//                               run, e.g. the last two epochs); NaN without one (the same)
//       max_load_share, load    tokens per expert (Figure 4) and the busiest expert's share
//   write_routing_report / write_expert_load   the CSV files routing_report (the example) writes
//
// The three models must route the same probe tokens (same count, same number of MoE layers,
// experts and k where compared); mismatches throw naming the layer and the sizes.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "graphmoe/routing/router.hpp"
#include "graphmoe/train/metrics.hpp"

namespace graphmoe {

struct LayerProbe {
  index_t layer = 0;                 // block index in the model
  Tensor<std::int32_t, cpu> indices;  // (N, k) selected experts, by descending score
  Tensor<double, cpu> r, p;           // (N, E)
  double graph_entropy_sum = 0;      // sums over the recorded batches, weighted by their tokens
  double self_weight_sum = 0;
};

class RoutingProbe {
 public:
  // Appends the routing of one forward of MoE layer `layer` (the layers of one forward must come
  // in the same order every time). graph_entropy and self_weight are the batch means of the graph.
  template <class T>
  void record(index_t slot, index_t layer, const Tensor<T, cpu>& r, const Tensor<T, cpu>& p,
              const Tensor<std::int32_t, cpu>& indices, double graph_entropy, double self_weight) {
    constexpr const char* op = "RoutingProbe::record";
    GRAPHMOE_CHECK(slot >= 0 && slot <= static_cast<index_t>(layers_.size()), op, "slot ", slot,
                   " skips past the ", layers_.size(), " layers recorded so far");
    GRAPHMOE_CHECK(r.rank() == 2 && p.shape() == r.shape() && indices.rank() == 2 &&
                       indices.dim(0) == r.dim(0) && r.dim(0) > 0,
                   op, "r, p must be (N, E) and indices (N, k) with the same N > 0, got ",
                   r.shape(), ", ", p.shape(), ", ", indices.shape());
    GRAPHMOE_CHECK(std::isfinite(graph_entropy) && std::isfinite(self_weight), op,
                   "layer ", layer, ": graph entropy ", graph_entropy, " or self-weight ",
                   self_weight, " is not finite");
    if (slot == static_cast<index_t>(layers_.size())) {
      layers_.emplace_back();
      layers_.back().layer = layer;
    }
    LayerProbe& lp = layers_[static_cast<std::size_t>(slot)];
    GRAPHMOE_CHECK(lp.layer == layer, op, "slot ", slot, " holds layer ", lp.layer, ", not ", layer);
    const index_t n = r.dim(0);
    append(lp.indices, indices, op);
    append(lp.r, to_double(r), op);
    append(lp.p, to_double(p), op);
    lp.graph_entropy_sum += graph_entropy * static_cast<double>(n);
    lp.self_weight_sum += self_weight * static_cast<double>(n);
  }

  const std::vector<LayerProbe>& layers() const { return layers_; }

 private:
  template <class T>
  static Tensor<double, cpu> to_double(const Tensor<T, cpu>& x) {
    Tensor<double, cpu> y(x.shape());
    for (index_t i = 0; i < x.numel(); ++i) y.data()[i] = static_cast<double>(x.data()[i]);
    return y;
  }
  template <class T>
  static void append(Tensor<T, cpu>& all, const Tensor<T, cpu>& part, const char* op) {
    if (all.empty()) {
      all = part.clone();
      return;
    }
    GRAPHMOE_CHECK(all.dim(1) == part.dim(1), op, "a batch of width ", part.dim(1),
                   " after batches of width ", all.dim(1));
    Tensor<T, cpu> grown(Shape{all.dim(0) + part.dim(0), all.dim(1)});
    std::copy_n(all.data(), all.numel(), grown.data());
    std::copy_n(part.data(), part.numel(), grown.data() + all.numel());
    all = std::move(grown);
  }

  std::vector<LayerProbe> layers_;
};

struct LayerReport {
  index_t layer = 0, tokens = 0;
  double entropy_r = 0, entropy_p = 0;
  double entropy_r_ratio = std::nan(""), entropy_p_ratio = std::nan("");
  double graph_entropy = 0, self_weight = 1, graph_changed_selection = 0;
  double fluct_top1 = std::nan(""), fluct_topk = std::nan("");
  double max_load_share = 0;
  std::vector<index_t> load;  // tokens per expert (a token counts once per selected expert)
};

inline std::vector<LayerReport> routing_report(const RoutingProbe& model,
                                               const RoutingProbe* compare = nullptr,
                                               const RoutingProbe* baseline = nullptr) {
  constexpr const char* op = "routing_report";
  const auto& ls = model.layers();
  GRAPHMOE_CHECK(!ls.empty(), op, "the model has no recorded MoE layer");
  auto check_other = [&](const RoutingProbe* o, const char* what) {
    if (!o) return;
    GRAPHMOE_CHECK(o->layers().size() == ls.size(), op, "the ", what, " model has ",
                   o->layers().size(), " MoE layers, the model ", ls.size());
    for (std::size_t i = 0; i < ls.size(); ++i)
      GRAPHMOE_CHECK(o->layers()[i].layer == ls[i].layer &&
                         o->layers()[i].r.shape() == ls[i].r.shape(),
                     op, "MoE layer ", i, ": the ", what, " model routes layer ",
                     o->layers()[i].layer, " with scores ", o->layers()[i].r.shape(),
                     ", the model layer ", ls[i].layer, " with ", ls[i].r.shape(),
                     " (same probe tokens and experts needed)");
  };
  check_other(compare, "compare");
  check_other(baseline, "baseline");
  std::vector<LayerReport> out;
  for (std::size_t i = 0; i < ls.size(); ++i) {
    const LayerProbe& l = ls[i];
    LayerReport rep;
    rep.layer = l.layer;
    rep.tokens = l.r.dim(0);
    const double n = static_cast<double>(rep.tokens);
    rep.entropy_r = mean_score_entropy(l.r);
    rep.entropy_p = mean_score_entropy(l.p);
    rep.graph_entropy = l.graph_entropy_sum / n;
    rep.self_weight = l.self_weight_sum / n;
    rep.graph_changed_selection = selection_change(l.r, l.indices);
    if (baseline) {
      const LayerProbe& b = baseline->layers()[i];
      const double hr = mean_score_entropy(b.r), hp = mean_score_entropy(b.p);
      rep.entropy_r_ratio = hr > 0 ? rep.entropy_r / hr : std::nan("");
      rep.entropy_p_ratio = hp > 0 ? rep.entropy_p / hp : std::nan("");
    }
    if (compare) {
      const Fluctuation f = routing_fluctuation(l.indices, compare->layers()[i].indices);
      rep.fluct_top1 = f.top1_changed;
      rep.fluct_topk = f.changed_tokens;
    }
    rep.load = expert_load(l.indices, l.r.dim(1));
    index_t mx = 0, total = 0;
    for (index_t c : rep.load) {
      mx = std::max(mx, c);
      total += c;
    }
    rep.max_load_share = total > 0 ? static_cast<double>(mx) / static_cast<double>(total) : 0.0;
    out.push_back(std::move(rep));
  }
  return out;
}

inline const std::vector<std::string>& routing_report_columns() {
  static const std::vector<std::string> cols = {
      "layer",         "tokens",      "entropy_r",  "entropy_p",
      "entropy_r_ratio", "entropy_p_ratio", "graph_entropy", "self_weight",
      "graph_changed_selection", "fluct_top1", "fluct_topk", "max_load_share"};
  return cols;
}

// One row per layer, the columns of routing_report_columns(); a metric that cannot be computed
// (the ratios without a baseline, the fluctuations without a compare model) is an empty field.
inline void write_routing_report(const std::string& path, const std::vector<LayerReport>& reps) {
  CsvLog csv(path, routing_report_columns());
  for (const LayerReport& r : reps)
    csv.row_or_missing(std::vector<double>{static_cast<double>(r.layer), static_cast<double>(r.tokens),
                                r.entropy_r, r.entropy_p, r.entropy_r_ratio, r.entropy_p_ratio,
                                r.graph_entropy, r.self_weight, r.graph_changed_selection,
                                r.fluct_top1, r.fluct_topk, r.max_load_share});
}

// layer,expert,tokens,share: tokens per expert of every layer, share of the layer's total.
inline void write_expert_load(const std::string& path, const std::vector<LayerReport>& reps) {
  CsvLog csv(path, {"layer", "expert", "tokens", "share"});
  for (const LayerReport& r : reps) {
    index_t total = 0;
    for (index_t c : r.load) total += c;
    for (std::size_t e = 0; e < r.load.size(); ++e)
      csv.row(std::vector<double>{static_cast<double>(r.layer), static_cast<double>(e),
                                  static_cast<double>(r.load[e]),
                                  total > 0 ? static_cast<double>(r.load[e]) / static_cast<double>(total)
                                            : 0.0});
  }
}

}  // namespace graphmoe
