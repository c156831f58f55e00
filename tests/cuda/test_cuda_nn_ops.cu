// Cross-backend tests of the CUDA backend's nn ops (layernorm, gelu, cross_entropy, embedding,
// dropout): every op runs forward and backward, in float and double, on random inputs on the CPU
// backend, the reference, and on the CUDA backend, and the results are compared
// (tests/cuda/cuda_test_support.cuh):
//
//   error metric   err = max_i |cuda_i - cpu_i| / max_i |cpu_i|     (normwise, L-infinity)
//   tolerance      float 1e-5, double 1e-12 (row sums in T on the GPU, in double on the CPU;
//                  CUDA's expf / erfcf within a few ulp); layernorm dx, dgamma and dbeta in float
//                  2e-5 (sums of up to a few hundred rows in fp32)
//   exact          dropout (the same Philox mask; y and dx one multiplication by the same scale)
//                  and embedding (a copy; the backward adds in the CPU's order)
//   determinism    layernorm's dgamma / dbeta and embedding's dtable are bit-identical over runs
//   error messages the CUDA op throws the CPU op's message, compared as strings
//
// Without a CUDA device every case prints "skipped: no CUDA device" and passes: the file is
// compiled by nvcc in CI and runs in full on a GPU machine.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "graphmoe/ops/cross_entropy.hpp"
#include "graphmoe/ops/dropout.hpp"
#include "graphmoe/ops/embedding.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/layernorm.hpp"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/cross_entropy.cuh"
#include "graphmoe/backend/cuda/dropout.cuh"
#include "graphmoe/backend/cuda/embedding.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/layernorm.cuh"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

// Everything lives in namespace graphmoe: with `using namespace graphmoe;` at global scope the
// backend tag `cuda` would be ambiguous with CCCL's `namespace cuda` (libcu++).
namespace graphmoe {
using namespace graphmoe::test;

namespace {

template <class T>
Tensor<T, cpu> shifted(Tensor<T, cpu> x, double scale, double shift) {
  for (index_t i = 0; i < x.numel(); ++i)
    x.data()[i] = static_cast<T>(x.data()[i] * scale + shift);
  return x;
}

template <class T>
double layernorm_grad_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

// |a - b| <= tol * max(1, |a|)
bool scalar_close(double a, double b, double tol) {
  return std::abs(a - b) <= tol * std::max(1.0, std::abs(a));
}

const GeluForm kForms[] = {GeluForm::Tanh, GeluForm::Erf};
const char* form_name(GeluForm f) { return f == GeluForm::Tanh ? "tanh" : "erf"; }

}  // namespace

// ---- layernorm ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: layernorm forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(21);
  for (const Shape shape : {Shape{1, 1}, Shape{200, 1}, Shape{37, 7}, Shape{64, 64},
                            Shape{2, 5, 33}, Shape{130, 768}, Shape{3, 4099}}) {
    CAPTURE(shape.str());
    const index_t d = shape.cols();
    // an offset mean, so that a one-pass variance would lose digits
    auto x = shifted(random_tensor<T>(shape, rng), 2.0, 3.0);
    auto gamma = random_tensor<T>({d}, rng, 0.5, 1.5);
    auto beta = random_tensor<T>({d}, rng);
    const T eps = T(1e-5);
    const auto xd = to_device(x), gd = to_device(gamma), bd = to_device(beta);

    Tensor<T> y, mean, rstd;
    Tensor<T, cuda> yd, meand, rstdd;
    layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
    layernorm_forward(xd, gd, bd, eps, yd, meand, rstdd);
    check_close("layernorm_forward y", y, yd);
    check_close("layernorm_forward mean", mean, meand);
    check_close("layernorm_forward rstd", rstd, rstdd);

    // y may alias x
    auto inplace = to_device(x);
    Tensor<T, cuda> m2, r2;
    layernorm_forward(inplace, gd, bd, eps, inplace, m2, r2);
    check_close("layernorm_forward in place", y, inplace);

    auto dy = random_tensor<T>(shape, rng);
    auto dgamma = random_tensor<T>({d}, rng), dbeta = random_tensor<T>({d}, rng);
    auto dgd = to_device(dgamma), dbd = to_device(dbeta);  // accumulated onto
    const auto dyd = to_device(dy);
    Tensor<T> dx;
    Tensor<T, cuda> dxd;
    layernorm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
    layernorm_backward(xd, gd, meand, rstdd, dyd, dxd, dgd, dbd);
    const double tol = layernorm_grad_tolerance<T>();
    check_close("layernorm_backward dx", dx, dxd, tol);
    check_close("layernorm_backward dgamma (accumulated)", dgamma, dgd, tol);
    check_close("layernorm_backward dbeta (accumulated)", dbeta, dbd, tol);

    // empty dgamma / dbeta are allocated as zeros; the result is the same bits on every run;
    // dx may alias dy
    Tensor<T, cuda> dg1, db1, dg2, db2, dx1;
    layernorm_backward(xd, gd, meand, rstdd, dyd, dx1, dg1, db1);
    auto g = to_device(dy);
    layernorm_backward(xd, gd, meand, rstdd, g, g, dg2, db2);
    check_equal("layernorm dgamma, run to run", to_host(dg1), dg2);
    check_equal("layernorm dbeta, run to run", to_host(db1), db2);
    check_equal("layernorm_backward dx in place", to_host(dx1), g);
    Tensor<T> dg0, db0, dx0;
    layernorm_backward(x, gamma, mean, rstd, dy, dx0, dg0, db0);
    check_close("layernorm_backward dgamma (from zero)", dg0, dg1, tol);
    check_close("layernorm_backward dbeta (from zero)", db0, db1, tol);
  }
}

