// Dispatch/combine: the plan against a naive stable grouping; a worked example of stability;
// gathers against naive loops; round trip; gradient checks; thread independence; float vs
// double; bad input.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "graphmoe/ops/dispatch.hpp"
#include "support/gradcheck.hpp"

using namespace graphmoe;
using namespace graphmoe::test;

namespace {
Tensor<std::int32_t> random_experts(index_t n, index_t k, index_t e, Rng& rng) {
  Tensor<std::int32_t> idx({n, k});
  for (index_t i = 0; i < idx.numel(); ++i)
    idx.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(e)));
  return idx;
}
}  // namespace

TEST_CASE("dispatch: plan matches a naive stable grouping by expert") {
  Rng rng(31);
  const index_t n = 23, k = 2, e = 5;
  auto idx = random_experts(n, k, e, rng);
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);
  CHECK(plan.num_tokens == n);
  CHECK(plan.k == k);
  CHECK(plan.num_experts == e);
  std::vector<std::int32_t> tokens, sources, offsets{0};
  for (index_t x = 0; x < e; ++x) {
    for (index_t t = 0; t < n; ++t)
      for (index_t j = 0; j < k; ++j)
        if (idx(t, j) == x) {
          tokens.push_back(static_cast<std::int32_t>(t));
          sources.push_back(static_cast<std::int32_t>(t * k + j));
        }
    offsets.push_back(static_cast<std::int32_t>(tokens.size()));
    CHECK(plan.count(x) == offsets.back() - offsets[offsets.size() - 2]);
    CHECK(plan.offset(x) == offsets[offsets.size() - 2]);
  }
  CHECK(plan.expert_offsets.to_vector() == offsets);
  CHECK(plan.slot_token.to_vector() == tokens);
  CHECK(plan.slot_source.to_vector() == sources);
  for (index_t s = 0; s < n * k; ++s) CHECK(plan.source_slot(plan.slot_source(s)) == s);

  // Rebuilding into the same plan with other indices reuses it correctly.
  auto idx2 = random_experts(n, k, e, rng);
  make_dispatch_plan(idx2, e, plan);
  for (index_t s = 0; s < n * k; ++s) {
    const std::int32_t a = plan.slot_source(s);
    CHECK(plan.slot_token(s) == a / k);
    CHECK(plan.source_slot(a) == s);
    CHECK(idx2.data()[a] >= 0);
    CHECK(plan.expert_offsets(idx2.data()[a]) <= s);
    CHECK(s < plan.expert_offsets(idx2.data()[a] + 1));
  }
}

TEST_CASE("dispatch: the sort is stable, worked example") {
  // token: 0      1      2      3
  auto idx = Tensor<std::int32_t>::from({4, 2}, {2, 0, 0, 2, 1, 2, 0, 3});
  DispatchPlan plan;
  make_dispatch_plan(idx, 5, plan);
  CHECK(plan.expert_offsets.to_vector() == std::vector<std::int32_t>{0, 3, 4, 7, 8, 8});
  // expert 0: (0,1) (1,0) (3,0); expert 1: (2,0); expert 2: (0,0) (1,1) (2,1); expert 3: (3,1)
  CHECK(plan.slot_source.to_vector() == std::vector<std::int32_t>{1, 2, 6, 4, 0, 3, 5, 7});
  CHECK(plan.slot_token.to_vector() == std::vector<std::int32_t>{0, 1, 3, 2, 0, 1, 2, 3});
  CHECK(plan.source_slot.to_vector() == std::vector<std::int32_t>{4, 0, 1, 5, 3, 6, 2, 7});
  CHECK(plan.count(4) == 0);
}

