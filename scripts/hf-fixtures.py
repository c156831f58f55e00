#!/usr/bin/env python3
"""Golden fixtures of the Hugging Face reader (include/graphmoe/hf/): tiny random models of each
family that graphmoe loads, written by transformers itself, with transformers' outputs.

Remake them (from the repository root; needs torch and transformers, which CI does not have):

    ~/.cache/graphmoe/venv-torch/bin/python scripts/hf-fixtures.py tests/hf/fixtures

For each family (llama, mixtral, olmoe, qwen2_moe, qwen3_moe, deepseek_v3) it builds a random model
with transformers (2 layers, hidden 64, 4 heads, 2 key/value heads where the family has
grouped-query attention, 8 experts of top-2, vocab 128; qwen3_moe with head_dim 32, so that its
query heads are twice hidden wide as in the Qwen3-MoE releases; deepseek_v3 with multi-head latent
attention, group-limited top-3 of sigmoid scores with a selection bias and a shared expert, vocab
96; seed fixed), draws every weight (norm weights near 1, biases, router weights and DeepSeek's
selection biases included, so that a tensor loaded into the wrong place shows), saves it with
save_pretrained (safetensors; mixtral sharded through max_shard_size, which writes
model.safetensors.index.json; llama in float32, mixtral, olmoe, qwen3_moe and deepseek_v3 in
bfloat16, qwen2_moe in float16) under DIR/<family>/, reloads it from disk in float32 with eager
attention (the file's 16-bit values are exact in float32) and writes DIR/<family>/expected.json:

  prompts        3 prompts' token ids (lengths 5, 9, 16)
  logits         transformers' float32 logits, subsampled: row t of prompt p holds the columns
                 c = t % column_stride + column_stride j (every column appears in some row)
  logsumexp      each row's logsumexp over all its columns (float64 from the float32 logits)
  experts        per prompt, per MoE layer (key: the layer's index), each token's chosen experts
                 (the router's top-k indices, sorted)
  router_margin  the smallest gap, over every token and MoE layer, between the k-th and the
                 (k+1)-th score that chooses (softmax; deepseek_v3: sigmoid + selection bias
                 within the chosen groups): how far the choice is from a tie; informational;
                 null for the dense llama
  greedy         transformers' greedy continuation of the first prompt: GREEDY_TOKENS new token
                 ids (argmax of each step's float32 logits, a full forward per step, eos not
                 stopping it)
  greedy_margin  the smallest gap, over those steps, between the largest and the second largest
                 logit (how far each choice is from a tie; informational)

All fixtures together stay under 1 MB (the script prints their size and fails above it).
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

SEED = 1234
PROMPT_LENGTHS = (5, 9, 16)
GREEDY_TOKENS = 64
COLUMN_STRIDE = 4
LIMIT_BYTES = 1_000_000

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
              pad_token_id=None)

# family -> (config class, model class, config fields, storage dtype, save_pretrained arguments)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM,
              dict(intermediate_size=16, rms_norm_eps=1e-5, rope_theta=500000.0),
              torch.float32, {}),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(intermediate_size=8, num_local_experts=8, num_experts_per_tok=2,
                     rms_norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=0.02),
                torch.bfloat16, dict(max_shard_size="64KB")),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM,
              dict(intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                   num_key_value_heads=4, rms_norm_eps=1e-5, norm_topk_prob=False,
                   eos_token_id=2, pad_token_id=1),
              torch.bfloat16, {}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(intermediate_size=32, moe_intermediate_size=8,
                       shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       decoder_sparse_step=2, norm_topk_prob=False, rms_norm_eps=1e-6,
                       rope_theta=1e6),
                  torch.float16, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(intermediate_size=32, moe_intermediate_size=8, num_experts=8,
                       num_experts_per_tok=2, head_dim=32, norm_topk_prob=True,
                       rms_norm_eps=1e-6, rope_theta=1e6),
                  torch.bfloat16, {}),
    # multi-head latent attention with a query latent and interleaved RoPE, one dense block
    # first, 8 routed experts in 4 groups (2 groups chosen, k = 3), one shared expert, sigmoid
    # scores with a selection bias, gates renormalised and scaled by 2.5
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM,
                    dict(vocab_size=96, num_key_value_heads=4, intermediate_size=16,
                         moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=3,
                         n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
                         norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-6,
                         rope_theta=10000.0),
                    torch.bfloat16, {}),
}


def draw_weights(model, gen):
    """Every parameter drawn: norms near 1, biases around 0, matrices N(0, 1 / fan_in); and
    DeepSeek-V3's selection biases (a buffer) around 0."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def routers(model):
    """(layer index, router module) of every MoE layer, in order."""
    out = []
    for name, mod in model.named_modules():
        if type(mod).__name__.lower().endswith("topkrouter"):
            parts = name.split(".")
            out.append((int(parts[parts.index("layers") + 1]), mod))
    return sorted(out, key=lambda x: x[0])