TEST_CASE("cuda vs cpu: layernorm bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(22);
  auto x = random_tensor<float>({4, 6}, rng);
  auto gamma = random_tensor<float>({6}, rng), beta = random_tensor<float>({6}, rng);
  auto bad_gamma = random_tensor<float>({5}, rng);
  const auto xd = to_device(x), gd = to_device(gamma), bd = to_device(beta);
  const auto bgd = to_device(bad_gamma);
  auto forward_msgs = [&](const Tensor<float>& g, const Tensor<float, cuda>& gdev, float eps) {
    Tensor<float> y, m, r;
    Tensor<float, cuda> yd, md, rd;
    const auto cpu_msg = error_of([&] { layernorm_forward(x, g, beta, eps, y, m, r); });
    const auto cuda_msg = error_of([&] { layernorm_forward(xd, gdev, bd, eps, yd, md, rd); });
    CHECK(!cpu_msg.empty());
    CHECK(cuda_msg == cpu_msg);
  };
  forward_msgs(bad_gamma, bgd, 1e-5f);
  forward_msgs(gamma, gd, 0.0f);
  forward_msgs(gamma, gd, std::numeric_limits<float>::infinity());

  Tensor<float> y, m, r;
  layernorm_forward(x, gamma, beta, 1e-5f, y, m, r);
  auto bad_dy = random_tensor<float>({4, 5}, rng);
  Tensor<float> dx, dg, db;
  Tensor<float, cuda> dxd, dgd, dbd;
  const auto cpu_msg = error_of([&] { layernorm_backward(x, gamma, m, r, bad_dy, dx, dg, db); });
  const auto cuda_msg = error_of([&] {
    layernorm_backward(xd, gd, to_device(m), to_device(r), to_device(bad_dy), dxd, dgd, dbd);
  });
  CHECK(cpu_msg.find("dy") != std::string::npos);
  CHECK(cuda_msg == cpu_msg);
  Tensor<float, cuda> wrong_y(Shape{3, 6}), md, rd;
  Tensor<float> wrong_y_cpu({3, 6});
  CHECK(error_of([&] { layernorm_forward(xd, gd, bd, 1e-5f, wrong_y, md, rd); }) ==
        error_of([&] {
          Tensor<float> mc, rc;
          layernorm_forward(x, gamma, beta, 1e-5f, wrong_y_cpu, mc, rc);
        }));
}

