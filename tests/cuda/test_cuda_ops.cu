// Cross-backend tests of the CUDA backend (ggml's test-backend-ops, Eigen's
// run_and_compare_to_gpu): every op runs on random inputs on the CPU backend, the reference, and
// on the CUDA backend, and the results are compared with a stated tolerance per type.
//
//   error metric   err = max_i |cuda_i - cpu_i| / max_i |cpu_i|     (normwise, L-infinity)
//   tolerance      float 1e-5, double 1e-12
//                  exact equality where the op only compares and copies (topk, the dispatch plan,
//                  dispatch_forward) or sums in the same order (topk_backward)
//   error messages the CUDA op throws the CPU op's message, compared as strings
//
// Without a CUDA device (cudaGetDeviceCount finds none) every case prints "skipped: no CUDA
// device" and passes: the file is compiled by nvcc in CI and runs in full on a GPU machine
// (scripts/gpu-check.sh).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gates.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "graphmoe/ops/topk.hpp"
#include "graphmoe/backend/cuda/allocator.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/deferred_check.cuh"
#include "graphmoe/backend/cuda/device.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/gates.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/grouped.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/backend/cuda/topk.cuh"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

// Everything lives in namespace graphmoe: with `using namespace graphmoe;` at global scope the
// backend tag `cuda` would be ambiguous with CCCL's `namespace cuda` (libcu++).
namespace graphmoe {
using namespace graphmoe::test;

namespace {

template <class T>
Tensor<T, cpu> scaled(Tensor<T, cpu> x, double s) {
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<T>(x.data()[i] * s);
  return x;
}

Tensor<std::int32_t> random_ids(index_t n, index_t k, index_t used, Rng& rng) {
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < idx.numel(); ++i)
    idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(used)));
  return idx;
}

__global__ void philox_kernel(std::uint64_t seed, std::uint64_t first, std::uint32_t* words,
                              index_t n) {
  GRAPHMOE_CUDA_GRID_STRIDE(i, n) {
    words[i] = philox_word(seed, first + static_cast<std::uint64_t>(i));
  }
}

const Trans kTrans[] = {Trans::N, Trans::T};
const char* tname(Trans t) { return t == Trans::N ? "N" : "T"; }

}  // namespace

// ---- device basics ------------------------------------------------------------------------------

TEST_CASE("cuda: device tensors, copies and the caching allocator") {
  SKIP_WITHOUT_CUDA_DEVICE();
  MESSAGE("device: ", cuda_device_name());
  Rng rng(1);
  auto h = random_tensor<float>({13, 7}, rng);
  Tensor<float, cuda> d = to_device(h);
  CHECK(d.shape() == h.shape());
  check_equal("round trip", h, d);
  check_equal("clone", h, d.clone());
  Tensor<float, cuda> c(h.shape());
  check_equal("zero-filled", Tensor<float>(h.shape()), c);
  c.copy_from(d);
  check_equal("copy_from", h, c);
  check_equal("view", h.view({7, 13}), d.view({7, 13}));
  check_equal("slice", h.slice(3, 9).clone(), d.slice(3, 9));
  check_equal("row", h[4].clone(), d[4]);
  c.zero();
  check_equal("zero", Tensor<float>(h.shape()), c);
  CHECK(to_host(Tensor<float, cuda>()).empty());

  // A freed block is reused for a request of the same size class, without cudaMalloc.
  const std::size_t bytes = 3 * 1024 * 1024 + 1000;  // size class 3.5 MiB, as bytes - 100
  CHECK(detail::CudaCachingAllocator::size_class(bytes) >= bytes);
  CHECK(detail::CudaCachingAllocator::size_class(bytes) < bytes / 4 * 5 + 512);
  { Tensor<char, cuda> a(Shape{static_cast<index_t>(bytes)}); }
  const CudaMemoryStats before = cuda_memory_stats();
  { Tensor<char, cuda> b(Shape{static_cast<index_t>(bytes) - 100}); }
  const CudaMemoryStats after = cuda_memory_stats();
  CHECK(after.cuda_malloc_calls == before.cuda_malloc_calls);
  CHECK(after.cache_hits == before.cache_hits + 1);
  cuda_empty_cache();
  CHECK(cuda_memory_stats().bytes_cached == 0);

  // The high-water mark restarts from what is in use, and then counts the size classes of the
  // blocks live at once.
  cuda_reset_peak_memory();
  const std::size_t base = cuda_memory_stats().bytes_in_use;
  CHECK(cuda_memory_stats().peak_bytes_in_use == base);
  {
    Tensor<char, cuda> a(Shape{index_t(1) << 20});
    Tensor<char, cuda> b(Shape{index_t(3) << 20});
  }
  { Tensor<char, cuda> c(Shape{index_t(1) << 20}); }
  CHECK(cuda_memory_stats().peak_bytes_in_use == base + (std::size_t(4) << 20));
  CHECK(cuda_memory_stats().bytes_in_use == base);
}

