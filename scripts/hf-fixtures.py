#!/usr/bin/env python3
"""Golden fixtures of the Hugging Face reader (include/graphmoe/hf/): tiny random models of each
family that graphmoe loads, written by transformers itself, with transformers' outputs.

Remake them (from the repository root; needs torch and transformers, which CI does not have):

    ~/.cache/graphmoe/venv-torch/bin/python scripts/hf-fixtures.py tests/hf/fixtures

For each family (llama, mixtral, olmoe, qwen2_moe, qwen3_moe) it builds a random model with
transformers (2 layers, hidden 64, 4 heads, 2 key/value heads where the family has grouped-query
attention, 8 experts of top-2, vocab 128; qwen3_moe with head_dim 32, so that its query heads are
twice hidden wide as in the Qwen3-MoE releases; seed fixed), draws every weight (norm weights near 1,
biases and router weights included, so that a tensor loaded into the wrong place shows), saves it
with save_pretrained (safetensors; mixtral sharded through max_shard_size, which writes
model.safetensors.index.json; llama in float32, mixtral, olmoe and qwen3_moe in bfloat16, qwen2_moe
in float16) under DIR/<family>/, reloads it from disk in float32 with eager attention (the file's
16-bit values are exact in float32) and writes DIR/<family>/expected.json:

  prompts        3 prompts' token ids (lengths 5, 9, 16)
  logits         transformers' float32 logits, subsampled: row t of prompt p holds the columns
                 c = t % column_stride + column_stride j (every column appears in some row)
  logsumexp      each row's logsumexp over all its columns (float64 from the float32 logits)
  experts        per prompt, per MoE layer (key: the layer's index), each token's chosen experts
                 (the router's top-k indices, sorted)
  router_margin  the smallest gap, over every token and MoE layer, between the k-th and the
                 (k+1)-th softmax score (how far the choice is from a tie; informational;
                 null for the dense llama)
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
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

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
              dict(intermediate_size=64, rms_norm_eps=1e-5, rope_theta=500000.0),
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
}


def draw_weights(model, gen):
    """Every parameter drawn: norms near 1, biases around 0, matrices N(0, 1 / fan_in)."""
    with torch.no_grad():
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
        if type(mod).__name__.endswith("TopKRouter"):
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
    hooks, seen = [], {}
    for layer, mod in routers(model):
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
            probs = torch.softmax(router_logits.float(), -1).sort(-1, descending=True).values
            k = indices.shape[-1]
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