// ---- gelu ---------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: gelu forward and backward, both forms", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(23);
  for (const Shape shape : {Shape{1}, Shape{1000}, Shape{37, 129}, Shape{2, 3, 4099}}) {
    for (const GeluForm form : kForms) {
      CAPTURE(shape.str());
      CAPTURE(form_name(form));
      auto x = shifted(random_tensor<T>(shape, rng), 8.0, 0.0);
      const T special[] = {T(0), T(-20), T(20), T(-40), T(1e-30), T(-1e4)};
      for (std::size_t k = 0; k < 6 && static_cast<index_t>(k) < x.numel(); ++k)
        x.data()[k] = special[k];
      auto dy = random_tensor<T>(shape, rng);
      const auto xd = to_device(x), dyd = to_device(dy);
      Tensor<T> y, dx;
      Tensor<T, cuda> yd, dxd;
      gelu_forward(form, x, y);
      gelu_forward(form, xd, yd);
      check_close("gelu_forward", y, yd);
      gelu_backward(form, x, dy, dx);
      gelu_backward(form, xd, dyd, dxd);
      check_close("gelu_backward", dx, dxd);

      // y may be x, dx may be dy
      auto a = to_device(x);
      gelu_forward(form, a, a);
      check_close("gelu_forward in place", y, a);
      auto g = to_device(dy);
      gelu_backward(form, xd, g, g);
      check_close("gelu_backward in place", dx, g);
    }
  }
}

TEST_CASE("cuda vs cpu: gelu bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(24);
  auto x = random_tensor<float>({3, 4}, rng);
  auto bad_dy = random_tensor<float>({4, 3}, rng);
  const auto xd = to_device(x);
  Tensor<float> y, dx;
  Tensor<float, cuda> yd, dxd;
  std::string cpu_msg = error_of([&] { gelu_forward(static_cast<GeluForm>(7), x, y); });
  CHECK(cpu_msg.find("unknown GeluForm 7") != std::string::npos);
  CHECK(error_of([&] { gelu_forward(static_cast<GeluForm>(7), xd, yd); }) == cpu_msg);
  cpu_msg = error_of([&] { gelu_backward(GeluForm::Tanh, x, bad_dy, dx); });
  CHECK(!cpu_msg.empty());
  CHECK(error_of([&] { gelu_backward(GeluForm::Tanh, xd, to_device(bad_dy), dxd); }) == cpu_msg);
  cpu_msg = error_of([&] { gelu_forward(GeluForm::Erf, Tensor<float>(), y); });
  CHECK(error_of([&] { gelu_forward(GeluForm::Erf, Tensor<float, cuda>(), yd); }) == cpu_msg);
}

// ---- cross_entropy ------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: cross-entropy forward and backward, with ignore_index", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(25);
  for (const std::int32_t ignore : {-100, 0}) {
    for (const Shape shape : {Shape{1, 1}, Shape{17, 5}, Shape{3, 4, 33}, Shape{64, 1000},
                              Shape{2049, 50}}) {
      for (const double ignored_fraction : {0.0, 0.3, 1.0}) {
        CAPTURE(ignore);
        CAPTURE(shape.str());
        CAPTURE(ignored_fraction);
        auto logits = shifted(random_tensor<T>(shape, rng), 6.0, 0.0);
        const index_t rows = logits.rows(), classes = logits.cols();
        Tensor<std::int32_t> targets(Shape::from_range(shape.begin(), shape.end() - 1));
        for (index_t i = 0; i < rows; ++i) {
          std::int32_t t =
              static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(classes)));
          if (rng.uniform_double() < ignored_fraction) t = ignore;
          targets.data()[i] = t;
        }
        const auto ld = to_device(logits);
        const auto td = to_device(targets);
        Tensor<T> lp;
        Tensor<T, cuda> lpd;
        index_t count = -1, countd = -1;
        const T loss = cross_entropy_forward(logits, targets, lp, ignore, &count);
        const T lossd = cross_entropy_forward(ld, td, lpd, ignore, &countd);
        CHECK(count == countd);
        CHECK_MESSAGE(scalar_close(loss, lossd, tolerance<T>()), "loss ", loss, " (cpu) vs ",
                      lossd, " (cuda)");
        check_close("cross_entropy_forward log_probs", lp, lpd);

        const T dloss = T(0.75);
        Tensor<T> dlogits;
        Tensor<T, cuda> dlogitsd;
        cross_entropy_backward(lp, targets, dloss, dlogits, ignore);
        cross_entropy_backward(lpd, td, dloss, dlogitsd, ignore);
        check_close("cross_entropy_backward dlogits", dlogits, dlogitsd);
        // dlogits may alias log_probs
        auto a = lpd.clone();
        cross_entropy_backward(a, td, dloss, a, ignore);
        check_close("cross_entropy_backward in place", dlogits, a);
        // with the forward's count: no scan, the same gradient
        Tensor<T, cuda> given;
        cross_entropy_backward(lpd, td, dloss, given, ignore, countd);
        check_close("cross_entropy_backward with the count", dlogits, given);
      }
    }
  }
}

