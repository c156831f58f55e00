// 16-bit storage on the CUDA backend: Tensor<__nv_bfloat16, cuda> and Tensor<__half, cuda>, with
// fp32 math in every op (detail::acc_t), against the CPU backend in float.
//
// Every cross-backend case draws float inputs, rounds them to H (bf16 or half) on the host, and
// gives the SAME rounded values to both sides: the CUDA op gets them as H, the CPU op gets them
// widened back to float (exactly). The CUDA result is widened to float and compared with
//
//   error metric   err = max_i |cuda_i - cpu_i| / max_i |cpu_i|     (normwise, L-infinity)
//   tolerance      bf16 1e-2, half 2e-3
//
// Why these bounds: with identical inputs, the only differences are (a) fp32 arithmetic in a
// different order (relative ~1e-6, K = 1408 GEMM sums included) and (b) the rounding of each
// stored output to H, at most u |cpu_i| <= u max_i |cpu_i| with u the unit roundoff: bf16 keeps 8
// significant bits, u = 2^-8 = 3.9e-3; half keeps 11, u = 2^-11 = 4.9e-4. So err <= u + ~1e-6 for
// every op that rounds once, and the tolerances (2.56 u for bf16, 4.1 u for half) also cover
// topk_backward with a repeated index (the partial sum is stored, then added to). layernorm's
// backward with its cache in H reads a rounded rstd, which enters dx up to cubed: 5 u there
// (2e-2 bf16, 3e-3 half; see check_layernorm; the inputs have |mean| << std, so the rounded mean
// adds little). Exact equality is required where the op only compares and copies (topk forward,
// dispatch_forward, fill), and for the conversions, which are checked bit for bit against the
// definition of round to nearest even.
//
// The conversion cases marked "(host)" need no GPU: they check detail::value_cast, the function
// every kernel rounds with, against an exact decoding of the 16-bit formats. The others print
// "skipped: no CUDA device" and pass without a GPU.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "graphmoe/ops/dispatch.hpp"
#include "graphmoe/ops/elementwise.hpp"
#include "graphmoe/ops/gelu.hpp"
#include "graphmoe/ops/gemm.hpp"
#include "graphmoe/ops/layernorm.hpp"
#include "graphmoe/ops/softmax.hpp"
#include "graphmoe/ops/topk.hpp"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/dispatch.cuh"
#include "graphmoe/backend/cuda/elementwise.cuh"
#include "graphmoe/backend/cuda/gelu.cuh"
#include "graphmoe/backend/cuda/gemm.cuh"
#include "graphmoe/backend/cuda/layernorm.cuh"
#include "graphmoe/backend/cuda/softmax.cuh"
#include "graphmoe/backend/cuda/topk.cuh"
#include "cuda/cuda_test_support.cuh"
#include "support/gradcheck.hpp"

