// graphmoe/models/upcycling.hpp: a model started from another one's weights, so that it computes
// what the other computed at step 0.
//
//   upcycle(from, to);   // to: declared, allocated, bound and initialised (TransformerLM)
//
// Every parameter of `to` is filled from `from` by one of three rules, or the call throws naming
// the parameter:
//   copied     `from` has a parameter of the same name and shape: its values (embeddings,
//              attention, norms, dense FFNs, the head; and an MoE block's router and experts
//              when `from` has them, so a pretrained MoE takes another router: below)
//   cloned     the expert bank of a block that is MoE in `to` and dense in `from`: every expert
//              a copy of the dense FFN (fc1 -> w1[e], its bias -> b1[e], fc2 -> w2[e], its bias
//              -> b2[e]): sparse upcycling (Komatsuzaki et al. 2023; Megatron-Core's
//              --moe-use-upcycling)
//   kept       what `from` cannot have: the router of such a block (as `to` drew it: the
//              experts are equal, so any router gives the dense output), a token graph's own
//              parameters ("graph." under a router: Blended's mixing weight, a learned
//              temperature) and untrained buffers (a bias-balancing selector's bias)
// and every parameter of `from` must be used (one left over means the models differ).
//
// Dense to MoE. A block's output equals the dense block's when its gates sum to 1 for every
// token: the selector renormalises (TokenChoiceOptions::norm_topk_prob, the default), the routed
// scaling factor is 1, nothing is dropped (capacity_factor <= 0) and there is no shared expert
// (its output would be added): `upcycle` refuses the others by name. With equal experts,
// sum_j g_j FFN(x) = FFN(x): the logits equal the dense model's up to rounding (exactly in real
// arithmetic; within 1e-15 relative in double).
//
// MoE to graph-aware MoE (graph upcycling). `to`'s router a Blended<G> graph router
// (BlendedSimilarityRouter, routing/graphs/blended.hpp) with a = 0 over the same scorer and
// selector: every weight copied, a kept at 0, and the model computes exactly what `from` did
// (bit for bit) until training moves a.
//
// The two models must compute alike apart from the MoE blocks: the sizes, norm, activation, GELU
// form, attention options and embeddings' tying are compared first. CPU (host-memory backends):
// upcycle once, then train on any backend from the saved checkpoint.
#pragma once

#include <cstring>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "graphmoe/config.hpp"
#include "graphmoe/models/transformer_lm.hpp"

