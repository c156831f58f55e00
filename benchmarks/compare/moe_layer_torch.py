#!/usr/bin/env python3
"""MoE layer forward+backward: graphmoe (bench_moe) beside the same layer in PyTorch, one run.

Shape: the paper's medium size, batch 4 x 512 tokens, D = 352, E = 16, d_ff = 352, top-2, float32,
causal token graphs. The PyTorch layer is written the usual way: per-expert index_select /
index_add_, one weight tensor per expert, autograd for the backward.

    python3 benchmarks/compare/moe_layer_torch.py --build-dir build [--threads 1 2] [--python PY]

Run it with a Python that has torch (PyPI's newest where it imports, else Debian's python3-torch
under /usr/bin/python3). OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and OMP_WAIT_POLICY=PASSIVE are set
for both sides. The last line is

    moe_layer fwd+bwd graphmoe/torch: softmax=R1 similarity=R2 attention=R3

with R the ratio of median times at 2 threads (below 1: graphmoe is faster).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

B, T, D, E, FF, K, H = 4, 512, 352, 16, 352, 2, 8


def torch_layer_times(router, threads, repeats):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = B * T
    u = torch.randn(n, D, generator=g, requires_grad=True)
    dy = torch.randn(n, D, generator=g)
    w_r = (0.02 * torch.randn(E, D, generator=g)).requires_grad_()
    b_r = torch.zeros(E, requires_grad=True)
    w1 = [(0.02 * torch.randn(FF, D, generator=g)).requires_grad_() for _ in range(E)]
    b1 = [torch.zeros(FF, requires_grad=True) for _ in range(E)]
    w2 = [(0.02 * torch.randn(D, FF, generator=g)).requires_grad_() for _ in range(E)]
    b2 = [torch.zeros(D, requires_grad=True) for _ in range(E)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    # attention cache for the Attention graph: probs of 8 heads, values, output map, output
    q = torch.randn(B, H, T, D // H, generator=g)
    k = torch.randn(B, H, T, D // H, generator=g)
    probs = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D // H)).masked_fill(~causal, float("-inf")), -1)
    probs.requires_grad_()
    v = torch.randn(B, T, D, generator=g, requires_grad=True)
    w_o = (torch.randn(D, D, generator=g) / math.sqrt(D)).requires_grad_()
    b_o = torch.zeros(D, requires_grad=True)
    a_out = u.detach().clone().view(B, T, D).requires_grad_()

    def graph(r):
        if router == "softmax":
            return r
        if router == "similarity":
            U = u.view(B, T, D)
            s = (U @ U.transpose(1, 2)).masked_fill(~causal, float("-inf")).softmax(-1)
            return (s @ r.view(B, T, E)).reshape(n, E)
        # attention: head of lowest mean entropy per sequence, posterior of Lemma 1 (sigma = 1)
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean(-1)  # (B, H)
        hstar = ent.argmin(-1)
        dh = D // H
        out = []
        for b in range(B):
            h = int(hstar[b])
            m = H * v[b, :, h * dh:(h + 1) * dh] @ w_o[:, h * dh:(h + 1) * dh].t() + b_o
            logits = probs[b, h].clamp_min(1e-30).log() + a_out[b] @ m.t() - 0.5 * (m * m).sum(-1)
            post = logits.masked_fill(probs[b, h] == 0, float("-inf")).softmax(-1)
            out.append(post @ r.view(B, T, E)[b])
        return torch.cat(out, 0)

    def step():
        r = F.linear(u, w_r, b_r).softmax(-1)
        p = graph(r)
        vals, idx = p.topk(K, dim=-1)
        gates = vals / vals.sum(-1, keepdim=True)
        y = torch.zeros_like(u)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            x = u.index_select(0, tok)
            h = F.gelu(F.linear(x, w1[e], b1[e]), approximate="tanh")
            ye = F.linear(h, w2[e], b2[e]) * gates[tok, slot].unsqueeze(1)
            y = y.index_add(0, tok, ye)
        y.backward(dy)

    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, torch.__version__


def graphmoe_times(build_dir, repetitions):
    exe = os.path.join(build_dir, "benchmarks", "bench_moe")
    out = subprocess.run(
        [exe, "--benchmark_filter=BM_moe_(softmax|similarity|attention)_fwdbwd",
         "--benchmark_format=json", f"--benchmark_repetitions={repetitions}",
         "--benchmark_report_aggregates_only=true"],
        check=True, capture_output=True, text=True).stdout
    res = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name = b["run_name"]  # BM_moe_similarity_fwdbwd/2/1/min_time:1.000/real_time
        parts = name.split("/")
        router = parts[0][len("BM_moe_"):-len("_fwdbwd")]
        res[(router, int(parts[1]), int(parts[2]))] = b["real_time"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--repeats", type=int, default=7, help="timed PyTorch steps per configuration")
    ap.add_argument("--repetitions", type=int, default=3, help="Google Benchmark repetitions")
    args = ap.parse_args()
    os.environ.update(OMP_WAIT_POLICY="PASSIVE")

    ours = graphmoe_times(args.build_dir, args.repetitions)
    rows, ratios = [], {}
    version = None
    for threads in (1, 2):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        for router in ("softmax", "similarity", "attention"):
            # torch must see the thread settings at import: run it in a child process
            code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
                    f"import moe_layer_torch as m; t, v = m.torch_layer_times({router!r}, {threads}, {args.repeats});"
                    "print(t, v)")
            env = dict(os.environ)
            res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
            t_torch, version = res.stdout.split()
            t_torch = float(t_torch)
            candidates = {p: ours[(router, threads, p)] for p in (0, 1) if (router, threads, p) in ours}
            best_p = min(candidates, key=candidates.get)
            t_ours = candidates[best_p]
            rows.append((router, threads, t_ours, best_p, t_torch, t_ours / t_torch))
            if threads == 2:
                ratios[router] = t_ours / t_torch
    print(f"torch {version}; shape B={B} T={T} D={D} E={E} d_ff={FF} top-{K}, float32, causal graphs")
    print(f"{'router':<12}{'threads':>8}{'graphmoe ms':>14}{'(parallel)':>12}{'torch ms':>12}{'ratio':>8}")
    for router, threads, a, p, b, r in rows:
        par = "experts" if p == 1 else "gemm"
        print(f"{router:<12}{threads:>8}{a:>14.1f}{par:>12}{b:>12.1f}{r:>8.2f}")
    print("moe_layer fwd+bwd graphmoe/torch: " + " ".join(f"{k}={ratios[k]:.2f}" for k in ("softmax", "similarity", "attention")))


if __name__ == "__main__":
    main()