TEST_CASE("dispatch: gathers match naive loops, round trip gives k * x") {
  Rng rng(32);
  const index_t n = 17, k = 3, e = 4, d = 6;
  auto idx = random_experts(n, k, e, rng);
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);
  auto x = random_tensor<double>({n, d}, rng);
  Tensor<double> xs;
  dispatch_forward(plan, x, xs);
  REQUIRE(xs.shape() == Shape{n * k, d});
  for (index_t s = 0; s < n * k; ++s)
    for (index_t c = 0; c < d; ++c) CHECK(xs(s, c) == x(plan.slot_token(s), c));

  auto ys = random_tensor<double>({n * k, d}, rng);
  auto gates = random_tensor<double>({n, k}, rng);
  Tensor<double> y;
  combine_forward(plan, ys, gates, y);
  for (index_t t = 0; t < n; ++t)
    for (index_t c = 0; c < d; ++c) {
      double s = 0;
      for (index_t j = 0; j < k; ++j) s += gates(t, j) * ys(plan.source_slot(t * k + j), c);
      CHECK(y(t, c) == doctest::Approx(s).epsilon(1e-14));
    }

  // dispatch backward = sum of the token's k slots
  Tensor<double> dx;
  dispatch_backward(plan, ys, dx);
  for (index_t t = 0; t < n; ++t)
    for (index_t c = 0; c < d; ++c) {
      double s = 0;
      for (index_t j = 0; j < k; ++j) s += ys(plan.source_slot(t * k + j), c);
      CHECK(dx(t, c) == doctest::Approx(s).epsilon(1e-14));
    }

  // Round trip: identity experts, gates 1
  auto ones = Tensor<double>::full({n, k}, 1.0);
  Tensor<double> back;
  combine_forward(plan, xs, ones, back);
  for (index_t i = 0; i < x.numel(); ++i)
    CHECK(back.data()[i] == doctest::Approx(k * x.data()[i]).epsilon(1e-14));
}

TEST_CASE("dispatch: gradient check of dispatch and combine (double)") {
  Rng rng(33);
  const index_t n = 7, k = 2, e = 3, d = 4;
  auto idx = random_experts(n, k, e, rng);
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);

  auto x = random_tensor<double>({n, d}, rng);
  auto wxs = random_tensor<double>({n * k, d}, rng);
  auto dispatch_loss = [&] {
    Tensor<double> xs;
    dispatch_forward(plan, x, xs);
    return weighted_sum(xs, wxs);
  };
  auto dx = Tensor<double>::full({n, d}, 5.0);  // assigned, not accumulated
  dispatch_backward(plan, wxs, dx);
  check_gradient("dx", x, dx, dispatch_loss);

  auto ys = random_tensor<double>({n * k, d}, rng);
  auto gates = random_tensor<double>({n, k}, rng);
  auto wy = random_tensor<double>({n, d}, rng);
  auto combine_loss = [&] {
    Tensor<double> y;
    combine_forward(plan, ys, gates, y);
    return weighted_sum(y, wy);
  };
  auto dys = Tensor<double>::full({n * k, d}, 5.0);
  auto dgates = Tensor<double>::full({n, k}, 5.0);
  combine_backward(plan, ys, gates, wy, dys, dgates);
  check_gradient("dys", ys, dys, combine_loss);
  check_gradient("dgates", gates, dgates, combine_loss);
}

TEST_CASE("dispatch: results do not depend on the thread count") {
  Rng rng(34);
  const index_t n = 1000, k = 2, e = 8, d = 64;
  auto idx = random_experts(n, k, e, rng);
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);
  auto x = random_tensor<float>({n, d}, rng);
  auto ys = random_tensor<float>({n * k, d}, rng);
  auto gates = random_tensor<float>({n, k}, rng);
  auto dy = random_tensor<float>({n, d}, rng);
  std::vector<std::vector<float>> results[2];
  for (int run = 0; run < 2; ++run) {
    set_num_threads(run == 0 ? 1 : 2);
    Tensor<float> xs, dx, y, dys, dgates;
    dispatch_forward(plan, x, xs);
    dispatch_backward(plan, ys, dx);
    combine_forward(plan, ys, gates, y);
    combine_backward(plan, ys, gates, dy, dys, dgates);
    results[run] = {xs.to_vector(), dx.to_vector(), y.to_vector(), dys.to_vector(),
                    dgates.to_vector()};
  }
  set_num_threads(1);
  CHECK(results[0] == results[1]);
}