TEST_CASE("cuda: CUDA errors are graphmoe::Error naming the call") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const std::string msg = error_of([] { Tensor<float, cuda> huge(Shape{index_t(1) << 42}); });
  CHECK(msg.find("graphmoe::cudaMalloc") != std::string::npos);
  CHECK(msg.find("out of memory") != std::string::npos);
  MESSAGE(msg);
  // The failed allocation leaves the allocator usable.
  Tensor<float, cuda> ok(Shape{16});
  CHECK(to_host(ok).numel() == 16);
}

TEST_CASE("cuda: the Philox stream on the device equals the CPU stream") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const std::uint64_t seed = 0x0123456789ABCDEFull, first = (std::uint64_t(1) << 32) - 5;
  const index_t n = 4099;
  Tensor<std::uint32_t, cuda> words(Shape{n});
  detail::launch_kernel<philox_kernel>(detail::grid_for(n), detail::kThreads, seed, first,
                                       words.data(), n);
  GRAPHMOE_CUDA_CHECK_LAUNCH();
  Tensor<std::uint32_t> ref({n});
  Rng rng(seed, first);
  for (index_t i = 0; i < n; ++i) ref.data()[i] = rng.next_u32();
  check_equal("philox words", ref, words);
}

// ---- gemm -----------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: gemm, all transposes", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(2);
  struct Mnk {
    index_t m, n, k;
  };
  for (const Mnk s : {Mnk{1, 1, 1}, Mnk{67, 45, 129}, Mnk{256, 384, 512}, Mnk{5, 3, 0}}) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        CAPTURE(s.m);
        CAPTURE(s.n);
        CAPTURE(s.k);
        CAPTURE(tname(ta));
        CAPTURE(tname(tb));
        auto A = random_tensor<T>(ta == Trans::N ? Shape{s.m, s.k} : Shape{s.k, s.m}, rng);
        auto B = random_tensor<T>(tb == Trans::N ? Shape{s.k, s.n} : Shape{s.n, s.k}, rng);
        auto C = random_tensor<T>({s.m, s.n}, rng);
        auto dA = to_device(A), dB = to_device(B);

        // beta != 0: C is read
        auto dC = to_device(C);
        gemm(ta, tb, T(0.5), A, B, T(2), C);
        gemm(ta, tb, T(0.5), dA, dB, T(2), dC);
        check_close("gemm C = 0.5 op(A) op(B) + 2 C", C, dC);

        // empty C: allocated, beta ignored
        Tensor<T> C2;
        Tensor<T, cuda> dC2;
        gemm(ta, tb, T(1), A, B, T(3), C2);
        gemm(ta, tb, T(1), dA, dB, T(3), dC2);
        check_close("gemm into an empty C", C2, dC2);

        // backward, accumulating into dA (beta_a = 1) and assigning dB (beta_b = 0)
        auto G = random_tensor<T>({s.m, s.n}, rng);
        auto gA = random_tensor<T>(A.shape(), rng), gB = random_tensor<T>(B.shape(), rng);
        auto dgA = to_device(gA), dgB = to_device(gB);
        gemm_backward(ta, tb, T(1.5), A, B, G, T(1), gA, T(0), gB);
        gemm_backward(ta, tb, T(1.5), dA, dB, to_device(G), T(1), dgA, T(0), dgB);
        if (s.k > 0) {
          check_close("gemm_backward dA", gA, dgA);
          check_close("gemm_backward dB", gB, dgB);
        }
      }
    }
  }
}