// Everything lives in namespace graphmoe (see test_cuda_ops.cu: `cuda` would be ambiguous).
namespace graphmoe {
using namespace graphmoe::test;

namespace {

using bf16 = __nv_bfloat16;
using half = __half;

template <class H>
constexpr bool is_bf16 = std::is_same_v<H, bf16>;

template <class H>
const char* half_name() {
  return is_bf16<H> ? "bf16" : "half";
}

// 2.56 u (bf16) and 4.1 u (half): see the comment at the top of the file.
template <class H>
double half_tolerance() {
  return is_bf16<H> ? 1e-2 : 2e-3;
}

// ---- exact decoding of the 16-bit formats, the reference for the conversions --------------------

struct Format {
  int mant_bits;  // stored fraction bits
  int exp_bits;
  int bias;
};

template <class H>
constexpr Format format_of() {
  return is_bf16<H> ? Format{7, 8, 127} : Format{10, 5, 15};
}

template <class H>
std::uint16_t bits_of(H h) {
  return std::bit_cast<std::uint16_t>(h);
}

template <class H>
H from_bits(std::uint16_t b) {
  return std::bit_cast<H>(b);
}

// The magnitude of the pattern's low 15 bits, reading the all-ones exponent as one more binade
// (the pattern just above the largest finite value decodes to 2^(emax + 1): the point beyond
// which round to nearest gives infinity, ties included, is halfway to it).
double magnitude_as_finite(std::uint16_t mag, Format f) {
  const int e = mag >> f.mant_bits;
  const int frac = mag & ((1 << f.mant_bits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(frac), 1 - f.bias - f.mant_bits);
  return std::ldexp(static_cast<double>(frac + (1 << f.mant_bits)), e - f.bias - f.mant_bits);
}

bool is_nan_pattern(std::uint16_t b, Format f) {
  const int exp_all = (1 << f.exp_bits) - 1;
  return ((b & 0x7FFF) >> f.mant_bits) == exp_all && (b & ((1 << f.mant_bits) - 1)) != 0;
}

bool is_inf_pattern(std::uint16_t b, Format f) {
  const int exp_all = (1 << f.exp_bits) - 1;
  return (b & 0x7FFF) == (exp_all << f.mant_bits);
}

// The exact value of a 16-bit pattern (NaN, +-inf, +-0 and subnormals included).
double decode(std::uint16_t b, Format f) {
  if (is_nan_pattern(b, f)) return std::numeric_limits<double>::quiet_NaN();
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  if (is_inf_pattern(b, f)) return sign * std::numeric_limits<double>::infinity();
  return sign * magnitude_as_finite(static_cast<std::uint16_t>(b & 0x7FFF), f);
}

// Whether r is x rounded to nearest, ties to even, in format f ("" if so, else why not).
std::string rne_violation(double x, std::uint16_t r, Format f) {
  if (std::isnan(x)) return is_nan_pattern(r, f) ? "" : "NaN did not stay NaN";
  if (is_nan_pattern(r, f)) return "a number became NaN";
  if (std::signbit(x) != ((r & 0x8000) != 0)) return "the sign changed";
  const double ax = std::fabs(x);
  const std::uint16_t mag = static_cast<std::uint16_t>(r & 0x7FFF);
  if (std::isinf(x)) return is_inf_pattern(r, f) ? "" : "inf did not stay inf";
  // r's magnitude and its two neighbours (the one above the largest finite value is 2^(emax+1))
  const double v = magnitude_as_finite(mag, f);
  const double dist = std::fabs(ax - v);
  if (mag > 0) {
    const auto next = static_cast<std::uint16_t>(mag - 1);
    const double below = std::fabs(ax - magnitude_as_finite(next, f));
    if (below < dist) return "the neighbour below is nearer";
    if (below == dist && (mag & 1)) return "a tie went to the odd neighbour (below is even)";
  }
  if (!is_inf_pattern(r, f)) {
    const auto next = static_cast<std::uint16_t>(mag + 1);
    const double above = std::fabs(ax - magnitude_as_finite(next, f));
    if (above < dist) return "the neighbour above is nearer";
    if (above == dist && (mag & 1)) return "a tie went to the odd neighbour (above is even)";
  }
  return "";
}

// Inputs for the rounding checks: every tie and its two neighbours in the float grid for a spread
// of binades (normal and subnormal results, the overflow threshold), signed zeros, infinities,
// NaN, and random float bit patterns.
template <class H>
std::vector<float> rounding_inputs(Rng& rng) {
  const Format f = format_of<H>();
  std::vector<float> v = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min()};
  const int exp_all = (1 << f.exp_bits) - 1;
  for (int e = 0; e < exp_all; e += (e < 4 || e > exp_all - 4) ? 1 : 3) {
    for (int frac : {0, 1, 2, 3, (1 << f.mant_bits) - 2, (1 << f.mant_bits) - 1}) {
      const std::uint16_t lo = static_cast<std::uint16_t>((e << f.mant_bits) | frac);
      const double a = magnitude_as_finite(lo, f);
      const double b = magnitude_as_finite(static_cast<std::uint16_t>(lo + 1), f);
      const float tie = static_cast<float>((a + b) / 2);  // exact: at most 12 significant bits
      for (const float t : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e30f)}) {
        v.push_back(t);
        v.push_back(-t);
      }
      v.push_back(static_cast<float>(a));
    }
  }
  for (int i = 0; i < 20000; ++i) {
    const float x = std::bit_cast<float>(rng.next_u32());
    v.push_back(x);
  }
  return v;
}

