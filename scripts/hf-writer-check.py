#!/usr/bin/env python3
"""The Hugging Face writer (include/graphmoe/hf/writer.hpp) against transformers itself.

From the repository root, with the test program built (needs torch and transformers, which CI does
not have; the versions of scripts/hf-fixtures.py):

    ~/.cache/graphmoe/venv-torch/bin/python scripts/hf-writer-check.py \\
        build/tests/test_hf_writer /tmp/hf-writer-models \\
        --report benchmarks/results/hf/<date>-writer-transformers.txt

It runs the test program's case "hf writer: models for transformers" with
GRAPHMOE_HF_WRITER_OUT=<models dir>: graphmoe writes one model per family (llama, mixtral,
olmoe, qwen2_moe, qwen3_moe, deepseek_v3: the fixtures' shapes, every weight drawn at random,
deepseek_v3's selection biases included; mixtral in BF16 over several shards with an index, the
others in F32) and a Qwen3-MoE model whose router was a
SimilarityRouter with a learned tau, saved with its graph dropped; beside each,
<name>.expected.json holds graphmoe's float logits on 3 prompts (lengths 5, 9, 16) and every MoE
layer's chosen experts, computed on the model read back from the written directory. This script
loads each directory with AutoModelForCausalLM.from_pretrained (float32, eager attention; missing,
unexpected or mismatched weights fail), runs the prompts and compares: the logits (max |a - b| /
max |b| over each prompt, at most 1e-4) and the chosen experts (router hooks, as
scripts/hf-fixtures.py reads them). It prints and writes a report (the command first, then the
versions) and exits 1 on any failure.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

BOUND = 1e-4


def routers(model):
    """(layer index, router module) of every MoE layer, in order."""
    out = []
    for name, mod in model.named_modules():
        if type(mod).__name__.lower().endswith("topkrouter"):
            parts = name.split(".")
            out.append((int(parts[parts.index("layers") + 1]), mod))
    return sorted(out, key=lambda x: x[0])


def check(models_dir, name, lines):
    d = os.path.join(models_dir, name)
    with open(os.path.join(models_dir, name + ".expected.json")) as f:
        ex = json.load(f)
    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    model.eval()
    problems = {k: v for k, v in info.items() if v}
    files = sorted(n for n in os.listdir(d))
    seen = {}
    hooks = []
    for layer, mod in routers(model):
        def hook(mod, args, out, layer=layer):
            seen[layer] = out
        hooks.append(mod.register_forward_hook(hook))
    worst = 0.0
    rows = mismatches = 0
    per_prompt = []
    for p, prompt in enumerate(ex["prompts"]):
        seen.clear()
        with torch.no_grad():
            out = model(torch.tensor([prompt])).logits[0].double()  # (T, V)
        ours = torch.tensor(ex["logits"][p], dtype=torch.float64).reshape(out.shape)
        rel = ((ours - out).abs().max() / out.abs().max()).item()
        per_prompt.append(rel)
        worst = max(worst, rel)
        for layer, (_, _, indices) in sorted(seen.items()):
            want = ex["experts"][p].get(str(layer))
            got = indices.sort(-1).values.tolist()
            for t in range(len(prompt)):
                rows += 1
                if want is None or got[t] != want[t]:
                    mismatches += 1
        layers_ours = sorted(int(k) for k in ex["experts"][p])
        if layers_ours != sorted(seen):
            problems["moe layers"] = f"graphmoe {layers_ours}, transformers {sorted(seen)}"
    for h in hooks:
        h.remove()
    ok = worst <= BOUND and mismatches == 0 and not problems
    lines.append(f"{name}: {type(model).__name__}, {ex['note']}")
    lines.append(f"  files: {' '.join(files)}")
    lines.append("  logits max|a-b|/max|b| per prompt: " +
                 ", ".join(f"{x:.3e}" for x in per_prompt) + f"  (worst {worst:.3e}, bound {BOUND:g})")
    lines.append(f"  experts: {rows - mismatches} of {rows} token-layers identical")
    if problems:
        lines.append(f"  loading: {problems}")
    lines.append(f"  {'PASS' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_program", help="the built test_hf_writer (e.g. build/tests/test_hf_writer)")
    ap.add_argument("models_dir", help="where graphmoe writes the models (created)")
    ap.add_argument("--report", help="write the report here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    command = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
    os.makedirs(args.models_dir, exist_ok=True)
    env = dict(os.environ, GRAPHMOE_HF_WRITER_OUT=os.path.abspath(args.models_dir))
    run = subprocess.run([args.test_program, "-tc=hf writer: models for transformers*", "-s"],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stdout.write(run.stdout + run.stderr)
        sys.exit(f"hf-writer-check: {args.test_program} failed ({run.returncode})")
    with open(os.path.join(args.models_dir, "manifest.json")) as f:
        names = json.load(f)
    lines = [f"command: {command}",
             f"torch {torch.__version__}, transformers {transformers.__version__}, "
             f"python {sys.version.split()[0]}",
             f"graphmoe side: {args.test_program} -tc='hf writer: models for transformers*' "
             f"with GRAPHMOE_HF_WRITER_OUT={args.models_dir}",
             "transformers side: AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, "
             "attn_implementation='eager'); 3 prompts (lengths 5, 9, 16); logits compared over "
             "every position and vocabulary entry",
             ""]
    ok = True
    for name in names:
        ok = check(args.models_dir, name, lines) and ok
    lines.append("")
    lines.append("all PASS" if ok else "FAILED")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.report:
        os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
        with open(args.report, "w") as f:
            f.write(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
