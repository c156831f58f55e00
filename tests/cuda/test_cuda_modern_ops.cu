// Cross-backend tests of the CUDA backend's rmsnorm, rope and swiglu: every op runs forward and
// backward, in float and double, on random inputs on the CPU backend, the reference, and on the
// CUDA backend, and the results are compared (tests/cuda/cuda_test_support.cuh):
//
//   error metric   err = max_i |cuda_i - cpu_i| / max_i |cpu_i|     (normwise, L-infinity)
//   tolerance      float 1e-5, double 1e-12 (rmsnorm's row sums in T on the GPU, in double on
//                  the CPU; rope's angles in double on both; CUDA's expf within a few ulp);
//                  rmsnorm dx and dweight in float 2e-5 (sums of up to a few hundred rows in fp32;
//                  dx with D = 1 1e-3: there it is a cancellation, r g (1 - x^2 r^2))
//   determinism    rmsnorm's dweight is bit-identical over runs
//   aliasing       y = x, dx = dy (rmsnorm, rope), dgu = gu (swiglu)
//   16-bit         bf16 and half storage (fp32 math) against the CPU op in float on the same
//                  rounded inputs: 2e-2 (bf16), 4e-3 (half)
//   error messages the CUDA op throws the CPU op's message (a negative position too, also from a
//                  deferred check), compared as strings
//
// Without a CUDA device every case prints "skipped: no CUDA device" and passes: the file is
// compiled by nvcc in CI and runs in full on a GPU machine (and under the CPU emulation as
// test_emu_cuda_modern_ops).
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/heads.cuh"
#include "graphmoe/backend/cuda/rmsnorm.cuh"
#include "graphmoe/backend/cuda/rope.cuh"
#include "graphmoe/backend/cuda/swiglu.cuh"
#include "graphmoe/core/deferred_check.hpp"
#include "graphmoe/ops/heads.hpp"
#include "graphmoe/ops/rmsnorm.hpp"
#include "graphmoe/ops/rope.hpp"
#include "graphmoe/ops/swiglu.hpp"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

// Everything lives in namespace graphmoe: with `using namespace graphmoe;` at global scope the
// backend tag `cuda` would be ambiguous with CCCL's `namespace cuda` (libcu++).
namespace graphmoe {
using namespace graphmoe::test;

namespace {

template <class T>
double grad_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

Tensor<std::int32_t> positions_for(index_t n, Rng& rng, std::uint32_t max_pos) {
  Tensor<std::int32_t> p(Shape{n});
  for (index_t i = 0; i < n; ++i)
    p.data()[i] = static_cast<std::int32_t>(rng.uniform_int(max_pos));
  if (n > 0) p.data()[0] = 0;
  return p;
}

const RopeLayout kLayouts[] = {RopeLayout::HalfSplit, RopeLayout::Interleaved};

// x rounded to H on the device, and back to float on the host (the reference's inputs).
template <class H>
Tensor<float> rounded_to(const Tensor<float>& x) {
  return to_host(converted<float>(converted<H>(to_device(x))));
}

template <class H>
void check_close_16(const std::string& what, const Tensor<float>& ref, const Tensor<H, cuda>& got) {
  const double tol = std::is_same_v<H, __nv_bfloat16> ? 2e-2 : 4e-3;
  check_close(what, ref, converted<float>(got), tol);
}

}  // namespace

// ---- rmsnorm ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: rmsnorm forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(71);
  for (const Shape shape : {Shape{1, 1}, Shape{200, 1}, Shape{37, 7}, Shape{64, 64},
                            Shape{2, 5, 33}, Shape{130, 256}, Shape{3, 1031}}) {
    CAPTURE(shape.str());
    const index_t d = shape.cols();
    auto x = random_tensor<T>(shape, rng, -2.0, 3.0);
    auto w = random_tensor<T>({d}, rng, 0.5, 1.5);
    const double eps = 1e-6;
    const auto xd = to_device(x), wd = to_device(w);

    Tensor<T> y, r;
    Tensor<T, cuda> yd, rd;
    rmsnorm_forward(x, w, eps, y, r);
    rmsnorm_forward(xd, wd, eps, yd, rd);
    check_close("rmsnorm_forward y", y, yd);
    check_close("rmsnorm_forward inv_rms", r, rd);

    auto inplace = to_device(x);  // y may alias x
    Tensor<T, cuda> r2;
    rmsnorm_forward(inplace, wd, eps, inplace, r2);
    check_close("rmsnorm_forward in place", y, inplace);

    auto dy = random_tensor<T>(shape, rng);
    auto dw = random_tensor<T>({d}, rng);
    auto dwd = to_device(dw);  // accumulated onto
    const auto dyd = to_device(dy);
    Tensor<T> dx;
    Tensor<T, cuda> dxd;
    rmsnorm_backward(x, w, r, dy, dx, dw);
    rmsnorm_backward(xd, wd, rd, dyd, dxd, dwd);
    const double tol = grad_tolerance<T>();
    // D = 1: dx = r g eps / (x^2 + eps) is all cancellation (1 - x^2 r^2), far from a row's scale
    check_close("rmsnorm_backward dx", dx, dxd, d == 1 && std::is_same_v<T, float> ? 1e-3 : tol);
    check_close("rmsnorm_backward dweight (accumulated)", dw, dwd, tol);

    // an empty dweight is allocated as zeros; the same bits on every run; dx may alias dy
    Tensor<T, cuda> dw1, dw2, dx1;
    rmsnorm_backward(xd, wd, rd, dyd, dx1, dw1);
    auto g = to_device(dy);
    rmsnorm_backward(xd, wd, rd, g, g, dw2);
    check_equal("rmsnorm dweight, run to run", to_host(dw1), dw2);
    check_equal("rmsnorm_backward dx in place", to_host(dx1), g);
    Tensor<T> dw0, dx0;
    rmsnorm_backward(x, w, r, dy, dx0, dw0);
    check_close("rmsnorm_backward dweight (from zero)", dw0, dw1, tol);
  }
}