TEST_CASE("cuda vs cpu: cross-entropy bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(26);
  auto logits = random_tensor<float>({5, 4}, rng);
  const auto ld = to_device(logits);
  for (const std::int32_t bad : {-1, 4, 1000}) {
    CAPTURE(bad);
    auto targets = Tensor<std::int32_t>::from({5}, {0, -100, bad, 1, bad});
    Tensor<float> lp;
    Tensor<float, cuda> lpd;
    const auto cpu_msg = error_of([&] { cross_entropy_forward(logits, targets, lp); });
    CHECK(cpu_msg.find("target of row 2") != std::string::npos);
    CHECK(error_of([&] { cross_entropy_forward(ld, to_device(targets), lpd); }) == cpu_msg);
    Tensor<float> dl;
    Tensor<float, cuda> dld;
    const auto cpu_msg2 =
        error_of([&] { cross_entropy_backward(logits, targets, 1.0f, dl); });
    CHECK(cpu_msg2.find("target of row 2") != std::string::npos);
    CHECK(error_of([&] { cross_entropy_backward(ld, to_device(targets), 1.0f, dld); }) ==
          cpu_msg2);
  }
  // targets of the wrong shape
  auto short_targets = Tensor<std::int32_t>::from({4}, {0, 1, 2, 3});
  Tensor<float> lp;
  Tensor<float, cuda> lpd;
  const auto cpu_msg = error_of([&] { cross_entropy_forward(logits, short_targets, lp); });
  CHECK(!cpu_msg.empty());
  CHECK(error_of([&] { cross_entropy_forward(ld, to_device(short_targets), lpd); }) == cpu_msg);
  // a row of logits with NaN: the softmax message, naming "logits"
  auto nan_logits = logits.clone();
  nan_logits(3, 1) = std::numeric_limits<float>::quiet_NaN();
  auto targets = Tensor<std::int32_t>::from({5}, {0, 1, 2, 3, 0});
  const auto cpu_msg3 = error_of([&] {
    Tensor<float> lp3;
    cross_entropy_forward(nan_logits, targets, lp3);
  });
  CHECK(cpu_msg3.find("row 3 of logits") != std::string::npos);
  CHECK(error_of([&] {
          Tensor<float, cuda> lp3;
          cross_entropy_forward(to_device(nan_logits), to_device(targets), lp3);
        }) == cpu_msg3);
  // a bad target and a bad row of logits: the target's error first, as the CPU checks
  auto both = Tensor<std::int32_t>::from({5}, {0, 1, 2, 3, 9});
  const auto cpu_msg4 = error_of([&] {
    Tensor<float> lp4;
    cross_entropy_forward(nan_logits, both, lp4);
  });
  CHECK(cpu_msg4.find("target of row 4 is 9") != std::string::npos);
  CHECK(error_of([&] {
          Tensor<float, cuda> lp4;
          cross_entropy_forward(to_device(nan_logits), to_device(both), lp4);
        }) == cpu_msg4);
#if defined(GRAPHMOE_CUDA_EMULATION)
  // one read back to the host per forward (flags, count and loss together)
  Tensor<float, cuda> lp5;
  const auto d_targets = to_device(targets);
  const auto before = graphmoe_cuda_emulation::counters();
  (void)cross_entropy_forward(ld, d_targets, lp5);
  CHECK(graphmoe_cuda_emulation::counters().copies_to_host - before.copies_to_host == 1);
#endif
}

