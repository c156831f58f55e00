// Expert parallel under mpiexec (ctest runs it with 2 and with 4 ranks): an MoE layer whose E
// experts are split over the W ranks, each rank holding b sequences, gives the outputs and the
// gradients of one process's layer on all W b sequences, for each router; also with uneven
// token counts per expert, an expert that receives no tokens, and (at 4 ranks) a rank whose
// experts receive none. Double precision: the only differences are the order of float sums.
//
// Under mpiexec with support/mpi_main.hpp's main(): only CHECK, never REQUIRE (see there).

#include <cstdint>
#include <cstdio>
#include <vector>

#include "graphmoe/train/distributed_checkpoint.hpp"
#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/layers/moe.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/optim.hpp"
#include "graphmoe/train/training_state.hpp"
#include "routing/router_fixtures.hpp"
#include "support/errors.hpp"
#include "support/mpi_main.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"

using namespace graphmoe;
using graphmoe::test::contains;
using graphmoe::test::error_of;

namespace {

constexpr index_t kExperts = 8, kDim = 6, kFf = 5, kLen = 4, kSeqs = 2;  // kSeqs per rank

MoEConfig config() {
  MoEConfig c;
  c.d_model = kDim;
  c.d_ff = kFf;
  c.router.num_experts = kExperts;
  c.router.k = 2;
  c.router.causal = true;
  c.router.load_balance_coef = 0.0;  // per rank, as in data parallel (docs/distributed.md)
  c.router.z_loss_coef = 0.0;  // a mean over each rank's tokens: see the training-step case
  c.router.allow_unused_options = true;  // one config for several routers
  c.router.options<ScheduledTopK>().k_min = 1;
  c.router.options<ScheduledTopK>().k_max = 2;
  c.router.options<ScheduledTopK>().schedule_steps = 1;
  c.router.options<CosineScorer>().dim = 3;
  c.router.options<Similarity>().tau = 2.0;
  test::set_scorer_init_std(c.router, 0.5);
  c.init_std = 0.5;
  return c;
}

// One process's layer (all experts) and this rank's expert-parallel layer, from the same seed.
template <class Policy>
struct Pair {
  ParameterArena<double> ref_arena, ep_arena;
  MoELayer<Policy, double> ref, ep;
  Pair(const MoEConfig& cfg, dist::Communicator& comm, std::uint64_t seed) {
    ref.declare(ref_arena, "moe.", cfg);
    ref_arena.allocate();
    ref.bind(ref_arena);
    Rng r1(seed);
    ref.init(r1);
    ref.router().set_step(1);
    ep.declare(ep_arena, "moe.", cfg, comm);
    ep_arena.allocate();
    ep.bind(ep_arena);
    Rng r2(seed);
    ep.init(r2);
    ep.router().set_step(1);
  }
};

// rows [begin, end) of t (a copy), t viewed as a matrix of `cols` columns
Tensor<double> rows_of(const Tensor<double>& t, index_t begin, index_t end) {
  return t.slice(begin, end).clone();
}

// The rank's sequences of a global attention cache (nb sequences of len tokens): its own slices
// of probs, v, out and their gradients; w_o and b_o (and their gradients) whole.
AttentionCache<double> cache_shard(const AttentionCache<double>& g, index_t s0, index_t s1,
                                   index_t len) {
  AttentionCache<double> c;
  c.num_heads = g.num_heads;
  c.probs = g.probs.slice(s0, s1).clone();
  c.v = g.v.slice(s0 * len, s1 * len).clone();
  c.out = g.out.slice(s0 * len, s1 * len).clone();
  c.w_o = g.w_o.clone();
  c.b_o = g.b_o.clone();
  c.dprobs = Tensor<double>(c.probs.shape());
  c.dv = Tensor<double>(c.v.shape());
  c.dout = Tensor<double>(c.out.shape());
  c.dw_o = Tensor<double>(c.w_o.shape());
  c.db_o = Tensor<double>(c.b_o.shape());
  return c;
}

double max_abs_diff(const Tensor<double>& a, const Tensor<double>& b) {
  CHECK(a.numel() == b.numel());
  double m = 0;
  for (index_t i = 0; i < std::min(a.numel(), b.numel()); ++i)
    m = std::max(m, std::abs(a.data()[i] - b.data()[i]));
  return m;
}

// The rows of one process's whole parameter `full` that `info` holds (full itself when the
// parameter is not sharded).
Tensor<double> mine_of(const Tensor<double>& full, const ParameterInfo& info) {
  if (!info.sharded()) return full;
  CHECK(info.full_shape() == full.shape());
  return full.slice(info.shard_begin, info.shard_begin + info.shape[0]);
}

// The largest difference of any parameter of `arena` from its rows of `ref`'s.
double max_param_diff(const ParameterArena<double>& arena, const ParameterArena<double>& ref) {
  double m = 0;
  for (const auto& info : arena.params()) {
    CAPTURE(info.name);
    m = std::max(m, max_abs_diff(arena.value(info.name), mine_of(ref.value(info.name), info)));
  }
  return m;
}

// Runs one forward and backward of both layers (the reference on all W b sequences, the
// expert-parallel one on this rank's b) and checks outputs, input gradients and every parameter
// gradient: a replicated parameter's summed over the ranks, an expert shard's against its rows.
template <class Policy>
void check_equal(Pair<Policy>& p, dist::Communicator& comm, const Tensor<double>& u_global,
                 const Tensor<double>& w_global, AttentionCache<double>* cache_global) {
  const int world = comm.size(), rank = comm.rank();
  const index_t nb = kSeqs * world, n0 = rank * kSeqs * kLen, n1 = n0 + kSeqs * kLen;
  AttentionCache<double> cache;
  if (cache_global != nullptr) {
    test::zero_sinks(*cache_global);
    cache = cache_shard(*cache_global, rank * kSeqs, (rank + 1) * kSeqs, kLen);
  }
  GraphContext<double> ref_ctx{kLen, cache_global};
  GraphContext<double> ep_ctx{kLen, cache_global != nullptr ? &cache : nullptr};
  (void)nb;

  Tensor<double> y_ref, du_ref, y_ep, du_ep;
  p.ref_arena.zero_grad();
  p.ref.forward(u_global, ref_ctx, y_ref);
  p.ref.backward(w_global, du_ref);

  const Tensor<double> u = rows_of(u_global, n0, n1), w = rows_of(w_global, n0, n1);
  p.ep_arena.zero_grad();
  const dist::Traffic before = comm.traffic();
  p.ep.forward(u, ep_ctx, y_ep);
  p.ep.backward(w, du_ep);
  // the bytes moved, to the byte: E / W counts to each rank, then the rows sent (xs forward, dys
  // backward) and received (ys and dxs go back the same way)
  const dist::ExpertExchange<double>& x = p.ep.expert_exchange();
  const index_t row = kDim * static_cast<index_t>(sizeof(double));
  CHECK(comm.traffic().all_to_all_calls - before.all_to_all_calls == 5);
  CHECK(comm.traffic().all_to_all_sent_bytes - before.all_to_all_sent_bytes ==
        kExperts * static_cast<index_t>(sizeof(index_t)) +
            2 * row * (x.sent_rows() + x.received_rows()));
  CHECK(comm.traffic().all_to_all_received_bytes - before.all_to_all_received_bytes ==
        kExperts * static_cast<index_t>(sizeof(index_t)) +
            2 * row * (x.sent_rows() + x.received_rows()));
  CHECK(x.sent_rows() == p.ep.plan().offset(kExperts));

  CHECK(max_abs_diff(y_ep, rows_of(y_ref, n0, n1)) < 1e-12);
  CHECK(max_abs_diff(du_ep, rows_of(du_ref, n0, n1)) < 1e-12);
  for (const auto& info : p.ep_arena.params()) {
    CAPTURE(info.name);
    const Tensor<double> g_ref = p.ref_arena.grad(info.name);
    Tensor<double> g = p.ep_arena.grad(info.name).clone();
    if (info.sharded()) {
      // this rank's experts: the rows of the whole layer's gradient
      CHECK(max_abs_diff(g, mine_of(g_ref, info)) < 1e-12);
    } else {
      comm.all_reduce_sum(g);  // each rank's tokens' part of the router's gradient
      CHECK(max_abs_diff(g, g_ref) < 1e-12);
    }
  }
  if (cache_global != nullptr) {
    CHECK(max_abs_diff(cache.dv, rows_of(cache_global->dv, n0, n1)) < 1e-12);
    Tensor<double> dw_o = cache.dw_o.clone();
    comm.all_reduce_sum(dw_o);
    CHECK(max_abs_diff(dw_o, cache_global->dw_o) < 1e-12);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("expert parallel: W ranks give the outputs and gradients of one process",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SMoEDropoutRouter, SimilarityXMoERouter, AttentionSMoEDropoutRouter) {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  const auto cfg = config();
  Pair<Policy> p(cfg, comm, 41);
  // the same initial model: the router whole, the experts this rank's rows of the whole layer's
  for (const auto& info : p.ep_arena.params()) {
    CAPTURE(info.name);
    if (info.sharded()) {
      CHECK(info.shard_rows == kExperts);
      CHECK(info.shard_begin == comm.rank() * (kExperts / world));
    }
  }
  CHECK(max_param_diff(p.ep_arena, p.ref_arena) == 0.0);
  Rng rng(42);  // the same global batch on every rank
  const index_t nb = kSeqs * world, n = nb * kLen;
  auto u = test::random_normal<double>({n, kDim}, rng);
  auto w = test::random_normal<double>({n, kDim}, rng);
  auto cache = test::random_attention_cache<double>(nb, kLen, 2, kDim, true, rng);
  for (int step = 0; step < 2; ++step) {  // twice: the exchange's buffers are reused
    CAPTURE(step);
    check_equal(p, comm, u, w, Policy::needs_attention ? &cache : nullptr);
  }
}

TEST_CASE("expert parallel: uneven counts, an expert with no tokens, a rank with none") {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  const auto cfg = config();
  Pair<SoftmaxRouter> p(cfg, comm, 51);
  Rng rng(52);
  const index_t n = kSeqs * world * kLen;
  auto u = test::random_normal<double>({n, kDim}, rng, 0.3);
  for (index_t i = 0; i < n; ++i) u(i, 0) += 3.0;  // every token has a large first component
  auto w = test::random_normal<double>({n, kDim}, rng);
  // the last two experts (rank W-1's at W = 4) score -30 below the others for every token
  for (auto* arena : {&p.ref_arena, &p.ep_arena}) {
    Tensor<double> weight = arena->value("moe.router.weight");
    for (const index_t e : {kExperts - 2, kExperts - 1}) {
      for (index_t c = 0; c < kDim; ++c) weight(e, c) = c == 0 ? -10.0 : 0.0;
    }
  }
  check_equal(p, comm, u, w, nullptr);
  // the scenario holds: those experts got no tokens, and the others uneven counts
  const DispatchPlan<>& plan = p.ref.plan();
  CHECK(plan.count(kExperts - 1) == 0);
  CHECK(plan.count(kExperts - 2) == 0);
  index_t lo = n, hi = 0;
  for (index_t e = 0; e < kExperts - 2; ++e) {
    lo = std::min(lo, plan.count(e));
    hi = std::max(hi, plan.count(e));
  }
  CHECK(hi > lo);
  // at 4 ranks the last rank holds just those two experts: it receives no rows at all
  if (world == 4 && comm.rank() == 3) CHECK(p.ep.expert_exchange().received_rows() == 0);
  index_t received = p.ep.expert_exchange().received_rows();
  comm.all_reduce_sum(std::span<index_t>(&received, 1));
  CHECK(received == n * cfg.router.k);  // every assignment went to exactly one rank
}

TEST_CASE("expert parallel: capacity drops stay on the sending rank") {
  // With a capacity, each rank drops by its own tokens (as data parallel routes per rank): compare
  // against one process run on this rank's tokens alone, whose drops are the same.
  dist::Communicator& comm = test::world();
  auto cfg = config();
  cfg.router.capacity_factor = 0.5;
  Pair<SoftmaxRouter> p(cfg, comm, 61);
  Rng rng(62 + static_cast<std::uint64_t>(comm.rank()));  // each rank its own tokens
  const index_t n = kSeqs * kLen;
  auto u = test::random_normal<double>({n, kDim}, rng);
  auto w = test::random_normal<double>({n, kDim}, rng);
  Tensor<double> y_ref, du_ref, y_ep, du_ep;
  p.ref.forward(u, {kLen, nullptr}, y_ref);
  p.ref.backward(w, du_ref);
  p.ep.forward(u, {kLen, nullptr}, y_ep);
  p.ep.backward(w, du_ep);
  CHECK(dropped_count(p.ep.routing().selection) > 0);
  CHECK(max_abs_diff(y_ep, y_ref) < 1e-12);
  CHECK(max_abs_diff(du_ep, du_ref) < 1e-12);
}

TEST_CASE("expert parallel: a training step equals one process's (averaged gradients, global clip)") {
  dist::Communicator& comm = test::world();
  const int world = comm.size(), rank = comm.rank();
  auto cfg = config();
  cfg.router.z_loss_coef = 0.01;  // a mean over tokens: averaging the ranks' gives the batch's
  Pair<SimilarityRouter> p(cfg, comm, 71);
  AdamWConfig ac;
  ac.lr = 0.05;
  AdamW<double> ref_opt(p.ref_arena, ac), ep_opt(p.ep_arena, ac);
  Rng rng(72);
  const index_t n = kSeqs * world * kLen, n0 = rank * kSeqs * kLen, n1 = n0 + kSeqs * kLen;
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    auto u = test::random_normal<double>({n, kDim}, rng);
    auto w = test::random_normal<double>({n, kDim}, rng);
    // the reference's loss is the mean over all W b sequences: dy = w / W; each rank's is the
    // mean over its own: dy = w, and average_gradients divides by W
    Tensor<double> w_ref = w.clone();
    scale(w_ref, 1.0 / world);
    Tensor<double> y, du;
    p.ref_arena.zero_grad();
    p.ref.forward(u, {kLen, nullptr}, y);
    p.ref.backward(w_ref, du);
    const double ref_norm = clip_grad_norm(p.ref_arena, 0.1);
    ref_opt.step(p.ref_arena);

    Tensor<double> y_ep, du_ep;
    p.ep_arena.zero_grad();
    p.ep.forward(rows_of(u, n0, n1), {kLen, nullptr}, y_ep);
    p.ep.backward(rows_of(w, n0, n1), du_ep);
    dist::average_gradients(comm, p.ep_arena);
    const double ep_norm = dist::clip_grad_norm(comm, p.ep_arena, 0.1);
    ep_opt.step(p.ep_arena);
    CHECK(dist::mean_over_ranks(comm, p.ep.routing().z_loss) ==
          doctest::Approx(p.ref.routing().z_loss).epsilon(1e-12));
    CHECK(ep_norm == doctest::Approx(ref_norm).epsilon(1e-12));
    CHECK(ref_norm > 0.1);  // the clip acted
    CHECK(max_param_diff(p.ep_arena, p.ref_arena) < 1e-11);
    CHECK(dist::max_parameter_divergence(comm, p.ep_arena) == 0.0);
  }
}

namespace {
// One training step of a layer on its rows of (u, w): loss = sum(y * w) / (rows of the whole
// batch), averaged gradients, the global clip, AdamW. Returns the loss summed over the ranks
// (the whole batch's). comm: the layer's communicator (nullptr: a one-process layer on all rows).
template <class Policy>
double train_step(MoELayer<Policy, double>& layer, ParameterArena<double>& arena,
                  AdamW<double>& opt, dist::Communicator* comm, const Tensor<double>& u,
                  const Tensor<double>& w, bool step = true) {
  const int world = comm != nullptr ? comm->size() : 1, rank = comm != nullptr ? comm->rank() : 0;
  const index_t n = u.rows() / world, n0 = rank * n;
  const Tensor<double> mu = rows_of(u, n0, n0 + n), mw = rows_of(w, n0, n0 + n);
  Tensor<double> dy = mw.clone();
  scale(dy, 1.0 / static_cast<double>(u.rows()) * world);  // each rank's loss: its mean x rows
  Tensor<double> y, du;
  arena.zero_grad();
  layer.forward(mu, {kLen, nullptr}, y);
  double loss = test::weighted_sum(y, mw) / static_cast<double>(u.rows());
  if (comm != nullptr) comm->all_reduce_sum(&loss, 1, dist::ElementType::F64);
  if (!step) return loss;
  layer.backward(dy, du);
  if (comm != nullptr) {
    dist::average_gradients(*comm, arena);
    dist::clip_grad_norm(*comm, arena, 0.1);
  } else {
    clip_grad_norm(arena, 0.1);
  }
  opt.step(arena);
  return loss;
}
}  // namespace

TEST_CASE("expert parallel: a checkpoint written at W ranks resumes at 1 and at W / 2 ranks") {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  auto cfg = config();
  cfg.router.z_loss_coef = 0.01;
  Pair<SimilarityRouter> p(cfg, comm, 81);
  AdamWConfig ac;
  ac.lr = 0.05;
  AdamW<double> ref_opt(p.ref_arena, ac), ep_opt(p.ep_arena, ac);
  Rng rng(82);
  const index_t n = kSeqs * world * kLen;
  std::vector<Tensor<double>> us, ws;
  for (int i = 0; i < 4; ++i) {
    us.push_back(test::random_normal<double>({n, kDim}, rng));
    ws.push_back(test::random_normal<double>({n, kDim}, rng));
  }
  for (int i = 0; i < 2; ++i) {
    const double lr = train_step(p.ref, p.ref_arena, ref_opt, nullptr, us[i], ws[i]);
    const double le = train_step(p.ep, p.ep_arena, ep_opt, &comm, us[i], ws[i]);
    CHECK(le == doctest::Approx(lr).epsilon(1e-11));
  }
  const std::string path = "test_expert_parallel_w" + std::to_string(world) + ".safetensors";
  // one process's function refuses what it cannot write whole
  CHECK(contains(error_of([&] { save_training_state(path, p.ep_arena, ep_opt, {}); }),
                 "holds expert shards"));
  CHECK(contains(error_of([&] {
                   std::vector<TensorRef> refs;
                   append_arena(refs, p.ep_arena);
                 }),
                 "is an expert shard"));
  dist::save_training_state(comm, path, p.ep_arena, ep_opt, {{"note", "test"}});
  comm.barrier();  // written before anyone reads
  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.at("model.moe.experts.w1").shape == Shape{kExperts, kFf, kDim});
  CHECK(f.at("adamw.v.moe.experts.b2").shape == Shape{kExperts, kDim});
  // the reference's next two losses (one step between them)
  const double next0 = train_step(p.ref, p.ref_arena, ref_opt, nullptr, us[2], ws[2]);
  const double next1 = train_step(p.ref, p.ref_arena, ref_opt, nullptr, us[3], ws[3], false);

  {  // world size 1: a one-process layer (other initial values, overwritten by the load)
    ParameterArena<double> a;
    MoELayer<SimilarityRouter, double> one;
    one.declare(a, "moe.", cfg);
    a.allocate();
    one.bind(a);
    Rng r(999);
    one.init(r);
    one.router().set_step(1);
    AdamW<double> opt(a, ac);
    load_training_state(f, a, opt);
    CHECK(opt.steps() == 2);
    CHECK(train_step(one, a, opt, nullptr, us[2], ws[2]) == doctest::Approx(next0).epsilon(1e-11));
    CHECK(train_step(one, a, opt, nullptr, us[3], ws[3], false) ==
          doctest::Approx(next1).epsilon(1e-11));
  }
  if (world >= 4) {  // world size W / 2: two groups of W / 2 ranks, each resuming the whole job
    MPI_Comm half_comm = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, comm.rank() / (world / 2), comm.rank(), &half_comm);
    {
      dist::MpiCommunicator half(half_comm);
      CHECK(half.size() == world / 2);
      // the half-world layer sees the batch rows of its own ranks: give it the whole batch
      // split W / 2 ways (train_step takes rows by the communicator's rank and size)
      ParameterArena<double> a;
      MoELayer<SimilarityRouter, double> ep;
      ep.declare(a, "moe.", cfg, half);
      a.allocate();
      ep.bind(a);
      Rng r(999);
      ep.init(r);
      ep.router().set_step(1);
      AdamW<double> opt(a, ac);
      load_training_state(f, a, opt);
      CHECK(train_step(ep, a, opt, &half, us[2], ws[2]) == doctest::Approx(next0).epsilon(1e-11));
      CHECK(train_step(ep, a, opt, &half, us[3], ws[3], false) ==
            doctest::Approx(next1).epsilon(1e-11));
    }
    MPI_Comm_free(&half_comm);
  }
  comm.barrier();
  if (comm.rank() == 0) std::remove(path.c_str());
}