// Doubles whose rounding through float would differ from a direct rounding (double rounding):
// just above and below a tie by less than half a float ulp.
template <class H>
std::vector<double> double_rounding_inputs() {
  const Format f = format_of<H>();
  std::vector<double> v;
  for (int e : {1, f.bias - 3, f.bias, f.bias + 5}) {
    for (int frac : {0, 1, 6}) {
      const std::uint16_t lo = static_cast<std::uint16_t>((e << f.mant_bits) | frac);
      const double a = magnitude_as_finite(lo, f);
      const double b = magnitude_as_finite(static_cast<std::uint16_t>(lo + 1), f);
      const double tie = (a + b) / 2, tiny = (b - a) * std::ldexp(1.0, -30);
      for (const double x : {tie, tie + tiny, tie - tiny}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
  return v;
}

// ---- tensors: rounding on the host, comparing in float ------------------------------------------

template <class H>
Tensor<H> to_half(const Tensor<float>& x) {
  Tensor<H> h;
  convert(x, h);
  return h;
}

Tensor<float> to_float(const auto& h) {
  Tensor<float> f;
  convert(h, f);
  return f;
}

// x with every entry rounded to H (still float: the CPU reference's input).
template <class H>
Tensor<float> rounded(const Tensor<float>& x) {
  return to_float(to_half<H>(x));
}

// Random float entries rounded to H, as a float tensor.
template <class H>
Tensor<float> random_rounded(const Shape& shape, Rng& rng, double lo = -1.0, double hi = 1.0) {
  return rounded<H>(random_tensor<float>(shape, rng, lo, hi));
}

template <class H>
Tensor<H, cuda> device_half(const Tensor<float>& x) {
  return to_device(to_half<H>(x));
}

template <class H>
void check_close_half(const std::string& what, const Tensor<float>& ref, const Tensor<H, cuda>& got,
                      double tol = half_tolerance<H>()) {
  const Tensor<float> h = to_float(to_host(got));
  REQUIRE_MESSAGE(h.shape() == ref.shape(), what, ": shape ", h.shape().str(), " vs ",
                  ref.shape().str());
  const double err = normwise_error(ref, h);
  if (verbose())
    std::printf("  %-40s %-5s shape %-14s error %.3e (tolerance %.0e)\n", what.c_str(),
                half_name<H>(), ref.shape().str().c_str(), err, tol);
  CHECK_MESSAGE(err <= tol, what, " (", half_name<H>(), "): error ", err, " > tolerance ", tol);
}

template <class H>
void check_equal_half(const std::string& what, const Tensor<float>& ref,
                      const Tensor<H, cuda>& got) {
  const Tensor<float> h = to_float(to_host(got));
  REQUIRE_MESSAGE(h.shape() == ref.shape(), what, ": shape ", h.shape().str(), " vs ",
                  ref.shape().str());
  index_t bad = 0, first = -1;
  for (index_t i = 0; i < ref.numel(); ++i) {
    if (!(h.data()[i] == ref.data()[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  CHECK_MESSAGE(bad == 0, what, " (", half_name<H>(), "): ", bad, " of ", ref.numel(),
                " entries differ, first at ", first);
}

Tensor<std::int32_t> random_ids(index_t n, index_t k, index_t used, Rng& rng) {
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < idx.numel(); ++i)
    idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(used)));
  return idx;
}

const Trans kTrans[] = {Trans::N, Trans::T};
const char* tname(Trans t) { return t == Trans::N ? "N" : "T"; }

}  // namespace

// ---- conversions ---------------------------------------------------------------------------------

TEST_CASE("half: the 16-bit types are trivially copyable 2-byte values, accumulated in float") {
  static_assert(std::is_trivially_copyable_v<bf16> && sizeof(bf16) == 2);
  static_assert(std::is_trivially_copyable_v<half> && sizeof(half) == 2);
  static_assert(std::is_same_v<detail::acc_t<bf16>, float>);
  static_assert(std::is_same_v<detail::acc_t<half>, float>);
  static_assert(std::is_same_v<detail::acc_t<float>, float>);
  static_assert(std::is_same_v<detail::acc_t<double>, double>);
  static_assert(detail::cuda_float_type<bf16> && detail::cuda_float_type<half>);
  static_assert(!detail::cuda_float_type<int>);
  CHECK(Tensor<bf16>(Shape{3}).bytes() == 6);
}

TEST_CASE_TEMPLATE("half (host): value_cast rounds float and double to nearest even", H, bf16,
                   half) {
  const Format f = format_of<H>();
  Rng rng(11);
  index_t bad = 0;
  for (const float x : rounding_inputs<H>(rng)) {
    const std::uint16_t r = bits_of(detail::value_cast<H>(x));
    const std::string why = rne_violation(x, r, f);
    if (!why.empty() && ++bad <= 5)
      MESSAGE(half_name<H>(), ": float ", x, " (bits ", std::bit_cast<std::uint32_t>(x),
              ") -> bits ", r, ": ", why);
    // from double: the same result for values a float holds (NaN: some NaN)
    const std::uint16_t rd = bits_of(detail::value_cast<H>(static_cast<double>(x)));
    CHECK((std::isnan(x) ? is_nan_pattern(rd, f) : rd == r));
  }
  CHECK(bad == 0);
  for (const double x : double_rounding_inputs<H>()) {
    const std::uint16_t r = bits_of(detail::value_cast<H>(x));
    CHECK_MESSAGE(rne_violation(x, r, f).empty(), half_name<H>(), ": double ", x, " -> bits ", r,
                  ": ", rne_violation(x, r, f));
  }
  // the classic ties: 1 + u (halfway between 1 and its successor) goes to 1 (even), 1 + 3u up
  const double u = std::ldexp(1.0, -(f.mant_bits + 1));
  CHECK(decode(bits_of(detail::value_cast<H>(1.0 + u)), f) == 1.0);
  CHECK(decode(bits_of(detail::value_cast<H>(1.0 + 3 * u)), f) == 1.0 + 4 * u);
  CHECK(decode(bits_of(detail::value_cast<H>(-(1.0 + 3 * u))), f) == -(1.0 + 4 * u));
  // double rounding: just above the tie must round up, though float(x) is the tie itself
  const double x = 1.0 + u + std::ldexp(1.0, -40);
  CHECK(static_cast<double>(static_cast<float>(x)) == 1.0 + u);
  CHECK(decode(bits_of(detail::value_cast<H>(x)), f) == 1.0 + 2 * u);
}

TEST_CASE_TEMPLATE("half (host): every 16-bit value survives float and double exactly", H, bf16,
                   half) {
  const Format f = format_of<H>();
  using Other = std::conditional_t<is_bf16<H>, half, bf16>;
  const Format g = format_of<Other>();
  index_t bad = 0, bad_cross = 0;
  for (std::uint32_t i = 0; i <= 0xFFFF; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const H h = from_bits<H>(b);
    const float w = detail::value_cast<float>(h);
    const double wd = detail::value_cast<double>(h);
    const double exact = decode(b, f);
    if (std::isnan(exact)) {
      if (!std::isnan(w) || !std::isnan(wd) ||
          !is_nan_pattern(bits_of(detail::value_cast<H>(w)), f))
        ++bad;
    } else if (static_cast<double>(w) != exact || wd != exact ||
               std::signbit(w) != std::signbit(exact) || bits_of(detail::value_cast<H>(w)) != b ||
               bits_of(detail::value_cast<H>(wd)) != b) {
      ++bad;
    }
    // to the other 16-bit format: one rounding of the exact value
    if (!rne_violation(exact, bits_of(detail::value_cast<Other>(h)), g).empty()) ++bad_cross;
  }
  CHECK(bad == 0);
  CHECK(bad_cross == 0);
}

TEST_CASE_TEMPLATE("cuda half: convert on the device equals the host conversion", H, bf16, half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  // all 65536 patterns: to float and double and back on the device
  Tensor<H> all({65536});
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b)
    all.data()[b] = from_bits<H>(static_cast<std::uint16_t>(b));
  const Tensor<H, cuda> d_all = to_device(all);
  Tensor<float, cuda> d_f;
  Tensor<double, cuda> d_d;
  convert(d_all, d_f);
  convert(d_all, d_d);
  Tensor<H, cuda> back_f, back_d;
  convert(d_f, back_f);
  convert(d_d, back_d);
  const Tensor<float> h_f = to_host(d_f);
  const Tensor<double> h_d = to_host(d_d);
  const Tensor<H> h_back_f = to_host(back_f), h_back_d = to_host(back_d);
  const Format f = format_of<H>();
  index_t bad = 0;
  for (std::uint32_t i = 0; i <= 0xFFFF; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const double exact = decode(b, f);
    const float w = h_f.data()[b];
    const double wd = h_d.data()[b];
    if (std::isnan(exact)) {
      if (!std::isnan(w) || !std::isnan(wd) || !is_nan_pattern(bits_of(h_back_f.data()[b]), f) ||
          !is_nan_pattern(bits_of(h_back_d.data()[b]), f))
        ++bad;
    } else if (static_cast<double>(w) != exact || wd != exact ||
               std::signbit(w) != std::signbit(exact) || bits_of(h_back_f.data()[b]) != b ||
               bits_of(h_back_d.data()[b]) != b) {
      ++bad;
    }
  }
  CHECK(bad == 0);

  // float and double to H: bit-identical to the host rounding (NaN: any NaN)
  Rng rng(12);
  const std::vector<float> xs = rounding_inputs<H>(rng);
  const auto n = static_cast<index_t>(xs.size());
  const Tensor<float> x = Tensor<float>::from({n}, xs);
  Tensor<H, cuda> dh;
  convert(to_device(x), dh);
  const Tensor<H> hh = to_host(dh);
  index_t bad_round = 0;
  for (index_t i = 0; i < n; ++i) {
    const std::uint16_t r = bits_of(hh.data()[i]);
    if (!rne_violation(xs[static_cast<std::size_t>(i)], r, f).empty()) ++bad_round;
  }
  CHECK(bad_round == 0);
  const std::vector<double> ds = double_rounding_inputs<H>();
  const Tensor<double> xd = Tensor<double>::from({static_cast<index_t>(ds.size())}, ds);
  Tensor<H, cuda> dhd;
  convert(to_device(xd), dhd);
  const Tensor<H> hhd = to_host(dhd);
  for (std::size_t i = 0; i < ds.size(); ++i)
    CHECK_MESSAGE(rne_violation(ds[i], bits_of(hhd.data()[i]), f).empty(), "double ", ds[i]);

  // the output convention and the error for an empty source
  Tensor<H, cuda> wrong(Shape{3});
  CHECK(error_of([&] { convert(to_device(x), wrong); }).find("output dst has shape") !=
        std::string::npos);
  CHECK(error_of([&] { convert(Tensor<float, cuda>(), wrong); }).find("src is empty") !=
        std::string::npos);
}

// ---- gemm -----------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: gemm and gemm_backward, all transposes", H, bf16,
                   half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(13);
  struct Mnk {
    index_t m, n, k;
  };
  // K = 352 and 1408: the FFN widths of the models (d = 352, 4 d = 1408)
  for (const Mnk s : {Mnk{1, 1, 1}, Mnk{67, 45, 129}, Mnk{64, 96, 352}, Mnk{33, 130, 1408},
                      Mnk{5, 3, 0}}) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        CAPTURE(s.m);
        CAPTURE(s.n);
        CAPTURE(s.k);
        CAPTURE(tname(ta));
        CAPTURE(tname(tb));
        const auto A = random_rounded<H>(ta == Trans::N ? Shape{s.m, s.k} : Shape{s.k, s.m}, rng);
        const auto B = random_rounded<H>(tb == Trans::N ? Shape{s.k, s.n} : Shape{s.n, s.k}, rng);
        auto C = random_rounded<H>({s.m, s.n}, rng);
        const auto dA = device_half<H>(A), dB = device_half<H>(B);

        // beta != 0: C is read (0.5 and 2 are exact in H)
        auto dC = device_half<H>(C);
        gemm(ta, tb, 0.5f, A, B, 2.0f, C);
        gemm(ta, tb, H(0.5f), dA, dB, H(2.0f), dC);
        check_close_half("gemm C = 0.5 op(A) op(B) + 2 C", C, dC);

        // empty C: allocated, beta ignored
        Tensor<float> C2;
        Tensor<H, cuda> dC2;
        gemm(ta, tb, 1.0f, A, B, 3.0f, C2);
        gemm(ta, tb, H(1.0f), dA, dB, H(3.0f), dC2);
        check_close_half("gemm into an empty C", C2, dC2);

        // backward (generic): accumulating into dA (beta_a = 1), assigning dB (beta_b = 0)
        const auto G = random_rounded<H>({s.m, s.n}, rng);
        auto gA = random_rounded<H>(A.shape(), rng), gB = random_rounded<H>(B.shape(), rng);
        auto dgA = device_half<H>(gA), dgB = device_half<H>(gB);
        gemm_backward(ta, tb, 1.5f, A, B, G, 1.0f, gA, 0.0f, gB);
        gemm_backward(ta, tb, H(1.5f), dA, dB, device_half<H>(G), H(1.0f), dgA, H(0.0f), dgB);
        if (s.k > 0) {
          check_close_half("gemm_backward dA", gA, dgA);
          check_close_half("gemm_backward dB", gB, dgB);
        }
      }
    }
  }
  // the float path's checks and messages
  Tensor<H, cuda> none;
  const auto a = random_rounded<H>({2, 3}, rng);
  Tensor<float> cpu_none;
  CHECK(error_of([&] { gemm(Trans::N, Trans::N, H(1.0f), device_half<H>(a), device_half<H>(a),
                            H(0.0f), none); }) ==
        error_of([&] { gemm(Trans::N, Trans::N, 1.0f, a, a, 0.0f, cpu_none); }));
}

