// benchmarks/bench_support.hpp: inputs shared by the MoE layer benchmarks (bench_moe,
// bench_moe_long).
#pragma once

#include <cmath>

#include "graphmoe/ops/attention.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/attention_cache.hpp"

namespace graphmoe::bench {

// A tensor of N(0, std^2) draws.
template <class T>
Tensor<T> normal(const Shape& s, Rng& rng, double std) {
  Tensor<T> t(s);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(rng.normal(0.0, std));
  return t;
}

// A realistic attention cache for nb sequences of len tokens of width d (x, (nb len, d), is the
// attention output a): probabilities from random projections of the tokens, through the
// attention op; zeroed gradient sinks, all of them allocated.
template <class T>
AttentionCache<T> attention_cache(const Tensor<T>& x, index_t nb, index_t len, index_t d,
                                  index_t heads, bool causal, Rng& rng) {
  AttentionCache<T> c;
  c.num_heads = heads;
  auto q = normal<T>({nb, len, d}, rng, 1.0);
  auto k = normal<T>({nb, len, d}, rng, 1.0);
  c.v = normal<T>({nb * len, d}, rng, 1.0);
  Tensor<T> out;
  attention_forward(q, k, c.v.view({nb, len, d}), heads, causal, c.probs, out, &c.row_entropy);
  c.w_o = normal<T>({d, d}, rng, 1.0 / std::sqrt(static_cast<double>(d)));
  c.b_o = Tensor<T>({d});
  c.out = x.clone();
  c.dprobs = Tensor<T>(c.probs.shape());
  c.dv = Tensor<T>(c.v.shape());
  c.dw_o = Tensor<T>(c.w_o.shape());
  c.db_o = Tensor<T>(c.b_o.shape());
  c.dout = Tensor<T>(c.out.shape());
  return c;
}

}  // namespace graphmoe::bench
