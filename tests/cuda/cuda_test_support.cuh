// Helpers of the cross-backend CUDA tests (test_cuda_ops.cu, test_cuda_nn_ops.cu, ...): the CPU
// backend is the reference, the CUDA result is copied back and compared.
//
//   error metric   normwise_error: max_i |cuda_i - cpu_i| / max_i |cpu_i|     (L-infinity)
//   tolerance      tolerance<T>(): float 1e-5, double 1e-12 (each test states where it differs)
//   equality       check_equal: entry for entry (ops that only compare, copy, or sum in the
//                  CPU's order)
//   messages       error_of(f): the graphmoe::Error message f throws, compared as strings
//
// Without a CUDA device (cudaGetDeviceCount finds none) SKIP_WITHOUT_CUDA_DEVICE() prints
// "skipped: no CUDA device" and returns, so that the case passes.
// GRAPHMOE_CUDA_TEST_VERBOSE=1 prints every comparison's error (scripts/gpu-check.sh keeps them).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>

#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/core/tensor.hpp"

namespace graphmoe::test {

inline bool have_device() {
  static const bool ok = cuda_device_count() > 0;
  return ok;
}

#define SKIP_WITHOUT_CUDA_DEVICE()                \
  do {                                            \
    if (!::graphmoe::test::have_device()) {       \
      MESSAGE("skipped: no CUDA device");         \
      return;                                     \
    }                                             \
  } while (0)

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float" : "double";
}

// max |got - ref| / max |ref| (0 / 0 counts as 0). NaN anywhere gives +inf.
template <class T>
double normwise_error(const Tensor<T, cpu>& ref, const Tensor<T, cpu>& got) {
  double diff = 0, scale = 0;
  for (index_t i = 0; i < ref.numel(); ++i) {
    const double r = static_cast<double>(ref.data()[i]), g = static_cast<double>(got.data()[i]);
    if (std::isnan(r) != std::isnan(g)) return std::numeric_limits<double>::infinity();
    if (std::isinf(r) || std::isinf(g)) {
      if (r != g) return std::numeric_limits<double>::infinity();
      continue;
    }
    diff = std::max(diff, std::abs(g - r));
    scale = std::max(scale, std::abs(r));
  }
  return diff == 0 ? 0.0 : diff / scale;
}

inline bool verbose() {
  static const bool v = [] {
    const char* e = std::getenv("GRAPHMOE_CUDA_TEST_VERBOSE");
    return e != nullptr && e[0] == '1';
  }();
  return v;
}

template <class T>
void check_close(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, cuda>& got,
                 double tol = tolerance<T>()) {
  const Tensor<T, cpu> h = to_host(got);
  REQUIRE_MESSAGE(h.shape() == ref.shape(), what, ": shape ", h.shape().str(), " vs ",
                  ref.shape().str());
  const double err = normwise_error(ref, h);
  if (verbose())
    std::printf("  %-36s %-6s shape %-14s error %.3e (tolerance %.0e)\n", what.c_str(),
                type_name<T>(), ref.shape().str().c_str(), err, tol);
  CHECK_MESSAGE(err <= tol, what, " (", type_name<T>(), "): error ", err, " > tolerance ", tol);
}