TEST_CASE("cuda vs cpu: gemm with beta = 0 ignores NaN in C, reads rank-3 A, rejects bad shapes") {
  SKIP_WITHOUT_CUDA_DEVICE();
  auto A = Tensor<float>::from({1, 2}, {1, 2});
  auto B = Tensor<float>::from({2, 1}, {3, 4});
  auto C = to_device(Tensor<float>::full({1, 1}, std::numeric_limits<float>::quiet_NaN()));
  gemm(Trans::N, Trans::N, 1.0f, to_device(A), to_device(B), 0.0f, C);
  CHECK(to_host(C).data()[0] == 11.0f);

  Rng rng(3);
  auto X = random_tensor<float>({2, 3, 4}, rng);
  auto W = random_tensor<float>({4, 5}, rng);
  Tensor<float> Y({6, 5});
  Tensor<float, cuda> dY(Shape{6, 5});
  gemm(Trans::N, Trans::N, 1.0f, X, W, 0.0f, Y);
  gemm(Trans::N, Trans::N, 1.0f, to_device(X), to_device(W), 0.0f, dY);
  check_close("rank-3 A read as a (6, 4) matrix", Y, dY);

  Tensor<float> none;
  Tensor<float, cuda> dnone;
  const auto cpu_msg = error_of([&] { gemm(Trans::N, Trans::N, 1.0f, A, A, 0.0f, none); });
  const auto cuda_msg =
      error_of([&] { gemm(Trans::N, Trans::N, 1.0f, to_device(A), to_device(A), 0.0f, dnone); });
  CHECK(!cpu_msg.empty());
  CHECK(cuda_msg == cpu_msg);
}

// ---- softmax ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: softmax and log_softmax, forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(4);
  const T ninf = -std::numeric_limits<T>::infinity();
  for (const Shape shape : {Shape{37, 1}, Shape{37, 7}, Shape{64, 64}, Shape{2, 5, 33},
                            Shape{9, 1000}, Shape{3, 4099}}) {
    CAPTURE(shape.str());
    auto x = scaled(random_tensor<T>(shape, rng), 8.0);
    // masked positions (-inf), leaving entry 0 of every row finite
    const index_t cols = shape.cols();
    for (index_t i = 0; i < x.numel(); ++i)
      if (i % cols != 0 && rng.uniform() < 0.2) x.data()[i] = ninf;
    auto dy = random_tensor<T>(shape, rng);
    const auto xd = to_device(x), dyd = to_device(dy);  // ...d: on the device

    Tensor<T> y, dx, ly, ldx;
    Tensor<T, cuda> yd, dxd, lyd, ldxd;
    softmax_forward(x, y);
    softmax_forward(xd, yd);
    check_close("softmax_forward", y, yd);
    const auto yh = to_host(yd);
    for (index_t i = 0; i < x.numel(); ++i)
      if (x.data()[i] == ninf) REQUIRE(yh.data()[i] == T(0));  // exactly 0 where masked
    softmax_backward(y, dy, dx);
    softmax_backward(yd, dyd, dxd);
    check_close("softmax_backward", dx, dxd);

    log_softmax_forward(x, ly);
    log_softmax_forward(xd, lyd);
    check_close("log_softmax_forward", ly, lyd);
    log_softmax_backward(ly, dy, ldx);
    log_softmax_backward(lyd, dyd, ldxd);
    check_close("log_softmax_backward", ldx, ldxd);

    // in place: y may be x, dx may be dy
    auto inplace = to_device(x);
    softmax_forward(inplace, inplace);
    check_close("softmax_forward in place", y, inplace);
    auto g = to_device(dy);
    softmax_backward(yd, g, g);
    check_close("softmax_backward in place", dx, g);
  }
}

