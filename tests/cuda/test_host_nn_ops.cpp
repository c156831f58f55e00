// The functors of the CUDA backend's nn ops (backend/cuda/detail/nn_functors.hpp), compiled by
// g++ against Thrust's CPU backend (THRUST_DEVICE_SYSTEM_CPP, see tests/CMakeLists.txt) and run
// with thrust::for_each / transform_reduce on host memory, must reproduce the CPU ops: these are
// the bodies that backend/cuda/{gelu,dropout,cross_entropy,embedding,layernorm}.cuh run on the
// GPU, so their logic is tested on every machine, with or without a GPU.
//
//   exact (entry for entry)   gelu forward and backward (erf form), dropout mask / y / dx,
//                             cross-entropy loss, embedding gather and the sorted, atomic-free
//                             embedding backward, layernorm's y and dx element formulas, and the
//                             layernorm parameter-gradient partials with a double accumulator
//                             (the CPU op's order and precision)
//   normwise 1e-5             the same partials with a float accumulator (what the GPU uses for
//                             float) against the CPU's double sums
//   entrywise 1e-6 / 1e-14    the tanh GELU and cross-entropy's dlogits, whose CPU ops use a
//                             vectorised exp (float / double)
//
// Compiled with -ffp-contract=off so that both sides round every operation the same way; the
// libm functions are the same (std::exp(float) is expf). On the GPU the ops differ from the CPU
// only where CUDA's libm and fused multiply-adds round differently (test_cuda_nn_ops.cu).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform_reduce.h>

#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/ops/dropout.hpp"
#include "graphmoe/ops/embedding.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/layernorm.hpp"
#include "graphmoe/backend/cuda/detail/nn_functors.hpp"
#include "support/gradcheck.hpp"

#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CPP && THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_OMP
#error "test_host_nn_ops must be compiled with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP or _OMP"
#endif

using namespace graphmoe;
using graphmoe::test::random_tensor;

namespace {

// op(i) for i in [0, n), as the CUDA op's grid-stride kernel calls it.
template <class Op>
void for_each_index(index_t n, const Op& op) {
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<index_t>(0),
                   thrust::counting_iterator<index_t>(n), op);
}

// Entry-for-entry equality of the bits (so NaN == NaN with the same payload, and -0 != +0).
template <class T>
void check_same_bits(const char* what, const Tensor<T>& ref, const Tensor<T>& got) {
  REQUIRE(ref.shape() == got.shape());
  index_t bad = 0, first = -1;
  for (index_t i = 0; i < ref.numel(); ++i) {
    if (std::memcmp(ref.data() + i, got.data() + i, sizeof(T)) != 0) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", ref.numel(), " entries differ, first at ", first,
                first >= 0 ? " (" : "", first >= 0 ? std::to_string(ref.data()[first]) : "",
                first >= 0 ? " vs " : "", first >= 0 ? std::to_string(got.data()[first]) : "",
                first >= 0 ? ")" : "");
}

// Entry for entry: |got - ref| <= rel * max(|ref|, floor), NaN where ref is NaN and infinities
// equal. For the CPU ops that use a vectorised exp (backend/cpu/detail/vexp.hpp: Eigen's packet
// exp, within a few ulp of the functors' std::exp): the tanh GELU and cross-entropy's dlogits.
template <class T>
void check_close_entries(const char* what, const Tensor<T>& ref, const Tensor<T>& got, double rel,
                         double floor) {
  REQUIRE(ref.shape() == got.shape());
  index_t bad = 0, first = -1;
  for (index_t i = 0; i < ref.numel(); ++i) {
    const double r = static_cast<double>(ref.data()[i]), g = static_cast<double>(got.data()[i]);
    const bool ok = std::isnan(r) ? std::isnan(g)
                    : std::isinf(r) ? g == r
                                    : std::abs(g - r) <= rel * std::max(std::abs(r), floor);
    if (!ok) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", ref.numel(), " entries differ by more than ",
                rel, " relative, first at ", first);
}

