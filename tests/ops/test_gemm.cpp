// GEMM: all transpose combinations against a naive triple loop; gradient checks; float vs double;
// bad input.
#include <doctest/doctest.h>

#include "graphmoe/ops/gemm.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
const Trans kTrans[] = {Trans::N, Trans::T};
const char* tname(Trans t) { return t == Trans::N ? "N" : "T"; }

// op(X)[i][j]
double op_at(const Tensor<double>& x, Trans t, index_t i, index_t j) {
  return t == Trans::N ? x(i, j) : x(j, i);
}
}  // namespace

TEST_CASE("gemm: all transpose combinations match a naive triple loop") {
  Rng rng(1);
  const index_t m = 5, k = 7, n = 3;
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      CAPTURE(tname(ta));
      CAPTURE(tname(tb));
      auto A = random_tensor<double>(ta == Trans::N ? Shape{m, k} : Shape{k, m}, rng);
      auto B = random_tensor<double>(tb == Trans::N ? Shape{k, n} : Shape{n, k}, rng);
      auto C = random_tensor<double>({m, n}, rng);
      auto C0 = C.clone();
      gemm(ta, tb, 0.5, A, B, 2.0, C);
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          double s = 0;
          for (index_t p = 0; p < k; ++p) s += op_at(A, ta, i, p) * op_at(B, tb, p, j);
          CHECK(C(i, j) == doctest::Approx(0.5 * s + 2.0 * C0(i, j)).epsilon(1e-12));
        }
    }
  }
}

TEST_CASE("gemm: beta = 0 ignores NaN in C, empty C is allocated") {
  auto A = Tensor<float>::from({1, 2}, {1, 2});
  auto B = Tensor<float>::from({2, 1}, {3, 4});
  auto C = Tensor<float>::full({1, 1}, std::numeric_limits<float>::quiet_NaN());
  gemm(Trans::N, Trans::N, 1.0f, A, B, 0.0f, C);
  CHECK(C(0, 0) == 11.0f);
  Tensor<float> D;
  gemm(Trans::N, Trans::N, 1.0f, A, B, 1.0f, D);
  CHECK(D.shape() == Shape{1, 1});
  CHECK(D(0, 0) == 11.0f);
}

TEST_CASE("gemm: gradient check, all transpose combinations (double)") {
  Rng rng(2);
  const index_t m = 4, k = 3, n = 5;
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      CAPTURE(tname(ta));
      CAPTURE(tname(tb));
      auto A = random_tensor<double>(ta == Trans::N ? Shape{m, k} : Shape{k, m}, rng);
      auto B = random_tensor<double>(tb == Trans::N ? Shape{k, n} : Shape{n, k}, rng);
      auto W = random_tensor<double>({m, n}, rng);
      const double alpha = 1.5;
      auto loss = [&] {
        Tensor<double> C;
        gemm(ta, tb, alpha, A, B, 0.0, C);
        return weighted_sum(C, W);
      };
      Tensor<double> dA(A.shape()), dB(B.shape());
      gemm_backward(ta, tb, alpha, A, B, W, 0.0, dA, 0.0, dB);
      check_gradient("dA", A, dA, loss);
      check_gradient("dB", B, dB, loss);
      // beta = 1 accumulates
      auto dA2 = dA.clone();
      Tensor<double> none;
      gemm_backward(ta, tb, alpha, A, B, W, 1.0, dA2, 0.0, none);
      CHECK(max_rel_diff(dA2, cast<double>(dA)) > 0);
      for (index_t i = 0; i < dA.numel(); ++i)
        CHECK(dA2.data()[i] == doctest::Approx(2 * dA.data()[i]));
    }
  }
}

TEST_CASE("gemm: float agrees with double at the MoE shapes' aspect") {
  Rng rng(3);
  auto A = random_tensor<double>({64, 96}, rng);
  auto B = random_tensor<double>({96, 40}, rng);
  Tensor<double> Cd;
  Tensor<float> Cf;
  gemm(Trans::N, Trans::N, 1.0, A, B, 0.0, Cd);
  gemm(Trans::N, Trans::N, 1.0f, cast<float>(A), cast<float>(B), 0.0f, Cf);
  CHECK(max_rel_diff(Cf, Cd) < 1e-5);
}

TEST_CASE("gemm: bad input") {
  Tensor<float> A({2, 3}), B({4, 5}), C({2, 5});
  CHECK_THROWS_WITH_AS(gemm(Trans::N, Trans::N, 1.0f, A, B, 0.0f, C),
                       doctest::Contains("inner dimensions differ"), Error);
  Tensor<float> B2({3, 5}), C2({5, 2});
  CHECK_THROWS_WITH_AS(gemm(Trans::N, Trans::N, 1.0f, A, B2, 0.0f, C2),
                       doctest::Contains("C has shape (5, 2)"), Error);
  Tensor<float> empty;
  CHECK_THROWS_WITH_AS(gemm(Trans::N, Trans::N, 1.0f, empty, B2, 0.0f, C), doctest::Contains("empty"), Error);
  Tensor<float> dC({2, 4});
  Tensor<float> dA(A.shape()), dB(B2.shape());
  CHECK_THROWS_WITH_AS(gemm_backward(Trans::N, Trans::N, 1.0f, A, B2, dC, 0.0f, dA, 0.0f, dB),
                       doctest::Contains("dC has shape (2, 4)"), Error);
}
