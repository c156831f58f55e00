// graphmoe/core/aux_losses.hpp: the host arithmetic of the auxiliary router losses (internal), one
// definition for every backend: the CPU system runs it on its tensors (backend/cpu/aux_losses.hpp),
// the CUDA system on host copies (backend/cuda/aux_losses.cuh), so the values are the same by
// construction. Contract and argument checks: ops/aux_losses.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "graphmoe/core/eigen.hpp"
#include "graphmoe/core/offender.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe {

// A loss value, or the first offending entry of the input that kept it from being computed.
struct LossValue {
  double value = 0;
  Offender bad;  // found(): nothing was computed, nothing was written
};

// The sequence-wise loss's value, or what kept it from being computed: an expert id outside
// [0, E) (bad_id: its flat slot and value) or a row of p whose sum is not > 0 or not finite
// (bad_row: the row and its sum). Nothing was written when either is found().
struct SeqAuxLossValue {
  double value = 0;
  Offender bad_id;
  Offender bad_row;
};

namespace detail {

// L_lb of p (N, E) and indices (N, k); if dp is non-empty, adds coef * dL_lb/dp to it. Returns
// the first expert id outside [0, E) instead (before writing dp).
template <class T>
LossValue load_balance_loss_host(const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                                 double coef, Tensor<T, cpu>* dp) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  std::vector<double> f(static_cast<std::size_t>(e), 0.0);
  for (index_t s = 0; s < slots; ++s) {
    const std::int32_t x = indices.data()[s];
    if (!(x >= 0 && x < e)) return {0.0, Offender{s, static_cast<double>(x)}};
    f[static_cast<std::size_t>(x)] += 1.0 / static_cast<double>(slots);
  }
  auto P = as_matrix(p);
  double loss = 0;
  for (index_t j = 0; j < e; ++j)
    loss += f[static_cast<std::size_t>(j)] * static_cast<double>(P.col(j).sum()) /
            static_cast<double>(n);
  loss *= static_cast<double>(e);
  if (dp != nullptr && !dp->empty()) {
    auto dP = as_matrix(*dp);
    for (index_t j = 0; j < e; ++j)
      dP.col(j).array() += static_cast<T>(coef * static_cast<double>(e) *
                                          f[static_cast<std::size_t>(j)] / static_cast<double>(n));
  }
  return {loss, {}};
}

// L_seq of p (N, E) and indices (N, k) over sequences of seq_len rows (seq_len >= 1 divides N);
// if dp is non-empty, adds coef * dL_seq/dp to it. Every slot of indices counts (the batch
// loss's rule: dropped assignments too). Returns the first id outside [0, E), else the first row
// whose sum is not > 0 or not finite, instead (before writing dp).
template <class T>
SeqAuxLossValue seq_aux_loss_host(const Tensor<T, cpu>& p, const Tensor<std::int32_t, cpu>& indices,
                                  index_t seq_len, double coef, Tensor<T, cpu>* dp) {
  const index_t n = p.rows(), e = p.cols(), slots = indices.numel();
  const index_t k = n > 0 ? slots / n : 0;
  SeqAuxLossValue out;
  for (index_t s = 0; s < slots; ++s) {
    const std::int32_t x = indices.data()[s];
    if (!(x >= 0 && x < e)) {
      out.bad_id = Offender{s, static_cast<double>(x)};
      return out;
    }
  }
  std::vector<double> sums(static_cast<std::size_t>(n), 0.0);
  for (index_t t = 0; t < n; ++t) {
    double s = 0;
    for (index_t j = 0; j < e; ++j) s += static_cast<double>(p.data()[t * e + j]);
    if (!(s > 0 && std::isfinite(s))) {
      out.bad_row = Offender{t, s};
      return out;
    }
    sums[static_cast<std::size_t>(t)] = s;
  }
  if (n == 0 || e == 0) return out;
  const index_t seqs = n / seq_len;
  const bool grad = dp != nullptr && !dp->empty();
  std::vector<double> f(static_cast<std::size_t>(e)), g(static_cast<std::size_t>(e));
  double loss = 0;
  for (index_t b = 0; b < seqs; ++b) {
    const index_t t0 = b * seq_len, t1 = t0 + seq_len;
    std::fill(f.begin(), f.end(), 0.0);
    for (index_t s = t0 * k; s < t1 * k; ++s) f[static_cast<std::size_t>(indices.data()[s])] += 1.0;
    for (auto& v : f)
      v *= static_cast<double>(e) / (static_cast<double>(k) * static_cast<double>(seq_len));
    for (index_t t = t0; t < t1; ++t) {
      const double inv = 1.0 / sums[static_cast<std::size_t>(t)];
      for (index_t j = 0; j < e; ++j)
        loss += f[static_cast<std::size_t>(j)] * static_cast<double>(p.data()[t * e + j]) * inv /
                static_cast<double>(seq_len);
    }
    if (!grad) continue;
    for (index_t j = 0; j < e; ++j)
      g[static_cast<std::size_t>(j)] = coef * f[static_cast<std::size_t>(j)] /
                                       (static_cast<double>(seq_len) * static_cast<double>(seqs));
    for (index_t t = t0; t < t1; ++t) {
      const double inv = 1.0 / sums[static_cast<std::size_t>(t)];
      double dot = 0;
      for (index_t j = 0; j < e; ++j)
        dot += g[static_cast<std::size_t>(j)] * static_cast<double>(p.data()[t * e + j]) * inv;
      for (index_t j = 0; j < e; ++j)
        dp->data()[t * e + j] = static_cast<T>(static_cast<double>(dp->data()[t * e + j]) +
                                               (g[static_cast<std::size_t>(j)] - dot) * inv);
    }
  }
  out.value = loss / static_cast<double>(seqs);
  return out;
}

// L_z of gamma (N, E); if dgamma is non-empty, adds coef * dL_z/dgamma to it.
template <class T>
double z_loss_host(const Tensor<T, cpu>& gamma, double coef, Tensor<T, cpu>* dgamma) {
  const index_t n = gamma.rows();
  auto G = as_matrix(gamma);
  double loss = 0;
  for (index_t i = 0; i < n; ++i) {
    const T mx = G.row(i).maxCoeff();
    const T lse = mx + std::log((G.row(i).array() - mx).exp().sum());
    loss += static_cast<double>(lse) * static_cast<double>(lse);
    if (dgamma != nullptr && !dgamma->empty()) {
      as_matrix(*dgamma).row(i).array() +=
          static_cast<T>(coef * 2.0 / static_cast<double>(n)) * lse * (G.row(i).array() - lse).exp();
    }
  }
  return loss / static_cast<double>(n);
}

}  // namespace detail
}  // namespace graphmoe