// max |got - ref| / max |ref|
template <class T>
double normwise_error(const Tensor<T>& ref, const Tensor<T>& got) {
  double diff = 0, scale = 0;
  for (index_t i = 0; i < ref.numel(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got.data()[i]) - ref.data()[i]));
    scale = std::max(scale, std::abs(static_cast<double>(ref.data()[i])));
  }
  return diff == 0 ? 0.0 : diff / scale;
}

const GeluForm kForms[] = {GeluForm::Tanh, GeluForm::Erf};

}  // namespace

// ---- gelu ---------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("host nn functors: gelu forward and backward equal the CPU op", T, float,
                   double) {
  Rng rng(11);
  auto x = random_tensor<T>({37, 129}, rng, -8.0, 8.0);
  // the tails and the special points of both forms
  const T special[] = {T(0), -T(0), T(1e-30), T(-1e-30), T(20), T(-20), T(40), T(-40), T(1e4),
                       T(-1e4), T(0.5), T(-0.5)};
  for (std::size_t k = 0; k < std::size(special); ++k) x.data()[k] = special[k];
  auto dy = random_tensor<T>(x.shape(), rng);
  for (GeluForm form : kForms) {
    CAPTURE(static_cast<int>(form));
    Tensor<T> y, dx;
    gelu_forward(form, x, y);
    gelu_backward(form, x, dy, dx);
    Tensor<T> y2(x.shape()), dx2(x.shape());
    for_each_index(x.numel(), detail::GeluForwardOp<T>{form, x.data(), y2.data()});
    for_each_index(x.numel(), detail::GeluBackwardOp<T>{form, x.data(), dy.data(), dx2.data()});
    // dx may alias dy
    Tensor<T> g = dy.clone();
    for_each_index(x.numel(), detail::GeluBackwardOp<T>{form, x.data(), g.data(), g.data()});
    if (form == GeluForm::Erf) {  // scalar on both sides: the same bits
      check_same_bits("gelu y", y, y2);
      check_same_bits("gelu dx", dx, dx2);
      check_same_bits("gelu dx in place", dx, g);
    } else {  // the CPU's tanh form is vectorised; dx relative to |dy| ~ 1 (gelu' cancels)
      const double rel = sizeof(T) == 4 ? 1e-6 : 1e-14;
      check_close_entries("gelu y", y, y2, rel, 0.0);
      check_close_entries("gelu dx", dx, dx2, rel, 1.0);
      check_same_bits("gelu dx in place", dx2, g);
    }
  }
}

// ---- dropout ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("host nn functors: dropout mask, y and dx equal the CPU op bit for bit", T,
                   float, double) {
  Rng rng(12);
  const std::uint64_t seed = 0x0123456789ABCDEFull;
  for (const index_t n : {1, 3, 4, 5, 1000, 4099, 9001}) {
    for (const std::uint64_t offset :
         {0ull, 1ull, 2ull, 3ull, 4097ull, (1ull << 32) - 3, (1ull << 33) + 5}) {
      for (const T p : {T(0), T(0.1), T(0.5), T(0.9)}) {
        CAPTURE(n);
        CAPTURE(offset);
        CAPTURE(p);
        auto x = random_tensor<T>({n}, rng);
        Tensor<T> y;
        Tensor<std::uint8_t> mask;
        dropout_forward(p, seed, offset, x, y, mask);
        Tensor<T> y2(x.shape());
        Tensor<std::uint8_t> mask2(x.shape());
        const T scale = T(1) / (T(1) - p);
        const index_t blocks = detail::dropout_blocks(offset, n);
        CHECK(blocks * 4 >= n);
        CHECK(blocks * 4 < n + 7);
        for_each_index(blocks, detail::DropoutForwardOp<T>{p, scale, seed, offset, n, x.data(),
                                                           y2.data(), mask2.data()});
        check_same_bits("dropout mask", mask, mask2);
        check_same_bits("dropout y", y, y2);

        auto dy = random_tensor<T>({n}, rng);
        Tensor<T> dx, dx2(x.shape());
        dropout_backward(p, mask, dy, dx);
        for_each_index(n, detail::DropoutBackwardOp<T>{scale, mask2.data(), dy.data(), dx2.data()});
        check_same_bits("dropout dx", dx, dx2);
      }
    }
  }
}

