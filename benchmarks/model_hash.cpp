// benchmarks/model_hash: hashes the outputs and gradients of the models the benchmarks time, so
// that a change meant to move code without changing results (a refactor) can be checked
// bit for bit: build it before and after, run both, compare the lines.
//
//   cmake --build build --target model_hash && build/benchmarks/model_hash > after.txt
//   (or by hand against another tree: g++ -std=c++20 -O2 -fopenmp -DEIGEN_USE_BLAS
//    -DGRAPHMOE_USE_BLAS -I<tree>/include -I/usr/include/eigen3 model_hash.cpp -lopenblas)
//
//   model_hash            prints one line per (model, router, scalar type):
//                         "<name> loss=<hex> logits=<fnv64> grads=<fnv64>"
//
// Models: TransformerLM (the paper's medium shape scaled down: 2 layers, D = 64, 4 heads, E = 8,
// top-2, T = 64, batch 2, vocabulary 512) with every router of the paper's table on the LM
// (softmax, similarity, attention, X-MoE, SMoE-Dropout and their graph variants), the GLaM
// layout, and VisionMoE with the similarity and attention routers; float and double. Auxiliary
// losses on (load balancing 0.01, z-loss 0.001), one thread. It reads only public headers that
// exist before and after the refactor.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "graphmoe/graphmoe.hpp"
#include "model_hash.hpp"

using namespace graphmoe;
using graphmoe::bench::double_bits;
using graphmoe::bench::fnv_tensor;

namespace {

template <class Policy, class T>
void lm(const char* name, MoELayout layout) {
  TransformerLMConfig c;
  c.vocab_size = 512;
  c.max_seq_len = 64;
  c.d_model = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.d_ff = 64;
  c.layout = layout;
  c.router.num_experts = 8;
  c.router.k = 2;
  c.router.load_balance_coef = 0.01;
  c.router.z_loss_coef = 0.001;
  TransformerLM<Policy, T> m(c, 42);
  Tensor<std::int32_t, cpu> ids(Shape{2, 64}), targets(Shape{2, 64});
  Rng rng(7);
  for (index_t i = 0; i < ids.numel(); ++i) {
    ids.data()[i] = static_cast<std::int32_t>(rng.uniform_int(512));
    targets.data()[i] = static_cast<std::int32_t>(rng.uniform_int(512));
  }
  m.set_step(3);
  const Loss loss = m.forward(ids, targets);
  m.arena().zero_grad();
  m.backward();
  std::printf("lm/%s/%s/%s loss=%016" PRIx64 " logits=%016" PRIx64 " grads=%016" PRIx64 "\n",
              name, layout == MoELayout::Switch ? "switch" : "glam",
              sizeof(T) == 4 ? "float" : "double", double_bits(loss.total()),
              fnv_tensor(m.logits()), fnv_tensor(m.arena().grads()));
}

template <class Policy, class T>
void vision(const char* name) {
  VisionMoEConfig c;
  c.d_model = 32;
  c.num_layers = 2;
  c.num_heads = 4;
  c.d_ff = 32;
  c.moe_last = 1;
  c.router.num_experts = 4;
  c.router.k = 2;
  c.router.load_balance_coef = 0.01;
  VisionMoE<Policy, T> m(c, 5);
  Tensor<T, cpu> images(Shape{4, 28, 28});
  Rng rng(3);
  for (index_t i = 0; i < images.numel(); ++i) images.data()[i] = static_cast<T>(rng.uniform());
  Tensor<std::int32_t, cpu> labels(Shape{4});
  for (index_t i = 0; i < 4; ++i) labels.data()[i] = static_cast<std::int32_t>(i % 10);
  const Loss loss = m.forward(images, labels);
  m.arena().zero_grad();
  m.backward();
  std::printf("vision/%s/%s loss=%016" PRIx64 " logits=%016" PRIx64 " grads=%016" PRIx64 "\n",
              name, sizeof(T) == 4 ? "float" : "double", double_bits(loss.total()),
              fnv_tensor(m.logits()), fnv_tensor(m.arena().grads()));
}

template <class T>
void all() {
  lm<SoftmaxRouter, T>("softmax", MoELayout::Switch);
  lm<SimilarityRouter, T>("similarity", MoELayout::Switch);
  lm<AttentionRouter, T>("attention", MoELayout::Switch);
  lm<XMoERouter, T>("xmoe", MoELayout::Switch);
  lm<SimilarityXMoERouter, T>("similarity-xmoe", MoELayout::Switch);
  lm<AttentionSMoEDropoutRouter, T>("attention-smoe-dropout", MoELayout::Switch);
  lm<SMoEDropoutRouter, T>("smoe-dropout", MoELayout::Switch);
  lm<SimilarityRouter, T>("similarity", MoELayout::GLaM);
  vision<SimilarityRouter, T>("similarity");
  vision<AttentionRouter, T>("attention");
}

}  // namespace

int main() {
  set_num_threads(1);
  all<float>();
  all<double>();
  return 0;
}