TEST_CASE_TEMPLATE("expert parallel: a TransformerLM with its experts over W ranks and data parallel "
                   "trains as one process", Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter) {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  TransformerLMConfig cfg;
  cfg.vocab_size = 11;
  cfg.max_seq_len = 5;
  cfg.d_model = 8;
  cfg.num_layers = 2;
  cfg.num_heads = 2;
  cfg.d_ff = 6;
  cfg.router.num_experts = 4;
  cfg.router.k = 2;
  cfg.router.load_balance_coef = 0.0;  // per rank (docs/distributed.md)
  cfg.router.z_loss_coef = 0.01;
  cfg.router.allow_unused_options = true;  // one config for several routers
  cfg.router.options<Similarity>().tau = 2.0;
  test::set_scorer_init_std(cfg.router, 0.5);
  cfg.init_std = 0.3;
  AdamWConfig ac;
  ac.lr = 0.02;
  TransformerLM<Policy, double> ref(cfg, 7), ep(cfg, 7, comm);
  AdamW<double> ref_opt(ref.arena(), ac), ep_opt(ep.arena(), ac);
  CHECK(ep.arena().has_shards());
  CHECK(ep.arena().numel() < ref.arena().numel());
  Rng data(123);
  const index_t b = 2, t = 5, rows = b * world;
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    LMBatch global{Tensor<std::int32_t>({rows, t}), Tensor<std::int32_t>({rows, t})};
    for (index_t i = 0; i < rows * t; ++i) {
      global.inputs.data()[i] = static_cast<std::int32_t>(data.uniform_int(11));
      global.targets.data()[i] = static_cast<std::int32_t>(data.uniform_int(11));
    }
    ref.arena().zero_grad();
    const Loss lr = ref.forward(global.inputs, global.targets);
    ref.backward();
    const double ref_norm = clip_grad_norm(ref.arena(), 0.5);
    ref_opt.step(ref.arena());

    const LMBatch mine = dist::shard(global, comm);
    ep.arena().zero_grad();
    const Loss le = ep.forward(mine.inputs, mine.targets);
    ep.backward();
    dist::average_gradients(comm, ep.arena());
    const double ep_norm = dist::clip_grad_norm(comm, ep.arena(), 0.5);
    ep_opt.step(ep.arena());

    CHECK(dist::mean_over_ranks(comm, le.task) == doctest::Approx(lr.task).epsilon(1e-12));
    CHECK(dist::mean_over_ranks(comm, le.z_loss) == doctest::Approx(lr.z_loss).epsilon(1e-12));
    CHECK(ep_norm == doctest::Approx(ref_norm).epsilon(1e-11));
    CHECK(max_param_diff(ep.arena(), ref.arena()) < 1e-11);
    CHECK(dist::max_parameter_divergence(comm, ep.arena()) == 0.0);
  }
}

TEST_CASE("expert parallel: bad configurations are refused on every rank") {
  dist::Communicator& comm = test::world();
  auto cfg = config();
  cfg.router.num_experts = comm.size() * 2 + 1;  // not a multiple of the world size
  ParameterArena<double> arena;
  MoELayer<SoftmaxRouter, double> layer;
  const std::string e = error_of([&] { layer.declare(arena, "moe.", cfg, comm); });
  CHECK(contains(e, "must be a multiple of the number of expert-parallel ranks"));
  TransformerLMConfig lc;
  lc.router.num_experts = comm.size() * 2 + 1;
  TransformerLM<SoftmaxRouter, double> lm;
  ParameterArena<double> la;
  CHECK(contains(error_of([&] { lm.declare(la, "", lc, &comm); }), "must be a multiple"));
  CHECK(la.size() == 0);  // refused before any parameter was added
  CHECK(dist::expert_shard(4, 0, 1).count == 4);
  CHECK(dist::expert_shard(8, 3, 4).first == 6);
  CHECK(contains(error_of([] { (void)dist::expert_shard(8, 4, 4); }), "rank 4 out of range"));
}