TEST_CASE("host nn functors: dropout writes only its n elements") {
  // offset 2, n 5: words 2..6 live in blocks 0 and 1; entries beyond n stay untouched
  const index_t n = 5;
  std::vector<float> x(8, 1.0f), y(8, -7.0f);
  std::vector<std::uint8_t> mask(8, 9);
  const index_t blocks = detail::dropout_blocks(2, n);
  CHECK(blocks == 2);
  for_each_index(blocks, detail::DropoutForwardOp<float>{0.5f, 2.0f, 1, 2, n, x.data(), y.data(),
                                                          mask.data()});
  for (index_t i = 0; i < n; ++i) CHECK((mask[i] == 0 || mask[i] == 1));
  for (index_t i = n; i < 8; ++i) {
    CHECK(mask[i] == 9);
    CHECK(y[i] == -7.0f);
  }
  CHECK(detail::dropout_blocks(0, 0) == 0);
  CHECK(detail::dropout_blocks(3, 1) == 1);
  CHECK(detail::dropout_blocks(3, 2) == 2);
}

// ---- cross_entropy ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("host nn functors: cross-entropy loss and dlogits equal the CPU op", T, float,
                   double) {
  Rng rng(13);
  const std::int32_t ignore = -100;
  for (const Shape shape : {Shape{1, 1}, Shape{17, 5}, Shape{3, 4, 33}, Shape{64, 1000}}) {
    for (const double ignored_fraction : {0.0, 0.3, 1.0}) {
      CAPTURE(shape.str());
      CAPTURE(ignored_fraction);
      auto logits = random_tensor<T>(shape, rng, -6.0, 6.0);
      const index_t rows = logits.rows(), classes = logits.cols();
      const Shape tshape = Shape::from_range(shape.begin(), shape.end() - 1);
      Tensor<std::int32_t> targets(tshape);
      index_t count = 0;
      for (index_t i = 0; i < rows; ++i) {
        const bool ignored = rng.uniform_double() < ignored_fraction;
        targets.data()[i] =
            ignored ? ignore
                    : static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(classes)));
        count += ignored ? 0 : 1;
        CHECK(!detail::cross_entropy_bad_target(targets.data()[i], classes, ignore));
      }
      Tensor<T> log_probs;
      const T loss = cross_entropy_forward(logits, targets, log_probs, ignore);
      const double nll = thrust::transform_reduce(
          thrust::cpp::par, thrust::counting_iterator<index_t>(0),
          thrust::counting_iterator<index_t>(rows),
          detail::CrossEntropyNllOp<T>{log_probs.data(), targets.data(), classes, ignore}, 0.0,
          thrust::plus<double>());
      const T loss2 = count == 0 ? T(0) : static_cast<T>(nll / static_cast<double>(count));
      CHECK(loss2 == loss);

      const T dloss = T(1.75);
      Tensor<T> dlogits, dlogits2(shape);
      cross_entropy_backward(log_probs, targets, dloss, dlogits, ignore);
      const T scale = count == 0 ? T(0)
                                 : static_cast<T>(static_cast<double>(dloss) /
                                                  static_cast<double>(count));
      for_each_index(logits.numel(),
                     detail::CrossEntropyBackwardOp<T>{scale, count == 0, classes, ignore,
                                                       log_probs.data(), targets.data(),
                                                       dlogits2.data()});
      const double rel = sizeof(T) == 4 ? 1e-6 : 1e-14;  // the CPU's exp is vectorised
      check_close_entries("dlogits", dlogits, dlogits2, rel, 0.0);
      // dlogits may alias log_probs
      Tensor<T> inplace = log_probs.clone();
      for_each_index(logits.numel(),
                     detail::CrossEntropyBackwardOp<T>{scale, count == 0, classes, ignore,
                                                       inplace.data(), targets.data(),
                                                       inplace.data()});
      check_same_bits("dlogits in place", dlogits2, inplace);
    }
  }
}

