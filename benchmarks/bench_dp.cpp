// bench_dp: data-parallel LM training steps under mpiexec: tokens/s of the whole job and the bytes
// each rank hands MPI per step, against the analytic count (docs/distributed.md, docs/benchmarks.md).
//
//   mpiexec -n W [--oversubscribe] build/benchmarks/bench_dp [--router softmax|similarity]
//       [--batch-per-rank b] [--seq T] [--steps N] [--warmup K] [--threads t] [--ep 0|1]
//   bash benchmarks/compare/dp_scaling.sh       # W = 1, 2, 4 and a table
//   bash benchmarks/compare/dp_scaling.sh build -- --ep 1     # the same, expert parallel
//
// --ep 1: every MoE layer's experts split over the W ranks (expert parallel, the rest data
// parallel; docs/distributed.md "Expert parallel"). The all-to-all bytes are then the mean over
// the ranks of what each handed MPI per step, against the analytic mean: per MoE layer, E int64
// counts, then 4 x b T k rows of D floats: each row a rank routes is sent out (xs) and its
// result sent back (ys) in the forward, and the same again in the backward (dys out, dxs back);
// over the ranks, rows received equal rows sent (no capacity, so no drops). The all-reduce count is then the replicated parameters' gradients (expert shards
// are not all-reduced) plus 8 bytes for the global gradient norm.
//
// Weak scaling: every rank trains b sequences of T tokens a step (a global batch of W b), on
// random tokens (throughput does not depend on the text), with the main job's model shape
// (vocabulary 1,024, D = 128, 4 layers, 4 heads, d_ff = 256, E = 8, top-2). Rank 0 prints one line:
//   dp_lm router=R ranks=W threads=t tokens_per_s=... step_ms=... allreduce_bytes_per_step=...
//   analytic_allreduce_bytes=... agreement_bytes_per_step=... alltoall_bytes_per_step=0
// The analytic all-reduce count is the arena's gradient buffer, grads().numel() x 4 bytes
// (parameters plus the arena's alignment padding), once a step (with --ep, see below).
#include <mpi.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "graphmoe/core/threads.hpp"
#include "graphmoe/train/data_parallel.hpp"
#include "graphmoe/dist/mpi.hpp"
#include "graphmoe/models/transformer_lm.hpp"
#include "graphmoe/train/optim.hpp"

using namespace graphmoe;

namespace {

struct Args {
  std::string router = "softmax";
  index_t batch_per_rank = 4, seq = 128;
  int steps = 5, warmup = 1, threads = 1;
  bool ep = false;
};

long parse_int(const char* flag, const char* text, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  GRAPHMOE_CHECK(text[0] != '\0' && end != nullptr && *end == '\0' && errno == 0 && v >= lo && v <= hi,
                 "bench_dp", flag, " must be an integer in [", lo, ", ", hi, "], got '", text, "'");
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    GRAPHMOE_CHECK(i + 1 < argc, "bench_dp", f, " needs a value");
    const char* v = argv[++i];
    if (f == "--router") {
      a.router = v;
      GRAPHMOE_CHECK(a.router == "softmax" || a.router == "similarity", "bench_dp",
                     "--router must be softmax or similarity, got '", a.router, "'");
    } else if (f == "--batch-per-rank") {
      a.batch_per_rank = parse_int("--batch-per-rank", v, 1, 4096);
    } else if (f == "--seq") {
      a.seq = parse_int("--seq", v, 1, 8192);
    } else if (f == "--steps") {
      a.steps = static_cast<int>(parse_int("--steps", v, 1, 100000));
    } else if (f == "--warmup") {
      a.warmup = static_cast<int>(parse_int("--warmup", v, 0, 100000));
    } else if (f == "--threads") {
      a.threads = static_cast<int>(parse_int("--threads", v, 1, 1024));
    } else if (f == "--ep") {
      a.ep = parse_int("--ep", v, 0, 1) == 1;
    } else {
      GRAPHMOE_CHECK(false, "bench_dp", "unknown option '", f,
                     "' (--router, --batch-per-rank, --seq, --steps, --warmup, --threads, --ep)");
    }
  }
  return a;
}