TEST_CASE("cuda vs cpu: softmax rows without a finite maximum throw the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<float>& bad_row : {std::vector<float>{1, nan, 2, nan},
                                            std::vector<float>{1, inf, 2, 3},
                                            std::vector<float>{-inf, -inf, -inf, -inf}}) {
    std::vector<float> values(5 * 4, 0.5f);
    std::copy(bad_row.begin(), bad_row.end(), values.begin() + 3 * 4);
    auto x = Tensor<float>::from({5, 4}, values);
    Tensor<float> y;
    Tensor<float, cuda> dyy;
    const auto cpu_msg = error_of([&] { softmax_forward(x, y); });
    const auto cuda_msg = error_of([&] { softmax_forward(to_device(x), dyy); });
    CHECK(cpu_msg.find("row 3") != std::string::npos);
    CHECK(cuda_msg == cpu_msg);
    Tensor<float, cuda> dly;
    CHECK(error_of([&] { log_softmax_forward(to_device(x), dly); }) ==
          error_of([&] { Tensor<float> ly; log_softmax_forward(x, ly); }));
  }
}

// ---- topk -----------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: topk forward and backward (exact)", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(5);
  const T inf = std::numeric_limits<T>::infinity();
  for (const index_t e : {1, 3, 8, 64, 300}) {
    for (const index_t k : {1, 2, 4}) {
      if (k > e) continue;
      CAPTURE(e);
      CAPTURE(k);
      const index_t n = 301;
      // half the rows continuous, half drawn from {-inf, 0, 1, 2, +inf}: many ties
      auto x = random_tensor<T>({n, e}, rng);
      for (index_t r = 0; r < n; r += 2)
        for (index_t c = 0; c < e; ++c) {
          const std::uint32_t v = rng.uniform_int(5);
          x(r, c) = v == 0 ? -inf : v == 4 ? inf : static_cast<T>(v - 1);
        }
      Tensor<T> values;
      Tensor<std::int32_t> indices;
      topk_forward(x, k, values, indices);
      Tensor<T, cuda> dvalues_out;
      Tensor<std::int32_t, cuda> dindices;
      topk_forward(to_device(x), k, dvalues_out, dindices);
      check_equal("topk values", values, dvalues_out);
      check_equal("topk indices", indices, dindices);

      // backward with repeated indices in a row (summed in order)
      Tensor<std::int32_t> idx({n, k});
      for (index_t i = 0; i < idx.numel(); ++i)
        idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
      auto g = random_tensor<T>({n, k}, rng);
      Tensor<T> dx({n, e});
      Tensor<T, cuda> ddx(Shape{n, e});
      topk_backward(idx, g, dx);
      topk_backward(to_device(idx), to_device(g), ddx);
      check_equal("topk_backward dx", dx, ddx);
    }
  }
}

TEST_CASE("cuda vs cpu: topk bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto x = Tensor<float>::from({3, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, nan, 12});
  Tensor<float> v;
  Tensor<std::int32_t> i;
  Tensor<float, cuda> dv;
  Tensor<std::int32_t, cuda> di;
  const auto cpu_msg = error_of([&] { topk_forward(x, 2, v, i); });
  CHECK(cpu_msg.find("row 2, column 2") != std::string::npos);
  CHECK(error_of([&] { topk_forward(to_device(x), 2, dv, di); }) == cpu_msg);

  auto idx = Tensor<std::int32_t>::from({2, 2}, {0, 1, 4, 2});
  auto g = Tensor<float>::from({2, 2}, {1, 1, 1, 1});
  Tensor<float> dx({2, 4});
  Tensor<float, cuda> ddx(Shape{2, 4});
  const auto cpu_msg2 = error_of([&] { topk_backward(idx, g, dx); });
  CHECK(!cpu_msg2.empty());
  CHECK(error_of([&] { topk_backward(to_device(idx), to_device(g), ddx); }) == cpu_msg2);
}

