// benchmarks/preset_dump: one preset of TransformerLMConfig::preset through a forward and one
// training step, written to a directory for benchmarks/compare/preset_torch.py to redo in PyTorch.
//
//   preset_dump --arch olmoe --router softmax --out DIR [--vocab 128] [--seq 16] [--batch 2]
//               [--seed 1] [--d-model 64] [--blocks 4] [--tau 1] [--lr 1e-3] [--clip 1]
//               [--weight-decay 0.01] [--double]
//
// The preset's architecture on a smaller shape (--d-model, --blocks; every other field is the
// preset's; --d-model 0 / --blocks 0 keep the preset's). The router is a name of the library's
// registry (graphmoe/routing/registry.hpp: softmax, sigmoid-bias, similarity, ...). After the
// model's own init from --seed, the norm gains are set to 1 + 0.1 z, every bias (the routers'
// included) and the bias-balanced selector's expert_bias to 0.02 z (z ~ N(0, 1) from a second
// stream), so that the weights' names and the biased selection are exercised.
//
// Then, as examples/train_lm's loop does (with a constant learning rate instead of its schedule):
// forward (mean cross-entropy + the routers' weighted auxiliary losses), zero_grad, backward,
// clip_grad_norm, AdamW step, after_optimizer_step (the bias update of sigmoid-bias routers), and
// a second forward on the same batch. Written to DIR:
//   config.json             the model, router, optimizer, the parameters (trainable, decayed)
//   weights.safetensors     the parameters before the step (append_arena)
//   grads.safetensors       their gradients before clipping
//   weights_step1.safetensors  the parameters after the step (expert_bias buffers included)
//   outputs.safetensors     ids, targets (B, T); logits, logits_step1 (B, T, V); per MoE block i
//                           blocks.<i>.indices / .gates (N, k) of both forwards (suffix _step1)
//   results.json            the two forwards' losses broken down, the gradient norm
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/lm_config.hpp"
#include "graphmoe/graphmoe.hpp"

using namespace graphmoe;
namespace fs = std::filesystem;

namespace {

struct Args {
  std::string arch = "gpt", router = "softmax", out;
  index_t vocab = 128, seq = 16, batch = 2, d_model = 64, blocks = 4;
  std::uint64_t seed = 1;
  double tau = 1.0, lr = 1e-3, clip = 1.0, weight_decay = 0.01;
  bool use_double = false;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "preset_dump: %s\nusage: preset_dump --arch A --router R --out DIR [--vocab V] "
               "[--seq T] [--batch B] [--seed S] [--d-model D] [--blocks L] [--tau X] [--lr X] "
               "[--clip X] [--weight-decay X] [--double]\n",
               msg);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--double") {
      a.use_double = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing value after " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--arch") a.arch = v;
    else if (k == "--router") a.router = v;
    else if (k == "--out") a.out = v;
    else if (k == "--vocab") a.vocab = std::stoll(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--seed") a.seed = std::stoull(v);
    else if (k == "--d-model") a.d_model = std::stoll(v);
    else if (k == "--blocks") a.blocks = std::stoll(v);
    else if (k == "--tau") a.tau = std::stod(v);
    else if (k == "--lr") a.lr = std::stod(v);
    else if (k == "--clip") a.clip = std::stod(v);
    else if (k == "--weight-decay") a.weight_decay = std::stod(v);
    else usage(("unknown option " + k).c_str());
  }
  if (a.out.empty()) usage("--out is required");
  return a;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

template <class T>
void save_arena(const std::string& path, const ParameterArena<T, cpu>& arena, bool grads) {
  std::vector<TensorRef> refs;
  if (!grads) {
    append_arena(refs, arena);
  } else {
    for (index_t i = 0; i < arena.size(); ++i) {
      const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
      refs.push_back({p.name, dtype_of<T>(), p.shape, arena.grad(i).data()});
    }
  }
  save_safetensors(path, refs);
}

nlohmann::json loss_json(const Loss& l) {
  return {{"task", l.task}, {"load_balance", l.load_balance}, {"z_loss", l.z_loss},
          {"total", l.total()}};
}

