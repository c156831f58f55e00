// graphmoe/testing/gradcheck.hpp: the finite-difference gradient checker graphmoe checks its own
// layers and policies with, for a user's policies and layers.
//
// Central differences in double precision,
//     dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / (2h),   h = 1e-6 by default,
// whose truncation error is O(h^2 |L'''|) ~ 1e-12 and round-off error O(eps |L| / h) ~ 1e-10 for
// O(1) losses. An entry passes when
//     |analytic - numeric| <= atol + rtol max(|analytic|, |numeric|),   atol = rtol = 1e-6,
// three orders of magnitude above the expected error and far below the error of a wrong formula.
// Discrete choices (top-k, capacity) make L piecewise: with random inputs a switch within +-h is
// unlikely, but a failure at one entry next to a tie can be that; the result names the entry.
//
//   check_gradient(name, x, analytic, loss)      one tensor x against its gradient `analytic`;
//                                                `loss` recomputes L from x's current contents
//   check_arena_gradients(arena, loss, backward) every trainable parameter of an arena (a user
//                                                layer or model): `backward` fills the gradients
//                                                after the checker zeroed them
//   check_router_gradients<Router>(cfg, n, d, seq_len)   (graphmoe/testing/router_gradcheck.hpp)
//                                                a whole RouterImpl<Router, double> (user policies
//                                                included) under L = sum w o gates (+ the enabled
//                                                auxiliary losses): du and every trainable
//                                                parameter the policies declared
// Each returns GradcheckResult(s): ok(), the entries checked, failures, the worst error relative
// to its bound and the first failures in words (str()). No test framework is needed:
//
//   for (const auto& r : graphmoe::testing::check_router_gradients<MyRouter>(cfg, 12, 6, 4))
//     if (!r.ok()) { std::fputs(r.str().c_str(), stderr); return 1; }
//
// The loss must be a deterministic function of the inputs: a policy that draws random numbers in
// forward must draw the same ones again (e.g. take Mode::Eval, core/mode.hpp; the router checker
// sets the router's mode to Eval, so a noisy scorer's gradient is checked without its noise, and
// calls set_mode(Mode::Train) never).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "graphmoe/core/arena.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe::testing {

struct GradcheckOptions {
  double h = 1e-6;
  double atol = 1e-6;
  double rtol = 1e-6;
  // Entries for which this returns true are not perturbed (e.g. where the function is not
  // defined on both sides).
  std::function<bool(index_t)> skip;
};

struct GradcheckResult {
  std::string name;
  index_t checked = 0;   // entries compared
  index_t failures = 0;  // entries outside the bound
  double worst = 0;      // max |analytic - numeric| / bound over the entries (< 1 passes)
  std::vector<std::string> first_failures;  // up to 5, "name[i]: analytic a vs numeric b"

  bool ok() const { return failures == 0; }
  std::string str() const {
    std::ostringstream os;
    os << name << ": " << (ok() ? "ok" : "FAILED") << ", " << checked << " entries, "
       << failures << " failures, worst error / bound " << worst << "\n";
    for (const auto& f : first_failures) os << "  " << f << "\n";
    return os.str();
  }
};

// Compares `analytic` (dL/dx) with central differences of `loss` in every entry of x (restored
// afterwards). `loss` must recompute the forward pass from the current contents of x.
inline GradcheckResult check_gradient(const std::string& name, Tensor<double, cpu>& x,
                                      const Tensor<double, cpu>& analytic,
                                      const std::function<double()>& loss,
                                      const GradcheckOptions& opt = {}) {
  GRAPHMOE_CHECK(analytic.shape() == x.shape(), "testing::check_gradient", name,
                 ": the gradient has shape ", analytic.shape(), ", the tensor ", x.shape());
  GRAPHMOE_CHECK(opt.h > 0 && std::isfinite(opt.h) && opt.atol >= 0 && opt.rtol >= 0,
                 "testing::check_gradient", "need h > 0 and atol, rtol >= 0, got h = ", opt.h,
                 ", atol = ", opt.atol, ", rtol = ", opt.rtol);
  GradcheckResult r;
  r.name = name;
  for (index_t i = 0; i < x.numel(); ++i) {
    if (opt.skip && opt.skip(i)) continue;
    const double saved = x.data()[i];
    x.data()[i] = saved + opt.h;
    const double lp = loss();
    x.data()[i] = saved - opt.h;
    const double lm = loss();
    x.data()[i] = saved;
    const double numeric = (lp - lm) / (2 * opt.h);
    const double a = analytic.data()[i];
    const double err = std::abs(a - numeric);
    const double bound = opt.atol + opt.rtol * std::max(std::abs(a), std::abs(numeric));
    ++r.checked;
    r.worst = std::max(r.worst, std::isfinite(err) ? err / bound : INFINITY);
    if (!(err <= bound)) {
      ++r.failures;
      if (r.first_failures.size() < 5) {
        std::ostringstream os;
        os << name << "[" << i << "]: analytic " << a << " vs numeric " << numeric;
        r.first_failures.push_back(os.str());
      }
    }
  }
  return r;
}

// Every trainable parameter of `arena`: `backward()` must fill the arena's gradients of the loss
// that `loss()` computes (the checker zeroes them first and runs loss() once before it, so that a
// layer's forward state is that of the current values); one result per parameter, named after it.
inline std::vector<GradcheckResult> check_arena_gradients(ParameterArena<double, cpu>& arena,
                                                          const std::function<double()>& loss,
                                                          const std::function<void()>& backward,
                                                          const GradcheckOptions& opt = {}) {
  GRAPHMOE_CHECK(arena.allocated(), "testing::check_arena_gradients",
                 "the arena is not allocated: declare, allocate, bind and init first");
  (void)loss();
  arena.zero_grad();
  backward();
  const Tensor<double, cpu> grads = arena.grads().clone();
  std::vector<GradcheckResult> out;
  for (index_t id = 0; id < arena.size(); ++id) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(id)];
    if (!p.trainable) continue;
    Tensor<double, cpu> x = arena.value(id);
    const Tensor<double, cpu> g =
        grads.slice(p.offset, p.offset + p.shape.numel()).view(p.shape);
    out.push_back(check_gradient(p.name, x, g, loss, opt));
  }
  return out;
}

}  // namespace graphmoe::testing