TEST_CASE("dispatch: float agrees with double") {
  Rng rng(35);
  const index_t n = 30, k = 2, e = 6, d = 20;
  auto idx = random_experts(n, k, e, rng);
  DispatchPlan plan;
  make_dispatch_plan(idx, e, plan);
  auto ys = random_tensor<double>({n * k, d}, rng);
  auto gates = random_tensor<double>({n, k}, rng);
  auto dy = random_tensor<double>({n, d}, rng);
  Tensor<double> yd, dysd, dgd, dxd;
  Tensor<float> yf, dysf, dgf, dxf;
  combine_forward(plan, ys, gates, yd);
  combine_forward(plan, cast<float>(ys), cast<float>(gates), yf);
  combine_backward(plan, ys, gates, dy, dysd, dgd);
  combine_backward(plan, cast<float>(ys), cast<float>(gates), cast<float>(dy), dysf, dgf);
  dispatch_backward(plan, ys, dxd);
  dispatch_backward(plan, cast<float>(ys), dxf);
  CHECK(max_rel_diff(yf, yd) < 1e-6);
  CHECK(max_rel_diff(dysf, dysd) < 1e-6);
  CHECK(max_rel_diff(dgf, dgd) < 1e-5);
  CHECK(max_rel_diff(dxf, dxd) < 1e-6);
}

TEST_CASE("dispatch: bad input") {
  DispatchPlan plan;
  auto bad = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 4, 1, 1});
  CHECK_THROWS_WITH_AS(make_dispatch_plan(bad, 4, plan),
                       doctest::Contains("expert id 4 of token 1, choice 1 is out of range [0, 4)"),
                       Error);
  auto negative = Tensor<std::int32_t>::from({1, 2}, {-1, 0});
  CHECK_THROWS_WITH_AS(make_dispatch_plan(negative, 4, plan),
                       doctest::Contains("expert id -1 of token 0, choice 0"), Error);
  CHECK_THROWS_WITH_AS(make_dispatch_plan(negative, 0, plan),
                       doctest::Contains("num_experts = 0"), Error);
  Tensor<std::int32_t> flat({6});
  CHECK_THROWS_WITH_AS(make_dispatch_plan(flat, 4, plan), doctest::Contains("(N, k) matrix"),
                       Error);

  Tensor<float> x({3, 5}), xs;
  CHECK_THROWS_WITH_AS(dispatch_forward(plan, x, xs), doctest::Contains("not built by"), Error);

  auto idx = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 3, 1, 1});
  make_dispatch_plan(idx, 4, plan);
  CHECK_THROWS_WITH_AS(plan.count(4), doctest::Contains("expert 4 is out of range"), Error);
  Tensor<float> x4({4, 5});
  CHECK_THROWS_WITH_AS(dispatch_forward(plan, x4, xs),
                       doctest::Contains("x has shape (4, 5), expected (3, 5)"), Error);
  Tensor<float> xs_wrong({6, 4});
  CHECK_THROWS_WITH_AS(dispatch_forward(plan, x, xs_wrong),
                       doctest::Contains("output xs has shape (6, 4), expected (6, 5)"), Error);
  Tensor<float> dxs({5, 5}), dx;
  CHECK_THROWS_WITH_AS(dispatch_backward(plan, dxs, dx),
                       doctest::Contains("dxs has shape (5, 5), expected (6, 5)"), Error);
  Tensor<float> ys({6, 5}), gates({3, 3}), y;
  CHECK_THROWS_WITH_AS(combine_forward(plan, ys, gates, y),
                       doctest::Contains("gates has shape (3, 3), expected (3, 2)"), Error);
  Tensor<float> gates_ok({3, 2}), dy({3, 4}), dys, dgates;
  CHECK_THROWS_WITH_AS(combine_backward(plan, ys, gates_ok, dy, dys, dgates),
                       doctest::Contains("dy has shape (3, 4), expected (3, 5)"), Error);
}