// ---- dispatch / combine -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: dispatch plan, dispatch and combine, forward and backward", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(6);
  const index_t e = 8, d = 37;
  for (const index_t k : {1, 2, 4}) {
    for (const index_t n : {1, 300, 4096}) {
      for (const index_t used : {e, index_t(5)}) {  // used = 5: experts 5, 6, 7 get no token
        CAPTURE(k);
        CAPTURE(n);
        CAPTURE(used);
        auto idx = random_ids(n, k, used, rng);
        DispatchPlan plan;
        make_dispatch_plan(idx, e, plan);
        CudaDispatchPlan dplan;
        make_dispatch_plan(to_device(idx), e, dplan);
        CHECK(dplan.num_tokens == n);
        CHECK(dplan.k == k);
        CHECK(dplan.num_experts == e);
        check_equal("expert_offsets", plan.expert_offsets, dplan.expert_offsets);
        check_equal("slot_token", plan.slot_token, dplan.slot_token);
        check_equal("slot_source", plan.slot_source, dplan.slot_source);
        check_equal("source_slot", plan.source_slot, dplan.source_slot);
        CHECK(dplan.backend.host_offsets.to_vector() == plan.expert_offsets.to_vector());
        for (index_t x = 0; x < e; ++x) {
          CHECK(dplan.count(x) == plan.count(x));
          CHECK(dplan.offset(x) == plan.offset(x));
        }
        const auto slot_expert = to_host(dplan.backend.slot_expert);
        for (index_t s = 0; s < n * k; ++s)
          CHECK(slot_expert.data()[s] == idx.data()[plan.slot_source.data()[s]]);

        auto x = random_tensor<T>({n, d}, rng);
        Tensor<T> xs;
        Tensor<T, cuda> dxs;
        dispatch_forward(plan, x, xs);
        dispatch_forward(dplan, to_device(x), dxs);
        check_equal("dispatch_forward", xs, dxs);

        auto gxs = random_tensor<T>({n * k, d}, rng);
        Tensor<T> gx;
        Tensor<T, cuda> dgx;
        dispatch_backward(plan, gxs, gx);
        dispatch_backward(dplan, to_device(gxs), dgx);
        check_close("dispatch_backward", gx, dgx);

        auto ys = random_tensor<T>({n * k, d}, rng);
        auto gates = random_tensor<T>({n, k}, rng, 0.0, 1.0);
        Tensor<T> y;
        Tensor<T, cuda> dyv;
        combine_forward(plan, ys, gates, y);
        combine_forward(dplan, to_device(ys), to_device(gates), dyv);
        check_close("combine_forward", y, dyv);

        auto gy = random_tensor<T>({n, d}, rng);
        Tensor<T> gys, ggates;
        Tensor<T, cuda> dgys, dggates;
        combine_backward(plan, ys, gates, gy, gys, ggates);
        combine_backward(dplan, to_device(ys), to_device(gates), to_device(gy), dgys, dggates);
        check_close("combine_backward dys", gys, dgys);
        check_close("combine_backward dgates", ggates, dggates);
      }
    }
  }
}

