#!/usr/bin/env python3
"""The report of benchmarks/compare/llamacpp_decode.sh (which runs it): llama-bench's JSON and
hf_decode's lines of each round, the agreement files, versions and the machine, printed as text.
Not meant to be run alone; its arguments are the shell script's settings."""
import argparse
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from datetime import datetime

import numpy as np


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def byte_decoder():
    """GPT-2's byte-level alphabet: the character of each byte value, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(model_dir):
    """id -> the bytes llama.cpp prints for it (special tokens: their text)."""
    tj = json.loads(read(os.path.join(model_dir, "tokenizer.json")))
    dec = byte_decoder()
    out = {}
    for piece, i in tj["model"]["vocab"].items():
        out[i] = bytes(dec[c] for c in piece)
    for t in tj.get("added_tokens", []):
        out[t["id"]] = t["content"].encode()
    return out


def parse_hf_decode(path):
    res = {}
    for line in read(path).splitlines():
        m = re.match(r"decode prompt=(\d+) gen=(\d+) threads=(\d+) reps=(\d+) tok/s=([\d.]+) "
                     r"sd=([\d.]+) samples=(.*)", line)
        if m:
            res[int(m.group(3)), int(m.group(1))] = dict(ts=float(m.group(5)), sd=float(m.group(6)),
                                        samples=[float(x) for x in m.group(7).split(",")])
    return res


def parse_bench(path):
    data = json.loads(read(path))
    return {(int(d["n_threads"]), int(d["n_depth"])): dict(ts=d["avg_ts"], sd=d["stddev_ts"], samples=d["samples_ts"],
                                    raw=d) for d in data if d["n_gen"] > 0 and d["n_prompt"] == 0}


def load_lines(path):
    return read(path).strip()


def agreement(work, model_dir, prompt_text):
    ag = os.path.join(work, "agree")
    lines = []
    g_out = read(os.path.join(ag, "graphmoe.out"))
    g = np.fromfile(os.path.join(ag, "graphmoe.bin"), dtype=np.float32)
    greedy = [int(x) for x in re.search(r"greedy:(.*)", g_out).group(1).split()]
    tb = token_bytes(model_dir)
    cfg = json.loads(read(os.path.join(model_dir, "config.json")))
    eos = cfg.get("eos_token_id")
    upto = greedy.index(eos) if eos in greedy else len(greedy)
    g_text = b"".join(tb[i] for i in greedy[:upto])
    ids = np.fromfile(os.path.join(ag, "llamacpp-olmoe-f32-tokens.bin"), dtype=np.int32)
    lines.append(f"prompt: {prompt_text!r} -> {len(ids)} token ids by llama.cpp's tokenizer "
                 f"({' '.join(map(str, ids.tolist()))}); graphmoe is fed the same ids")
    for ty in ("f32", "bf16"):
        l = np.fromfile(os.path.join(ag, f"llamacpp-olmoe-{ty}.bin"), dtype=np.float32)
        ids_ty = np.fromfile(os.path.join(ag, f"llamacpp-olmoe-{ty}-tokens.bin"), dtype=np.int32)
        if l.shape != g.shape:
            lines.append(f"{ty}: llama.cpp's logits have {l.size} values, graphmoe's {g.size}")
            continue
        diff = np.abs(l.astype(np.float64) - g)
        top_g = np.argsort(-g)[:10]
        top_l = np.argsort(-l)[:10]
        margin = np.sort(g)[-1] - np.sort(g)[-2]
        lines.append(
            f"{ty} GGUF, last prompt position's logits (llama-debug --save-logits) vs graphmoe's: "
            f"max|diff| {diff.max():.3g}, max|diff|/max|graphmoe| {diff.max() / np.abs(g).max():.3g}, "
            f"argmax {int(top_l[0])} vs {int(top_g[0])} ({'equal' if top_l[0] == top_g[0] else 'DIFFERENT'}; "
            f"graphmoe's top-2 margin {margin:.3g}), top-10 sets {'equal' if set(top_l) == set(top_g) else 'differ'}"
            + ("" if np.array_equal(ids_ty, ids) else " (its prompt ids differ from f32's!)"))
        s_out = read(os.path.join(ag, f"simple-{ty}.out"), "rb")
        p = prompt_text.encode()
        s_text = s_out[len(p):] if s_out.startswith(p) else s_out
        if s_text.endswith(b"\n") and not g_text.endswith(b"\n"):
            s_text = s_text[:-1]  # llama-simple ends its output with a newline
        n = 0
        while n < min(len(s_text), len(g_text)) and s_text[n] == g_text[n]:
            n += 1
        same = s_text == g_text
        # how many of graphmoe's tokens lie within the agreeing prefix of bytes
        k, acc = 0, 0
        for i in greedy[:upto]:
            if acc + len(tb[i]) > n:
                break
            acc += len(tb[i])
            k += 1
        lines.append(
            f"{ty} GGUF, greedy continuation (llama-simple -n 32, stops at eos) vs graphmoe's greedy "
            f"ids turned into bytes by the tokenizer: "
            + (f"identical ({len(g_text)} bytes, {upto} tokens{', eos' if upto < len(greedy) else ''})"
               if same else
               f"agree on the first {n} of {len(s_text)} / {len(g_text)} bytes (graphmoe's first {k} of {upto} tokens)"))
    lines.append(f"graphmoe greedy ids: {' '.join(map(str, greedy))}")
    # the reference: transformers on the same directory and ids (float32, eager attention)
    import torch
    from transformers import OlmoeForCausalLM
    torch.set_num_threads(2)
    m = OlmoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                         attn_implementation="eager").eval()
    seq = [int(x) for x in ids]
    t_greedy = []
    with torch.no_grad():
        ref = m(torch.tensor([seq])).logits[0, -1].double().numpy()
        for _ in range(len(greedy)):  # a full forward per token, eos not stopping it
            nxt = int(m(torch.tensor([seq])).logits[0, -1].argmax())
            t_greedy.append(nxt)
            seq.append(nxt)
    d = np.abs(ref - g).max()
    lines.append(f"transformers (the checkpoint's reference) vs graphmoe, same ids: last logits "
                 f"max|diff| {d:.3g} (max|logit| {np.abs(ref).max():.3g}); greedy {len(greedy)} ids "
                 + ("identical" if t_greedy == greedy else
                    f"differ from token {next(i for i, (a, b) in enumerate(zip(t_greedy, greedy)) if a != b)}"))
    return lines


def main():
    ap = argparse.ArgumentParser()
    for a in ("work", "prompts", "threads", "sdist", "src", "build-dir", "command", "phases",
              "openblas-coretype", "prompt-text"):
        ap.add_argument("--" + a, default="")
    for a in ("rounds", "gen", "reps"):
        ap.add_argument("--" + a, type=int)
    args = ap.parse_args()
    work, model_dir = args.work, os.path.join(args.work, "model")
    prompts = [int(x) for x in args.prompts.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    main_t = 2 if 2 in threads else threads[0]  # the comparison's thread count
    tm = os.path.join(work, "timing")
    rounds = []
    for r in range(1, args.rounds + 1):
        rounds.append(dict(graphmoe=parse_hf_decode(os.path.join(tm, f"graphmoe-{r}.out")),
                           f32=parse_bench(os.path.join(tm, f"f32-{r}.out")),
                           bf16=parse_bench(os.path.join(tm, f"bf16-{r}.out")),
                           load={s: load_lines(os.path.join(tm, f"{s}-{r}.load"))
                                 for s in ("graphmoe", "f32", "bf16")}))
    raw = rounds[0]["f32"][main_t, prompts[0]]["raw"]
    meta = json.loads(read(os.path.join(model_dir, "graphmoe_model.json")))
    cfg = json.loads(read(os.path.join(model_dir, "config.json")))
    g_first = read(os.path.join(work, "agree", "graphmoe.out")).splitlines()[0]
    ggml_ver = sh(f"sed -n 's/^set(GGML_VERSION_\\(MAJOR\\|MINOR\\|PATCH\\) \\([0-9]*\\))/\\2/p' "
                  f"{args.src}/ggml/CMakeLists.txt | paste -sd.")
    cpu = sh("lscpu | sed -n 's/^Model name: *//p'")
    out = []
    out.append(f"# {args.command}")
    out.append(f"# machine: {cpu}, {os.cpu_count()} CPUs; {platform.platform()}; "
               f"{sh('g++ --version | head -1')}; load average at the end {read('/proc/loadavg').split()[:3]}")
    out.append(f"# {datetime.now():%Y-%m-%d %H:%M}")
    out.append(f"llama.cpp: vendor/llama.cpp of PyPI's {args.sdist} (pip download --no-binary); "
               f"commit {sh(f'git -C {args.src} log -1 --format=%H,%cs 2>/dev/null') or '(unknown)'} "
               f"(the sdist carries the submodule's git metadata; llama-bench build_commit "
               f"{raw.get('build_commit')}), ggml {ggml_ver}; CPU backend "
               f"only: Release, GGML_NATIVE=ON, no BLAS; backends {raw.get('backends')}; "
               f"cpu_info {raw.get('cpu_info')!r}")
    out.append(f"model: OlmoeForCausalLM L={cfg['num_hidden_layers']} D={cfg['hidden_size']} "
               f"H={cfg['num_attention_heads']} (kv {cfg['num_key_value_heads']}) E={cfg['num_experts']} "
               f"top-{cfg['num_experts_per_tok']} norm_topk_prob={cfg['norm_topk_prob']} d_ff={cfg['intermediate_size']} "
               f"V={cfg['vocab_size']} max_position_embeddings={cfg['max_position_embeddings']}, "
               f"{meta['parameters']} parameters, random weights (seed {meta['seed']}), written by "
               f"transformers {meta['transformers']} save_pretrained (float32; torch {meta['torch']}); "
               f"llama.cpp: convert_hf_to_gguf.py --outtype f32 / bf16 (llama-bench: model_type "
               f"{raw.get('model_type')!r}, {raw.get('model_n_params')} parameters)")
    out.append(f"graphmoe: {args.build_dir}/benchmarks/hf_decode (hf::load_lm<SoftmaxRouter, float>, "
               f"Decoder; float compute: graphmoe has no bf16 CPU compute path, so only float is timed); "
               f"{g_first}")
    out.append(f"decode at batch 1, {args.threads} threads, after a prompt of P tokens: {args.gen} "
               f"single-token steps at positions P .. P+{args.gen - 1}, random ids, one warm-up and "
               f"{args.reps} timed repetitions, tokens/s = mean over repetitions (llama-bench -p 0 -n "
               f"{args.gen} -d {args.prompts} -t {args.threads} -r {args.reps} -o json; defaults otherwise: "
               f"KV cache {raw.get('type_k')}/{raw.get('type_v')}, flash_attn {raw.get('flash_attn')} (-1: auto), "
               f"n_batch {raw.get('n_batch')}, n_ubatch {raw.get('n_ubatch')}, poll {raw.get('poll')}); "
               f"graphmoe's KV cache is float")
    out.append(f"OPENBLAS_CORETYPE={args.openblas_coretype or '(unset)'} (scripts/openblas-coretype.sh)")
    out.append(f"phases: {args.phases}")
    out.append("")
    out.append("| round | threads | prompt | graphmoe tok/s | llama.cpp f32 tok/s | graphmoe / f32 | llama.cpp bf16 tok/s "
               "| graphmoe / bf16 | 1-min load before/after, others' CPU share: graphmoe; f32; bf16 |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    ratios = {(t, p): {"f32": [], "bf16": []} for t in threads for p in prompts}
    for t in threads:
      for r, rd in enumerate(rounds, 1):
        for p in prompts:
            g = rd["graphmoe"][t, p]
            f, b = rd["f32"][t, p], rd["bf16"][t, p]
            rf, rb = g["ts"] / f["ts"], g["ts"] / b["ts"]
            ratios[t, p]["f32"].append(rf)
            ratios[t, p]["bf16"].append(rb)
            out.append(f"| {r} | {t} | {p} | {g['ts']:.1f} +- {g['sd']:.1f} | {f['ts']:.1f} +- {f['sd']:.1f} | "
                       f"{rf:.2f} | {b['ts']:.1f} +- {b['sd']:.1f} | {rb:.2f} | "
                       f"{rd['load']['graphmoe']}; {rd['load']['f32']}; {rd['load']['bf16']} |")
    out.append("")
    out.append("per repetition tok/s:")
    for t in threads:
      for r, rd in enumerate(rounds, 1):
        for p in prompts:
            out.append(f"  round {r} threads {t} prompt {p}: graphmoe {rd['graphmoe'][t, p]['samples']}, "
                       f"f32 {[round(x, 2) for x in rd['f32'][t, p]['samples']]}, "
                       f"bf16 {[round(x, 2) for x in rd['bf16'][t, p]['samples']]}")
    out.append("")
    out.append("agreement:")
    try:
        out += ["  " + l for l in agreement(work, model_dir, args.prompt_text)]
    except Exception as e:  # reported, not fatal: the timing stands on its own
        out.append(f"  could not be checked: {type(e).__name__}: {e}")
    out.append("")
    for t in threads:
      for p in prompts:
        for ty in ("f32", "bf16"):
            out.append(f"decode tokens/s graphmoe/llama.cpp-{ty} olmoe batch 1 threads {t} prompt {p}: "
                       + " / ".join(f"{x:.2f}" for x in ratios[t, p][ty]))
    # the fastest repetition of each side over all rounds: the least disturbed, on a busy machine
    out.append("fastest repetition over the rounds (tok/s; on a busy machine the least disturbed):")
    for t in threads:
        for p in prompts:
            best = {side: max(x for rd in rounds for x in rd[side][t, p]["samples"])
                    for side in ("graphmoe", "f32", "bf16")}
            out.append(f"  threads {t} prompt {p}: graphmoe {best['graphmoe']:.1f}, llama.cpp f32 "
                       f"{best['f32']:.1f} ({best['graphmoe'] / best['f32']:.2f}x), bf16 {best['bf16']:.1f} "
                       f"({best['graphmoe'] / best['bf16']:.2f}x)")
    others = max(int(re.search(r"others (\d+)%", rd["load"][side]).group(1))
                 for rd in rounds for side in ("graphmoe", "f32", "bf16"))
    lowest = min(min(ratios[main_t, p]["f32"]) for p in prompts)
    median = statistics.median([x for p in prompts for x in ratios[main_t, p]["f32"]])
    verdict = (f"{'met' if lowest >= 1.0 else 'not met'} (lowest ratio {lowest:.2f}, median {median:.2f}"
               f"{'; moonshot met' if lowest >= 1.3 else ''})")
    if others > 10:
        verdict = (f"not judged: other processes took up to {others}% of the machine's CPU time during "
                   f"the runs, which costs llama.cpp's 2 threads (a barrier per op) far more than "
                   f"graphmoe's; rerun on an idle machine (as measured: {verdict})")
    out.append(f"target graphmoe >= 1.0x llama.cpp f32 at batch 1, {main_t} threads (moonshot 1.3x): {verdict}")
    print("\n".join(out))


if __name__ == "__main__":
    main()
