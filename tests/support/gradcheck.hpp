// Test support: a finite-difference gradient checker and random tensors.
//
// Gradient checks run in double precision with central differences,
//     dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / (2h),   h = 1e-6 by default,
// whose truncation error is O(h^2 * |L'''|) ~ 1e-12 and round-off error O(eps * |L| / h) ~ 1e-10
// for the O(1) losses used here. An entry passes when
//     |analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|),
// with atol = rtol = 1e-6 by default: three orders of magnitude above the expected error and
// far below the error of any wrong gradient formula (which is O(|gradient|)).
//
// The scalar loss is usually L = sum_i w_i y_i for a fixed random w, so that dL/dy = w tests every
// output entry with a distinct weight.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"
#include "graphmoe/testing/gradcheck.hpp"

namespace graphmoe::test {

// The library's public checker (graphmoe/testing/gradcheck.hpp) reported through doctest: every
// entry outside the bound is a failed check, with the worst error in the summary. Its own type
// (not an alias), so that an unqualified check_gradient(..., opt) in a test picks this function
// over the public one, which argument-dependent lookup also finds through the base class.
struct GradcheckOptions : graphmoe::testing::GradcheckOptions {};

// Compares `analytic` (dL/dx) with central differences of `loss` in every entry of x. `loss`
// must recompute the forward pass from the current contents of x.
inline void check_gradient(const std::string& name, Tensor<double, cpu>& x,
                           const Tensor<double, cpu>& analytic,
                           const std::function<double()>& loss, GradcheckOptions opt = {}) {
  REQUIRE_MESSAGE(analytic.shape() == x.shape(), name, ": gradient shape ", analytic.shape().str(),
                  " != parameter shape ", x.shape().str());
  const graphmoe::testing::GradcheckResult r =
      graphmoe::testing::check_gradient(name, x, analytic, loss, opt);
  for (const auto& f : r.first_failures) FAIL_CHECK(f);
  CHECK_MESSAGE(r.ok(), name, ": ", r.failures, " of ", x.numel(),
                " entries off; worst error/bound ", r.worst);
}

template <class T>
Tensor<T, cpu> random_tensor(const Shape& shape, Rng& rng, double lo = -1.0, double hi = 1.0) {
  Tensor<T, cpu> t(shape);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(rng.uniform(lo, hi));
  return t;
}

template <class T>
Tensor<T, cpu> random_normal(const Shape& shape, Rng& rng, double stddev = 1.0) {
  Tensor<T, cpu> t(shape);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(rng.normal(0.0, stddev));
  return t;
}

// sum_i w_i y_i
inline double weighted_sum(const Tensor<double, cpu>& y, const Tensor<double, cpu>& w) {
  REQUIRE(y.numel() == w.numel());
  double s = 0;
  for (index_t i = 0; i < y.numel(); ++i) s += y.data()[i] * w.data()[i];
  return s;
}

template <class To, class From>
Tensor<To, cpu> cast(const Tensor<From, cpu>& x) {
  Tensor<To, cpu> y(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) y.data()[i] = static_cast<To>(x.data()[i]);
  return y;
}

// max_i |a_i - b_i| / (1 + |b_i|)
template <class A, class B>
double max_rel_diff(const Tensor<A, cpu>& a, const Tensor<B, cpu>& b) {
  REQUIRE(a.shape() == b.shape());
  double m = 0;
  for (index_t i = 0; i < a.numel(); ++i) {
    const double x = static_cast<double>(a.data()[i]), y = static_cast<double>(b.data()[i]);
    m = std::max(m, std::abs(x - y) / (1.0 + std::abs(y)));
  }
  return m;
}

}  // namespace graphmoe::test