def make(family, out_dir, seed):
    config_cls, model_cls, fields, dtype, save_args = FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    kw = dict(COMMON)
    kw.update(fields)
    config = config_cls(**kw)
    model = model_cls(config).eval()
    draw_weights(model, gen)
    d = os.path.join(out_dir, family)
    shutil.rmtree(d, ignore_errors=True)
    model.to(dtype).save_pretrained(d, **save_args)

    # transformers' own reading of the saved files, in float32 (16-bit values are exact there)
    model = model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    hooks, seen, mods = [], {}, {}
    for layer, mod in routers(model):
        mods[layer] = mod
        def hook(mod, args, out, layer=layer):
            seen[layer] = out
        hooks.append(mod.register_forward_hook(hook))

    prompts, logits, lse, experts = [], [], [], []
    margin = math.inf
    for length in PROMPT_LENGTHS:
        ids = torch.randint(0, config.vocab_size, (length,), generator=gen)
        seen.clear()
        with torch.no_grad():
            out = model(ids[None, :]).logits[0].float()  # (T, V)
        prompts.append(ids.tolist())
        logits.append([[float("%.8g" % x) for x in out[t, t % COLUMN_STRIDE::COLUMN_STRIDE].tolist()]
                       for t in range(length)])
        lse.append([float("%.10g" % x) for x in torch.logsumexp(out.double(), -1).tolist()])
        chosen = {}
        for layer, (router_logits, _, indices) in sorted(seen.items()):
            chosen[str(layer)] = indices.sort(-1).values.tolist()
            k = indices.shape[-1]
            if hasattr(mods[layer], "e_score_correction_bias"):
                # the scores that choose: sigmoid + bias, within the chosen groups
                s = torch.sigmoid(router_logits.float()) + mods[layer].e_score_correction_bias
                g = mods[layer].num_group
                top2 = s.view(s.shape[0], g, -1).topk(2, dim=-1).values.sum(-1)
                keep = torch.zeros_like(top2).scatter(1, top2.topk(mods[layer].topk_group).indices, 1)
                s = s.masked_fill(keep.repeat_interleave(s.shape[1] // g, 1) == 0, -math.inf)
                probs = s.sort(-1, descending=True).values
            else:
                probs = torch.softmax(router_logits.float(), -1).sort(-1, descending=True).values
            margin = min(margin, (probs[:, k - 1] - probs[:, k]).min().item())
        experts.append(chosen)
    for h in hooks:
        h.remove()

    # greedy decoding of the first prompt (a full forward per step: no cache to differ)
    seq = list(prompts[0])
    greedy, greedy_margin = [], math.inf
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            last = model(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(last, 2).values
            greedy_margin = min(greedy_margin, (top[0] - top[1]).item())
            nxt = int(torch.argmax(last).item())
            greedy.append(nxt)
            seq.append(nxt)

    expected = {
        "family": family,
        "architecture": config.architectures[0] if config.architectures else model_cls.__name__,
        "storage_dtype": str(dtype).replace("torch.", ""),
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "prompts": prompts,
        "column_stride": COLUMN_STRIDE,
        "logits": logits,
        "logsumexp": lse,
        "experts": experts,
        "router_margin": margin if math.isfinite(margin) else None,
        "greedy": greedy,
        "greedy_margin": greedy_margin,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    print(f"{family:10s} {size / 1000:7.1f} kB  files {sorted(os.listdir(d))}  "
          f"router margin {margin:.2e}  greedy margin {greedy_margin:.2e}")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="where the fixtures go (tests/hf/fixtures)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="only these families (repeatable; default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    total = 0
    for i, family in enumerate(args.family or FAMILIES):
        total += make(family, args.out_dir, args.seed + i)
    print(f"total {total / 1000:.1f} kB")
    if not args.family and total > LIMIT_BYTES:
        sys.exit(f"hf-fixtures: the fixtures take {total} bytes, more than {LIMIT_BYTES}")


if __name__ == "__main__":
    main()