// The expert bank's grouped ops against one CPU gemm / bias / column sum per expert, on a plan
// with empty experts and (E_bank < plan E) a capacity-drop bucket whose rows must stay untouched.
TEST_CASE_TEMPLATE("cuda vs cpu: grouped gemm, expert biases and expert column sums", T, float,
                   double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(61);
  const index_t n = 150, k = 2, e = 6, bank = 5, d = 13, f = 9;  // expert 5 = the drop bucket
  const auto idx = random_ids(n, k, e, rng);
  for (index_t i = 0; i < n * k; ++i)  // experts 1 and 3 get no rows
    if (idx.data()[i] == 1 || idx.data()[i] == 3) idx.data()[i] = 0;
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);
  CudaDispatchPlan dplan;
  make_dispatch_plan(to_device(idx), e, dplan);
  const index_t rows = plan.offset(bank);
  REQUIRE(rows > 0);
  REQUIRE(rows < n * k);

  const auto x = random_tensor<T>({n * k, d}, rng), w = random_tensor<T>({bank, f, d}, rng);
  const auto dy = random_tensor<T>({n * k, f}, rng);
  const auto dx = to_device(x), dw = to_device(w), ddy = to_device(dy);
  for (const bool transposed : {false, true}) {
    CAPTURE(transposed);
    // forward form: H_e = X_e W_e^T; backward forms: dX_e = dY_e W_e, dW_e += dY_e^T X_e
    auto h = random_tensor<T>({n * k, f}, rng), gx = random_tensor<T>({n * k, d}, rng);
    auto gw = random_tensor<T>({bank, f, d}, rng);
    auto dh = to_device(h), dgx = to_device(gx), dgw = to_device(gw);
    std::vector<Tensor<T, cuda>> a, b, c, a2, b2, c2, a3, b3, c3;
    for (index_t x_e = 0; x_e < bank; ++x_e) {
      const index_t r0 = plan.offset(x_e), r1 = plan.offset(x_e + 1);
      Tensor<T> hs = h.slice(r0, r1), gxs = gx.slice(r0, r1), gws = gw[x_e];
      if (!transposed) {
        gemm(Trans::N, Trans::T, T(1), x.slice(r0, r1), w[x_e], T(0), hs);
        a.push_back(dx.slice(r0, r1)), b.push_back(dw[x_e]), c.push_back(dh.slice(r0, r1));
      } else {
        gemm(Trans::N, Trans::N, T(1), dy.slice(r0, r1), w[x_e], T(0), gxs);
        gemm(Trans::T, Trans::N, T(0.5), dy.slice(r0, r1), x.slice(r0, r1), T(1), gws);
        a2.push_back(ddy.slice(r0, r1)), b2.push_back(dw[x_e]), c2.push_back(dgx.slice(r0, r1));
        a3.push_back(ddy.slice(r0, r1)), b3.push_back(dx.slice(r0, r1)), c3.push_back(dgw[x_e]);
      }
    }
    if (!transposed) {
      grouped_gemm(Trans::N, Trans::T, T(1), a, b, T(0), c);
      check_close("grouped gemm N T", h, dh);
    } else {
      grouped_gemm(Trans::N, Trans::N, T(1), a2, b2, T(0), c2);
      grouped_gemm(Trans::T, Trans::N, T(0.5), a3, b3, T(1), c3);
      check_close("grouped gemm N N", gx, dgx);
      check_close("grouped gemm T N, beta = 1", gw, dgw);
    }
  }

  // Biases per expert row and column sums per expert.
  const auto bias = random_tensor<T>({bank, f}, rng);
  auto y = random_tensor<T>({n * k, f}, rng);
  auto db = random_tensor<T>({bank, f}, rng);
  auto dyv = to_device(y), ddb = to_device(db);
  for (index_t x_e = 0; x_e < bank; ++x_e) {
    const index_t r0 = plan.offset(x_e), r1 = plan.offset(x_e + 1);
    if (r1 == r0) continue;
    Tensor<T> ys = y.slice(r0, r1), dbs = db[x_e];
    add_row_vector(bias[x_e], ys);
    accumulate_column_sums(dy.slice(r0, r1), dbs);
  }
  add_expert_rows(to_device(bias), dplan, dyv.slice(0, rows));
  accumulate_expert_column_sums(ddy.slice(0, rows), dplan, ddb);
  check_close("add_expert_rows (drop bucket untouched)", y, dyv);
  check_close("accumulate_expert_column_sums", db, ddb);

  // Bad input: mismatched lists, a C of the wrong shape, more rows than the experts cover.
  std::vector<Tensor<T, cuda>> one{dx.slice(0, 2)}, none;
  CHECK(error_of([&] { grouped_gemm(Trans::N, Trans::T, T(1), one, none, T(0), none); })
            .find("got 1 A, 0 B and 0 C matrices") != std::string::npos);
  std::vector<Tensor<T, cuda>> wb{dw[0]}, bad_c{Tensor<T, cuda>(Shape{2, f + 1})};
  CHECK(error_of([&] { grouped_gemm(Trans::N, Trans::T, T(1), one, wb, T(0), bad_c); })
            .find("C has shape (2, 10)") != std::string::npos);
  CHECK(error_of([&] {
          add_expert_rows(to_device(bias), dplan, Tensor<T, cuda>(Shape{n * k + 1, f}));
        }).find("y covers 301 rows and 5 experts; the plan has 300 slots") != std::string::npos);
}

