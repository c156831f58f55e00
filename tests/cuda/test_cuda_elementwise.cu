// Cross-backend tests of backend/cuda/elementwise.cuh and backend/cuda/gates.cuh against the CPU
// ops (tests/cuda/cuda_test_support.cuh: normwise error, tolerance float 1e-5, double 1e-12;
// exact where the op only copies, compares or counts). Without a CUDA device every case passes
// with "skipped: no CUDA device".
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/gates.cuh"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gates.hpp"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

namespace graphmoe {
using test::check_close;
using test::check_equal;
using test::error_of;
using test::random_tensor;
using test::tolerance;

TEST_CASE_TEMPLATE("cuda vs cpu: add_row_vector, column sums, add, axpy, scale, fill, dot", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(1);
  for (index_t rows : {1, 7, 300}) {
    CAPTURE(rows);
    const Tensor<T, cpu> y0 = random_tensor<T>(Shape{rows, 37}, rng);
    const Tensor<T, cpu> b = random_tensor<T>(Shape{37}, rng);
    Tensor<T, cpu> hy = y0.clone();
    Tensor<T, graphmoe::cuda> dy = to_device(y0);
    add_row_vector(b, hy);
    add_row_vector(to_device(b), dy);
    check_close("add_row_vector", hy, dy);
    Tensor<T, cpu> hdb = b.clone();
    Tensor<T, graphmoe::cuda> ddb = to_device(b);
    accumulate_column_sums(y0, hdb);
    accumulate_column_sums(to_device(y0), ddb);
    check_close("accumulate_column_sums", hdb, ddb);
    Tensor<T, cpu> hs;
    Tensor<T, graphmoe::cuda> ds;
    add(y0, hy, hs);
    add(to_device(y0), dy, ds);
    check_close("add", hs, ds);
    add(hs, hs, hs);  // in place
    add(ds, ds, ds);
    check_close("add in place", hs, ds);
    axpy(T(-0.5), y0, hy);
    axpy(T(-0.5), to_device(y0), dy);
    check_close("axpy", hy, dy);
    scale(hy, T(3));
    scale(dy, T(3));
    check_close("scale", hy, dy);
    Tensor<T, cpu> hd = Tensor<T, cpu>::from(Shape{1}, {T(0.5)});
    Tensor<T, graphmoe::cuda> dd = to_device(hd);
    accumulate_dot(y0, hy, T(2), hd);
    accumulate_dot(to_device(y0), dy, T(2), dd);
    check_close("accumulate_dot", hd, dd);
    CHECK(read_scalar(dd) == to_host(dd).data()[0]);
    fill(hy, T(4));
    fill(dy, T(4));
    check_equal("fill", hy, dy);
  }
  Tensor<T, graphmoe::cuda> y(Shape{3, 5});
  CHECK(error_of([&] { add_row_vector(Tensor<T, graphmoe::cuda>(Shape{4}), y); }) ==
        error_of([&] { add_row_vector(Tensor<T, cpu>(Shape{4}), Tensor<T, cpu>(Shape{3, 5})); }));
  CHECK(error_of([&] { axpy(T(1), Tensor<T, graphmoe::cuda>(Shape{2}), y); }) ==
        error_of([&] { axpy(T(1), Tensor<T, cpu>(Shape{2}), Tensor<T, cpu>(Shape{3, 5})); }));
}

TEST_CASE_TEMPLATE("cuda vs cpu: normalize_rows forward and backward, check_finite, patchify", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(2);
  const T eps = T(1e-3);
  Tensor<T, cpu> x = random_tensor<T>(Shape{9, 300}, rng);
  for (index_t j = 0; j < 300; ++j) x(8, j) *= T(1e-6);  // a clamped row
  Tensor<T, cpu> hy = x.clone(), hn;
  Tensor<T, graphmoe::cuda> dy = to_device(x), dn;
  normalize_rows(hy, hn, eps);
  normalize_rows(dy, dn, eps);
  check_close("normalize_rows y", hy, dy);
  check_close("normalize_rows norms", hn, dn);
  const Tensor<T, cpu> g = random_tensor<T>(x.shape(), rng);
  Tensor<T, cpu> hg = g.clone();
  Tensor<T, graphmoe::cuda> dg = to_device(g);
  normalize_rows_backward(hy, hn, eps, hg);
  normalize_rows_backward(dy, dn, eps, dg);
  check_close("normalize_rows dx", hg, dg);

  Tensor<T, cpu> bad = random_tensor<T>(Shape{4, 6}, rng);
  bad(2, 3) = std::numeric_limits<T>::quiet_NaN();
  CHECK(error_of([&] { check_finite("op", "x", to_device(bad)); }) ==
        error_of([&] { check_finite("op", "x", bad); }));
  CHECK(error_of([&] { check_finite("op", "x", to_device(x)); }).empty());

  const Tensor<T, cpu> images = random_tensor<T>(Shape{3, 8, 12, 3}, rng);
  Tensor<T, cpu> hp;
  Tensor<T, graphmoe::cuda> dp;
  patchify(images, 4, 8, 12, 3, hp);
  patchify(to_device(images), 4, 8, 12, 3, dp);
  check_equal("patchify", hp, dp);
}

TEST_CASE_TEMPLATE("cuda vs cpu: gates, capacity mask and the drop bucket", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(3);
  const index_t n = 257, k = 3, e = 8;
  Tensor<std::int32_t, cpu> idx(Shape{n, k});
  for (index_t i = 0; i < n; ++i)  // k distinct experts per token
    for (index_t j = 0; j < k; ++j)
      idx(i, j) = static_cast<std::int32_t>((i * 5 + j * 3 + rng.uniform_int(2)) % e);
  for (index_t i = 0; i < n; ++i)
    if (idx(i, 1) == idx(i, 0) || idx(i, 2) == idx(i, 0) || idx(i, 2) == idx(i, 1)) {
      idx(i, 0) = 0;
      idx(i, 1) = 1;
      idx(i, 2) = 2;
    }
  for (index_t cap : {0, 1, 40, 100, 1000}) {
    CAPTURE(cap);
    Tensor<std::uint8_t, cpu> hk;
    Tensor<std::uint8_t, graphmoe::cuda> dk;
    capacity_mask(idx, e, cap, hk);
    capacity_mask(to_device(idx), e, cap, dk);
    check_equal("keep", hk, dk);
    CHECK(count_dropped(hk) == count_dropped(dk));
    if (cap == 1) CHECK(count_dropped(hk) == n * k - e);
    Tensor<std::int32_t, cpu> hids;
    Tensor<std::int32_t, graphmoe::cuda> dids;
    route_dropped_to(idx, hk, static_cast<std::int32_t>(e), hids);
    route_dropped_to(to_device(idx), dk, static_cast<std::int32_t>(e), dids);
    check_equal("route_dropped_to", hids, dids);

    const Tensor<T, cpu> values = random_tensor<T>(Shape{n, k}, rng, 0.05, 1.0);
    Tensor<T, cpu> hgates;
    Tensor<T, graphmoe::cuda> dgates;
    renormalized_gates(values, hk, hgates);
    renormalized_gates(to_device(values), dk, dgates);
    check_close("gates", hgates, dgates);
    const Tensor<T, cpu> dg = random_tensor<T>(Shape{n, k}, rng);
    Tensor<T, cpu> hdp;
    Tensor<T, graphmoe::cuda> ddp;
    renormalized_gates_backward(values, idx, hk, hgates, dg, e, hdp);
    renormalized_gates_backward(to_device(values), to_device(idx), dk, dgates, to_device(dg), e,
                                ddp);
    check_close("gates dp", hdp, ddp);
  }
  Tensor<T, cpu> zero(Shape{2, 2});
  const auto ones = Tensor<std::uint8_t, cpu>::from(Shape{2, 2}, {1, 1, 1, 1});
  CHECK(error_of([&] {
          Tensor<T, graphmoe::cuda> g;
          renormalized_gates(to_device(zero), to_device(ones), g);
        }) == error_of([&] {
          Tensor<T, cpu> g;
          renormalized_gates(zero, ones, g);
        }));
  // An expert id outside [0, E): one message (ops/gates.hpp's) for both backends.
  const auto bad_ids = Tensor<std::int32_t, cpu>::from(Shape{2, 2}, {0, 1, 9, 2});
  const std::string cpu_error = error_of([&] {
    Tensor<std::uint8_t, cpu> keep;
    capacity_mask(bad_ids, 4, 1, keep);
  });
  CHECK(cpu_error.find("expert id 9 at assignment 2 is outside [0, 4)") != std::string::npos);
  CHECK(error_of([&] {
          Tensor<std::uint8_t, graphmoe::cuda> keep;
          capacity_mask(to_device(bad_ids), 4, 1, keep);
        }) == cpu_error);
  // deferred (no copy to the host until the scope ends): the same message
  CHECK(error_of([&] {
          with_deferred_checks(graphmoe::cuda{}, [&] {
            Tensor<std::uint8_t, graphmoe::cuda> keep;
            capacity_mask(to_device(bad_ids), 4, 1, keep);
          });
        }) == cpu_error);
}

TEST_CASE("cuda vs cpu: the capacity mask over many assignments, several per thread") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(11);
  const index_t n = 3001, k = 2, e = 5;  // 6002 ids: 24 per thread of an expert's block
  Tensor<std::int32_t, cpu> idx(Shape{n, k});
  for (index_t a = 0; a < n * k; ++a)
    idx.data()[a] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
  for (index_t cap : {1, 600, 1200, 1300}) {
    CAPTURE(cap);
    Tensor<std::uint8_t, cpu> hk;
    Tensor<std::uint8_t, graphmoe::cuda> dk;
    capacity_mask(idx, e, cap, hk);
    capacity_mask(to_device(idx), e, cap, dk);
    check_equal("keep", hk, dk);
  }
}

}  // namespace graphmoe
