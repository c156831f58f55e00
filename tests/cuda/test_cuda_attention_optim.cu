// Cross-backend tests of the CUDA attention op (backend/cuda/attention.cuh) and of the optimizers
// on cuda (backend/cuda/optim.cuh), with the CPU backend as the reference (see
// cuda_test_support.cuh for the error metric).
//
//   attention_forward    out, probs (exact zeros above the diagonal when causal), row entropy:
//                        normwise, float 1e-5 (entropy 2e-5), double 1e-12
//   attention_backward   dq, dk, dv with and without dprobs_extra (NaN above the diagonal of
//                        dprobs_extra must be ignored when causal), into outputs holding garbage
//                        (assigned, not accumulated): float 2e-5 (the gradient chains three
//                        products and the softmax backward), double 1e-12
//                        shapes with B <= H and B > H (the two ways of batching the heads) and
//                        T > 64 (the CPU's causal row blocks), causal and not
//   AdamW, SGD           parameters and state after several steps: bitwise equal (the same
//                        element functor, rounded intrinsics on the device)
//   clip_grad_norm       the norm and the clipped gradients: bitwise equal (the same summation
//                        order), over an arena of many chunks
//   AdamW + mirror       the fused step (w and bf16(w) in one pass) against the step followed by
//                        a conversion: bitwise equal weights, state and mirror; a stale mirror
//                        (a frozen parameter written behind it) refreshed in full by the step
//   bad inputs           the CPU ops' messages, compared as strings
//
// Without a CUDA device every case prints "skipped: no CUDA device" and passes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/cuda_test_support.cuh"
#include "graphmoe/ops/attention.hpp"
#include "graphmoe/backend/cuda/attention.cuh"
#include "graphmoe/backend/cuda/convert.cuh"
#include "graphmoe/backend/cuda/copy.cuh"
#include "graphmoe/backend/cuda/optim.cuh"
#include "graphmoe/ops/optim.hpp"
#include "graphmoe/train/optim.hpp"
#include "support/gradcheck.hpp"

