// Decode speed: tokens/s of a float TransformerLM generating one token per sequence and
// step, incrementally (inference/decoder.hpp: the KV cache and the routing caches) and by the O(t^2)
// reference that runs a full forward over the context for every new token (what
// Decoding::FullForward does).
//
// Model: the paper's medium shape (TransformerLMConfig::paper_medium: 6 pre-norm blocks, D = 352,
// 8 heads, d_ff = 352, every FFN an MoE with E = 16 experts, top-2, GELU (tanh), learned positions,
// tied head) with a vocabulary of 10000 and max_seq_len 1088 (a 1024-token prompt plus 64), random
// weights (seed 1), Mode::Eval. Routers: SoftmaxRouter, SimilarityRouter, AttentionRouter.
// Token ids are random with a fixed seed.
//
// The olmoe cases: the olmoe preset (TransformerLMConfig::olmoe(10000): 4 pre-norm blocks, D = 256,
// 8 heads, RMSNorm, RoPE base 10000 (HalfSplit), QK-norm over the whole q and k projections,
// SwiGLU experts without biases, E = 64 experts of width 128, top-8 with unnormalised gates, the
// router's linear with its bias, untied head) with max_seq_len 576 (a 512-token prompt plus 64),
// random weights (seed 1), Mode::Eval; routers SoftmaxRouter and SimilarityRouter; batch 1.
//
//   ./benchmarks/bench_decode --benchmark_filter='BM_decode_incremental'
//   python3 benchmarks/compare/decode_torch.py --build-dir build     (beside PyTorch)
//   python3 benchmarks/compare/decode_torch.py --build-dir build --arch olmoe   (the olmoe cases)
//
// Arguments: {batch, prompt, threads} (threads: graphmoe::set_num_threads; 2, the comparison's
// default, and 1). Each case builds its model and prefills its own decoder: filter to the cases
// wanted (the comparison script runs one case per process).
//
// BM_decode_incremental_<router>: a Decoder with `batch` slots; every slot is fed the `prompt`
//   tokens first (untimed; Decoder::prefill, slot by slot, in chunks of 256 tokens), then each iteration is one step: one new token per slot at the position after the
//   slot's last. Every kRewindEvery steps every slot is rewound to the prompt's length
//   (Decoder::rewind, O(1)), so the timed steps stay at positions prompt .. prompt + 15.
//   items_per_second = tokens (batch per step). Counters: kv_values/token and
//   routing_values/token (DecodeCache::kv_values_per_token, routing_values_per_token, summed over
//   the layers) and cache_MiB (those values for all slots at max_seq_len, 4 bytes each: the
//   Attention graph's per-head entropy sums are doubles, so its MiB is a little low).
// BM_decode_incremental_olmoe_<router>: the same timed loop on the olmoe preset, batch 1, prompts
//   64 and 512, threads 2 and 1; the same counters (cache_MiB at max_seq_len 576) and params (the
//   model's parameters, ParameterArena::numel: decode_torch.py checks its PyTorch model against it).
// BM_prefill_<router>: time to first token: each iteration resets slot 0 of a one-slot Decoder
//   and feeds the `prompt` tokens with Decoder::prefill in steps of `chunk` tokens (chunk 1:
//   step by step, one token per step (Decoder::step's way); 256: GEMMs of 256 rows), which
//   returns the last token's logits (what the first generated token is drawn from). One untimed
//   step of `chunk` tokens first (first-touch allocations). items_per_second = prompt tokens.
// BM_decode_full_forward_<router>: each iteration is one TransformerLM::forward over
//   (batch, prompt) ids, i.e. the cost of the next token of every sequence when nothing is cached
//   (the logits of every position are computed, as Decoding::FullForward's forward does);
//   items_per_second = tokens (batch per forward). One untimed forward first.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "graphmoe/inference/decoder.hpp"
#include "graphmoe/models/transformer_lm.hpp"

using namespace graphmoe;

namespace {

constexpr index_t kVocab = 10000, kMaxSeq = 1088;
constexpr index_t kOlmoeMaxSeq = 576;  // the olmoe cases: a 512-token prompt plus 64
constexpr index_t kRewindEvery = 16;

TransformerLMConfig decode_config() {
  TransformerLMConfig c = TransformerLMConfig::paper_medium(kVocab);
  c.max_seq_len = kMaxSeq;
  return c;
}

TransformerLMConfig olmoe_decode_config() {
  TransformerLMConfig c = TransformerLMConfig::olmoe(kVocab);
  c.max_seq_len = kOlmoeMaxSeq;
  return c;
}

std::vector<std::int32_t> random_ids(index_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = static_cast<std::int32_t>(rng.next_u32() % kVocab);
  return ids;
}

// cfg: the model (decode_config() or olmoe_decode_config()); params: add the params counter.
template <class Policy>
void BM_decode_incremental(benchmark::State& state, const TransformerLMConfig& cfg, bool params) {
  using T = float;
  const index_t batch = state.range(0), prompt = state.range(1);
  set_num_threads(static_cast<int>(state.range(2)));
  TransformerLM<Policy, T> lm(cfg, /*seed=*/1);
  lm.set_mode(Mode::Eval);
  Decoder<Policy, T> dec(lm, batch);

  std::vector<index_t> slots(static_cast<std::size_t>(batch));
  for (index_t s = 0; s < batch; ++s) slots[static_cast<std::size_t>(s)] = s;
  const std::vector<std::int32_t> prompt_ids = random_ids(batch * prompt, 7);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch));
  // prefill, untimed
  for (index_t s = 0; s < batch; ++s)
    (void)dec.prefill(s, std::span<const std::int32_t>(prompt_ids).subspan(
                             static_cast<std::size_t>(s * prompt), static_cast<std::size_t>(prompt)));
  // the generated tokens: random ids (sampling is not timed here)
  const std::vector<std::int32_t> gen = random_ids(batch * kRewindEvery, 11);
  index_t k = 0;
  for (auto _ : state) {
    if (k == kRewindEvery) {
      for (index_t s = 0; s < batch; ++s) dec.rewind(s, prompt);
      k = 0;
    }
    for (index_t s = 0; s < batch; ++s)
      ids[static_cast<std::size_t>(s)] = gen[static_cast<std::size_t>(k * batch + s)];
    const Tensor<T, cpu>& logits = dec.step(slots, ids);
    benchmark::DoNotOptimize(logits.data());
    ++k;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * batch);
  const auto& cache = dec.cache();
  const index_t kv = cache.kv_values_per_token(), routing = cache.routing_values_per_token();
  state.counters["kv_values/token"] = static_cast<double>(kv);
  state.counters["routing_values/token"] = static_cast<double>(routing);
  state.counters["cache_MiB"] = static_cast<double>((kv + routing) * batch * cfg.max_seq_len) *
                                sizeof(T) / (1024.0 * 1024.0);
  if (params) state.counters["params"] = static_cast<double>(lm.arena().numel());
  set_num_threads(1);
}