TEST_CASE("dispatch: a plan whose rebuild failed is invalid until rebuilt") {
  DispatchPlan<cpu> plan;
  auto idx = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 3, 1, 1});
  make_dispatch_plan(idx, 4, plan);
  CHECK(plan.count(1) == 3);
  for (index_t e = 0; e <= 4; ++e) CHECK(plan.offset(e) == plan.expert_offsets.data()[e]);
  auto bad = Tensor<std::int32_t>::from({3, 2}, {0, 1, 2, 7, 1, 1});
  CHECK_THROWS_WITH_AS(make_dispatch_plan(bad, 4, plan),
                       doctest::Contains("expert id 7 of token 1, choice 1 is out of range [0, 4)"),
                       Error);
  Tensor<float> x({3, 5}), xs;
  CHECK_THROWS_WITH_AS(dispatch_forward(plan, x, xs),
                       doctest::Contains("dispatch_forward: the plan was not built by make_dispatch_plan"),
                       Error);
  make_dispatch_plan(idx, 4, plan);
  dispatch_forward(plan, x, xs);
  CHECK(xs.rows() == 6);
}

// ---- the padded layout (make_padded_dispatch_plan) ------------------------------------------

namespace {
// keep: drop about a quarter of the assignments at random
Tensor<std::uint8_t> random_keep(index_t n, index_t k, Rng& rng) {
  Tensor<std::uint8_t> keep({n, k});
  for (index_t i = 0; i < keep.numel(); ++i) keep.data()[i] = rng.uniform_int(4) == 0 ? 0 : 1;
  return keep;
}
}  // namespace

TEST_CASE("dispatch: the padded plan against a naive placement, worked example") {
  // token: 0      1      2      3;  keep drops (1, 1) and (3, 0)
  auto idx = Tensor<std::int32_t>::from({4, 2}, {2, 0, 0, 2, 1, 2, 0, 3});
  auto keep = Tensor<std::uint8_t>::from({4, 2}, {1, 1, 1, 0, 1, 1, 0, 1});
  DispatchPlan plan;
  make_padded_dispatch_plan(idx, keep, 4, 3, plan);
  CHECK(plan.capacity == 3);
  CHECK(plan.num_slots() == 12);
  CHECK(plan.num_assignments() == 8);
  CHECK(plan.expert_offsets.to_vector() == std::vector<std::int32_t>{0, 3, 6, 9, 12});
  // expert 0: (0,1) (1,0); expert 1: (2,0); expert 2: (0,0) (2,1); expert 3: (3,1)
  CHECK(plan.slot_source.to_vector() ==
        std::vector<std::int32_t>{1, 2, -1, 4, -1, -1, 0, 5, -1, 7, -1, -1});
  CHECK(plan.slot_token.to_vector() ==
        std::vector<std::int32_t>{0, 1, -1, 2, -1, -1, 0, 2, -1, 3, -1, -1});
  CHECK(plan.source_slot.to_vector() == std::vector<std::int32_t>{6, 0, 1, -1, 3, 7, -1, 9});
  for (index_t e = 0; e < 4; ++e) {
    CHECK(plan.count(e) == 3);  // every expert's block is C rows
    CHECK(plan.offset(e) == 3 * e);
  }
}