namespace graphmoe {

namespace detail {

// "blocks.<i>." of a parameter name (relative to the model's prefix), and i; -1 when the name is
// not a block's.
inline index_t upcycle_block_of(const std::string& name, std::string* rest = nullptr) {
  const std::string pre = "blocks.";
  if (name.rfind(pre, 0) != 0) return -1;
  const std::size_t dot = name.find('.', pre.size());
  if (dot == std::string::npos) return -1;
  index_t i = 0;
  for (std::size_t c = pre.size(); c < dot; ++c) {
    if (name[c] < '0' || name[c] > '9') return -1;
    i = i * 10 + (name[c] - '0');
  }
  if (rest != nullptr) *rest = name.substr(dot + 1);
  return i;
}

}  // namespace detail

template <class RFrom, class RTo, class T, class B, class C>
  requires(B::host_memory)
void upcycle(const TransformerLM<RFrom, T, B, C>& from, TransformerLM<RTo, T, B, C>& to) {
  constexpr const char* op = "upcycle";
  GRAPHMOE_CHECK(from.bound() && to.bound(), op, "both models must be declared, allocated and "
                 "bound (and `to` initialised) first");
  const TransformerLMConfig& a = from.config();
  const TransformerLMConfig& b = to.config();
  auto same = [&](bool ok, const char* field) {
    GRAPHMOE_CHECK(ok, op, "the models differ in ", field,
                   ": upcycling copies a model into one that computes the same apart from its "
                   "MoE blocks");
  };
  same(a.vocab_size == b.vocab_size, "vocab_size");
  same(a.d_model == b.d_model, "d_model");
  same(a.num_layers == b.num_layers, "num_layers");
  same(a.num_heads == b.num_heads, "num_heads");
  same(a.tie_embeddings == b.tie_embeddings, "tie_embeddings");
  same(a.activation == b.activation, "activation");
  same(a.ffn_bias == b.ffn_bias, "ffn_bias");
  same(a.gelu == b.gelu, "gelu");
  same(a.norm == b.norm, "norm");
  same(a.norm_eps == b.norm_eps, "norm_eps");
  const AttentionOptions &aa = a.attention, &ba = b.attention;
  same(aa.num_kv_heads == ba.num_kv_heads, "attention.num_kv_heads");
  same(aa.head_dim_for(a.d_model, a.num_heads) == ba.head_dim_for(b.d_model, b.num_heads),
       "attention.head_dim");
  same(aa.kv_lora_rank == ba.kv_lora_rank && aa.q_lora_rank == ba.q_lora_rank &&
           aa.qk_nope_head_dim == ba.qk_nope_head_dim &&
           aa.qk_rope_head_dim == ba.qk_rope_head_dim && aa.v_head_dim == ba.v_head_dim &&
           aa.latent_norm_eps == ba.latent_norm_eps,
       "multi-head latent attention (kv_lora_rank, q_lora_rank, head widths)");
  same(aa.rope_theta == ba.rope_theta, "attention.rope_theta");
  same(aa.rope_layout == ba.rope_layout, "attention.rope_layout");
  same(aa.qk_norm == ba.qk_norm, "attention.qk_norm");
  same(aa.qk_norm_eps == ba.qk_norm_eps, "attention.qk_norm_eps");
  same(aa.qkv_bias == ba.qkv_bias && aa.out_bias == ba.out_bias, "attention biases");
  // a token graph is carried only into the same graph (or Blended over it, from a = 0)
  using GFrom = typename RFrom::graph;
  using GTo = typename RTo::graph;
  if constexpr (!std::is_same_v<GFrom, Independent>) {
    constexpr bool carried = std::is_same_v<GFrom, GTo> || [] {
      if constexpr (requires { typename GTo::inner_graph; })
        return std::is_same_v<typename GTo::inner_graph, GFrom>;
      else
        return false;
    }();
    GRAPHMOE_CHECK(carried, op, "the model upcycled from routes through the token graph '",
                   GFrom::name, "', which the router '", RTo::name(), "' does not have");
  }

  // The blocks that become MoE here, and what their gates must be for the dense output.
  std::vector<char> cloned(static_cast<std::size_t>(b.num_layers), 0);
  for (index_t i = 0; i < b.num_layers; ++i) {
    if (!b.is_moe_layer(i)) {
      GRAPHMOE_CHECK(!a.is_moe_layer(i), op, "block ", i, " is MoE in the model upcycled from "
                     "but dense in the model upcycled to");
      continue;
    }
    if (a.is_moe_layer(i)) continue;
    cloned[static_cast<std::size_t>(i)] = 1;
    const index_t expert_width = b.expert_d_ff > 0 ? b.expert_d_ff : b.d_ff;
    GRAPHMOE_CHECK(expert_width == a.d_ff, op, "block ", i, ": the experts' width ", expert_width,
                   " differs from the dense FFN's d_ff ", a.d_ff, " (every expert is a copy of it)");
    GRAPHMOE_CHECK(b.shared_d_ff == 0, op, "block ", i, ": a shared expert (shared_d_ff ",
                   b.shared_d_ff, ") would add its output to the copies' and change the model");
    const RouterConfig& rc = b.router;
    using Opt = typename policy_detail::shared_options_of<typename RTo::selector>::type;
    if constexpr (requires { rc.options<Opt>().norm_topk_prob; }) {
      const auto& tc = rc.options<Opt>();
      GRAPHMOE_CHECK(tc.norm_topk_prob, op, "block ", i, ": the gates are not renormalised "
                     "(norm_topk_prob = false), so k copies of the FFN would not sum to it; set "
                     "norm_topk_prob (train_lm --norm-topk-prob true)");
      GRAPHMOE_CHECK(tc.routed_scaling_factor == 1.0, op, "block ", i,
                     ": routed_scaling_factor is ", tc.routed_scaling_factor,
                     ", which would scale the copies' sum; use 1");
    } else {
      // Refused at run time, not at compile time: a program that registers every router (train_lm)
      // instantiates upcycle for all of them, and MoE-to-MoE upcycling needs no such selector.
      GRAPHMOE_CHECK(false, op, "block ", i, " is dense in the model upcycled from: dense blocks "
                     "become MoE only through a token-choice selector (TopK, BiasBalancedTopK: "
                     "TokenChoiceOptions), whose renormalised gates sum the expert copies to the "
                     "dense FFN; this router's selector chooses otherwise (e.g. ScheduledTopK)");
    }
    GRAPHMOE_CHECK(!(rc.capacity_factor > 0), op, "block ", i, ": a capacity (capacity_factor ",
                   rc.capacity_factor, ") drops tokens, whose output would then differ");
  }

  ParameterArena<T, B>& fa = from.arena();
  ParameterArena<T, B>& ta = to.arena();
  const auto [ff, fe] = from.parameter_ids();
  const auto [tf, te] = to.parameter_ids();
  std::unordered_map<std::string, index_t> source;  // name relative to the prefix -> id
  for (index_t id = ff; id < fe; ++id) {
    const ParameterInfo& p = fa.params()[static_cast<std::size_t>(id)];
    GRAPHMOE_CHECK(!p.sharded(), op, "parameter '", p.name, "' is an expert shard: upcycle "
                   "whole models (before expert parallelism)");
    source.emplace(p.name.substr(from.prefix().size()), id);
  }
  std::vector<char> used(static_cast<std::size_t>(fe - ff), 0);
  auto take = [&](const std::string& name) -> index_t {
    auto it = source.find(name);
    if (it == source.end()) return -1;
    used[static_cast<std::size_t>(it->second - ff)] = 1;
    return it->second;
  };

  // Plan every copy before writing anything: a refused pair of models is left as it was.
  struct Copy {
    index_t dst, src;
    index_t dst_offset;  // elements, into dst
    index_t count;
  };
  std::vector<Copy> plan;
  for (index_t id = tf; id < te; ++id) {
    const ParameterInfo& p = ta.params()[static_cast<std::size_t>(id)];
    GRAPHMOE_CHECK(!p.sharded(), op, "parameter '", p.name, "' is an expert shard: upcycle "
                   "whole models (before expert parallelism)");
    const std::string name = p.name.substr(to.prefix().size());
    std::string rest;
    const index_t blk = detail::upcycle_block_of(name, &rest);
    const bool clone = blk >= 0 && blk < b.num_layers && cloned[static_cast<std::size_t>(blk)] != 0;
    if (clone && rest.rfind("moe.experts.", 0) == 0) {
      const std::string which = rest.substr(std::string("moe.experts.").size());
      const std::string dense = "blocks." + std::to_string(blk) + ".ffn." +
                                (which == "w1"   ? "fc1.weight"
                                 : which == "b1" ? "fc1.bias"
                                 : which == "w2" ? "fc2.weight"
                                 : which == "b2" ? "fc2.bias"
                                                 : "");
      const index_t src = take(dense);
      GRAPHMOE_CHECK(src >= 0, op, "expert parameter '", p.name, "' has no dense counterpart '",
                     from.prefix(), dense, "'");
      const ParameterInfo& s = fa.params()[static_cast<std::size_t>(src)];
      const index_t experts = p.shape[0];
      GRAPHMOE_CHECK(p.shape.numel() == experts * s.shape.numel(), op, "expert parameter '", p.name,
                     "' of shape ", p.shape, " does not hold ", experts, " copies of '", s.name,
                     "' of shape ", s.shape);
      for (index_t e = 0; e < experts; ++e)
        plan.push_back({id, src, e * s.shape.numel(), s.shape.numel()});
      continue;
    }
    const index_t src = take(name);
    if (src >= 0) {
      const ParameterInfo& s = fa.params()[static_cast<std::size_t>(src)];
      GRAPHMOE_CHECK(s.shape == p.shape, op, "parameter '", p.name, "' has shape ", p.shape,
                     " but the model upcycled from has ", s.shape);
      plan.push_back({id, src, 0, p.shape.numel()});
      continue;
    }
    const bool router = clone && rest.rfind("moe.router.", 0) == 0;
    const bool graph = blk >= 0 && rest.find("router.graph.") != std::string::npos;
    GRAPHMOE_CHECK(router || graph || !p.trainable, op, "parameter '", p.name, "' of shape ",
                   p.shape, " has no counterpart in the model upcycled from");
  }
  // the dense FFN of a cloned block feeds the experts; of the rest, nothing may be left over
  for (index_t id = ff; id < fe; ++id) {
    if (used[static_cast<std::size_t>(id - ff)] != 0) continue;
    const ParameterInfo& p = fa.params()[static_cast<std::size_t>(id)];
    GRAPHMOE_CHECK(!p.trainable, op, "parameter '", p.name,
                   "' of the model upcycled from has no place in the model upcycled to");
  }
  for (const Copy& c : plan) {
    const Tensor<T, B> src = fa.value(c.src), dst = ta.value(c.dst);
    std::memcpy(dst.data() + c.dst_offset, src.data(), static_cast<std::size_t>(c.count) * sizeof(T));
  }
  ta.mark_values_written();  // a compute mirror (C != T) is refreshed at the next forward
}

}  // namespace graphmoe
