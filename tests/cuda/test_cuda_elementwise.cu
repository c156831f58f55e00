// Cross-backend tests of backend/cuda/elementwise.cuh and backend/cuda/gates.cuh against the CPU
// ops (tests/cuda/cuda_test_support.cuh: normwise error, tolerance float 1e-5, double 1e-12;
// exact where the op only copies, compares or counts). Without a CUDA device every case passes
// with "skipped: no CUDA device".
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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

namespace {

// The same bytes (not only equal values: -0 and 0 differ here).
template <class T>
void check_bits(const std::string& what, const Tensor<T, cpu>& ref, const Tensor<T, graphmoe::cuda>& got) {
  const Tensor<T, cpu> h = to_host(got);
  REQUIRE(h.shape() == ref.shape());
  index_t bad = 0;
  for (index_t i = 0; i < ref.numel(); ++i)
    bad += std::memcmp(h.data() + i, ref.data() + i, sizeof(T)) != 0 ? 1 : 0;
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", ref.numel(), " entries differ in their bits");
}

// (E) counts: random in [0, 9), a run of entries set to the mean where it is an integer (ties).
Tensor<std::int32_t, cpu> random_loads(index_t e, Rng& rng) {
  Tensor<std::int32_t, cpu> loads(Shape{e});
  std::int64_t total = 0;
  for (index_t x = 0; x < e; ++x) total += loads(x) = static_cast<std::int32_t>(rng.uniform_int(9));
  // make the total a multiple of E by raising the first experts, then give a few the mean
  for (index_t x = 0; total % e != 0; x = (x + 1) % e, ++total) ++loads(x);
  const auto mean = static_cast<std::int32_t>(total / e);
  for (index_t x = 0; x + 1 < e; x += 5) {  // pairs moved to the mean keep the total
    const std::int32_t sum = loads(x) + loads(x + 1);
    if (sum < mean) continue;
    loads(x) = mean;
    loads(x + 1) = sum - mean;
  }
  return loads;
}

}  // namespace

// ops/gates.hpp expert_bias_update: the kernel's bias equals the CPU loop's bit for bit (integer
// counts summed exactly in any order, then one addition in double, one rounding).
TEST_CASE_TEMPLATE("cuda vs cpu: expert_bias_update (bit for bit), zero loads, errors", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(23);
  for (index_t e : {1, 8, 64, 300}) {  // 300: more experts than the block's 256 threads
    for (double rate : {1e-3, 0.05}) {
      CAPTURE(e);
      CAPTURE(rate);
      const Tensor<T, cpu> bias0 = random_tensor<T>(Shape{e}, rng, -0.2, 0.2);
      Tensor<std::int32_t, cpu> loads = random_loads(e, rng);
      if (e == 64) loads(3) = loads(3) + 1000000;  // one expert far above the mean
      Tensor<T, cpu> hb = bias0.clone();
      Tensor<T, graphmoe::cuda> db = to_device(bias0);
      const Tensor<std::int32_t, graphmoe::cuda> dl = to_device(loads);
      for (int step = 0; step < 3; ++step) {  // the update applied to its own result
        expert_bias_update(hb, loads, rate);
        expert_bias_update(db, dl, rate);
        check_bits("bias", hb, db);
      }
      check_equal("loads (read only)", loads, dl);
      // a step that routed no token changes nothing
      Tensor<std::int32_t, cpu> zero(Shape{e});
      const Tensor<T, cpu> kept = hb.clone();
      expert_bias_update(db, to_device(zero), rate);
      check_bits("bias after zero loads", kept, db);
    }
  }
  // the op layer's messages, the same on both backends
  const Tensor<T, cpu> b(Shape{4});
  const Tensor<std::int32_t, cpu> l3(Shape{3});
  const std::string cpu_error = error_of([&] { expert_bias_update(b, l3, 0.1); });
  CHECK(cpu_error.find("loads must be a (4) vector") != std::string::npos);
  CHECK(error_of([&] { expert_bias_update(to_device(b), to_device(l3), 0.1); }) == cpu_error);
}

// bf16 and half biases: the device update equals the host arithmetic in double with one rounding
// (detail::value_cast, as the CPU loop would round a double).
TEST_CASE_TEMPLATE("cuda: expert_bias_update in bf16 and half rounds once from double", H,
                   __nv_bfloat16, __half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(29);
  const index_t e = 40;
  const double rate = 1e-3;  // below the 16-bit spacing of most entries: the rounding matters
  Tensor<H, cpu> bias(Shape{e});
  for (index_t x = 0; x < e; ++x) bias.data()[x] = detail::value_cast<H>(0.3 * rng.normal());
  const Tensor<std::int32_t, cpu> loads = random_loads(e, rng);
  double total = 0;
  for (index_t x = 0; x < e; ++x) total += loads(x);
  const double mean = total / static_cast<double>(e);
  Tensor<H, cpu> want = bias.clone();
  for (index_t x = 0; x < e; ++x) {
    const double sign = loads(x) < mean ? 1.0 : (loads(x) > mean ? -1.0 : 0.0);
    want.data()[x] =
        detail::value_cast<H>(detail::value_cast<double>(bias.data()[x]) + rate * sign);
  }
  Tensor<H, graphmoe::cuda> db = to_device(bias);
  expert_bias_update(db, to_device(loads), rate);
  check_bits("bias", want, db);
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
