// Attention: forward against a naive loop evaluation (causal and not); gradient checks of q, k, v
// with and without a gradient into the probabilities; causality; thread independence; float vs
// double; bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "graphmoe/ops/attention.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
// Loop-by-loop attention in double: probs (B, H, T, T), out (B, T, H dh).
void naive_attention(const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v,
                     index_t heads, bool causal, Tensor<double>& probs, Tensor<double>& out) {
  const index_t B = q.dim(0), T = q.dim(1), C = q.dim(2), dh = C / heads;
  probs = Tensor<double>({B, heads, T, T});
  out = Tensor<double>({B, T, C});
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < heads; ++h)
      for (index_t i = 0; i < T; ++i) {
        std::vector<double> s(static_cast<std::size_t>(T));
        double m = -std::numeric_limits<double>::infinity();
        for (index_t j = 0; j < T; ++j) {
          double dot = 0;
          for (index_t c = 0; c < dh; ++c) dot += q(b, i, h * dh + c) * k(b, j, h * dh + c);
          s[j] = causal && j > i ? -std::numeric_limits<double>::infinity()
                                 : dot / std::sqrt(static_cast<double>(dh));
          m = std::max(m, s[j]);
        }
        double z = 0;
        for (index_t j = 0; j < T; ++j) z += std::exp(s[j] - m);
        for (index_t j = 0; j < T; ++j) probs(b, h, i, j) = std::exp(s[j] - m) / z;
        for (index_t c = 0; c < dh; ++c) {
          double acc = 0;
          for (index_t j = 0; j < T; ++j) acc += probs(b, h, i, j) * v(b, j, h * dh + c);
          out(b, i, h * dh + c) = acc;
        }
      }
}

struct Inputs {
  Tensor<double> q, k, v;
};
Inputs random_inputs(index_t B, index_t T, index_t C, Rng& rng) {
  return {random_tensor<double>({B, T, C}, rng), random_tensor<double>({B, T, C}, rng),
          random_tensor<double>({B, T, C}, rng)};
}
}  // namespace

TEST_CASE("attention: forward matches a naive loop evaluation") {
  Rng rng(41);
  const index_t B = 2, T = 7, H = 3, dh = 4;
  auto in = random_inputs(B, T, H * dh, rng);
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    Tensor<double> probs, out, nprobs, nout;
    attention_forward(in.q, in.k, in.v, H, causal, probs, out);
    naive_attention(in.q, in.k, in.v, H, causal, nprobs, nout);
    REQUIRE(probs.shape() == Shape{B, H, T, T});
    REQUIRE(out.shape() == Shape{B, T, H * dh});
    CHECK(max_rel_diff(probs, nprobs) < 1e-14);
    CHECK(max_rel_diff(out, nout) < 1e-14);
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h)
        for (index_t i = 0; i < T; ++i) {
          double sum = 0;
          for (index_t j = 0; j < T; ++j) {
            sum += probs(b, h, i, j);
            if (causal && j > i) CHECK(probs(b, h, i, j) == 0.0);  // exactly zero
          }
          CHECK(sum == doctest::Approx(1.0).epsilon(1e-14));
        }
  }
}

TEST_CASE("attention: forward matches naive loops across causal row blocks (T = 150)") {
  Rng rng(47);
  const index_t B = 1, T = 150, H = 2, dh = 4;  // three row blocks of the causal products
  auto in = random_inputs(B, T, H * dh, rng);
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    Tensor<double> probs, out, nprobs, nout;
    attention_forward(in.q, in.k, in.v, H, causal, probs, out);
    naive_attention(in.q, in.k, in.v, H, causal, nprobs, nout);
    CHECK(max_rel_diff(probs, nprobs) < 1e-14);
    CHECK(max_rel_diff(out, nout) < 1e-14);
  }
}