template <class Policy>
void BM_prefill(benchmark::State& state) {
  using T = float;
  const index_t prompt = state.range(0), chunk = state.range(1);
  set_num_threads(static_cast<int>(state.range(2)));
  TransformerLM<Policy, T> lm(decode_config(), /*seed=*/1);
  lm.set_mode(Mode::Eval);
  Decoder<Policy, T> dec(lm, 1);
  const std::vector<std::int32_t> ids = random_ids(prompt, 7);
  const std::span<const std::int32_t> all(ids);
  (void)dec.prefill(0, all.first(static_cast<std::size_t>(std::min(chunk, prompt))), chunk);
  for (auto _ : state) {
    dec.reset(0);
    const Tensor<T, cpu>& logits = dec.prefill(0, all, chunk);
    benchmark::DoNotOptimize(logits.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * prompt);
  set_num_threads(1);
}

template <class Policy>
void BM_decode_full_forward(benchmark::State& state) {
  using T = float;
  const index_t batch = state.range(0), prompt = state.range(1);
  set_num_threads(static_cast<int>(state.range(2)));
  TransformerLM<Policy, T> lm(decode_config(), /*seed=*/1);
  lm.set_mode(Mode::Eval);
  const std::vector<std::int32_t> prompt_ids = random_ids(batch * prompt, 7);
  Tensor<std::int32_t> ids(Shape{batch, prompt});
  std::copy(prompt_ids.begin(), prompt_ids.end(), ids.data());
  const Tensor<std::int32_t> no_targets;
  lm.forward(ids, no_targets);  // first-touch allocations
  for (auto _ : state) {
    lm.forward(ids, no_targets);
    benchmark::DoNotOptimize(lm.logits().data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * batch);
  set_num_threads(1);
}

// Iterations are fixed per case, so that Google Benchmark calls each case once (the prefill of
// 8 x 1024 tokens is not repeated to estimate an iteration count): incremental, 96 steps (6 rewinds);
// full forward, 32 forwards of 64 tokens, 8 of 1024 (one sequence) and 2 of 8 x 1024.
template <class Policy>
void register_router(const char* router) {
  for (int threads : {2, 1})
    for (index_t batch : {1, 8})
      for (index_t prompt : {64, 1024}) {
        benchmark::RegisterBenchmark(("BM_decode_incremental_" + std::string(router)).c_str(),
                                     BM_decode_incremental<Policy>, decode_config(), false)
            ->Args({batch, prompt, threads})
            ->ArgNames({"batch", "prompt", "threads"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(96);
        const index_t tokens = batch * prompt;
        const index_t iters = tokens <= 64 ? 32 : tokens <= 1024 ? 8 : 2;
        benchmark::RegisterBenchmark(("BM_decode_full_forward_" + std::string(router)).c_str(),
                                     BM_decode_full_forward<Policy>)
            ->Args({batch, prompt, threads})
            ->ArgNames({"batch", "prompt", "threads"})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->Iterations(iters);
      }
  // time to first token of a 1024-token prompt at batch 1, 2 threads: step by step against
  // chunks of 256 (2 prefills each)
  for (index_t chunk : {1, 256})
    benchmark::RegisterBenchmark(("BM_prefill_" + std::string(router)).c_str(), BM_prefill<Policy>)
        ->Args({1024, chunk, 2})
        ->ArgNames({"prompt", "chunk", "threads"})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(2);
}

// The olmoe preset at batch 1: incremental decoding only, 96 steps as above.
template <class Policy>
void register_olmoe_router(const char* router) {
  for (int threads : {2, 1})
    for (index_t prompt : {64, 512})
      benchmark::RegisterBenchmark(("BM_decode_incremental_olmoe_" + std::string(router)).c_str(),
                                   BM_decode_incremental<Policy>, olmoe_decode_config(), true)
          ->Args({1, prompt, threads})
          ->ArgNames({"batch", "prompt", "threads"})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->Iterations(96);
}

}  // namespace

int main(int argc, char** argv) {
  register_router<SoftmaxRouter>("softmax");
  register_router<SimilarityRouter>("similarity");
  register_router<AttentionRouter>("attention");
  register_olmoe_router<SoftmaxRouter>("softmax");
  register_olmoe_router<SimilarityRouter>("similarity");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