// Everything lives in namespace graphmoe: with `using namespace graphmoe;` at global scope the
// backend tag `cuda` would be ambiguous with CCCL's `namespace cuda` (libcu++).
namespace graphmoe {
using graphmoe::test::check_close;
using graphmoe::test::check_equal;
using graphmoe::test::error_of;
using graphmoe::test::random_tensor;

namespace {

template <class T>
double backward_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

struct AttentionCase {
  index_t batch, seq, heads, head_dim;
};

// ---- optimizer helpers ------------------------------------------------------------------------

// The same layout on both backends: two chunks in one parameter, padding, ranks 0 to 2, a frozen
// parameter. extra_rows adds a large parameter (many chunks, several blocks of the norm kernel).
template <class T, class B>
ParameterArena<T, B> declare_arena(index_t extra_rows) {
  ParameterArena<T, B> arena;
  arena.add("emb", Shape{41, 300});
  arena.add("frozen", Shape{5}, false);
  arena.add("w", Shape{17, 9});
  arena.add("b", Shape{9});
  arena.add("gain", Shape{});
  if (extra_rows > 0) arena.add("big", Shape{extra_rows, 1000});
  arena.allocate();
  return arena;
}

// Fills the CPU arena's values and gradients at random (padding stays zero) and copies both
// buffers to the cuda arena.
template <class T>
void fill_both(ParameterArena<T, cpu>& h, ParameterArena<T, cuda>& d, Rng& rng, bool values) {
  for (const auto& p : h.params()) {
    if (values) h.value(p.name).copy_from(random_tensor<T>(p.shape, rng));
    h.grad(p.name).copy_from(random_tensor<T>(p.shape, rng, -0.1, 0.1));
  }
  Tensor<T, cuda> dv = d.values(), dg = d.grads();
  if (values) to_device(h.values(), dv);
  to_device(h.grads(), dg);
}

template <class T, class OptCpu, class OptCuda>
void check_state(const OptCpu& oh, const OptCuda& od, const ParameterArena<T, cpu>& h,
                 const ParameterArena<T, cuda>& d) {
  const auto sh = oh.state(h);
  const auto sd = od.state(d);
  REQUIRE(sh.size() == sd.size());
  for (std::size_t i = 0; i < sh.size(); ++i) {
    CHECK(sh[i].first == sd[i].first);
    check_equal(sh[i].first, sh[i].second.clone(), sd[i].second);
  }
}

}  // namespace

// ---- attention ----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: attention forward and backward", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(21);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (const AttentionCase s : {AttentionCase{1, 1, 1, 1}, AttentionCase{2, 5, 3, 4},
                                AttentionCase{5, 9, 2, 3}, AttentionCase{1, 70, 4, 8},
                                AttentionCase{3, 33, 1, 16}, AttentionCase{2, 130, 2, 32}}) {
    for (const bool causal : {false, true}) {
      CAPTURE(s.batch);
      CAPTURE(s.seq);
      CAPTURE(s.heads);
      CAPTURE(s.head_dim);
      CAPTURE(causal);
      const index_t width = s.heads * s.head_dim;
      const Shape x_shape{s.batch, s.seq, width};
      const Shape p_shape{s.batch, s.heads, s.seq, s.seq};
      const auto q = random_tensor<T>(x_shape, rng, -2.0, 2.0);
      const auto k = random_tensor<T>(x_shape, rng, -2.0, 2.0);
      const auto v = random_tensor<T>(x_shape, rng);
      const auto qd = to_device(q), kd = to_device(k), vd = to_device(v);

      // forward; the device outputs start with garbage (they are assigned)
      Tensor<T> probs, out, ent;
      attention_forward(q, k, v, s.heads, causal, probs, out, &ent);
      Tensor<T, cuda> probs_d = to_device(random_tensor<T>(p_shape, rng));
      Tensor<T, cuda> out_d = to_device(random_tensor<T>(x_shape, rng));
      Tensor<T, cuda> ent_d;
      attention_forward(qd, kd, vd, s.heads, causal, probs_d, out_d, &ent_d);
      check_close("attention_forward out", out, out_d);
      check_close("attention_forward probs", probs, probs_d);
      check_close("attention_forward row entropy", ent, ent_d,
                  std::is_same_v<T, float> ? 2e-5 : 1e-12);
      if (causal) {
        const Tensor<T> ph = to_host(probs_d);
        index_t nonzero = 0;
        for (index_t r = 0; r < s.batch * s.heads * s.seq; ++r)
          for (index_t j = r % s.seq + 1; j < s.seq; ++j)
            if (ph.data()[r * s.seq + j] != T(0)) ++nonzero;
        CHECK_MESSAGE(nonzero == 0, nonzero, " probabilities above the diagonal are not 0");
      }
      // without the entropy: the same probabilities
      Tensor<T, cuda> probs_d2, out_d2;
      attention_forward(qd, kd, vd, s.heads, causal, probs_d2, out_d2);
      check_close("attention_forward probs (no entropy)", probs, probs_d2);

      // backward, without and with dprobs_extra
      const auto dout = random_tensor<T>(x_shape, rng);
      auto extra = random_tensor<T>(p_shape, rng);
      if (causal)  // ignored above the diagonal by both backends
        for (index_t r = 0; r < s.batch * s.heads * s.seq; ++r)
          for (index_t j = r % s.seq + 1; j < s.seq; ++j) extra.data()[r * s.seq + j] = nan;
      const auto doutd = to_device(dout), extrad = to_device(extra);
      for (const bool with_extra : {false, true}) {
        CAPTURE(with_extra);
        const Tensor<T> e = with_extra ? extra : Tensor<T>();
        const Tensor<T, cuda> ed = with_extra ? extrad : Tensor<T, cuda>();
        Tensor<T> dq, dk, dv;
        attention_backward(q, k, v, s.heads, causal, probs, dout, e, dq, dk, dv);
        Tensor<T, cuda> dqd = to_device(random_tensor<T>(x_shape, rng));
        Tensor<T, cuda> dkd = to_device(random_tensor<T>(x_shape, rng));
        Tensor<T, cuda> dvd;
        attention_backward(qd, kd, vd, s.heads, causal, probs_d, doutd, ed, dqd, dkd, dvd);
        check_close("attention_backward dq", dq, dqd, backward_tolerance<T>());
        check_close("attention_backward dk", dk, dkd, backward_tolerance<T>());
        check_close("attention_backward dv", dv, dvd, backward_tolerance<T>());
      }
    }
  }
}