TEST_CASE("attention: forward overwrites stale outputs") {
  Rng rng(42);
  auto in = random_inputs(1, 5, 4, rng);
  auto probs = Tensor<double>::full({1, 2, 5, 5}, std::numeric_limits<double>::quiet_NaN());
  auto out = Tensor<double>::full({1, 5, 4}, std::numeric_limits<double>::quiet_NaN());
  Tensor<double> nprobs, nout;
  attention_forward(in.q, in.k, in.v, 2, true, probs, out);
  naive_attention(in.q, in.k, in.v, 2, true, nprobs, nout);
  CHECK(max_rel_diff(probs, nprobs) < 1e-14);
  CHECK(max_rel_diff(out, nout) < 1e-14);
}

TEST_CASE("attention: gradient check of q, k, v with a gradient into probs (double)") {
  Rng rng(43);
  const index_t B = 2, T = 5, H = 2, dh = 3;
  for (bool causal : {false, true}) {
    for (bool with_extra : {true, false}) {
      CAPTURE(causal);
      CAPTURE(with_extra);
      auto in = random_inputs(B, T, H * dh, rng);
      auto w1 = random_tensor<double>({B, T, H * dh}, rng);
      auto w2 = with_extra ? random_tensor<double>({B, H, T, T}, rng) : Tensor<double>();
      // L = sum(w1 * out) + sum(w2 * probs)
      auto loss = [&] {
        Tensor<double> probs, out;
        attention_forward(in.q, in.k, in.v, H, causal, probs, out);
        return weighted_sum(out, w1) + (with_extra ? weighted_sum(probs, w2) : 0.0);
      };
      Tensor<double> probs, out;
      attention_forward(in.q, in.k, in.v, H, causal, probs, out);
      auto dq = Tensor<double>::full(in.q.shape(), 7.0);  // assigned: stale contents ignored
      auto dk = Tensor<double>::full(in.q.shape(), 7.0);
      Tensor<double> dv;
      attention_backward(in.q, in.k, in.v, H, causal, probs, w1, w2, dq, dk, dv);
      check_gradient("dq", in.q, dq, loss);
      check_gradient("dk", in.k, dk, loss);
      check_gradient("dv", in.v, dv, loss);
    }
  }
}

TEST_CASE("attention: gradient check across causal row blocks (T = 70, double)") {
  Rng rng(48);
  const index_t B = 1, T = 70, H = 2, dh = 2;
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    auto in = random_inputs(B, T, H * dh, rng);
    auto w1 = random_tensor<double>({B, T, H * dh}, rng);
    auto w2 = random_tensor<double>({B, H, T, T}, rng);
    auto loss = [&] {
      Tensor<double> probs, out;
      attention_forward(in.q, in.k, in.v, H, causal, probs, out);
      return weighted_sum(out, w1) + weighted_sum(probs, w2);
    };
    Tensor<double> probs, out, dq, dk, dv;
    attention_forward(in.q, in.k, in.v, H, causal, probs, out);
    attention_backward(in.q, in.k, in.v, H, causal, probs, w1, w2, dq, dk, dv);
    check_gradient("dq", in.q, dq, loss);
    check_gradient("dk", in.k, dk, loss);
    check_gradient("dv", in.v, dv, loss);
  }
}

TEST_CASE("attention: causal outputs ignore later tokens, non-causal ones do not") {
  Rng rng(44);
  const index_t B = 2, T = 9, H = 2, dh = 5;
  auto in = random_inputs(B, T, H * dh, rng);
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    Tensor<double> probs0, out0;
    attention_forward(in.q, in.k, in.v, H, causal, probs0, out0);
    for (index_t j = 1; j < T; ++j) {
      CAPTURE(j);
      Inputs p{in.q.clone(), in.k.clone(), in.v.clone()};
      for (index_t c = 0; c < H * dh; ++c) {
        p.q(1, j, c) += 0.5;
        p.k(1, j, c) -= 0.7;
        p.v(1, j, c) += 0.9;
      }
      Tensor<double> probs1, out1;
      attention_forward(p.q, p.k, p.v, H, causal, probs1, out1);
      for (index_t i = 0; i < j; ++i) {
        bool same = true;
        for (index_t c = 0; c < H * dh; ++c) same = same && out1(1, i, c) == out0(1, i, c);
        CHECK(same == causal);
      }
      // batch 0 is never affected
      for (index_t i = 0; i < T; ++i)
        for (index_t c = 0; c < H * dh; ++c) CHECK(out1(0, i, c) == out0(0, i, c));
    }
  }
}