// ---- softmax ------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: softmax and log_softmax, forward and backward", H,
                   bf16, half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(14);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (const Shape shape : {Shape{37, 1}, Shape{37, 7}, Shape{64, 64}, Shape{9, 1000},
                            Shape{3, 4099}}) {
    CAPTURE(shape.str());
    auto x = random_rounded<H>(shape, rng, -8.0, 8.0);
    const index_t cols = shape.cols();
    for (index_t i = 0; i < x.numel(); ++i)
      if (i % cols != 0 && rng.uniform() < 0.2) x.data()[i] = ninf;
    const auto dy = random_rounded<H>(shape, rng);
    const auto xd = device_half<H>(x), dyd = device_half<H>(dy);

    Tensor<float> y, ly;
    Tensor<H, cuda> yd, lyd;
    softmax_forward(x, y);
    softmax_forward(xd, yd);
    check_close_half("softmax_forward", y, yd);
    const auto yh = to_float(to_host(yd));
    for (index_t i = 0; i < x.numel(); ++i)
      if (x.data()[i] == ninf) REQUIRE(yh.data()[i] == 0.0f);  // exactly 0 where masked
    auto inplace = device_half<H>(x);
    softmax_forward(inplace, inplace);
    check_close_half("softmax_forward in place", y, inplace);

    // backward from the same rounded y on both sides
    const auto yr = rounded<H>(y);
    Tensor<float> dx;
    Tensor<H, cuda> dxd;
    softmax_backward(yr, dy, dx);
    softmax_backward(device_half<H>(yr), dyd, dxd);
    check_close_half("softmax_backward", dx, dxd);
    auto g = device_half<H>(dy);
    softmax_backward(device_half<H>(yr), g, g);
    check_close_half("softmax_backward in place", dx, g);

    log_softmax_forward(x, ly);
    log_softmax_forward(xd, lyd);
    check_close_half("log_softmax_forward", ly, lyd);
    const auto lyr = rounded<H>(ly);
    Tensor<float> ldx;
    Tensor<H, cuda> ldxd;
    log_softmax_backward(lyr, dy, ldx);
    log_softmax_backward(device_half<H>(lyr), dyd, ldxd);
    check_close_half("log_softmax_backward", ldx, ldxd);
  }

  // a row without a finite maximum: the CPU message on the widened values
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto bad = Tensor<float>::from({3, 4}, {0.5f, 1, 2, 3, 1, nan, 2, nan, 0, 0, 0, 0});
  Tensor<float> y;
  Tensor<H, cuda> yd;
  const auto cpu_msg = error_of([&] { softmax_forward(bad, y); });
  CHECK(cpu_msg.find("row 1") != std::string::npos);
  CHECK(error_of([&] { softmax_forward(device_half<H>(bad), yd); }) == cpu_msg);
}