template <class Policy>
void run(dist::Communicator& comm, const Args& a) {
  TransformerLMConfig cfg;
  cfg.vocab_size = 1024;
  cfg.max_seq_len = a.seq;
  cfg.d_model = 128;
  cfg.num_layers = 4;
  cfg.num_heads = 4;
  cfg.d_ff = 256;
  cfg.router.num_experts = 8;
  cfg.router.k = 2;
  TransformerLM<Policy, float> lm = a.ep ? TransformerLM<Policy, float>(cfg, 1, comm)
                                         : TransformerLM<Policy, float>(cfg, 1);
  AdamW<float> opt(lm.arena(), AdamWConfig{});
  dist::broadcast_parameters(comm, lm.arena());
  const int world = comm.size();
  Rng data(7);  // the same global batches everywhere; each rank takes its shard
  auto step = [&] {
    LMBatch global{Tensor<std::int32_t>({a.batch_per_rank * world, a.seq}),
                   Tensor<std::int32_t>({a.batch_per_rank * world, a.seq})};
    for (index_t i = 0; i < global.inputs.numel(); ++i) {
      global.inputs.data()[i] = static_cast<std::int32_t>(data.uniform_int(1024));
      global.targets.data()[i] = static_cast<std::int32_t>(data.uniform_int(1024));
    }
    const LMBatch mine = dist::shard(global, comm);
    lm.arena().zero_grad();
    lm.forward(mine.inputs, mine.targets);
    lm.backward();
    dist::average_gradients(comm, lm.arena());
    if (a.ep)
      dist::clip_grad_norm(comm, lm.arena(), 1.0);
    else
      clip_grad_norm(lm.arena(), 1.0);
    opt.step(lm.arena());
  };
  for (int i = 0; i < a.warmup; ++i) step();
  comm.barrier();
  comm.reset_traffic();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  comm.barrier();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const dist::Traffic t = comm.traffic();
  const double tokens = static_cast<double>(a.batch_per_rank * world * a.seq) * a.steps;
  double analytic = 0;  // the replicated ranges of the gradient buffer (all of it without --ep)
  for (const auto& [b, e] : dist::detail::replicated_ranges(lm.arena()))
    analytic += static_cast<double>(e - b) * sizeof(float);
  if (a.ep) analytic += sizeof(double);  // dist::clip_grad_norm's sum of the shards' squares
  index_t moe_layers = 0;
  for (index_t l = 0; l < cfg.num_layers; ++l) moe_layers += cfg.is_moe_layer(l) ? 1 : 0;
  const double analytic_a2a =
      a.ep ? static_cast<double>(moe_layers) *
                 (static_cast<double>(cfg.router.num_experts) * sizeof(std::int64_t) +
                  4.0 * static_cast<double>(a.batch_per_rank * a.seq * cfg.router.k) *
                      static_cast<double>(cfg.d_model) * sizeof(float))
           : 0.0;
  double a2a[2] = {static_cast<double>(t.all_to_all_sent_bytes),
                   static_cast<double>(t.all_to_all_received_bytes)};
  comm.all_reduce_sum(a2a, 2, dist::ElementType::F64);  // the mean over the ranks, below
  const double in_sync = dist::max_parameter_divergence(comm, lm.arena());
  if (comm.rank() == 0) {
    std::printf("dp_lm router=%s ranks=%d threads=%d batch_per_rank=%lld seq=%lld steps=%d "
                "tokens_per_s=%.1f step_ms=%.2f allreduce_bytes_per_step=%.0f "
                "analytic_allreduce_bytes=%.0f ratio=%.4f allreduce_calls_per_step=%.2f "
                "agreement_bytes_per_step=%.1f alltoall_bytes_per_step=%.0f "
                "alltoall_received_bytes_per_step=%.0f analytic_alltoall_bytes=%.0f ep=%d "
                "max_parameter_divergence=%g\n",
                a.router.c_str(), world, a.threads, static_cast<long long>(a.batch_per_rank),
                static_cast<long long>(a.seq), a.steps, tokens / secs, 1e3 * secs / a.steps,
                static_cast<double>(t.all_reduce_bytes) / a.steps, analytic,
                static_cast<double>(t.all_reduce_bytes) / a.steps / analytic,
                static_cast<double>(t.all_reduce_calls) / a.steps,
                static_cast<double>(t.agreement_bytes) / a.steps,
                a2a[0] / world / a.steps, a2a[1] / world / a.steps, analytic_a2a, a.ep ? 1 : 0,
                in_sync);
  }
}

}  // namespace

int main(int argc, char** argv) {
  dist::MpiEnvironment mpi(argc, argv);
  try {
    const Args a = parse(argc, argv);
    set_num_threads(a.threads);
    dist::MpiCommunicator comm;
    if (a.router == "similarity")
      run<SimilarityRouter>(comm, a);
    else
      run<SoftmaxRouter>(comm, a);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;  // every rank parses the same arguments, so every rank returns here
  }
  return 0;
}
