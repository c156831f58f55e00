// A third backend, plugged in from outside the library the way a user would (core/backend.hpp,
// docs/extending.md "A new backend"): `toy::checked_cpu`, a checked variant of the CPU backend.
// Its tensors live in host memory; each op it is asked for runs the CPU system on the same bytes
// and then checks every floating-point tensor argument for NaN, naming the op that produced it.
// The op layer (ops/) finds its overloads by argument-dependent lookup on the tag; no header of
// the library is edited and nothing is specialised but backend_allocator.
//
// Checked here: the Backend concept accepts the tag (and rejects what is not a backend); a Linear
// layer and a softmax run on it give the CPU backend's results bit for bit through the toy's own
// overloads (counted); the op layer's argument checks run before the backend is called, with the
// CPU's message; the toy backend's own check reports a NaN an op produced.
#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "graphmoe/layers/linear.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "support/errors.hpp"

namespace toy {

struct checked_cpu {
  static constexpr const char* name = "checked_cpu";
  static constexpr bool host_memory = true;
};

// How often each op reached this backend.
inline std::map<std::string, int> calls;

template <class X>
struct is_toy_tensor : std::false_type {};
template <class T>
struct is_toy_tensor<graphmoe::Tensor<T, checked_cpu>> : std::true_type {};

// A toy tensor as a CPU tensor over the same bytes; anything else passes through.
template <class X>
decltype(auto) to_cpu(X&& x) {
  if constexpr (is_toy_tensor<std::remove_cvref_t<X>>::value) {
    using T = typename std::remove_cvref_t<X>::value_type;
    return graphmoe::Tensor<T, graphmoe::cpu>::borrow(x.data(), x.shape());
  } else {
    return std::forward<X>(x);
  }
}

// After an op: no floating-point tensor argument may hold a NaN.
template <class X>
void check_no_nan(const char* op, int arg, const X& x) {
  if constexpr (is_toy_tensor<X>::value) {
    if constexpr (std::is_floating_point_v<typename X::value_type>) {
      for (graphmoe::index_t i = 0; i < x.numel(); ++i)
        GRAPHMOE_USER_CHECK(!(x.data()[i] != x.data()[i]), "checked_cpu", op,
                            " left a NaN in its argument ", arg, " at entry ", i);
    }
  }
}

template <class... A>
decltype(auto) run_on_cpu(const char* op, auto&& call, A&&... a) {
  ++calls[op];
  std::tuple<decltype(to_cpu(std::forward<A>(a)))...> args{to_cpu(std::forward<A>(a))...};
  auto check = [&] {
    int arg = 1;
    (check_no_nan(op, arg++, a), ...);
  };
  if constexpr (std::is_void_v<decltype(std::apply(call, args))>) {
    std::apply(call, args);
    check();
  } else {
    auto result = std::apply(call, args);
    check();
    return result;
  }
}

// One overload per op the test uses: the tag first, as the CPU and CUDA systems declare theirs.
#define TOY_OP(op)                                                                          \
  template <class... A>                                                                     \
  decltype(auto) op(checked_cpu, A&&... a) {                                                \
    return run_on_cpu(                                                                      \
        #op, [](auto&... v) -> decltype(auto) { return graphmoe::op(graphmoe::cpu{}, v...); }, \
        std::forward<A>(a)...);                                                             \
  }
TOY_OP(gemm)
TOY_OP(add_row_vector)
TOY_OP(accumulate_column_sums)
TOY_OP(fill_normal)
TOY_OP(softmax_forward)
TOY_OP(softmax_backward)
#undef TOY_OP

}  // namespace toy

// Storage: the CPU allocator (host memory, 64-byte aligned).
template <>
struct graphmoe::backend_allocator<toy::checked_cpu> : graphmoe::backend_allocator<graphmoe::cpu> {};

using namespace graphmoe;
using Toy = toy::checked_cpu;