TEST_CASE("attention: results do not depend on the thread count") {
  Rng rng(45);
  const index_t B = 2, T = 100, H = 4, dh = 8;
  auto in = random_inputs(B, T, H * dh, rng);
  auto dout = random_tensor<double>({B, T, H * dh}, rng);
  auto dextra = random_tensor<double>({B, H, T, T}, rng);
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    std::vector<Tensor<double>> r[2];
    for (int run = 0; run < 2; ++run) {
      set_num_threads(run == 0 ? 1 : 2);
      Tensor<double> probs, out, dq, dk, dv;
      attention_forward(in.q, in.k, in.v, H, causal, probs, out);
      attention_backward(in.q, in.k, in.v, H, causal, probs, dout, dextra, dq, dk, dv);
      r[run] = {probs, out, dq, dk, dv};
    }
    set_num_threads(1);
    for (std::size_t i = 0; i < r[0].size(); ++i) {
      CAPTURE(i);
      CHECK(max_rel_diff(r[1][i], r[0][i]) < 1e-13);
    }
  }
}

TEST_CASE("attention: float agrees with double") {
  Rng rng(46);
  const index_t B = 2, T = 33, H = 4, dh = 8;
  auto in = random_inputs(B, T, H * dh, rng);
  auto dout = random_tensor<double>({B, T, H * dh}, rng);
  auto dextra = random_tensor<double>({B, H, T, T}, rng);
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    Tensor<double> pd, od, dqd, dkd, dvd;
    Tensor<float> pf, of, dqf, dkf, dvf;
    attention_forward(in.q, in.k, in.v, H, causal, pd, od);
    attention_backward(in.q, in.k, in.v, H, causal, pd, dout, dextra, dqd, dkd, dvd);
    auto qf = cast<float>(in.q), kf = cast<float>(in.k), vf = cast<float>(in.v);
    attention_forward(qf, kf, vf, H, causal, pf, of);
    attention_backward(qf, kf, vf, H, causal, pf, cast<float>(dout), cast<float>(dextra), dqf, dkf,
                       dvf);
    CHECK(max_rel_diff(pf, pd) < 1e-6);
    CHECK(max_rel_diff(of, od) < 1e-6);
    CHECK(max_rel_diff(dqf, dqd) < 1e-5);
    CHECK(max_rel_diff(dkf, dkd) < 1e-5);
    CHECK(max_rel_diff(dvf, dvd) < 1e-5);
  }
}

TEST_CASE("attention: bad input") {
  Tensor<float> q({2, 4, 6}), k({2, 4, 6}), v({2, 4, 6}), probs, out;
  CHECK_THROWS_WITH_AS(attention_forward(q, k, v, 4, false, probs, out),
                       doctest::Contains("num_heads = 4 does not divide the width 6"), Error);
  CHECK_THROWS_WITH_AS(attention_forward(q, k, v, 0, false, probs, out),
                       doctest::Contains("num_heads = 0"), Error);
  Tensor<float> k_short({2, 3, 6});
  CHECK_THROWS_WITH_AS(attention_forward(q, k_short, v, 2, false, probs, out),
                       doctest::Contains("k has shape (2, 3, 6), expected (2, 4, 6)"), Error);
  Tensor<float> q2({8, 6});
  CHECK_THROWS_WITH_AS(attention_forward(q2, q2, q2, 2, false, probs, out),
                       doctest::Contains("q must be (B, T, H*dh)"), Error);
  Tensor<float> probs_wrong({2, 3, 4, 4});
  CHECK_THROWS_WITH_AS(attention_forward(q, k, v, 2, false, probs_wrong, out),
                       doctest::Contains("output probs has shape (2, 3, 4, 4), expected (2, 2, 4, 4)"),
                       Error);

  Tensor<float> p({2, 2, 4, 4}), dout({2, 4, 6}), none, dq, dk, dv;
  CHECK_THROWS_WITH_AS(attention_backward(q, k, v, 3, false, p, dout, none, dq, dk, dv),
                       doctest::Contains("probs has shape (2, 2, 4, 4), expected (2, 3, 4, 4)"),
                       Error);
  Tensor<float> extra_wrong({2, 2, 4, 3});
  CHECK_THROWS_WITH_AS(attention_backward(q, k, v, 2, true, p, dout, extra_wrong, dq, dk, dv),
                       doctest::Contains("dprobs_extra has shape (2, 2, 4, 3)"), Error);
  Tensor<float> dout_wrong({2, 4, 5});
  CHECK_THROWS_WITH_AS(attention_backward(q, k, v, 2, true, p, dout_wrong, none, dq, dk, dv),
                       doctest::Contains("dout has shape (2, 4, 5), expected (2, 4, 6)"), Error);
}