TEST_CASE("host nn functors: the bad-target predicate and message match the CPU op") {
  CHECK(detail::cross_entropy_bad_target(-1, 5, -100));
  CHECK(detail::cross_entropy_bad_target(5, 5, -100));
  CHECK(!detail::cross_entropy_bad_target(4, 5, -100));
  CHECK(!detail::cross_entropy_bad_target(-100, 5, -100));
  CHECK(!detail::cross_entropy_bad_target(7, 5, 7));  // ignore_index may lie outside [0, C)
  auto logits = Tensor<float>::from({3, 5}, std::vector<float>(15, 0.5f));
  auto targets = Tensor<std::int32_t>::from({3}, {0, -100, 9});
  Tensor<float> lp;
  CHECK_THROWS_WITH_AS(cross_entropy_forward(logits, targets, lp),
                       "graphmoe::cross_entropy_forward: target of row 2 is 9, outside the class "
                       "range [0, 5) and not ignore_index (-100)",
                       Error);
}

// ---- embedding ----------------------------------------------------------------------------------

template <class T, class Policy>
void check_embedding(const char* policy_name, const Policy& policy) {
  CAPTURE(policy_name);
  Rng rng(14);
  for (const index_t vocab : {1, 7, 300}) {
    for (const index_t d : {1, 7, 64}) {
      for (const Shape ids_shape : {Shape{1}, Shape{5, 20}, Shape{2, 3, 171}}) {
        CAPTURE(vocab);
        CAPTURE(d);
        CAPTURE(ids_shape.str());
        Tensor<std::int32_t> ids(ids_shape);
        const index_t n = ids.numel();
        for (index_t i = 0; i < n; ++i)
          ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
        CHECK(detail::first_bad_id(policy, ids.data(), n, vocab) == -1);
        auto table = random_tensor<T>({vocab, d}, rng);

        Tensor<T> out;
        embedding_forward(ids, table, out);
        Tensor<T> out2(out.shape());
        for_each_index(n * d, detail::EmbeddingGatherOp<T>{ids.data(), table.data(), d, vocab, out2.data()});
        check_same_bits("embedding out", out, out2);
        // an id out of range (reported by a deferred check after the gather ran): a zero row,
        // never a read outside the table
        auto bad_ids = ids.clone();
        bad_ids.data()[0] = static_cast<std::int32_t>(vocab);
        for_each_index(n * d, detail::EmbeddingGatherOp<T>{bad_ids.data(), table.data(), d, vocab,
                                                          out2.data()});
        for (index_t c = 0; c < d; ++c) CHECK(out2.data()[c] == T(0));

        auto dout = random_tensor<T>(out.shape(), rng);
        auto dtable = random_tensor<T>({vocab, d}, rng);  // accumulates onto these values
        Tensor<T> dtable2 = dtable.clone();
        embedding_backward(ids, dout, dtable);
        std::vector<std::uint32_t> keys(static_cast<std::size_t>(n));
        std::vector<index_t> order(static_cast<std::size_t>(n)), starts(static_cast<std::size_t>(n));
        detail::embedding_backward_sorted(policy, ids.data(), n, dout.data(), d, dtable2.data(),
                                          keys.data(), order.data(), starts.data());
        check_same_bits("embedding dtable", dtable, dtable2);
      }
    }
  }
}

TEST_CASE_TEMPLATE("host nn functors: embedding gather and sorted backward equal the CPU op", T,
                   float, double) {
  check_embedding<T>("thrust::cpp::par", thrust::cpp::par);
  // thrust::device is the system embedding.cuh's policy belongs to; compiled by g++ it is
  // THRUST_DEVICE_SYSTEM, so the device code path runs on the CPU.
  check_embedding<T>("thrust::device", thrust::device);
}

TEST_CASE("host nn functors: the first bad id and its message") {
  auto ids = Tensor<std::int32_t>::from({2, 3}, {0, 4, 2, -1, 9, 3});
  CHECK(detail::first_bad_id(thrust::cpp::par, ids.data(), 6, 5) == 3);
  CHECK(detail::first_bad_id(thrust::cpp::par, ids.data(), 6, 10) == 3);
  CHECK(detail::first_bad_id(thrust::cpp::par, ids.data() + 4, 2, 5) == 0);
  CHECK(detail::first_bad_id(thrust::cpp::par, ids.data(), 3, 5) == -1);
  CHECK(detail::first_bad_id(thrust::cpp::par, ids.data(), 3, 4) == 1);
  auto table = Tensor<float>({5, 2});
  Tensor<float> out;
  CHECK_THROWS_WITH_AS(embedding_forward(ids, table, out),
                       "graphmoe::embedding_forward: id -1 at flat position 3 of ids (2, 3) is out "
                       "of range [0, 5)",
                       Error);
}