TEST_CASE("cuda vs cpu: dispatch plan reuse and bad expert ids") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(7);
  CudaDispatchPlan dplan;
  DispatchPlan plan;
  for (int round = 0; round < 3; ++round) {  // rebuilt into the same plan
    auto idx = random_ids(50, 2, 6, rng);
    make_dispatch_plan(idx, 6, plan);
    make_dispatch_plan(to_device(idx), 6, dplan);
    check_equal("slot_source after rebuild", plan.slot_source, dplan.slot_source);
    check_equal("source_slot after rebuild", plan.source_slot, dplan.source_slot);
  }
  for (const std::int32_t bad : {-1, 6, 1000}) {
    CAPTURE(bad);
    auto idx = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 3, bad, 5});
    const auto cpu_msg = error_of([&] { make_dispatch_plan(idx, 6, plan); });
    CHECK(cpu_msg.find("token 2, choice 0") != std::string::npos);
    CHECK(error_of([&] { make_dispatch_plan(to_device(idx), 6, dplan); }) == cpu_msg);
    Tensor<float, cuda> xs;
    CHECK(error_of([&] { dispatch_forward(dplan, Tensor<float, cuda>(Shape{3, 4}), xs); })
              .find("not built by make_dispatch_plan") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: the padded dispatch plan, dispatch and combine", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(8);
  const index_t d = 7;
  // (n, k, E, C): one thread's share of several ids, experts over and under C, empty experts
  for (const auto& [n, k, e, cap] : std::vector<std::array<index_t, 4>>{
           {5, 2, 4, 1}, {300, 2, 5, 100}, {1200, 1, 3, 500}, {97, 3, 8, 20}}) {
    CAPTURE(n);
    CAPTURE(e);
    CAPTURE(cap);
    auto idx = random_ids(n, k, e > 3 ? e - 1 : e, rng);  // with E > 3 the last expert is empty
    // the capacity mask decides keep (as the selector does), then a few more drops
    Tensor<std::uint8_t> keep;
    capacity_mask(idx, e, cap, keep);
    for (index_t a = 0; a < n * k; a += 7) keep.data()[a] = 0;
    DispatchPlan plan;
    CudaDispatchPlan dplan;
    for (int rebuild = 0; rebuild < 2; ++rebuild) {
      make_padded_dispatch_plan(idx, keep, e, cap, plan);
      make_padded_dispatch_plan(to_device(idx), to_device(keep), e, cap, dplan);
    }
    CHECK(dplan.capacity == cap);
    CHECK(dplan.k == k);
    check_equal("expert_offsets", plan.expert_offsets, dplan.expert_offsets);
    check_equal("slot_token", plan.slot_token, dplan.slot_token);
    check_equal("slot_source", plan.slot_source, dplan.slot_source);
    check_equal("source_slot", plan.source_slot, dplan.source_slot);
    CHECK(dplan.backend.host_offsets.to_vector() == plan.expert_offsets.to_vector());
    const auto slot_expert = to_host(dplan.backend.slot_expert);
    for (index_t s = 0; s < e * cap; ++s) CHECK(slot_expert.data()[s] == s / cap);

    const index_t slots = e * cap;
    auto x = random_tensor<T>({n, d}, rng);
    Tensor<T> xs;
    Tensor<T, cuda> dxs(Shape{slots, d});
    fill(dxs, T(7));  // every row is written, zero rows included
    dispatch_forward(plan, x, xs);
    dispatch_forward(dplan, to_device(x), dxs);
    check_equal("dispatch_forward", xs, dxs);
    auto gxs = random_tensor<T>({slots, d}, rng);
    Tensor<T> gx;
    Tensor<T, cuda> dgx;
    dispatch_backward(plan, gxs, gx);
    dispatch_backward(dplan, to_device(gxs), dgx);
    check_close("dispatch_backward", gx, dgx);
    auto ys = random_tensor<T>({slots, d}, rng);
    auto gates = random_tensor<T>({n, k}, rng, 0.0, 1.0);
    Tensor<T> y;
    Tensor<T, cuda> dyv;
    combine_forward(plan, ys, gates, y);
    combine_forward(dplan, to_device(ys), to_device(gates), dyv);
    check_close("combine_forward", y, dyv);
    auto gy = random_tensor<T>({n, d}, rng);
    Tensor<T> gys, ggates;
    Tensor<T, cuda> dgys(Shape{slots, d}), dggates(Shape{n, k});
    fill(dgys, T(7));
    fill(dggates, T(7));
    combine_backward(plan, ys, gates, gy, gys, ggates);
    combine_backward(dplan, to_device(ys), to_device(gates), to_device(gy), dgys, dggates);
    check_close("combine_backward dys", gys, dgys);
    check_close("combine_backward dgates", ggates, dggates);
  }
}

