// Shared fixtures for the router tests: random sequences and a random attention cache.
#pragma once

#include <cmath>

#include "graphmoe/core/attention_cache.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "support/gradcheck.hpp"

namespace graphmoe::test {

// A valid attention cache for nb sequences of len tokens: probs are row softmaxes of random
// logits (causal mask optional), v, w_o, b_o, out random; gradient sinks allocated.
template <class T>
AttentionCache<T> random_attention_cache(index_t nb, index_t len, index_t heads, index_t d_model,
                                         bool causal, Rng& rng, double logit_scale = 2.0) {
  AttentionCache<T> c;
  c.num_heads = heads;
  c.causal = causal;
  Tensor<T> logits = random_normal<T>({nb, heads, len, len}, rng, logit_scale);
  if (causal)
    for (index_t b = 0; b < nb; ++b)
      for (index_t h = 0; h < heads; ++h)
        for (index_t i = 0; i < len; ++i)
          for (index_t j = i + 1; j < len; ++j)
            logits(b, h, i, j) = -std::numeric_limits<T>::infinity();
  softmax_forward(logits, c.probs);
  c.v = random_normal<T>({nb * len, d_model}, rng, 0.5);
  c.w_o = random_normal<T>({d_model, d_model}, rng, 0.3);
  c.b_o = random_normal<T>({d_model}, rng, 0.3);
  c.out = random_normal<T>({nb * len, d_model}, rng, 1.0);
  c.dprobs = Tensor<T>(c.probs.shape());
  c.dv = Tensor<T>(c.v.shape());
  c.dw_o = Tensor<T>(c.w_o.shape());
  c.db_o = Tensor<T>(c.b_o.shape());
  c.dout = Tensor<T>(c.out.shape());
  return c;
}

// Row entropies (the attention layer's, which choose h*) under which HeadChoice::PerSequenceCausal
// takes head 0 for rows 0..59 of every sequence and head 1 from row 60 on (head 0: 1 everywhere;
// head 1: 2 on rows < 30, 0 after, so its prefix mean drops below 1 at row 60; others 1.5), so
// that the first block of 64 rows mixes two heads.
template <class T>
void set_head_switch_at_60(AttentionCache<T>& c, index_t nb, index_t len) {
  c.row_entropy = Tensor<T>({nb, c.num_heads, len});
  for (index_t b = 0; b < nb; ++b)
    for (index_t h = 0; h < c.num_heads; ++h)
      for (index_t i = 0; i < len; ++i)
        c.row_entropy(b, h, i) = static_cast<T>(h == 0 ? 1.0 : h == 1 ? (i < 30 ? 2.0 : 0.0) : 1.5);
}

template <class T>
void zero_sinks(AttentionCache<T>& c) {
  c.dprobs.zero();
  c.dv.zero();
  c.dw_o.zero();
  c.db_o.zero();
  c.dout.zero();
}

// Rows of a random probability matrix (N, E).
template <class T>
Tensor<T> random_probs(index_t n, index_t e, Rng& rng, double scale = 1.5) {
  Tensor<T> g = random_normal<T>({n, e}, rng, scale), r;
  softmax_forward(g, r);
  return r;
}

inline double entropy_of(const double* p, index_t n) {
  double h = 0;
  for (index_t i = 0; i < n; ++i)
    if (p[i] > 0) h -= p[i] * std::log(p[i]);
  return h;
}

}  // namespace graphmoe::test