// ---- gelu ---------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: gelu forward and backward, both forms", H, bf16,
                   half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(15);
  for (const GeluForm form : {GeluForm::Erf, GeluForm::Tanh}) {
    CAPTURE(static_cast<int>(form));
    const auto x = random_rounded<H>({129, 67}, rng, -6.0, 6.0);
    const auto dy = random_rounded<H>(x.shape(), rng);
    Tensor<float> y, dx;
    Tensor<H, cuda> yd, dxd;
    gelu_forward(form, x, y);
    gelu_forward(form, device_half<H>(x), yd);
    check_close_half("gelu_forward", y, yd);
    gelu_backward(form, x, dy, dx);
    gelu_backward(form, device_half<H>(x), device_half<H>(dy), dxd);
    check_close_half("gelu_backward", dx, dxd);
    auto inplace = device_half<H>(x);
    gelu_forward(form, inplace, inplace);
    check_close_half("gelu_forward in place", y, inplace);
  }
}

// ---- layernorm ----------------------------------------------------------------------------------

// S: the type of the cache mean / rstd (float, recommended, or H). With the cache in H, backward
// reads rstd rounded (relative error up to u): dx = rstd (g - mean_g) - rstd^3 (x - mean)
// mean(g (x - mean)) carries it once in the first term and three times in the second, so dx may
// be off by 4 u before its own rounding (u): 5 u, i.e. 2e-2 for bf16 and 3e-3 for half.
template <class H, class S>
void check_layernorm(Rng& rng, const Shape& shape) {
  CAPTURE(shape.str());
  const bool fp32_cache = std::is_same_v<S, float>;
  CAPTURE(fp32_cache);
  const index_t d = shape.cols();
  const auto x = random_rounded<H>(shape, rng, -2.0, 2.0);
  const auto gamma = random_rounded<H>({d}, rng, 0.5, 1.5);
  const auto beta = random_rounded<H>({d}, rng);
  const H eps_h = H(1e-5f);
  const float eps = detail::value_cast<float>(eps_h);  // the same eps on both sides
  const auto xd = device_half<H>(x), gd = device_half<H>(gamma), bd = device_half<H>(beta);

  Tensor<float> y, mean, rstd;
  Tensor<H, cuda> yd;
  Tensor<S, cuda> meand, rstdd;
  layernorm_forward(x, gamma, beta, eps, y, mean, rstd);
  layernorm_forward(xd, gd, bd, eps_h, yd, meand, rstdd);
  check_close_half("layernorm_forward y", y, yd);
  if constexpr (std::is_same_v<S, float>) {
    // fp32 statistics, never rounded to H: fp32 accuracy
    check_close("layernorm_forward mean (fp32 cache)", mean, meand, 1e-4);
    check_close("layernorm_forward rstd (fp32 cache)", rstd, rstdd, 1e-4);
  } else {
    check_close_half("layernorm_forward mean", mean, meand);
    check_close_half("layernorm_forward rstd", rstd, rstdd);
  }
  auto inplace = device_half<H>(x);
  Tensor<S, cuda> m2, r2;
  layernorm_forward(inplace, gd, bd, eps_h, inplace, m2, r2);
  check_close_half("layernorm_forward in place", y, inplace);

  const auto dy = random_rounded<H>(shape, rng);
  auto dgamma = random_rounded<H>({d}, rng), dbeta = random_rounded<H>({d}, rng);
  auto dgd = device_half<H>(dgamma), dbd = device_half<H>(dbeta);
  Tensor<float> dx;
  Tensor<H, cuda> dxd;
  layernorm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
  layernorm_backward(xd, gd, meand, rstdd, device_half<H>(dy), dxd, dgd, dbd);
  const double tol = std::is_same_v<S, float> ? half_tolerance<H>() : (is_bf16<H> ? 2e-2 : 3e-3);
  check_close_half("layernorm_backward dx", dx, dxd, tol);
  check_close_half("layernorm_backward dgamma (accumulated)", dgamma, dgd, tol);
  check_close_half("layernorm_backward dbeta (accumulated)", dbeta, dbd, tol);
  auto g = device_half<H>(dy);
  Tensor<H, cuda> dg2, db2;
  layernorm_backward(xd, gd, meand, rstdd, g, g, dg2, db2);
  check_close_half("layernorm_backward dx in place", dx, g, tol);
}

