// Data parallel under mpiexec (ctest runs it with 2 and with 4 ranks): W ranks with b sequences
// each train the same steps as one process with the W b sequences, for each router (double, so
// that the only difference is the order of the sums: 1e-12).
//
// Under mpiexec with support/mpi_main.hpp's main(): only CHECK, never REQUIRE (see there).

#include <cmath>
#include <cstdint>
#include <string>

#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/optim.hpp"
#include "support/gradcheck.hpp"
#include "support/router_options.hpp"
#include "support/errors.hpp"
#include "support/mpi_main.hpp"

using namespace graphmoe;
using graphmoe::test::contains;
using graphmoe::test::error_of;

namespace {

TransformerLMConfig tiny() {
  TransformerLMConfig c;
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.d_model = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 6;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.load_balance_coef = 0.0;  // per shard, not per batch (see the last test case)
  c.router.z_loss_coef = 0.01;       // a mean over tokens: the same either way
  c.router.allow_unused_options = true;  // one config for several routers
  c.router.options<CosineScorer>().dim = 4;
  c.router.options<ScheduledTopK>().k_min = 1;
  c.router.options<ScheduledTopK>().k_max = 2;
  c.router.options<ScheduledTopK>().schedule_steps = 2;
  c.router.options<Similarity>().tau = 2.0;
  test::set_scorer_init_std(c.router, 0.5);
  c.init_std = 0.3;
  return c;
}

LMBatch random_batch(index_t rows, index_t t, index_t vocab, Rng& rng) {
  LMBatch b{Tensor<std::int32_t>({rows, t}), Tensor<std::int32_t>({rows, t})};
  for (index_t i = 0; i < rows * t; ++i) {
    b.inputs.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
    b.targets.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  }
  return b;
}

}  // namespace

TEST_CASE_TEMPLATE("data parallel: W ranks x b sequences train as one process with W b sequences",
                   Policy, SoftmaxRouter, SimilarityRouter, AttentionRouter, XMoERouter,
                   SMoEDropoutRouter) {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  const index_t b = 2, t = 5, rows = b * world;
  const auto cfg = tiny();
  AdamWConfig ac;
  ac.lr = 0.02;
  // the reference: one process, the whole batch (every rank computes the same one)
  TransformerLM<Policy, double> ref(cfg, 7);
  AdamW<double> ref_opt(ref.arena(), ac);
  // data parallel: each rank draws other parameters; the broadcast makes them the root's
  TransformerLM<Policy, double> dp(cfg, 7 + 1000 * static_cast<std::uint64_t>(comm.rank()));
  if (comm.rank() != 0) CHECK(test::max_rel_diff(dp.arena().values(), ref.arena().values()) > 0.1);
  dist::broadcast_parameters(comm, dp.arena());
  CHECK(test::max_rel_diff(dp.arena().values(), ref.arena().values()) == 0.0);
  AdamW<double> dp_opt(dp.arena(), ac);
  Rng data(123);  // the same global batches on every rank
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const LMBatch global = random_batch(rows, t, cfg.vocab_size, data);
    ref.set_step(step);
    dp.set_step(step);
    ref.arena().zero_grad();
    const Loss lr = ref.forward(global.inputs, global.targets);
    ref.backward();
    const double ref_norm = clip_grad_norm(ref.arena(), 0.5);
    ref_opt.step(ref.arena());

    const LMBatch mine = dist::shard(global, comm);
    CHECK(mine.inputs.shape() == Shape{b, t});
    dp.arena().zero_grad();
    const Loss ld = dp.forward(mine.inputs, mine.targets);
    dp.backward();
    const dist::Traffic before = comm.traffic();
    dist::average_gradients(comm, dp.arena());
    // one all-reduce of the whole gradient buffer: the analytic count, to the byte
    CHECK(comm.traffic().all_reduce_calls - before.all_reduce_calls == 1);
    CHECK(comm.traffic().all_reduce_bytes - before.all_reduce_bytes ==
          dp.arena().grads().numel() * static_cast<index_t>(sizeof(double)));
    CHECK(comm.traffic().agreement_calls - before.agreement_calls == 1);
    const double dp_norm = clip_grad_norm(dp.arena(), 0.5);
    dp_opt.step(dp.arena());

    CHECK(dist::mean_over_ranks(comm, ld.task) == doctest::Approx(lr.task).epsilon(1e-12));
    CHECK(dist::mean_over_ranks(comm, ld.z_loss) == doctest::Approx(lr.z_loss).epsilon(1e-12));
    CHECK(dp_norm == doctest::Approx(ref_norm).epsilon(1e-11));
    CHECK(test::max_rel_diff(dp.arena().values(), ref.arena().values()) < 1e-11);
    // the ranks stay bitwise in sync: the same averaged gradients, the same step
    CHECK(dist::max_parameter_divergence(comm, dp.arena()) == 0.0);
  }
}

TEST_CASE("data parallel: the load-balancing loss is per shard (the documented difference)") {
  dist::Communicator& comm = test::world();
  const int world = comm.size();
  auto cfg = tiny();
  cfg.router.load_balance_coef = 0.1;
  TransformerLM<SoftmaxRouter, double> ref(cfg, 3), dp(cfg, 3);
  Rng data(5);
  const LMBatch global = random_batch(2 * world, 5, cfg.vocab_size, data);
  const LMBatch mine = dist::shard(global, comm);
  const Loss lr = ref.forward(global.inputs, global.targets);
  const Loss ld = dp.forward(mine.inputs, mine.targets);
  // the task loss is the same, the balancing term is not: E sum_e f_e P_e is not linear in the
  // tokens, so the mean of the shards' values differs from the batch's
  CHECK(dist::mean_over_ranks(comm, ld.task) == doctest::Approx(lr.task).epsilon(1e-12));
  const double lb = dist::mean_over_ranks(comm, ld.load_balance);
  CHECK(lb > 0.0);
  CHECK(std::abs(lb - lr.load_balance) > 1e-9 * lr.load_balance);
}

TEST_CASE("data parallel: the average of rank-dependent gradients, a batch that does not split") {
  dist::Communicator& comm = test::world();
  Rng rng(1);
  const LMBatch odd = random_batch(comm.size() + 1, 3, 5, rng);
  CHECK(error_of([&] { dist::shard(odd, comm); }).find("equal shards") != std::string::npos);
  // on W ranks, the average of rank-dependent gradients
  ParameterArena<double> a;
  a.add("g", Shape{3});
  a.allocate();
  for (index_t i = 0; i < 3; ++i) a.grad(0).data()[i] = static_cast<double>(comm.rank() + 1) * static_cast<double>(i + 1);
  dist::average_gradients(comm, a);
  const double mean_rank = (comm.size() + 1) / 2.0;  // mean of 1..W
  for (index_t i = 0; i < 3; ++i) CHECK(a.grad(0).data()[i] == doctest::Approx(mean_rank * static_cast<double>(i + 1)).epsilon(1e-15));
}
