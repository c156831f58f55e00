// The optimizer functors of core/optim_math.hpp, the arithmetic that
// backend/cuda/optim.cuh runs on the GPU, run here by g++ through Thrust's CPU backend
// (THRUST_DEVICE_SYSTEM_CPP, set in tests/CMakeLists.txt) and compared with the CPU optimizers
// bit for bit:
//
//   AdamW, SGD (plain, momentum, Nesterov, weight decay, set_no_decay): thrust::for_each of the
//     element functor over every trainable parameter's padded range, several steps, equals
//     AdamW<T> / SGD<T>::step on the values and the state;
//   the functors equal the Eigen array expressions the CPU optimizers used before them (same
//     operation order, exact square root);
//   the gradient norm: the eight lanes + combine of optim_math.hpp (the CUDA kernel's order) equal
//     accumulate_double, and give clip_grad_norm's norm bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform.h>

#include "graphmoe/backend/cpu/detail/reduce.hpp"
#include "graphmoe/core/rng.hpp"
#include "graphmoe/core/optim_math.hpp"
#include "graphmoe/train/optim.hpp"
#include "support/gradcheck.hpp"

#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CPP && THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_OMP
#error "test_host_optim must be compiled with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP or _OMP"
#endif

using namespace graphmoe;
using graphmoe::test::random_tensor;