TEST_CASE("cuda vs cpu: attention rejects bad inputs with the CPU messages") {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(22);
  const auto q = random_tensor<float>({2, 4, 6}, rng);
  const auto qd = to_device(q);
  const auto flat = random_tensor<float>({4, 6}, rng);
  const auto other = random_tensor<float>({2, 5, 6}, rng);
  const auto probs = random_tensor<float>({2, 3, 4, 4}, rng);
  const auto bad_probs = random_tensor<float>({2, 3, 4, 5}, rng);
  std::vector<std::string> cpu_msgs, cuda_msgs;
  const auto both = [&](const std::function<void()>& on_cpu, const std::function<void()>& on_cuda) {
    cpu_msgs.push_back(error_of(on_cpu));
    cuda_msgs.push_back(error_of(on_cuda));
  };
  // forward: q not rank 3, k of another shape, heads not dividing the width, probs preallocated
  // with the wrong shape
  both([&] { Tensor<float> p, o; attention_forward(flat, flat, flat, 3, false, p, o); },
       [&] {
         Tensor<float, cuda> p, o;
         const auto f = to_device(flat);
         attention_forward(f, f, f, 3, false, p, o);
       });
  both([&] { Tensor<float> p, o; attention_forward(q, other, q, 3, true, p, o); },
       [&] { Tensor<float, cuda> p, o; attention_forward(qd, to_device(other), qd, 3, true, p, o); });
  both([&] { Tensor<float> p, o; attention_forward(q, q, q, 4, false, p, o); },
       [&] { Tensor<float, cuda> p, o; attention_forward(qd, qd, qd, 4, false, p, o); });
  both([&] { Tensor<float> p = bad_probs.clone(), o; attention_forward(q, q, q, 3, false, p, o); },
       [&] {
         Tensor<float, cuda> p = to_device(bad_probs), o;
         attention_forward(qd, qd, qd, 3, false, p, o);
       });
  // backward: probs, dout and dprobs_extra of the wrong shapes
  both([&] {
         Tensor<float> a, b, c;
         attention_backward(q, q, q, 3, false, bad_probs, q, Tensor<float>(), a, b, c);
       },
       [&] {
         Tensor<float, cuda> a, b, c;
         attention_backward(qd, qd, qd, 3, false, to_device(bad_probs), qd, Tensor<float, cuda>(),
                            a, b, c);
       });
  both([&] {
         Tensor<float> a, b, c;
         attention_backward(q, q, q, 3, true, probs, other, Tensor<float>(), a, b, c);
       },
       [&] {
         Tensor<float, cuda> a, b, c;
         attention_backward(qd, qd, qd, 3, true, to_device(probs), to_device(other),
                            Tensor<float, cuda>(), a, b, c);
       });
  both([&] {
         Tensor<float> a, b, c;
         attention_backward(q, q, q, 3, false, probs, q, bad_probs, a, b, c);
       },
       [&] {
         Tensor<float, cuda> a, b, c;
         attention_backward(qd, qd, qd, 3, false, to_device(probs), qd, to_device(bad_probs), a,
                            b, c);
       });
  for (std::size_t i = 0; i < cpu_msgs.size(); ++i) {
    CAPTURE(i);
    CHECK(!cpu_msgs[i].empty());
    CHECK(cuda_msgs[i] == cpu_msgs[i]);
  }
}

// ---- optimizers -----------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("cuda vs cpu: AdamW steps are bitwise the CPU's", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (const bool custom_decay : {false, true}) {
    CAPTURE(custom_decay);
    Rng rng(23);
    auto h = declare_arena<T, cpu>(0);
    auto d = declare_arena<T, cuda>(0);
    fill_both(h, d, rng, true);
    AdamWConfig cfg;
    cfg.weight_decay = 0.1;
    AdamW<T> oh(h, cfg);
    AdamW<T, cuda> od(d, cfg);
    if (custom_decay) {
      oh.set_no_decay([](const std::string& n) { return n == "emb"; });
      od.set_no_decay([](const std::string& n) { return n == "emb"; });
    }
    for (const double lr : {1e-3, 3e-2, 0.0, 5e-3}) {
      CAPTURE(lr);
      fill_both(h, d, rng, false);
      oh.step(h, lr);
      od.step(d, lr);
      check_equal("AdamW values", h.values(), d.values());
      check_state(oh, od, h, d);
    }
    CHECK(od.steps() == oh.steps());
    oh.step(h);  // the configured learning rate
    od.step(d);
    check_equal("AdamW values, step(arena)", h.values(), d.values());
  }
}