template <class Policy, class T>
int run(const Args& a) {
  TransformerLMConfig cfg = TransformerLMConfig::preset(a.arch, a.vocab);
  if (a.d_model > 0) cfg.d_model = a.d_model;
  if (a.blocks > 0) cfg.num_layers = a.blocks;
  cfg.max_seq_len = std::max(cfg.max_seq_len, a.seq);
  cfg.router.options<Similarity>().tau = a.tau;
  cfg.router.allow_unused_options = true;
  TransformerLM<Policy, T> lm(cfg, a.seed);
  ParameterArena<T, cpu>& arena = lm.arena();

  // norm gains, biases and expert biases away from their initial constants
  Rng prng(a.seed * 1000003ull + 17);
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    Tensor<T, cpu> v = arena.value(i);
    const bool gain = p.shape.rank() == 1 && ends_with(p.name, ".weight");
    const bool bias = ends_with(p.name, "bias");  // ".bias", "selector.expert_bias"
    if (!gain && !bias) continue;
    for (index_t j = 0; j < v.numel(); ++j)
      v.data()[j] = static_cast<T>(gain ? 1.0 + 0.1 * prng.normal() : 0.02 * prng.normal());
  }
  arena.mark_values_written();

  const index_t b = a.batch, t = a.seq;
  Tensor<std::int32_t, cpu> ids(Shape{b, t}), targets(Shape{b, t});
  Rng drng(a.seed + 12345);
  for (index_t i = 0; i < ids.numel(); ++i) {
    ids.data()[i] = static_cast<std::int32_t>(drng.uniform_int(static_cast<std::uint64_t>(a.vocab)));
    targets.data()[i] = static_cast<std::int32_t>(drng.uniform_int(static_cast<std::uint64_t>(a.vocab)));
  }

  fs::create_directories(a.out);
  const fs::path dir(a.out);
  save_arena((dir / "weights.safetensors").string(), arena, false);

  // the per-block selections of the last forward, kept (the tensors are reused by the next one)
  std::vector<Tensor<std::int32_t, cpu>> keep_idx;
  std::vector<Tensor<T, cpu>> keep_gates;
  std::vector<std::string> keep_names;
  auto keep_routing = [&](const std::string& suffix) {
    for (index_t l = 0; l < cfg.num_layers; ++l) {
      if (!lm.block(l).is_moe()) continue;
      const auto& sel = lm.block(l).moe().routing().selection;
      keep_idx.push_back(sel.indices.clone());
      keep_gates.push_back(sel.gates.clone());
      keep_names.push_back("blocks." + std::to_string(l) + ".%s" + suffix);
    }
  };

  lm.set_step(0);
  const Loss loss0 = lm.forward(ids, targets);
  const Tensor<T, cpu> logits0 = lm.logits().clone();
  keep_routing("");
  arena.zero_grad();
  lm.backward();
  save_arena((dir / "grads.safetensors").string(), arena, true);
  const double norm = clip_grad_norm(arena, a.clip);
  AdamWConfig acfg;
  acfg.lr = a.lr;
  acfg.weight_decay = a.weight_decay;
  AdamW<T, cpu> adam(arena, acfg);
  adam.step(arena, a.lr);
  lm.after_optimizer_step();
  save_arena((dir / "weights_step1.safetensors").string(), arena, false);
  lm.set_step(1);
  const Loss loss1 = lm.forward(ids, targets);
  const Tensor<T, cpu> logits1 = lm.logits().clone();
  keep_routing("_step1");

  std::vector<TensorRef> outs = {
      {"ids", DType::I32, ids.shape(), ids.data()},
      {"targets", DType::I32, targets.shape(), targets.data()},
      {"logits", dtype_of<T>(), logits0.shape(), logits0.data()},
      {"logits_step1", dtype_of<T>(), logits1.shape(), logits1.data()}};
  std::vector<std::string> names;  // kept alive while outs refers to them
  names.reserve(2 * keep_names.size());
  for (std::size_t i = 0; i < keep_names.size(); ++i) {
    const std::string& n = keep_names[i];
    const std::size_t at = n.find("%s");
    names.push_back(n.substr(0, at) + "indices" + n.substr(at + 2));
    names.push_back(n.substr(0, at) + "gates" + n.substr(at + 2));
  }
  for (std::size_t i = 0; i < keep_names.size(); ++i) {
    outs.push_back({names[2 * i], DType::I32, keep_idx[i].shape(), keep_idx[i].data()});
    outs.push_back({names[2 * i + 1], dtype_of<T>(), keep_gates[i].shape(), keep_gates[i].data()});
  }
  save_safetensors((dir / "outputs.safetensors").string(), outs);

  // config.json: the train_lm record of the config, then every field spelled out
  nlohmann::json j = examples::lm_config_json(cfg, a.router, false);
  const auto& at = cfg.attention;
  const TokenChoiceOptions& choice = cfg.router.options<TopK>();  // BiasBalancedTopK's too
  std::vector<index_t> moe_layers;
  for (index_t l = 0; l < cfg.num_layers; ++l)
    if (cfg.is_moe_layer(l)) moe_layers.push_back(l);
  j.update(nlohmann::json{
      {"arch", a.arch},
      {"router", a.router},
      {"router_policy", Policy::name()},
      {"dtype", sizeof(T) == 4 ? "float32" : "float64"},
      {"activation", ffn_activation_name(cfg.activation)},
      {"gelu", cfg.gelu == GeluForm::Tanh ? "tanh" : "erf"},
      {"ffn_bias", cfg.ffn_bias},
      {"norm", norm_kind_name(cfg.norm)},
      {"norm_eps", cfg.norm_eps},
      {"num_kv_heads", at.num_kv_heads == 0 ? cfg.num_heads : at.num_kv_heads},
      {"rope_theta", at.rope_theta},
      {"rope_layout", at.rope_layout == RopeLayout::Interleaved ? "interleaved" : "half-split"},
      {"qk_norm", at.qk_norm == QKNorm::None ? "none" : (at.qk_norm == QKNorm::Full ? "full" : "per-head")},
      {"qk_norm_eps", at.qk_norm_eps},
      {"qkv_bias", at.qkv_bias},
      {"out_bias", at.out_bias},
      {"expert_d_ff", cfg.experts_width()},
      {"shared_d_ff", cfg.shared_d_ff},
      {"shared_expert_gate", cfg.shared_expert_gate},
      {"first_k_dense", cfg.first_k_dense},
      {"moe_every", cfg.moe_every},
      {"moe_layers", moe_layers},
      {"causal", cfg.router.causal},
      {"capacity_factor", cfg.router.capacity_factor},
      {"norm_topk_prob", choice.norm_topk_prob},
      {"routed_scaling_factor", choice.routed_scaling_factor},
      {"n_group", choice.n_group},
      {"topk_group", choice.topk_group},
      {"bias_update_rate", cfg.router.options<BiasBalancedTopK>().bias_update_rate},
      {"tau", cfg.router.options<Similarity>().tau},
      {"tau_mode", static_cast<int>(cfg.router.options<Similarity>().tau_mode)},
      {"batch", b},
      {"seq", t},
      {"seed", a.seed},
      {"optimizer",
       {{"lr", a.lr}, {"beta1", acfg.beta1}, {"beta2", acfg.beta2}, {"eps", acfg.eps},
        {"weight_decay", a.weight_decay}, {"clip", a.clip}}}});
  nlohmann::json params = nlohmann::json::array();
  for (index_t i = 0; i < arena.size(); ++i) {
    const ParameterInfo& p = arena.params()[static_cast<std::size_t>(i)];
    std::vector<index_t> shape(p.shape.begin(), p.shape.end());
    params.push_back({{"name", p.name}, {"shape", shape}, {"trainable", p.trainable},
                      {"decay", p.trainable && adam.decays(i)}});
  }
  j["params"] = params;
  std::ofstream(dir / "config.json") << j.dump(1) << "\n";
  std::ofstream(dir / "results.json")
      << nlohmann::json{{"loss", loss_json(loss0)}, {"loss_step1", loss_json(loss1)},
                        {"grad_norm", norm}}
             .dump(1)
      << "\n";
  std::printf("preset_dump %s %s %s: loss %.9g (task %.9g), grad norm %.6g, step-1 loss %.9g -> %s\n",
              a.arch.c_str(), a.router.c_str(), sizeof(T) == 4 ? "float" : "double", loss0.total(),
              loss0.task, norm, loss1.total(), a.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  set_num_threads(1);
  try {
    // the registry's names; the routers PyTorch redoes are compiled (each one is two models)
    return with_router(a.router, [&]<class Policy>() -> int {
      if constexpr (std::is_same_v<Policy, SoftmaxRouter> ||
                    std::is_same_v<Policy, SigmoidBiasRouter> ||
                    std::is_same_v<Policy, SimilarityRouter> ||
                    std::is_same_v<Policy, SimilaritySigmoidBiasRouter>) {
        return a.use_double ? run<Policy, double>(a) : run<Policy, float>(a);
      } else {
        std::fprintf(stderr, "preset_dump: router '%s' (%s) is not built here; built: softmax, "
                     "sigmoid-bias, similarity, sigmoid-bias-similarity\n", a.router.c_str(),
                     Policy::name().c_str());
        return 2;
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "preset_dump: %s\n", e.what());
    return 1;
  }
}