namespace {

// An arena with two chunks in one parameter, padding, ranks 0 to 2 and a frozen parameter.
template <class T>
ParameterArena<T> make_arena(Rng& rng) {
  ParameterArena<T> arena;
  arena.add("emb", Shape{41, 300});  // 12300 elements: two chunks
  arena.add("frozen", Shape{5}, false);
  arena.add("w", Shape{17, 9});
  arena.add("b", Shape{9});
  arena.add("gain", Shape{});
  arena.allocate();
  for (const auto& p : arena.params()) {
    arena.value(p.name).copy_from(random_tensor<T>(p.shape, rng));
    arena.grad(p.name).copy_from(random_tensor<T>(p.shape, rng, -0.1, 0.1));
  }
  return arena;
}

template <class T>
void new_gradients(ParameterArena<T>& arena, Rng& rng) {
  for (const auto& p : arena.params())
    arena.grad(p.name).copy_from(random_tensor<T>(p.shape, rng, -0.1, 0.1));
}

template <class T>
bool bitwise_equal(const T* a, const T* b, index_t n) {
  return std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

// The padded range of parameter p (what the optimizers update).
template <class T>
index_t padded_end(const ParameterInfo& p) {
  constexpr index_t align = ParameterArena<T>::kAlign;
  return p.offset + (p.shape.numel() + align - 1) / align * align;
}

template <class T>
struct AdamWElement {
  detail::AdamWUpdate<T> u;
  T *p, *m, *v;
  const T* g;
  bool decay;
  void operator()(index_t j) const { u(p[j], g[j], m[j], v[j], decay); }
};

template <class T>
struct SGDElement {
  detail::SGDUpdate<T> u;
  T *p, *buf;
  const T* g;
  bool decay;
  void operator()(index_t j) const {
    T unused = T(0);
    u(p[j], g[j], buf != nullptr ? buf[j] : unused, decay);
  }
};

// The state view `name` of an optimizer, as a flat copy placed like arena.values().
template <class T, class Opt>
std::vector<T> flat_state(const Opt& opt, const ParameterArena<T>& arena, const std::string& prefix) {
  std::vector<T> out(static_cast<std::size_t>(arena.values().numel()), T(0));
  for (const auto& [name, view] : opt.state(arena)) {
    if (name.rfind(prefix, 0) != 0) continue;
    const index_t offset = arena.params()[static_cast<std::size_t>(
                                              arena.find(name.substr(prefix.size())))]
                               .offset;
    std::copy(view.data(), view.data() + view.numel(), out.begin() + offset);
  }
  return out;
}

template <class T, class Policy>
void check_adamw(const Policy& policy, bool custom_decay) {
  Rng rng(11);
  ParameterArena<T> arena = make_arena<T>(rng);
  const index_t size = arena.values().numel();
  // the Thrust side's copies
  std::vector<T> p(arena.values().data(), arena.values().data() + size);
  std::vector<T> m(static_cast<std::size_t>(size)), v(static_cast<std::size_t>(size));
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  AdamW<T> opt(arena, cfg);
  if (custom_decay) opt.set_no_decay([](const std::string& n) { return n == "emb"; });
  const double lrs[] = {1e-3, 3e-2, 0.0, 5e-3};
  std::int64_t t = 0;
  for (const double lr : lrs) {
    new_gradients(arena, rng);
    opt.step(arena, lr);
    ++t;
    const auto u = detail::AdamWUpdate<T>::make(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay,
                                                lr, t);
    for (std::size_t i = 0; i < arena.params().size(); ++i) {
      const ParameterInfo& info = arena.params()[i];
      if (!info.trainable) continue;
      const bool decay = u.decays(opt.decays(static_cast<index_t>(i)));
      thrust::for_each(policy, thrust::counting_iterator<index_t>(info.offset),
                       thrust::counting_iterator<index_t>(padded_end<T>(info)),
                       AdamWElement<T>{u, p.data(), m.data(), v.data(), arena.grads().data(),
                                       decay});
    }
    CAPTURE(lr);
    CHECK(bitwise_equal(p.data(), arena.values().data(), size));
    CHECK(flat_state(opt, arena, "adamw.m.") == m);
    CHECK(flat_state(opt, arena, "adamw.v.") == v);
  }
}

template <class T, class Policy>
void check_sgd(const Policy& policy, SGDConfig cfg, bool custom_decay) {
  Rng rng(12);
  ParameterArena<T> arena = make_arena<T>(rng);
  const index_t size = arena.values().numel();
  std::vector<T> p(arena.values().data(), arena.values().data() + size);
  std::vector<T> buf(static_cast<std::size_t>(size));
  SGD<T> opt(arena, cfg);
  if (custom_decay) opt.set_no_decay([](const std::string& n) { return n == "w"; });
  for (const double lr : {0.1, 0.02, 0.3}) {
    new_gradients(arena, rng);
    opt.step(arena, lr);
    const auto u = detail::SGDUpdate<T>::make(lr, cfg.momentum, cfg.weight_decay, cfg.nesterov);
    for (std::size_t i = 0; i < arena.params().size(); ++i) {
      const ParameterInfo& info = arena.params()[i];
      if (!info.trainable) continue;
      const bool decay = u.decays(opt.decays(static_cast<index_t>(i)));
      thrust::for_each(policy, thrust::counting_iterator<index_t>(info.offset),
                       thrust::counting_iterator<index_t>(padded_end<T>(info)),
                       SGDElement<T>{u, p.data(), cfg.momentum > 0 ? buf.data() : nullptr,
                                     arena.grads().data(), decay});
    }
    CAPTURE(lr);
    CHECK(bitwise_equal(p.data(), arena.values().data(), size));
    if (cfg.momentum > 0) CHECK(flat_state(opt, arena, "sgd.momentum.") == buf);
  }
}

template <class T>
using Array = Eigen::Array<T, Eigen::Dynamic, 1>;

template <class T>
Array<T> random_array(index_t n, Rng& rng, double lo, double hi) {
  Array<T> a(n);
  for (index_t i = 0; i < n; ++i) a(i) = static_cast<T>(lo + (hi - lo) * rng.uniform());
  return a;
}

}  // namespace

TEST_CASE_TEMPLATE("host optim: AdamW functor through Thrust equals AdamW<T>::step", T, float,
                   double) {
  check_adamw<T>(thrust::device, false);
  check_adamw<T>(thrust::cpp::par, true);
}

TEST_CASE_TEMPLATE("host optim: SGD functor through Thrust equals SGD<T>::step", T, float, double) {
  struct Case {
    double momentum, weight_decay;
    bool nesterov;
  };
  for (const Case c : {Case{0, 0, false}, Case{0, 0.05, false}, Case{0.9, 0, false},
                       Case{0.9, 0.05, false}, Case{0.8, 0, true}, Case{0.8, 0.05, true}}) {
    CAPTURE(c.momentum);
    CAPTURE(c.weight_decay);
    CAPTURE(c.nesterov);
    SGDConfig cfg;
    cfg.momentum = c.momentum;
    cfg.weight_decay = c.weight_decay;
    cfg.nesterov = c.nesterov;
    check_sgd<T>(thrust::device, cfg, false);
    check_sgd<T>(thrust::cpp::par, cfg, true);
  }
}

TEST_CASE_TEMPLATE("host optim: the functors equal the Eigen expressions they replaced", T, float,
                   double) {
  // optim.hpp before the functors, with the square root exact (Eigen's float sqrt is an rsqrt
  // approximation under EIGEN_FAST_MATH; the functor takes the exact root, as CUDA does).
  Rng rng(13);
  const index_t n = 1037;
  const T b1 = T(0.9), b2 = T(0.999), c1 = static_cast<T>(1.0 - 0.9),
          c2 = static_cast<T>(1.0 - 0.999), tbc1 = static_cast<T>(1.0 - std::pow(0.9, 3.0)),
          tbc2 = static_cast<T>(1.0 - std::pow(0.999, 3.0)), teps = T(1e-8), tlr = T(1e-3),
          twd = T(0.01);
  const auto u = detail::AdamWUpdate<T>::make(0.9, 0.999, 1e-8, 0.01, 1e-3, 3);
  for (const bool decay : {false, true}) {
    Array<T> p = random_array<T>(n, rng, -1, 1), g = random_array<T>(n, rng, -0.1, 0.1);
    Array<T> m = random_array<T>(n, rng, -0.01, 0.01), v = random_array<T>(n, rng, 0, 1e-3);
    Array<T> p2 = p, m2 = m, v2 = v;
    m = b1 * m + c1 * g;
    v = b2 * v + c2 * g.square();
    const auto root = (v / tbc2).unaryExpr([](T x) { return std::sqrt(x); });
    if (decay)
      p -= tlr * ((m / tbc1) / (root + teps) + twd * p);
    else
      p -= tlr * ((m / tbc1) / (root + teps));
    for (index_t j = 0; j < n; ++j) u(p2(j), g(j), m2(j), v2(j), decay);
    CHECK(bitwise_equal(p.data(), p2.data(), n));
    CHECK(bitwise_equal(m.data(), m2.data(), n));
    CHECK(bitwise_equal(v.data(), v2.data(), n));
  }
  for (const bool decay : {false, true}) {
    for (const bool nesterov : {false, true}) {
      const T mu = T(0.9), lr = T(0.1), wd = T(0.05);
      const auto s = detail::SGDUpdate<T>::make(0.1, 0.9, 0.05, nesterov);
      Array<T> p = random_array<T>(n, rng, -1, 1), g = random_array<T>(n, rng, -0.1, 0.1);
      Array<T> b = random_array<T>(n, rng, -0.1, 0.1);
      Array<T> p2 = p, b2s = b;
      if (decay) {
        b = mu * b + (g + wd * p);
        if (nesterov)
          p -= lr * ((g + wd * p) + mu * b);
        else
          p -= lr * b;
      } else {
        b = mu * b + g;
        if (nesterov)
          p -= lr * (g + mu * b);
        else
          p -= lr * b;
      }
      for (index_t j = 0; j < n; ++j) s(p2(j), g(j), b2s(j), decay);
      CHECK(bitwise_equal(p.data(), p2.data(), n));
      CHECK(bitwise_equal(b.data(), b2s.data(), n));
    }
  }
}

namespace {
template <class T>
struct ChunkSumsq {
  const T* g;
  double operator()(const detail::OptimChunk& c) const {
    double lanes[8];
    for (int k = 0; k < 8; ++k) lanes[k] = detail::sumsq_lane(g + c.begin, c.end - c.begin, k);
    return detail::combine_sumsq_lanes(lanes, g + c.begin, c.end - c.begin);
  }
};
}  // namespace

TEST_CASE_TEMPLATE("host optim: the CUDA norm's lane order gives clip_grad_norm bit for bit", T,
                   float, double) {
  Rng rng(14);
  for (const index_t n : {0, 1, 7, 8, 9, 100, 8191, 8192}) {
    CAPTURE(n);
    const Tensor<T> g = random_tensor<T>({n}, rng);
    const T* gp = g.data();
    const double ref =
        detail::accumulate_double(n, [gp](index_t j) { return static_cast<double>(gp[j]) * gp[j]; });
    const double got = ChunkSumsq<T>{gp}(detail::OptimChunk{0, n, 0, 0});
    CHECK(std::memcmp(&ref, &got, sizeof(double)) == 0);
  }
  ParameterArena<T> arena = make_arena<T>(rng);
  const std::vector<detail::OptimChunk> chunks = detail::trainable_chunks(arena);
  std::vector<double> partial(chunks.size());
  thrust::transform(thrust::device, chunks.begin(), chunks.end(), partial.begin(),
                    ChunkSumsq<T>{arena.grads().data()});
  double sumsq = 0;
  for (const double s : partial) sumsq += s;
  const double norm = std::sqrt(sumsq);
  CHECK(norm == clip_grad_norm(arena, 0.0));
}