TEST_CASE("cuda: AdamW's fused step writes the bf16 mirror, bitwise the step then a conversion") {
  SKIP_WITHOUT_CUDA_DEVICE();
  using M = __nv_bfloat16;
  Rng rng(25);
  auto h = declare_arena<float, cpu>(0);
  auto fused = declare_arena<float, cuda>(0);
  auto plain = declare_arena<float, cuda>(0);
  auto copy_to = [&](ParameterArena<float, cuda>& d, bool values) {
    Tensor<float, cuda> dv = d.values(), dg = d.grads();
    if (values) to_device(h.values(), dv);
    to_device(h.grads(), dg);
  };
  fill_both(h, fused, rng, true);
  copy_to(plain, true);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  AdamW<float, cuda> of(fused, cfg), op(plain, cfg);
  ComputeMirror<float, M, cuda> mirror(fused);
  CHECK(!mirror.current());  // never copied
  mirror.refresh();
  CHECK(mirror.current());
  CHECK_THROWS(of.step(plain, 1e-3, &mirror));  // another arena's mirror
  auto check_all = [&](const char* what) {
    CAPTURE(what);
    CHECK(mirror.current());
    check_equal("values", to_host(plain.values()), fused.values());
    const auto sp = op.state(plain), sf = of.state(fused);
    REQUIRE(sp.size() == sf.size());
    for (std::size_t i = 0; i < sp.size(); ++i) check_equal(sp[i].first, to_host(sp[i].second), sf[i].second);
    check_equal("mirror", to_host(converted<float>(converted<M>(plain.values()))),
                converted<float>(mirror.values()));
  };
  for (const double lr : {1e-3, 3e-2, 0.0, 5e-3}) {
    CAPTURE(lr);
    fill_both(h, fused, rng, false);
    copy_to(plain, false);
    of.step(fused, lr, &mirror);
    op.step(plain, lr);
    check_all("fused step");
  }
  // a frozen parameter (which no step writes) written behind the mirror, marked as the contract
  // says: the mirror is stale, and the next fused step refreshes all of it
  const Tensor<float, cpu> frozen = random_tensor<float>(Shape{5}, rng);
  for (ParameterArena<float, cuda>* a : {&fused, &plain}) {
    Tensor<float, cuda> v = a->value("frozen");
    to_device(frozen, v);
    a->mark_values_written();
  }
  CHECK(!mirror.current());
  of.step(fused, 1e-3, &mirror);
  op.step(plain, 1e-3);
  check_all("after a write behind the mirror");
}

TEST_CASE_TEMPLATE("cuda vs cpu: SGD steps are bitwise the CPU's", T, float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  struct Case {
    double momentum, weight_decay;
    bool nesterov;
  };
  for (const Case c : {Case{0, 0, false}, Case{0, 0.05, false}, Case{0.9, 0, false},
                       Case{0.9, 0.05, false}, Case{0.8, 0, true}, Case{0.8, 0.05, true}}) {
    CAPTURE(c.momentum);
    CAPTURE(c.weight_decay);
    CAPTURE(c.nesterov);
    Rng rng(24);
    auto h = declare_arena<T, cpu>(0);
    auto d = declare_arena<T, cuda>(0);
    fill_both(h, d, rng, true);
    SGDConfig cfg;
    cfg.momentum = c.momentum;
    cfg.weight_decay = c.weight_decay;
    cfg.nesterov = c.nesterov;
    SGD<T> oh(h, cfg);
    SGD<T, cuda> od(d, cfg);
    oh.set_no_decay([](const std::string& n) { return n == "w"; });
    od.set_no_decay([](const std::string& n) { return n == "w"; });
    for (const double lr : {0.1, 0.02, 0.3}) {
      CAPTURE(lr);
      fill_both(h, d, rng, false);
      oh.step(h, lr);
      od.step(d, lr);
      check_equal("SGD values", h.values(), d.values());
      check_state(oh, od, h, d);
    }
  }
}