// cross_entropy_forward_into inside a deferred scope (the language model's forward; a CUDA graph):
// nothing read until the scope ends, loss and count delivered then, the backward reading the count
// on the device; outside a scope the immediate form. Both equal the CPU's; errors the CPU's.
TEST_CASE_TEMPLATE("cuda vs cpu: cross_entropy_forward_into, deferred and immediate", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(29);
  const index_t rows = 37, classes = 11;
  const auto logits = random_tensor<T>({rows, classes}, rng, -3.0, 3.0);
  Tensor<std::int32_t> targets({rows});
  for (index_t i = 0; i < rows; ++i)
    targets.data()[i] = i % 7 == 3 ? -100
                                   : static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(classes)));
  const auto ld = to_device(logits);
  const auto td = to_device(targets);
  Tensor<T> lp, dl;
  CrossEntropyResult<cpu> host;
  cross_entropy_forward_into(logits, targets, lp, -100, host);
  CHECK(host.count == 32.0);  // 37 rows, 3, 10, 17, 24 and 31 ignored
  cross_entropy_backward(lp, targets, T(0.5), dl, -100, host);
  for (const bool deferred : {false, true}) {
    CAPTURE(deferred);
    CrossEntropyResult<cuda> dev;
    Tensor<T, cuda> lpd, dld;
    auto run = [&] { cross_entropy_forward_into(ld, td, lpd, -100, dev); };
    if (deferred) {
      with_deferred_checks(cuda{}, [&] {
#if defined(GRAPHMOE_CUDA_EMULATION)
        const auto before = graphmoe_cuda_emulation::counters();
        run();
        CHECK(graphmoe_cuda_emulation::counters().copies_to_host == before.copies_to_host);
        CHECK(graphmoe_cuda_emulation::counters().synchronizations == before.synchronizations);
#else
        run();
#endif
        CHECK(dev.count == -1);  // not delivered yet
        CHECK_FALSE(dev.device.empty());
      });
    } else {
      run();
      CHECK(dev.device.empty());
    }
    CHECK(dev.count == host.count);
    CHECK(dev.loss == doctest::Approx(host.loss).epsilon(std::is_same_v<T, float> ? 1e-6 : 1e-14));
    check_close("log_probs", lp, lpd);
    cross_entropy_backward(lpd, td, T(0.5), dld, -100, dev);
    check_close("dlogits (count on the device or the host)", dl, dld);
  }
  // every target ignored: loss 0, count 0, a zero gradient
  Tensor<std::int32_t> none({rows});
  for (index_t i = 0; i < rows; ++i) none.data()[i] = -100;
  CrossEntropyResult<cuda> empty;
  Tensor<T, cuda> lpe, dle;
  with_deferred_checks(cuda{}, [&] { cross_entropy_forward_into(ld, to_device(none), lpe, -100, empty); });
  CHECK(empty.count == 0.0);
  CHECK(empty.loss == 0.0);
  cross_entropy_backward(lpe, to_device(none), T(1), dle, -100, empty);
  check_equal("dlogits, every target ignored", Tensor<T>({rows, classes}), dle);
  // bad input, deferred: the CPU's messages, the target's first
  auto nan_logits = logits.clone();
  nan_logits(3, 1) = std::numeric_limits<T>::quiet_NaN();
  auto bad_targets = targets.clone();
  bad_targets.data()[20] = static_cast<std::int32_t>(classes);
  for (const bool bad_row : {false, true}) {
    for (const bool bad_target : {false, true}) {
      if (!bad_row && !bad_target) continue;
      const auto& lg = bad_row ? nan_logits : logits;
      const auto& tg = bad_target ? bad_targets : targets;
      const std::string cpu_msg = error_of([&] {
        Tensor<T> p;
        CrossEntropyResult<cpu> r;
        cross_entropy_forward_into(lg, tg, p, -100, r);
      });
      CHECK(!cpu_msg.empty());
      Tensor<T, cuda> p;
      CrossEntropyResult<cuda> r;  // outlives the scope (its values are delivered at the end)
      CHECK(error_of([&] {
              with_deferred_checks(cuda{}, [&] {
                cross_entropy_forward_into(to_device(lg), to_device(tg), p, -100, r);
              });
            }) == cpu_msg);
    }
  }
}