TEST_CASE_TEMPLATE("cuda half vs cpu float: layernorm, fp32 or 16-bit cache", H, bf16, half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(16);
  for (const Shape shape : {Shape{1, 1}, Shape{37, 64}, Shape{130, 352}, Shape{2, 3, 1000}}) {
    check_layernorm<H, float>(rng, shape);
    check_layernorm<H, H>(rng, shape);
  }
  // the argument checks and their messages: those of the float op
  const auto x = random_rounded<H>({4, 8}, rng);
  const auto gamma = random_rounded<H>({8}, rng);
  Tensor<float> y, mean, rstd;
  Tensor<H, cuda> yd;
  Tensor<float, cuda> meand, rstdd;
  CHECK(error_of([&] {
          layernorm_forward(device_half<H>(x), device_half<H>(gamma), device_half<H>(gamma),
                            H(0.0f), yd, meand, rstdd);
        }) == error_of([&] { layernorm_forward(x, gamma, gamma, 0.0f, y, mean, rstd); }));
  const auto short_gamma = random_rounded<H>({7}, rng);
  CHECK(error_of([&] {
          layernorm_forward(device_half<H>(x), device_half<H>(short_gamma), device_half<H>(gamma),
                            H(1e-5f), yd, meand, rstdd);
        }) == error_of([&] { layernorm_forward(x, short_gamma, gamma, 1e-5f, y, mean, rstd); }));
}