TEST_CASE("dispatch: the padded plan's gathers equal the compact plan's with the drop bucket") {
  Rng rng(34);
  const index_t n = 19, k = 2, e = 4, d = 5, cap = 9;
  for (int round = 0; round < 3; ++round) {
    auto idx = random_experts(n, k, e, rng);
    auto keep = random_keep(n, k, rng);
    // a capacity mask on top: at most cap kept per expert, in token order
    std::vector<index_t> load(static_cast<std::size_t>(e), 0);
    for (index_t a = 0; a < n * k; ++a)
      if (keep.data()[a] && load[static_cast<std::size_t>(idx.data()[a])]++ >= cap)
        keep.data()[a] = 0;
    DispatchPlan padded, compact;
    make_padded_dispatch_plan(idx, keep, e, cap, padded);
    Tensor<std::int32_t> ids(idx.shape());
    for (index_t a = 0; a < n * k; ++a)
      ids.data()[a] = keep.data()[a] ? idx.data()[a] : static_cast<std::int32_t>(e);
    make_dispatch_plan(ids, e + 1, compact);
    // the same assignments in the same order within each expert
    for (index_t x = 0; x < e; ++x) {
      const index_t c = compact.count(x);
      for (index_t r = 0; r < cap; ++r) {
        const index_t s = x * cap + r;
        if (r < c) {
          CHECK(padded.slot_source(s) == compact.slot_source(compact.offset(x) + r));
          CHECK(padded.slot_token(s) == compact.slot_token(compact.offset(x) + r));
        } else {
          CHECK(padded.slot_source(s) == -1);
          CHECK(padded.slot_token(s) == -1);
        }
      }
    }
    auto x = random_tensor<double>({n, d}, rng);
    Tensor<double> xs;
    dispatch_forward(padded, x, xs);
    for (index_t s = 0; s < padded.num_slots(); ++s)
      for (index_t c = 0; c < d; ++c)
        CHECK(xs(s, c) == (padded.slot_token(s) < 0 ? 0.0 : x(padded.slot_token(s), c)));
    // experts' outputs: a function of the slot's content, so both layouts see the same rows;
    // the compact bucket's rows are zero as the expert bank leaves them
    auto per_token = random_tensor<double>({n * k, d}, rng);  // the output of assignment a
    auto gates = random_tensor<double>({n, k}, rng);
    for (index_t a = 0; a < n * k; ++a)
      if (!keep.data()[a]) gates.data()[a] = 0;  // as the selector's gates
    Tensor<double> ysp({padded.num_slots(), d}), ysc({compact.num_slots(), d});
    for (index_t s = 0; s < padded.num_slots(); ++s)
      for (index_t c = 0; c < d; ++c)
        ysp(s, c) = padded.slot_source(s) < 0 ? 1e6 : per_token(padded.slot_source(s), c);
    for (index_t s = 0; s < compact.num_slots(); ++s)
      for (index_t c = 0; c < d; ++c)
        ysc(s, c) = s >= compact.offset(e) ? 0.0 : per_token(compact.slot_source(s), c);
    Tensor<double> yp, yc;
    combine_forward(padded, ysp, gates, yp);  // empty slots (1e6) are never read
    combine_forward(compact, ysc, gates, yc);
    for (index_t i = 0; i < yp.numel(); ++i)
      CHECK(yp.data()[i] == doctest::Approx(yc.data()[i]).epsilon(1e-15));
    auto dy = random_tensor<double>({n, d}, rng);
    auto dysp = Tensor<double>::full({padded.num_slots(), d}, 5.0);  // assigned
    auto dgp = Tensor<double>::full({n, k}, 5.0);
    Tensor<double> dysc, dgc;
    combine_backward(padded, ysp, gates, dy, dysp, dgp);
    combine_backward(compact, ysc, gates, dy, dysc, dgc);
    for (index_t a = 0; a < n * k; ++a) {
      CHECK(dgp.data()[a] == doctest::Approx(dgc.data()[a]).epsilon(1e-15));
      if (!keep.data()[a]) CHECK(dgp.data()[a] == 0.0);
    }
    for (index_t s = 0; s < padded.num_slots(); ++s)
      for (index_t c = 0; c < d; ++c) {
        const std::int32_t a = padded.slot_source(s);
        CHECK(dysp(s, c) == (a < 0 ? 0.0 : dysc(compact.source_slot(a), c)));
      }
    Tensor<double> dxp, dxc;
    dispatch_backward(padded, dysp, dxp);
    dispatch_backward(compact, dysc, dxc);
    for (index_t i = 0; i < dxp.numel(); ++i)
      CHECK(dxp.data()[i] == doctest::Approx(dxc.data()[i]).epsilon(1e-15));
  }
}