TEST_CASE("cuda vs cpu: rmsnorm bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(72);
  auto x = random_tensor<float>({4, 6}, rng);
  auto w = random_tensor<float>({6}, rng);
  const auto xd = to_device(x), wd = to_device(w);
  Tensor<float> y, r;
  Tensor<float, cuda> yd, rd;
  std::string cpu_msg = error_of([&] { rmsnorm_forward(x, w, 0.0, y, r); });
  CHECK(cpu_msg.find("rmsnorm_forward") != std::string::npos);
  CHECK(error_of([&] { rmsnorm_forward(xd, wd, 0.0, yd, rd); }) == cpu_msg);
  cpu_msg = error_of([&] { rmsnorm_forward(x, Tensor<float>({5}), 1e-5, y, r); });
  CHECK(error_of([&] { rmsnorm_forward(xd, Tensor<float, cuda>(Shape{5}), 1e-5, yd, rd); }) ==
        cpu_msg);
  rmsnorm_forward(x, w, 1e-5, y, r);
  rmsnorm_forward(xd, wd, 1e-5, yd, rd);
  Tensor<float> dx, dw;
  Tensor<float, cuda> dxd, dwd;
  cpu_msg = error_of([&] { rmsnorm_backward(x, w, r, Tensor<float>({6, 4}), dx, dw); });
  CHECK(cpu_msg.find("rmsnorm_backward: dy has shape (6, 4)") != std::string::npos);
  CHECK(error_of([&] { rmsnorm_backward(xd, wd, rd, Tensor<float, cuda>(Shape{6, 4}), dxd, dwd); }) ==
        cpu_msg);
}

// ---- rope ---------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: rope forward and backward, both layouts", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(73);
  struct Case {
    Shape shape;
    index_t heads;
  };
  for (const Case c : {Case{Shape{1, 2}, 1}, Case{Shape{7, 3, 16}, 2}, Case{Shape{33, 64}, 4},
                       Case{Shape{130, 6 * 64}, 6}, Case{Shape{5, 2 * 128}, 2}}) {
    CAPTURE(c.shape.str());
    const index_t n = c.shape.numel() / c.shape.cols();
    const auto pos = positions_for(n, rng, 8192);
    const auto posd = to_device(pos);
    auto x = random_tensor<T>(c.shape, rng);
    const auto xd = to_device(x);
    for (const RopeLayout layout : kLayouts) {
      for (const double theta : {10000.0, 1000000.0}) {
        CAPTURE(static_cast<int>(layout));
        CAPTURE(theta);
        Tensor<T> y, dx;
        Tensor<T, cuda> yd, dxd;
        rope_forward(x, pos, c.heads, theta, layout, y);
        rope_forward(xd, posd, c.heads, theta, layout, yd);
        check_close("rope_forward y", y, yd);
        rope_backward(x, pos, c.heads, theta, layout, dx);
        rope_backward(xd, posd, c.heads, theta, layout, dxd);
        check_close("rope_backward dx", dx, dxd);
        auto inplace = to_device(x);  // y may alias x, dx may alias dy
        rope_forward(inplace, posd, c.heads, theta, layout, inplace);
        check_close("rope_forward in place", y, inplace);
        rope_backward(inplace, posd, c.heads, theta, layout, inplace);
        check_close("rope forward then backward", x, inplace);
      }
    }
  }
}