// ---- embedding ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: embedding forward and backward (exact)", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(27);
  for (const index_t vocab : {1, 5, 1000}) {
    for (const index_t d : {1, 7, 96}) {
      for (const Shape ids_shape : {Shape{1}, Shape{5, 20}, Shape{4, 3, 171}, Shape{20000}}) {
        CAPTURE(vocab);
        CAPTURE(d);
        CAPTURE(ids_shape.str());
        Tensor<std::int32_t> ids(ids_shape);
        for (index_t i = 0; i < ids.numel(); ++i)
          ids.data()[i] =
              static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
        auto table = random_tensor<T>({vocab, d}, rng);
        const auto idsd = to_device(ids);
        Tensor<T> out;
        Tensor<T, cuda> outd;
        embedding_forward(ids, table, out);
        embedding_forward(idsd, to_device(table), outd);
        check_equal("embedding_forward", out, outd);

        auto dout = random_tensor<T>(out.shape(), rng);
        auto dtable = random_tensor<T>({vocab, d}, rng);  // accumulated onto
        auto dtabled = to_device(dtable);
        auto dtabled2 = to_device(dtable);
        auto dtabled3 = to_device(dtable);
        const auto doutd = to_device(dout);
        embedding_backward(ids, dout, dtable);
        embedding_backward(idsd, doutd, dtabled);
        check_equal("embedding_backward dtable", dtable, dtabled);
        embedding_backward(idsd, doutd, dtabled2);
        check_equal("embedding_backward, run to run", to_host(dtabled), dtabled2);
        // inside a deferred scope (a language model's forward, a CUDA graph): the ids' checks are
        // deferrable flags and the backward is the direct kernel (no Thrust; O(n^2) id
        // comparisons, so the small shapes only): bit for bit the CPU's too
        if (ids.numel() <= 1000) {
          Tensor<T, cuda> outd3;
          with_deferred_checks(cuda{}, [&] {
            embedding_forward(idsd, to_device(table), outd3);
            embedding_backward(idsd, doutd, dtabled3);
          });
          check_equal("embedding_forward (deferred check)", out, outd3);
          check_equal("embedding_backward (direct kernel)", dtable, dtabled3);
        }
      }
    }
  }
}

TEST_CASE("cuda vs cpu: embedding bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(28);
  auto table = random_tensor<float>({5, 3}, rng);
  const auto tabled = to_device(table);
  for (const std::int32_t bad : {-1, 5, 1 << 30}) {
    CAPTURE(bad);
    auto ids = Tensor<std::int32_t>::from({2, 3}, {0, 4, 2, bad, 1, bad});
    Tensor<float> out;
    Tensor<float, cuda> outd;
    const auto cpu_msg = error_of([&] { embedding_forward(ids, table, out); });
    CHECK(cpu_msg.find("at flat position 3") != std::string::npos);
    CHECK(error_of([&] { embedding_forward(to_device(ids), tabled, outd); }) == cpu_msg);
    auto dout = random_tensor<float>({2, 3, 3}, rng);
    auto dtable = Tensor<float>({5, 3});
    Tensor<float, cuda> dtabled(Shape{5, 3});
    const auto cpu_msg2 = error_of([&] { embedding_backward(ids, dout, dtable); });
    CHECK(cpu_msg2.find("at flat position 3") != std::string::npos);
    CHECK(error_of([&] { embedding_backward(to_device(ids), to_device(dout), dtabled); }) ==
          cpu_msg2);
    check_equal("dtable untouched by the failed call", dtable, dtabled);
    // deferred (the checks' flags read when the scope ends): the same messages
    CHECK(error_of([&] {
            with_deferred_checks(cuda{}, [&] { embedding_forward(to_device(ids), tabled, outd); });
          }) == cpu_msg);
    CHECK(error_of([&] {
            with_deferred_checks(cuda{}, [&] {
              embedding_backward(to_device(ids), to_device(dout), dtabled);
            });
          }) == cpu_msg2);
  }
  auto ids = Tensor<std::int32_t>::from({2, 3}, {0, 1, 2, 3, 4, 0});
  auto bad_dout = random_tensor<float>({2, 3, 4}, rng);
  auto dtable = Tensor<float>({5, 3});
  Tensor<float, cuda> dtabled(Shape{5, 3});
  const auto cpu_msg = error_of([&] { embedding_backward(ids, bad_dout, dtable); });
  CHECK(cpu_msg.find("dout") != std::string::npos);
  CHECK(error_of([&] { embedding_backward(to_device(ids), to_device(bad_dout), dtabled); }) ==
        cpu_msg);
  Tensor<float, cuda> empty_table;
  CHECK(error_of([&] { embedding_backward(to_device(ids), to_device(bad_dout), empty_table); }) ==
        error_of([&] {
          Tensor<float> e;
          embedding_backward(ids, bad_dout, e);
        }));
}

