// benchmarks/model_hash_cuda: model_hash.cpp's bit-for-bit check for the CUDA backend. It hashes
// the outputs and gradients of CUDA models whose routers exercise every token-graph path (the
// fused Similarity kernels, the Similarity block path at each precision and with each option,
// the Attention graph at each precision, causal with one and with several row blocks, and not
// causal), the attention op and the padded experts' strided-batched GEMMs, so that a change meant
// to move CUDA code without changing results can be checked: build it before and after, run both,
// compare the lines.
//
//   cmake --build build --target model_hash_emulated && build/benchmarks/model_hash_emulated
//     (the CUDA emulation of tests/cuda/emulation: every kernel and cuBLAS call on the CPU, so the
//     lines are the same on any machine; built when the emulation tests are)
//
//   prints one line per case: "<name> loss=<hex> logits=<fnv64> grads=<fnv64>"
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "graphmoe/cuda.cuh"
#include "model_hash.hpp"

using namespace graphmoe;
using graphmoe::bench::double_bits;

namespace {

template <class T>
std::uint64_t fnv_device(const Tensor<T, graphmoe::cuda>& t) {
  return bench::fnv_tensor(to_host(t));
}

Tensor<std::int32_t, cpu> random_ids(index_t batch, index_t len, index_t vocab, Rng& rng) {
  Tensor<std::int32_t, cpu> t(Shape{batch, len});
  for (index_t i = 0; i < t.numel(); ++i)
    t.data()[i] = static_cast<std::int32_t>(rng.uniform_int(static_cast<std::uint32_t>(vocab)));
  return t;
}

// One TransformerLM<Policy, T, cuda> forward (with the loss) and backward on `batch` sequences of
// `len` tokens; `modify` sets the router's options.
template <class Policy, class T>
void lm(const std::string& name, index_t batch, index_t len,
        const std::function<void(TransformerLMConfig&)>& modify = {}) {
  TransformerLMConfig c;
  c.vocab_size = 61;
  c.max_seq_len = len;
  c.d_model = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 24;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.load_balance_coef = 0.01;
  c.router.z_loss_coef = 0.001;
  c.router.allow_unused_options = true;
  c.init_std = 0.2;
  if (modify) modify(c);
  TransformerLM<Policy, T, graphmoe::cuda> m(c, 42);
  Rng rng(7);
  const Tensor<std::int32_t, cpu> ids = random_ids(batch, len, c.vocab_size, rng);
  const Tensor<std::int32_t, cpu> targets = random_ids(batch, len, c.vocab_size, rng);
  m.set_step(3);
  const Loss loss = m.forward(to_device(ids), to_device(targets));
  m.arena().zero_grad();
  m.backward();
  std::printf("lm/%s/%s loss=%016" PRIx64 " logits=%016" PRIx64 " grads=%016" PRIx64 "\n",
              name.c_str(), sizeof(T) == 4 ? "float" : "double", double_bits(loss.total()),
              fnv_device(m.logits()), fnv_device(m.arena().grads()));
  std::fflush(stdout);
}

// VisionMoE<Policy, T, cuda>: graphs that are not causal.
template <class Policy, class T>
void vision(const std::string& name,
            const std::function<void(VisionMoEConfig&)>& modify = {}) {
  VisionMoEConfig c;
  c.d_model = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.d_ff = 16;
  c.moe_last = 1;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.load_balance_coef = 0.01;
  c.router.allow_unused_options = true;
  if (modify) modify(c);
  VisionMoE<Policy, T, graphmoe::cuda> m(c, 5);
  Tensor<T, cpu> images(Shape{2, 28, 28});
  Rng rng(3);
  for (index_t i = 0; i < images.numel(); ++i) images.data()[i] = static_cast<T>(rng.uniform());
  Tensor<std::int32_t, cpu> labels(Shape{2});
  for (index_t i = 0; i < 2; ++i) labels.data()[i] = static_cast<std::int32_t>(i % 10);
  const Loss loss = m.forward(to_device(images), to_device(labels));
  m.arena().zero_grad();
  m.backward();
  std::printf("vision/%s/%s loss=%016" PRIx64 " logits=%016" PRIx64 " grads=%016" PRIx64 "\n",
              name.c_str(), sizeof(T) == 4 ? "float" : "double", double_bits(loss.total()),
              fnv_device(m.logits()), fnv_device(m.arena().grads()));
  std::fflush(stdout);
}

template <class T>
void all() {
  constexpr bool is_float = std::is_same_v<T, float>;
  lm<SoftmaxRouter, T>("softmax", 2, 24);
  lm<SoftmaxRouter, T>("softmax-padded", 2, 24, [](TransformerLMConfig& c) {
    c.expert_layout = ExpertLayout::Padded;
    c.router.capacity_factor = 0.75;
  });
  lm<SimilarityRouter, T>("similarity", 2, 24);
  lm<SimilarityRouter, T>("similarity-options", 2, 24, [](TransformerLMConfig& c) {
    auto& o = c.router.options<Similarity>();
    o.tau_mode = TauMode::Learned;
    o.projection = true;
    o.exclude_self = true;
  });
  lm<AttentionRouter, T>("attention", 2, 24);
  lm<AttentionRouter, T>("attention-long", 1, 300);  // two causal row blocks
  vision<SimilarityRouter, T>("similarity-options", [](VisionMoEConfig& c) {
    c.router.options<Similarity>().exclude_self = true;
  });
  vision<AttentionRouter, T>("attention");
  if constexpr (is_float) {
    for (const GraphPrecision p : {GraphPrecision::TF32, GraphPrecision::BF16}) {
      const std::string tag = graph_precision_name(p);
      lm<SimilarityRouter, T>("similarity-" + tag, 2, 24, [p](TransformerLMConfig& c) {
        c.router.options<Similarity>().precision = p;
      });
      lm<SimilarityRouter, T>("similarity-long-" + tag, 1, 300, [p](TransformerLMConfig& c) {
        c.router.options<Similarity>().precision = p;
      });
      lm<AttentionRouter, T>("attention-" + tag, 2, 24, [p](TransformerLMConfig& c) {
        c.router.options<Attention>().precision = p;
      });
      lm<AttentionRouter, T>("attention-long-" + tag, 1, 300, [p](TransformerLMConfig& c) {
        c.router.options<Attention>().precision = p;
      });
      vision<AttentionRouter, T>("attention-" + tag, [p](VisionMoEConfig& c) {
        c.router.options<Attention>().precision = p;
      });
    }
  }
}

}  // namespace

int main() {
  all<float>();
  all<double>();
  return 0;
}