TEST_CASE_TEMPLATE("cuda vs cpu: clip_grad_norm, the same norm and gradients bit for bit", T,
                   float, double) {
  SKIP_WITHOUT_CUDA_DEVICE();
  Rng rng(25);
  auto h = declare_arena<T, cpu>(300);  // 300 000 + 12 300 elements: 39 chunks, 2 blocks
  auto d = declare_arena<T, cuda>(300);
  fill_both(h, d, rng, true);
  const double measured = clip_grad_norm(h, 0.0);
  CHECK(clip_grad_norm(d, 0.0) == measured);  // measure only: nothing changes
  check_equal("gradients after measuring", h.grads(), d.grads());
  CHECK(clip_grad_norm(d, -1.0) == measured);
  CHECK(clip_grad_norm(d, 2 * measured) == measured);  // below the limit: unchanged
  check_equal("gradients below the limit", h.grads(), d.grads());
  const double limit = measured / 3;
  CHECK(clip_grad_norm(d, limit) == clip_grad_norm(h, limit));
  check_equal("clipped gradients", h.grads(), d.grads());
  CHECK(clip_grad_norm(d, 0.0) == clip_grad_norm(h, 0.0));

  // only frozen parameters: norm 0
  ParameterArena<T, cuda> frozen;
  frozen.add("f", Shape{7}, false);
  frozen.allocate();
  CHECK(clip_grad_norm(frozen, 1.0) == 0.0);
}

TEST_CASE("cuda vs cpu: optimizer and clip_grad_norm errors are the CPU messages") {
  SKIP_WITHOUT_CUDA_DEVICE();
  ParameterArena<float> uh;
  ParameterArena<float, cuda> ud;
  uh.add("w", Shape{3, 3});
  ud.add("w", Shape{3, 3});
  const auto same = [](const std::string& a, const std::string& b) {
    CHECK(!a.empty());
    CHECK(a == b);
  };
  same(error_of([&] { AdamW<float> o(uh, AdamWConfig{}); }),
       error_of([&] { AdamW<float, cuda> o(ud, AdamWConfig{}); }));
  same(error_of([&] { clip_grad_norm(uh, 1.0); }), error_of([&] { clip_grad_norm(ud, 1.0); }));

  Rng rng(26);
  auto h = declare_arena<float, cpu>(0);
  auto d = declare_arena<float, cuda>(0);
  fill_both(h, d, rng, true);
  AdamW<float> ah(h, AdamWConfig{});
  AdamW<float, cuda> ad(d, AdamWConfig{});
  SGD<float> sh(h, SGDConfig{});
  SGD<float, cuda> sd(d, SGDConfig{});
  same(error_of([&] { ah.step(h, -1.0); }), error_of([&] { ad.step(d, -1.0); }));
  same(error_of([&] { sh.step(h, std::nan("")); }), error_of([&] { sd.step(d, std::nan("")); }));
  // another arena than the optimizer's
  auto h2 = declare_arena<float, cpu>(1);
  auto d2 = declare_arena<float, cuda>(1);
  same(error_of([&] { ah.step(h2); }), error_of([&] { ad.step(d2); }));
  same(error_of([&] { sh.state(h2); }), error_of([&] { sd.state(d2); }));
  // NaN and Inf gradients, NaN max_norm
  same(error_of([&] { clip_grad_norm(h, std::nan("")); }),
       error_of([&] { clip_grad_norm(d, std::nan("")); }));
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    h.grad("b").data()[3] = bad;
    Tensor<float, cuda> dg = d.grads();
    to_device(h.grads(), dg);
    const std::string msg = error_of([&] { clip_grad_norm(h, 1.0); });
    CHECK(msg.find(std::isnan(bad) ? "gradient norm is nan" : "gradient norm is inf") !=
          std::string::npos);
    same(msg, error_of([&] { clip_grad_norm(d, 1.0); }));
  }
}

}  // namespace graphmoe