// ---- dropout ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: dropout forward and backward (exact, the same mask)", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(29);
  const std::uint64_t seed = 0xFEDCBA9876543210ull;
  for (const Shape shape : {Shape{1}, Shape{3}, Shape{7, 1301}, Shape{2, 3, 4099}}) {
    for (const std::uint64_t offset : {0ull, 1ull, 3ull, (1ull << 32) - 3, (1ull << 33) + 5}) {
      for (const T p : {T(0), T(0.1), T(0.5), T(0.9)}) {
        CAPTURE(shape.str());
        CAPTURE(offset);
        CAPTURE(p);
        auto x = random_tensor<T>(shape, rng);
        const auto xd = to_device(x);
        Tensor<T> y;
        Tensor<std::uint8_t> mask;
        Tensor<T, cuda> yd;
        Tensor<std::uint8_t, cuda> maskd;
        dropout_forward(p, seed, offset, x, y, mask);
        dropout_forward(p, seed, offset, xd, yd, maskd);
        check_equal("dropout mask", mask, maskd);
        check_equal("dropout_forward y", y, yd);
        // y may be x
        auto a = to_device(x);
        Tensor<std::uint8_t, cuda> mask2;
        dropout_forward(p, seed, offset, a, a, mask2);
        check_equal("dropout_forward in place", y, a);

        auto dy = random_tensor<T>(shape, rng);
        Tensor<T> dx;
        Tensor<T, cuda> dxd;
        dropout_backward(p, mask, dy, dx);
        dropout_backward(p, maskd, to_device(dy), dxd);
        check_equal("dropout_backward dx", dx, dxd);
        auto g = to_device(dy);
        dropout_backward(p, maskd, g, g);
        check_equal("dropout_backward in place", dx, g);
      }
    }
  }
}

TEST_CASE("cuda vs cpu: dropout bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(30);
  auto x = random_tensor<float>({3, 4}, rng);
  const auto xd = to_device(x);
  for (const float p : {-0.1f, 1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(p);
    Tensor<float> y;
    Tensor<std::uint8_t> m;
    Tensor<float, cuda> yd;
    Tensor<std::uint8_t, cuda> md;
    const auto cpu_msg = error_of([&] { dropout_forward(p, 1, 0, x, y, m); });
    CHECK(cpu_msg.find("drop probability") != std::string::npos);
    CHECK(error_of([&] { dropout_forward(p, 1, 0, xd, yd, md); }) == cpu_msg);
  }
  auto mask = Tensor<std::uint8_t>({4, 3});
  Tensor<float> dx;
  Tensor<float, cuda> dxd;
  const auto cpu_msg = error_of([&] { dropout_backward(0.5f, mask, x, dx); });
  CHECK(cpu_msg.find("mask has shape") != std::string::npos);
  CHECK(error_of([&] { dropout_backward(0.5f, to_device(mask), xd, dxd); }) == cpu_msg);
}

}  // namespace graphmoe