// ---- elementwise --------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: add_row_vector, column sums, axpy, scale, fill", H,
                   bf16, half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(17);
  for (const Shape shape : {Shape{1, 1}, Shape{300, 37}, Shape{1024, 352}}) {
    CAPTURE(shape.str());
    const index_t cols = shape.cols();
    auto y = random_rounded<H>(shape, rng);
    const auto b = random_rounded<H>({cols}, rng);
    auto yd = device_half<H>(y);
    add_row_vector(b, y);
    add_row_vector(device_half<H>(b), yd);
    check_close_half("add_row_vector", y, yd);

    // the column sums of 1024 rows: fp32 sums, rounded once
    const auto dy = random_rounded<H>(shape, rng);
    auto db = random_rounded<H>({cols}, rng);
    auto dbd = device_half<H>(db);
    accumulate_column_sums(dy, db);
    accumulate_column_sums(device_half<H>(dy), dbd);
    check_close_half("accumulate_column_sums", db, dbd);

    const auto x = random_rounded<H>(shape, rng);
    auto z = random_rounded<H>(shape, rng);
    auto zd = device_half<H>(z);
    const H alpha = H(-0.375f);  // exact in H
    axpy(detail::value_cast<float>(alpha), x, z);
    axpy(alpha, device_half<H>(x), zd);
    check_close_half("axpy", z, zd);

    z = to_float(to_host(zd));  // z as the CUDA side holds it
    scale(z, 3.0f);
    scale(zd, H(3.0f));
    check_close_half("scale", z, zd);

    const H value = H(0.1f);
    fill(zd, value);
    check_equal_half("fill", Tensor<float>::full(shape, detail::value_cast<float>(value)), zd);
  }
  // check_finite names the first non-finite entry, as a float
  auto t = Tensor<float>::from({2, 2}, {1, 2, std::numeric_limits<float>::infinity(), 4});
  const auto msg = error_of([&] { check_finite("op", "t", device_half<H>(t)); });
  CHECK(msg == error_of([&] { check_finite("op", "t", t); }));
}