TEST_CASE("cuda vs cpu: rope bad input throws the CPU message, also deferred") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(74);
  auto x = random_tensor<float>({4, 12}, rng);
  const auto xd = to_device(x);
  auto neg = Tensor<std::int32_t>::from({4}, {0, 3, -2, -7});
  const auto negd = to_device(neg);
  Tensor<float> y;
  Tensor<float, cuda> yd;
  std::string cpu_msg =
      error_of([&] { rope_forward(x, neg, 2, 10000.0, RopeLayout::HalfSplit, y); });
  CHECK(cpu_msg.find("rope_forward: position -2 at flat position 2") != std::string::npos);
  CHECK(error_of([&] { rope_forward(xd, negd, 2, 10000.0, RopeLayout::HalfSplit, yd); }) ==
        cpu_msg);
  CHECK(error_of([&] {
          with_deferred_checks(graphmoe::cuda{}, [&] {
            Tensor<float, cuda> yy;
            rope_forward(xd, negd, 2, 10000.0, RopeLayout::HalfSplit, yy);
          });
        }) == cpu_msg);
  cpu_msg = error_of([&] { rope_backward(x, neg, 3, 10000.0, RopeLayout::Interleaved, y); });
  CHECK(cpu_msg.find("rope_backward: position -2") != std::string::npos);
  CHECK(error_of([&] { rope_backward(xd, negd, 3, 10000.0, RopeLayout::Interleaved, yd); }) ==
        cpu_msg);
  const auto pos = to_device(Tensor<std::int32_t>::from({4}, {0, 1, 2, 3}));
  cpu_msg = error_of([&] {
    rope_forward(x, Tensor<std::int32_t>::from({4}, {0, 1, 2, 3}), 4, 10000.0,
                 RopeLayout::HalfSplit, y);
  });
  CHECK(cpu_msg.find("rope_forward: the head dimension dh = 3") != std::string::npos);
  CHECK(error_of([&] { rope_forward(xd, pos, 4, 10000.0, RopeLayout::HalfSplit, yd); }) ==
        cpu_msg);
}

// ---- concat_heads / split_heads (multi-head latent attention's joins) ---------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: concat_heads and split_heads, the same bits", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(76);
  for (const auto& [n, heads, wa, wb] : std::vector<std::array<index_t, 4>>{
           {1, 1, 1, 1}, {7, 3, 2, 5}, {33, 16, 48, 16}, {5, 1, 512, 64}}) {
    CAPTURE(n);
    CAPTURE(heads);
    const auto a = random_tensor<T>(Shape{n, heads * wa}, rng);
    const auto b = random_tensor<T>(Shape{n, heads * wb}, rng);
    Tensor<T> y;
    Tensor<T, cuda> yd;
    concat_heads(a, b, heads, y);
    concat_heads(to_device(a), to_device(b), heads, yd);
    CHECK(to_host(yd).to_vector() == y.to_vector());
    Tensor<T> a2, b2;
    Tensor<T, cuda> a2d, b2d;
    split_heads(y, heads, wa, a2, b2);
    split_heads(yd, heads, wa, a2d, b2d);
    CHECK(to_host(a2d).to_vector() == a.to_vector());
    CHECK(to_host(b2d).to_vector() == b2.to_vector());
  }
  std::string cpu_msg = error_of([&] {
    Tensor<float> a, b;
    split_heads(Tensor<float>({2, 6}), 3, 2, a, b);
  });
  std::string dev_msg = error_of([&] {
    Tensor<float, cuda> a, b;
    split_heads(Tensor<float, cuda>({2, 6}), 3, 2, a, b);
  });
  CHECK(!cpu_msg.empty());
  CHECK(dev_msg == cpu_msg);
}

