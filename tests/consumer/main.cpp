// Downstream consumer: includes the umbrella header, runs a GEMM and checks the result, then
// prints whether OpenMP and OpenBLAS are on. Exit status 0 when C = A B is right, 1 otherwise.
#include <graphmoe/graphmoe.hpp>

#include <cmath>
#include <cstdio>

// Defined in second.cpp, which also includes <graphmoe/graphmoe.hpp>.
float sum_of(const graphmoe::Tensor<float>& t);

int main() {
  using graphmoe::Shape;
  using graphmoe::Tensor;
  // A (2, 3), B (3, 2): C = A B = [[58, 64], [139, 154]].
  auto A = Tensor<float>::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  auto B = Tensor<float>::from(Shape{3, 2}, {7, 8, 9, 10, 11, 12});
  Tensor<float> C;
  graphmoe::gemm(graphmoe::Trans::N, graphmoe::Trans::N, 1.0f, A, B, 0.0f, C);

  const float expected[] = {58, 64, 139, 154};
  bool ok = C.shape() == Shape{2, 2};
  for (int i = 0; ok && i < 4; ++i) ok = std::fabs(C.data()[i] - expected[i]) < 1e-4f;
  ok = ok && std::fabs(sum_of(C) - 415.0f) < 1e-3f;

  std::printf("graphmoe %d.%d.%d consumer: C = [[%g, %g], [%g, %g]] %s\n", GRAPHMOE_VERSION_MAJOR,
              GRAPHMOE_VERSION_MINOR, GRAPHMOE_VERSION_PATCH, C.data()[0], C.data()[1],
              C.data()[2], C.data()[3], ok ? "ok" : "WRONG");
  // What the package attached (run_consumer.cmake checks it against GRAPHMOE_USE_OPENMP/_BLAS).
#if defined(_OPENMP)
  const int openmp = 1;
#else
  const int openmp = 0;
#endif
#if defined(GRAPHMOE_USE_BLAS)
  const int blas = 1;
#else
  const int blas = 0;
#endif
  std::printf("openmp=%d blas=%d\n", openmp, blas);
  return ok ? 0 : 1;
}