// ---- dispatch / combine -------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: dispatch and combine, forward and backward", H, bf16,
                   half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(18);
  const index_t e = 8, d = 352;
  for (const index_t k : {1, 2, 4}) {
    for (const index_t n : {1, 300}) {
      CAPTURE(k);
      CAPTURE(n);
      const auto idx = random_ids(n, k, e, rng);
      DispatchPlan plan;
      make_dispatch_plan(idx, e, plan);
      CudaDispatchPlan dplan;
      make_dispatch_plan(to_device(idx), e, dplan);

      const auto x = random_rounded<H>({n, d}, rng);
      Tensor<float> xs;
      Tensor<H, cuda> dxs;
      dispatch_forward(plan, x, xs);
      dispatch_forward(dplan, device_half<H>(x), dxs);
      check_equal_half("dispatch_forward", xs, dxs);

      const auto gxs = random_rounded<H>({n * k, d}, rng);
      Tensor<float> gx;
      Tensor<H, cuda> dgx;
      dispatch_backward(plan, gxs, gx);
      dispatch_backward(dplan, device_half<H>(gxs), dgx);
      check_close_half("dispatch_backward", gx, dgx);

      const auto ys = random_rounded<H>({n * k, d}, rng);
      const auto gates = random_rounded<H>({n, k}, rng, 0.0, 1.0);
      Tensor<float> y;
      Tensor<H, cuda> dyv;
      combine_forward(plan, ys, gates, y);
      combine_forward(dplan, device_half<H>(ys), device_half<H>(gates), dyv);
      check_close_half("combine_forward", y, dyv);

      const auto gy = random_rounded<H>({n, d}, rng);
      Tensor<float> gys, ggates;
      Tensor<H, cuda> dgys, dggates;
      combine_backward(plan, ys, gates, gy, gys, ggates);
      combine_backward(dplan, device_half<H>(ys), device_half<H>(gates), device_half<H>(gy), dgys,
                       dggates);
      check_close_half("combine_backward dys", gys, dgys);
      check_close_half("combine_backward dgates (fp32 dot products)", ggates, dggates);
    }
  }
}

// ---- topk -----------------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda half vs cpu float: topk forward (exact) and backward", H, bf16, half) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(19);
  const float inf = std::numeric_limits<float>::infinity();
  for (const index_t e : {1, 8, 64}) {
    for (const index_t k : {1, 2, 4}) {
      if (k > e) continue;
      CAPTURE(e);
      CAPTURE(k);
      const index_t n = 301;
      // rounding to H makes ties common; half the rows from {-inf, 0, 1, 2, +inf}
      auto x = random_rounded<H>({n, e}, rng);
      for (index_t r = 0; r < n; r += 2)
        for (index_t c = 0; c < e; ++c) {
          const std::uint32_t v = rng.uniform_int(5);
          x(r, c) = v == 0 ? -inf : v == 4 ? inf : static_cast<float>(v - 1);
        }
      Tensor<float> values;
      Tensor<std::int32_t> indices;
      topk_forward(x, k, values, indices);
      Tensor<H, cuda> dvalues;
      Tensor<std::int32_t, cuda> dindices;
      topk_forward(device_half<H>(x), k, dvalues, dindices);
      check_equal_half("topk values", values, dvalues);
      check_equal("topk indices", indices, dindices);

      // backward with repeated indices in a row (summed in order)
      const auto idx = random_ids(n, k, e, rng);
      const auto g = random_rounded<H>({n, k}, rng);
      Tensor<float> dx({n, e});
      Tensor<H, cuda> ddx(Shape{n, e});
      topk_backward(idx, g, dx);
      topk_backward(to_device(idx), device_half<H>(g), ddx);
      check_close_half("topk_backward dx", dx, ddx);
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto bad = Tensor<float>::from({2, 3}, {1, 2, 3, 4, nan, 6});
  Tensor<float> v;
  Tensor<std::int32_t> i;
  Tensor<H, cuda> dv;
  Tensor<std::int32_t, cuda> di;
  CHECK(error_of([&] { topk_forward(device_half<H>(bad), 2, dv, di); }) ==
        error_of([&] { topk_forward(bad, 2, v, i); }));
}

}  // namespace graphmoe