// ---- swiglu -------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: swiglu forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(75);
  for (const Shape shape : {Shape{1, 2}, Shape{37, 14}, Shape{2, 5, 66}, Shape{130, 512}}) {
    CAPTURE(shape.str());
    auto gu = random_tensor<T>(shape, rng, -8.0, 8.0);
    gu.data()[0] = T(-200);  // far into both tails: finite on both backends
    if (gu.numel() > 3) gu.data()[1] = T(200);
    const auto gud = to_device(gu);
    Tensor<T> h;
    Tensor<T, cuda> hd;
    swiglu_forward(gu, h);
    swiglu_forward(gud, hd);
    check_close("swiglu_forward h", h, hd);
    auto dh = random_tensor<T>(h.shape(), rng);
    const auto dhd = to_device(dh);
    Tensor<T> dgu;
    Tensor<T, cuda> dgud;
    swiglu_backward(gu, dh, dgu);
    swiglu_backward(gud, dhd, dgud);
    check_close("swiglu_backward dgu", dgu, dgud);
    auto inplace = to_device(gu);  // dgu may alias gu
    swiglu_backward(inplace, dhd, inplace);
    check_close("swiglu_backward in place", dgu, inplace);
  }
}

TEST_CASE("cuda vs cpu: swiglu bad input throws the CPU message") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Tensor<float> h, dgu;
  Tensor<float, cuda> hd, dgud;
  std::string cpu_msg = error_of([&] { swiglu_forward(Tensor<float>({3, 5}), h); });
  CHECK(cpu_msg.find("swiglu_forward") != std::string::npos);
  CHECK(error_of([&] { swiglu_forward(Tensor<float, cuda>(Shape{3, 5}), hd); }) == cpu_msg);
  cpu_msg = error_of([&] { swiglu_backward(Tensor<float>({3, 4}), Tensor<float>({3, 3}), dgu); });
  CHECK(error_of([&] {
          swiglu_backward(Tensor<float, cuda>(Shape{3, 4}), Tensor<float, cuda>(Shape{3, 3}), dgud);
        }) == cpu_msg);
}

// ---- 16-bit storage -----------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: rmsnorm, rope and swiglu in bf16 and half", H, __nv_bfloat16,
                   __half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(76);
  const index_t n = 45, heads = 4, dh = 32, d = heads * dh;
  const auto x = rounded_to<H>(random_tensor<float>({n, d}, rng, -2.0, 2.0));
  const auto w = rounded_to<H>(random_tensor<float>({d}, rng, 0.5, 1.5));
  const auto dy = rounded_to<H>(random_tensor<float>({n, d}, rng));
  const auto xh = converted<H>(to_device(x)), wh = converted<H>(to_device(w));
  const auto dyh = converted<H>(to_device(dy));

  Tensor<float> y, r, dx, dw;
  Tensor<H, cuda> yh, rh, dxh, dwh;
  rmsnorm_forward(x, w, 1e-6, y, r);
  rmsnorm_forward(xh, wh, 1e-6, yh, rh);
  check_close_16("rmsnorm_forward y (16-bit)", y, yh);
  check_close_16("rmsnorm_forward inv_rms (16-bit)", r, rh);
  rmsnorm_backward(x, w, r, dy, dx, dw);
  rmsnorm_backward(xh, wh, rh, dyh, dxh, dwh);
  check_close_16("rmsnorm_backward dx (16-bit)", dx, dxh);
  check_close_16("rmsnorm_backward dweight (16-bit)", dw, dwh);

  const auto pos = positions_for(n, rng, 4096);
  const auto posd = to_device(pos);
  for (const RopeLayout layout : kLayouts) {
    Tensor<float> ry, rdx;
    Tensor<H, cuda> ryh, rdxh;
    rope_forward(x, pos, heads, 10000.0, layout, ry);
    rope_forward(xh, posd, heads, 10000.0, layout, ryh);
    check_close_16("rope_forward (16-bit)", ry, ryh);
    rope_backward(dy, pos, heads, 10000.0, layout, rdx);
    rope_backward(dyh, posd, heads, 10000.0, layout, rdxh);
    check_close_16("rope_backward (16-bit)", rdx, rdxh);
  }

  Tensor<float> h, dgu;
  Tensor<H, cuda> hh, dguh;
  swiglu_forward(x, h);
  swiglu_forward(xh, hh);
  check_close_16("swiglu_forward (16-bit)", h, hh);
  const auto dhh = rounded_to<H>(random_tensor<float>(h.shape(), rng));
  swiglu_backward(x, dhh, dgu);
  swiglu_backward(xh, converted<H>(to_device(dhh)), dguh);
  check_close_16("swiglu_backward (16-bit)", dgu, dguh);
}

}  // namespace graphmoe