// ---- layernorm ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("host nn functors: layernorm element formulas and parameter gradients", T,
                   float, double) {
  Rng rng(15);
  for (const index_t n : {1, 63, 64, 65, 300}) {
    for (const index_t d : {1, 5, 128}) {
      CAPTURE(n);
      CAPTURE(d);
      auto x = random_tensor<T>({n, d}, rng, -3.0, 3.0);
      auto gamma = random_tensor<T>({d}, rng, 0.5, 1.5);
      auto beta = random_tensor<T>({d}, rng);
      const T eps = T(1e-5);
      Tensor<T> y, mean, rstd;
      layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
      Tensor<T> y2(x.shape());
      for (index_t i = 0; i < n; ++i)
        for (index_t j = 0; j < d; ++j)
          y2(i, j) = detail::layernorm_y(x(i, j), mean.data()[i], rstd.data()[i], gamma.data()[j],
                                         beta.data()[j]);
      check_same_bits("layernorm y", y, y2);

      auto dy = random_tensor<T>({n, d}, rng);
      auto dgamma = random_tensor<T>({d}, rng), dbeta = random_tensor<T>({d}, rng);
      const Tensor<T> dgamma0 = dgamma.clone(), dbeta0 = dbeta.clone();
      Tensor<T> dx;
      layernorm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);

      // dx from the element formula, with the row sums taken as the CPU op takes them
      Tensor<T> dx2(x.shape());
      for (index_t i = 0; i < n; ++i) {
        const T m = mean.data()[i], r = rstd.data()[i];
        const double sum_g =
            detail::accumulate_double(d, [&](index_t j) { return dy(i, j) * gamma.data()[j]; });
        const double sum_gx = detail::accumulate_double(d, [&](index_t j) {
          return static_cast<double>(dy(i, j) * gamma.data()[j]) *
                 static_cast<double>((x(i, j) - m) * r);
        });
        const double inv_d = 1.0 / static_cast<double>(d);
        const T mean_g = static_cast<T>(sum_g * inv_d), mean_gx = static_cast<T>(sum_gx * inv_d);
        for (index_t j = 0; j < d; ++j)
          dx2(i, j) = detail::layernorm_dx(x(i, j), dy(i, j), gamma.data()[j], m, r, mean_g,
                                           mean_gx);
      }
      check_same_bits("layernorm dx", dx, dx2);

      // the parameter gradients: chunk partials, then the chunk-ordered reduction
      const index_t chunks = detail::layernorm_chunks(n);
      CHECK(chunks == (n + 63) / 64);
      {
        Tensor<double> partial({chunks, 2 * d});
        Tensor<T> dg = dgamma0.clone(), db = dbeta0.clone();
        for_each_index(chunks * d, detail::LayernormParamPartialOp<T, double>{
                                       x.data(), dy.data(), mean.data(), rstd.data(), n, d,
                                       partial.data()});
        for_each_index(2 * d, detail::LayernormParamReduceOp<T, double>{partial.data(), chunks, d,
                                                                         dg.data(), db.data()});
        check_same_bits("layernorm dgamma (double partials)", dgamma, dg);
        check_same_bits("layernorm dbeta (double partials)", dbeta, db);
      }
      {
        // what the GPU runs for T = float: partials in T
        Tensor<T> partial({chunks, 2 * d});
        Tensor<T> dg = dgamma0.clone(), db = dbeta0.clone();
        for_each_index(chunks * d, detail::LayernormParamPartialOp<T, T>{
                                       x.data(), dy.data(), mean.data(), rstd.data(), n, d,
                                       partial.data()});
        for_each_index(2 * d, detail::LayernormParamReduceOp<T, T>{partial.data(), chunks, d,
                                                                    dg.data(), db.data()});
        const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-14;
        CHECK(normwise_error(dgamma, dg) <= tol);
        CHECK(normwise_error(dbeta, db) <= tol);
      }
    }
  }
}