template <class T>
void check_equal(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, cuda>& got) {
  const Tensor<T, cpu> h = to_host(got);
  REQUIRE_MESSAGE(h.shape() == ref.shape(), what, ": shape ", h.shape().str(), " vs ",
                  ref.shape().str());
  index_t bad = 0, first = -1;
  for (index_t i = 0; i < ref.numel(); ++i) {
    // equal values (so that -inf == -inf and 0 == -0 count; NaN never occurs here)
    if (!(h.data()[i] == ref.data()[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", ref.numel(), " entries differ, first at ", first);
}

// The key projection's bias has a zero gradient in exact arithmetic: it adds q_i . b_k to every
// score of query row i, which the row softmax cancels. Both backends return round-off there (the
// emulated CUDA run found the relative comparison of two round-offs failing), so it is compared
// against the scale of the other gradients instead.
// Whether the key bias is trained for real: with RoPE or QK-norm q . (k + b_k) is no longer q . k
// plus a constant of the row (a test of such a model sets this with KeyBiasTrained).
inline bool& key_bias_trained() {
  static bool on = false;
  return on;
}
struct KeyBiasTrained {
  KeyBiasTrained() { key_bias_trained() = true; }
  ~KeyBiasTrained() { key_bias_trained() = false; }
  KeyBiasTrained(const KeyBiasTrained&) = delete;
  KeyBiasTrained& operator=(const KeyBiasTrained&) = delete;
};
inline bool has_zero_gradient(const std::string& name) {
  if (key_bias_trained()) return false;
  const std::string suffix = "k_proj.bias";
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// max_i |a_i - b_i|; +inf where exactly one of a_i, b_i is finite.
template <class T>
double max_abs_difference(const Tensor<T, cpu>& a, const Tensor<T, cpu>& b) {
  double diff = 0;
  for (index_t j = 0; j < a.numel(); ++j) {
    const double x = static_cast<double>(a.data()[j]), y = static_cast<double>(b.data()[j]);
    diff = std::isfinite(x) == std::isfinite(y) ? std::max(diff, std::abs(x - y))
                                                : std::numeric_limits<double>::infinity();
  }
  return diff;
}

template <class T>
double max_abs(const Tensor<T, cpu>& t) {
  double m = 0;
  for (index_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(static_cast<double>(t.data()[i])));
  return m;
}

// Compares the gradients (grads = true) or the values of two parameter arenas declared alike,
// parameter by parameter, with check_close (arena_scale: max |difference| relative to the
// arena's largest entry instead of the parameter's own). A parameter with has_zero_gradient(name) instead
// needs |gradient| <= tol * (the arena's largest gradient) on both backends, and its values may
// differ by zero_grad_slack (after optimizer steps: AdamW turns round-off into steps of up to lr).
template <class HostArena, class DevArena>
void check_arenas(const std::string& what, const HostArena& host, const DevArena& dev, bool grads,
                  double tol, double zero_grad_slack = 0, bool arena_scale = false) {
  REQUIRE(host.size() == dev.size());
  double scale = 0;
  for (index_t i = 0; i < host.size(); ++i)
    scale = std::max(scale, max_abs(grads ? host.grad(i) : host.value(i)));
  for (index_t i = 0; i < host.size(); ++i) {
    const std::string name = host.params()[static_cast<std::size_t>(i)].name;
    if (!has_zero_gradient(name)) {
      const auto ref = grads ? host.grad(i) : host.value(i);
      if (!arena_scale) {
        check_close(what + (grads ? " d" : " ") + name, ref, grads ? dev.grad(i) : dev.value(i),
                    tol);
        continue;
      }
      const double diff = max_abs_difference(ref, to_host(grads ? dev.grad(i) : dev.value(i)));
      const double err = diff / std::max(max_abs(ref), scale);
      CHECK_MESSAGE(err <= tol, what, (grads ? " d" : " "), name, ": error ", err,
                    " (relative to the arena's largest entry ", scale, ") > tolerance ", tol);
    } else if (grads) {
      const double h = max_abs(host.grad(i)), d = max_abs(to_host(dev.grad(i)));
      CHECK_MESSAGE(h <= tol * scale, what, " d", name, ": CPU round-off ", h, " vs scale ", scale);
      CHECK_MESSAGE(d <= tol * scale, what, " d", name, ": CUDA round-off ", d, " vs scale ", scale);
    } else {
      const auto h = host.value(i);
      const double diff = max_abs_difference(h, to_host(dev.value(i)));
      CHECK_MESSAGE(diff <= zero_grad_slack + tol * max_abs(h), what, " ", name, ": values differ by ",
                    diff, " (slack ", zero_grad_slack, ")");
    }
  }
}

// The message of the graphmoe::Error that f throws ("" if none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace graphmoe::test