TEST_CASE("dispatch: gradient check of dispatch and combine on a padded plan (double)") {
  Rng rng(35);
  const index_t n = 7, k = 2, e = 3, d = 4, cap = 4;
  auto idx = random_experts(n, k, e, rng);
  auto keep = random_keep(n, k, rng);
  std::vector<index_t> load(static_cast<std::size_t>(e), 0);
  for (index_t a = 0; a < n * k; ++a)
    if (keep.data()[a] && load[static_cast<std::size_t>(idx.data()[a])]++ >= cap) keep.data()[a] = 0;
  DispatchPlan plan;
  make_padded_dispatch_plan(idx, keep, e, cap, plan);
  const index_t s = plan.num_slots();
  auto x = random_tensor<double>({n, d}, rng);
  auto wxs = random_tensor<double>({s, d}, rng);
  for (index_t r = 0; r < s; ++r)  // an empty slot's row is a constant 0: no gradient to check
    if (plan.slot_token(r) < 0)
      for (index_t c = 0; c < d; ++c) wxs(r, c) = 0;
  auto dispatch_loss = [&] {
    Tensor<double> xs;
    dispatch_forward(plan, x, xs);
    return weighted_sum(xs, wxs);
  };
  auto dx = Tensor<double>::full({n, d}, 5.0);
  dispatch_backward(plan, wxs, dx);
  check_gradient("dx", x, dx, dispatch_loss);

  auto ys = random_tensor<double>({s, d}, rng);
  auto gates = random_tensor<double>({n, k}, rng);
  auto wy = random_tensor<double>({n, d}, rng);
  auto combine_loss = [&] {
    Tensor<double> y;
    combine_forward(plan, ys, gates, y);
    return weighted_sum(y, wy);
  };
  auto dys = Tensor<double>::full({s, d}, 5.0);
  auto dgates = Tensor<double>::full({n, k}, 5.0);
  combine_backward(plan, ys, gates, wy, dys, dgates);
  check_gradient("dys", ys, dys, combine_loss);
  check_gradient("dgates", gates, dgates, combine_loss);
}

TEST_CASE("dispatch: the padded plan refuses an expert over capacity, a bad id and bad shapes") {
  auto idx = Tensor<std::int32_t>::from({3, 2}, {0, 1, 0, 2, 0, 1});
  auto all = Tensor<std::uint8_t>::from({3, 2}, {1, 1, 1, 1, 1, 1});
  DispatchPlan plan;
  CHECK_THROWS_WITH_AS(make_padded_dispatch_plan(idx, all, 3, 2, plan),
                       doctest::Contains("expert 0 received more than 2 kept assignments (the "
                                         "first beyond them: token 2, choice 0)"),
                       Error);
  Tensor<double> xs;
  CHECK_THROWS_WITH_AS(dispatch_forward(plan, Tensor<double>({3, 2}), xs),
                       doctest::Contains("not built by make_dispatch_plan"), Error);
  // dropped (keep = 0): any id, even out of range, is left out
  auto bad = Tensor<std::int32_t>::from({3, 2}, {0, 1, 0, 7, -1, 1});
  auto keep = Tensor<std::uint8_t>::from({3, 2}, {1, 1, 1, 0, 0, 1});
  make_padded_dispatch_plan(bad, keep, 3, 2, plan);
  CHECK(plan.source_slot.to_vector() == std::vector<std::int32_t>{0, 2, 1, -1, -1, 3});
  CHECK_THROWS_WITH_AS(make_padded_dispatch_plan(bad, all, 3, 2, plan),
                       doctest::Contains("expert id 7 of token 1, choice 1 is out of range [0, 3)"),
                       Error);
  CHECK_THROWS_WITH_AS(make_padded_dispatch_plan(idx, all, 3, 0, plan),
                       doctest::Contains("capacity = 0 must be >= 1"), Error);
  CHECK_THROWS_WITH_AS(make_padded_dispatch_plan(idx, Tensor<std::uint8_t>({2, 3}), 3, 2, plan),
                       doctest::Contains("keep"), Error);
}