TEST_CASE("cuda vs cpu: the padded plan's errors, at once and deferred, and no read to the host") {
  SKIP_WITHOUT_CUDA_DEVICE();
  const auto idx = Tensor<std::int32_t>::from({3, 2}, {0, 1, 0, 7, 0, 1});
  const auto all = Tensor<std::uint8_t>::from({3, 2}, {1, 1, 1, 1, 1, 1});
  const auto drop = Tensor<std::uint8_t>::from({3, 2}, {1, 1, 1, 0, 1, 1});
  for (const index_t cap : {1, 2}) {  // cap 1: over capacity first (token 1, choice 0); 2: id 7
    CAPTURE(cap);
    DispatchPlan plan;
    const auto cpu_msg = error_of([&] { make_padded_dispatch_plan(idx, all, 3, cap, plan); });
    CHECK(!cpu_msg.empty());
    CudaDispatchPlan dplan;
    CHECK(error_of([&] {
            make_padded_dispatch_plan(to_device(idx), to_device(all), 3, cap, dplan);
          }) == cpu_msg);
    CHECK(error_of([&] {
            with_deferred_checks(cuda{}, [&] {
              make_padded_dispatch_plan(to_device(idx), to_device(all), 3, cap, dplan);
            });
          }) == cpu_msg);
  }
  // a valid plan in a deferred scope: no copy to the host until the scope's end
  const auto d_idx = to_device(idx);
  const auto d_drop = to_device(drop);
  CudaDispatchPlan dplan;
  with_deferred_checks(cuda{}, [&] {
#if defined(GRAPHMOE_CUDA_EMULATION)
    const auto before = graphmoe_cuda_emulation::counters();
    make_padded_dispatch_plan(d_idx, d_drop, 3, 3, dplan);
    const auto after = graphmoe_cuda_emulation::counters();
    CHECK(after.copies_to_host == before.copies_to_host);
    CHECK(after.async_copies_to_host == before.async_copies_to_host);
    CHECK(after.kernel_launches - before.kernel_launches == 1);
#else
    make_padded_dispatch_plan(d_idx, d_drop, 3, 3, dplan);
#endif
  });
  CHECK(dplan.backend.host_offsets.to_vector() == std::vector<std::int32_t>{0, 3, 6, 9});
  CHECK(to_host(dplan.source_slot).to_vector() == std::vector<std::int32_t>{0, 3, 1, -1, 2, 4});
}

}  // namespace graphmoe