TEST_CASE_TEMPLATE("attention_forward: row entropies from the softmax match -sum p log p", T, float, double) {
  graphmoe::Rng rng(91);
  for (bool causal : {false, true}) {
    const graphmoe::index_t b = 2, t = 70, h = 2, dh = 3;
    auto q = graphmoe::test::random_normal<T>({b, t, h * dh}, rng, 1.5);
    auto k = graphmoe::test::random_normal<T>({b, t, h * dh}, rng, 1.5);
    auto v = graphmoe::test::random_normal<T>({b, t, h * dh}, rng);
    graphmoe::Tensor<T> probs, out, ent;
    graphmoe::attention_forward(q, k, v, h, causal, probs, out, &ent);
    REQUIRE(ent.shape() == graphmoe::Shape{b, h, t});
    double worst = 0;
    for (graphmoe::index_t bb = 0; bb < b; ++bb)
      for (graphmoe::index_t hh = 0; hh < h; ++hh)
        for (graphmoe::index_t i = 0; i < t; ++i) {
          double e = 0;
          for (graphmoe::index_t j = 0; j < t; ++j) {
            const double p = static_cast<double>(probs(bb, hh, i, j));
            if (p > 0) e -= p * std::log(p);
          }
          worst = std::max(worst, std::abs(e - static_cast<double>(ent(bb, hh, i))));
        }
    CHECK(worst < (std::is_same_v<T, float> ? 1e-4 : 1e-10));
  }
}

// Eigen's packet exp alone returns about 1e-39 (float) or 1e-308 (double) far below its range
// instead of 0: a subnormal probability that made every later product on it several times slower
// (the decode rows of docs/benchmarks.md, "Decoding"). The softmax row gives std::exp's values.
TEST_CASE_TEMPLATE("attention_forward: a probability far below its row's maximum is exactly 0", T,
                   float, double) {
  const graphmoe::index_t t = 3, dh = 1;
  const T big = std::is_same_v<T, float> ? T(40) : T(60);  // scores q k: -big^2 and +big^2 apart
  graphmoe::Tensor<T> q = graphmoe::Tensor<T>::from({1, t, dh}, {T(0), big, big});
  graphmoe::Tensor<T> k = graphmoe::Tensor<T>::from({1, t, dh}, {-big, big, T(0)});
  graphmoe::Tensor<T> v = graphmoe::Tensor<T>::from({1, t, dh}, {T(1), T(2), T(3)});
  graphmoe::Tensor<T> probs, out, ent;
  graphmoe::attention_forward(q, k, v, 1, true, probs, out, &ent);
  // row 1: scores -big^2, big^2 (2 big^2 apart: exp underflows to 0); row 2: -big^2, big^2, 0
  CHECK(probs(0, 0, 1, 0) == T(0));
  CHECK(probs(0, 0, 1, 1) == T(1));
  CHECK(ent(0, 0, 1) == T(0));
  CHECK(probs(0, 0, 2, 0) == T(0));
  CHECK(out(0, 1, 0) == T(2));
}