namespace {
struct NotABackend {};
struct NoHostMemoryFlag {
  static constexpr const char* name = "x";
};
static_assert(Backend<cpu> && Backend<cuda> && Backend<Toy>);
static_assert(!Backend<int> && !Backend<NotABackend> && !Backend<NoHostMemoryFlag>);

template <class T>
bool same_bytes(const Tensor<T, cpu>& a, const Tensor<T, Toy>& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}

template <class B>
struct LinearRun {
  ParameterArena<double, B> arena;
  Linear<double, B> layer;
  Tensor<double, B> x{Shape{5, 3}}, y, dy{Shape{5, 4}}, dx{Shape{5, 3}};
  LinearRun() {
    layer.declare(arena, "lin.", 3, 4);
    arena.allocate();
    layer.bind(arena);
    Rng rng(9);
    layer.init(rng, 0.5);
    for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = 0.1 * static_cast<double>(i) - 0.7;
    for (index_t i = 0; i < dy.numel(); ++i) dy.data()[i] = 0.05 * static_cast<double>(i % 7) - 0.2;
    layer.forward(x, y);
    layer.backward(dy, &dx);
  }
};
}  // namespace

TEST_CASE("a third backend plugs in: a Linear layer on toy::checked_cpu equals the CPU's, bit for bit") {
  toy::calls.clear();
  LinearRun<cpu> ref;
  LinearRun<Toy> run;
  CHECK(same_bytes(ref.y, run.y));
  CHECK(same_bytes(ref.dx, run.dx));
  CHECK(same_bytes(ref.arena.values(), run.arena.values()));
  CHECK(same_bytes(ref.arena.grads(), run.arena.grads()));
  // the toy's own overloads ran (found by argument-dependent lookup on the tag)
  CHECK(toy::calls["fill_normal"] == 1);
  CHECK(toy::calls["gemm"] == 3);  // forward, and dx and dW in backward
  CHECK(toy::calls["add_row_vector"] == 1);
  CHECK(toy::calls["accumulate_column_sums"] == 1);
}

TEST_CASE("a third backend plugs in: softmax through the op layer, and its checks before the backend") {
  toy::calls.clear();
  Tensor<float, cpu> xc(Shape{2, 3});
  Tensor<float, Toy> xt(Shape{2, 3});
  for (index_t i = 0; i < 6; ++i) xc.data()[i] = xt.data()[i] = 0.3f * static_cast<float>(i) - 1.f;
  Tensor<float, cpu> yc, dxc;
  Tensor<float, Toy> yt, dxt;
  softmax_forward(xc, yc);
  softmax_forward(xt, yt);
  CHECK(same_bytes(yc, yt));
  softmax_backward(yc, xc, dxc);
  softmax_backward(yt, xt, dxt);
  CHECK(same_bytes(dxc, dxt));
  CHECK(toy::calls["softmax_forward"] == 1);
  CHECK(toy::calls["softmax_backward"] == 1);

  // A shape error is the op layer's, with the CPU's message, and never reaches the backend.
  Tensor<double, cpu> ac(Shape{2, 3}), bc(Shape{4, 5}), cc;
  Tensor<double, Toy> at(Shape{2, 3}), bt(Shape{4, 5}), ct;
  const std::string cpu_error = test::error_of([&] { gemm(Trans::N, Trans::N, 1.0, ac, bc, 0.0, cc); });
  const std::string toy_error = test::error_of([&] { gemm(Trans::N, Trans::N, 1.0, at, bt, 0.0, ct); });
  CHECK(test::contains(cpu_error, "graphmoe::gemm: inner dimensions differ"));
  CHECK(toy_error == cpu_error);
  CHECK(toy::calls["gemm"] == 0);
}

TEST_CASE("a third backend plugs in: its own check names the op that produced a NaN") {
  Tensor<double, Toy> a(Shape{2, 2}), b(Shape{2, 2}), c;
  a.data()[0] = std::numeric_limits<double>::quiet_NaN();
  const std::string what = test::error_of([&] { gemm(Trans::N, Trans::N, 1.0, a, b, 0.0, c); });
  CAPTURE(what);
  CHECK(test::contains(what, "checked_cpu: gemm left a NaN in its argument"));
  CHECK(!test::contains(what, "graphmoe::"));  // the user backend's error, not the library's
}
