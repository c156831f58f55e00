#!/usr/bin/env python3
"""MoE layer forward+backward: graphmoe (bench_moe) beside the same layer in PyTorch, one run.

Shapes (--shape), float32, causal token graphs, batch 4 x 512 tokens:

  medium (default)  the paper's medium size: D = 352, E = 16 GELU experts of d_ff = 352 with
                    biases, top-2, renormalised gates; routers softmax, similarity, attention
                    (bench_moe's BM_moe_<router>_fwdbwd rows).
  fine              fine-grained experts, the olmoe preset's MoE layer (TransformerLMConfig::olmoe):
                    D = 256, E = 64 SwiGLU experts of width 128 without biases, top-8, gates not
                    renormalised; routers softmax, similarity, sigmoid_bias (the
                    BM_moe_fine_<router>_fwdbwd rows).

The PyTorch layer is written the usual way: per-expert index_select / index_add_, one weight
tensor per expert, autograd for the backward. With --shape fine it is Hugging Face's
OlmoeSparseMoeBlock: a router linear map (with a bias for softmax and similarity and none for
sigmoid_bias, as graphmoe's LinearScorer and SigmoidScorer), softmax or sigmoid scores, topk, the
unnormalised gates, experts down(silu(gate(x)) * up(x)) with separate bias-free gate, up and down
weights; sigmoid_bias selects the top-8 of the scores plus a zero selection-bias buffer
(DeepSeek-V3's e_score_correction_bias) and gates with the scores alone. similarity (both shapes):
p = S r, S = softmax(U U^T / tau) causal within each sequence, tau = 1 (graphmoe's default).

    python3 benchmarks/compare/moe_layer_torch.py --build-dir build [--shape fine] [--repeats 7]
        [--python PY ...] [--no-compile]

Every torch found is measured (torch_peers.py): by default Debian's python3-torch
(/usr/bin/python3, torch 1.13), the current PyPI torch of scripts/install-torch-current.sh
(~/.cache/graphmoe/venv-torch, or $GRAPHMOE_TORCH_VENV), and the python running the script; or
the --python interpreters given. One that is missing or whose torch does not import is reported
and skipped. A torch with torch.compile is measured twice: eager, and with the layer's forward
through torch.compile (default inductor backend), its first 5 steps untimed; where torch.compile
is missing or fails, the script prints "<torch> compiled: unavailable (reason)". Each torch side
runs as a child process under its own interpreter (compiled ones with
TORCHINDUCTOR_COMPILE_THREADS=1). OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and
OMP_WAIT_POLICY=PASSIVE are set for both sides; graphmoe's times come from one bench_moe run
(median of --repetitions), compared with every torch. As in lm_torch.py, each run is repeated,
after waiting for a quiet moment, when other processes used more than --max-other-load of the
CPUs (/proc/stat). The summary lines are one per torch and mode, then the line kept from the
single-torch script, last:

    moe_layer fwd+bwd graphmoe/torch-2.15.0: softmax=R1 similarity=R2 attention=R3
    moe_layer fwd+bwd graphmoe/torch-2.15.0-compiled: softmax=R1 similarity=R2 attention=R3
    moe_layer fwd+bwd graphmoe/torch: softmax=R1 similarity=R2 attention=R3

(with --shape fine: softmax=R1 similarity=R2 sigmoid_bias=R3), with R the ratio of median times at
2 threads (below 1: graphmoe is faster), and the last line's R against the first torch found
whose runs succeeded, eager (Debian's 1.13 by default). A torch whose eager run fails is reported
("<torch>: failed, not compared") and left out. The table's header names the shape.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import time

import torch_peers
from torch_peers import fmt_load, run_measured

B, T, D, E, FF, K, H = 4, 512, 352, 16, 352, 2, 8
ROUTERS = ("softmax", "similarity", "attention")
# --shape fine: the olmoe preset's MoE layer (B, T as above)
FINE_D, FINE_E, FINE_FF, FINE_K = 256, 64, 128, 8
FINE_ROUTERS = ("softmax", "similarity", "sigmoid_bias")
SHAPES = {
    "medium": {"routers": ROUTERS, "bench": "BM_moe_",
               "line": f"shape B={B} T={T} D={D} E={E} d_ff={FF} top-{K}, float32, causal graphs"},
    "fine": {"routers": FINE_ROUTERS, "bench": "BM_moe_fine_",
             "line": f"shape fine (the olmoe preset's MoE layer): B={B} T={T} D={FINE_D} "
                     f"E={FINE_E} SwiGLU experts of width {FINE_FF} without biases, top-{FINE_K}, "
                     f"gates not renormalised, float32, causal graphs"},
}


def torch_layer_times(router, threads, repeats, mode="eager", shape="medium"):
    """Median ms of the PyTorch layer's forward+backward, as a dict: ms, version; or version and
    error where mode "compiled" cannot run (torch.compile missing or failing)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    layer, u, dy, _ = (fine_layer if shape == "fine" else medium_layer)(router, g)

    run = layer
    if mode == "compiled":
        run, reason = torch_peers.compile_or_reason(torch, layer)
        if run is None:
            return {"version": torch.__version__, "error": reason}

    def step():
        run(u).backward(dy)

    try:
        for _ in range(2 if mode == "eager" else 5):  # compiled: compilation and recompilation
            step()
    except Exception as e:  # torch.compile's errors surface at the first call
        if mode != "compiled":
            raise
        return {"version": torch.__version__, "error": torch_peers.error_reason(e)}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "version": torch.__version__}


def medium_layer(router, g):
    """The paper's medium layer: (layer, u, dy, parameters by name) for torch_layer_times."""
    import torch
    import torch.nn.functional as F

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

    def layer(u):
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
        return y

    return layer, u, dy, {"router.weight": w_r, "router.bias": b_r, "w1": w1, "b1": b1, "w2": w2,
                          "b2": b2}


def fine_layer(router, g):
    """The olmoe preset's MoE layer as Hugging Face's OlmoeSparseMoeBlock writes it (per-expert
    loop, separate gate / up / down weights, autograd): (layer, u, dy, parameters by name) for
    torch_layer_times. Weights N(0, 0.02^2) and biases zero, as graphmoe initialises them."""
    import torch
    import torch.nn.functional as F

    n, d, n_e, ff, k = B * T, FINE_D, FINE_E, FINE_FF, FINE_K
    u = torch.randn(n, d, generator=g, requires_grad=True)
    dy = torch.randn(n, d, generator=g)
    w_r = (0.02 * torch.randn(n_e, d, generator=g)).requires_grad_()
    # graphmoe's LinearScorer (softmax, similarity) has a bias, its SigmoidScorer none
    b_r = None if router == "sigmoid_bias" else torch.zeros(n_e, requires_grad=True)
    # sigmoid_bias: the per-expert selection bias (a buffer, not trained; zero as graphmoe's
    # before any balancing step)
    e_bias = torch.zeros(n_e)
    w_g = [(0.02 * torch.randn(ff, d, generator=g)).requires_grad_() for _ in range(n_e)]
    w_u = [(0.02 * torch.randn(ff, d, generator=g)).requires_grad_() for _ in range(n_e)]
    w_d = [(0.02 * torch.randn(d, ff, generator=g)).requires_grad_() for _ in range(n_e)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def layer(u):
        logits = F.linear(u, w_r, b_r)
        r = logits.sigmoid() if router == "sigmoid_bias" else logits.softmax(-1)
        p = r
        if router == "similarity":  # tau = 1
            U = u.view(B, T, d)
            s = (U @ U.transpose(1, 2)).masked_fill(~causal, float("-inf")).softmax(-1)
            p = (s @ r.view(B, T, n_e)).reshape(n, n_e)
        if router == "sigmoid_bias":  # the bias selects; the gates are the scores
            idx = (p + e_bias).topk(k, dim=-1).indices
            gates = p.gather(1, idx)
        else:
            gates, idx = p.topk(k, dim=-1)
        # norm_topk_prob = false: the gates are not renormalised
        y = torch.zeros_like(u)
        for e in range(n_e):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            x = u.index_select(0, tok)
            h = F.silu(F.linear(x, w_g[e])) * F.linear(x, w_u[e])
            y.index_add_(0, tok, F.linear(h, w_d[e]) * gates[tok, slot].unsqueeze(1))
        return y

    return layer, u, dy, {"router.weight": w_r, "router.bias": b_r, "expert_bias": e_bias,
                          "gate": w_g, "up": w_u, "down": w_d}


def graphmoe_times(args):
    shape = SHAPES[args.shape]
    exe = os.path.join(args.build_dir, "benchmarks", "bench_moe")
    cmd = [exe, f"--benchmark_filter={shape['bench']}({'|'.join(shape['routers'])})_fwdbwd",
           "--benchmark_format=json"]
    if args.repetitions > 1:
        cmd += [f"--benchmark_repetitions={args.repetitions}",
                "--benchmark_report_aggregates_only=true"]
    out, load = run_measured(cmd, dict(os.environ), args, "graphmoe")
    res = {}
    for b in json.loads(out)["benchmarks"]:
        if (b.get("aggregate_name") != "median" if args.repetitions > 1
                else b.get("run_type", "iteration") != "iteration"):
            continue
        name = b["run_name"]  # BM_moe_similarity_fwdbwd/2/1/min_time:1.000/real_time
        parts = name.split("/")
        router = parts[0][len(shape["bench"]):-len("_fwdbwd")]
        res[(router, int(parts[1]), int(parts[2]))] = b["real_time"]
    return res, load


def torch_ms(args, peer, mode, router, threads):
    """{"ms", "load"} of one torch child, or {"error"} where it cannot run."""
    here = os.path.dirname(os.path.abspath(__file__))
    # torch must see the thread settings at import: run it in a child process
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import moe_layer_torch as m;"
            f"print(json.dumps(m.torch_layer_times({router!r}, {threads}, {args.repeats}, "
            f"{mode!r}, {args.shape!r})))")
    label = f"{peer.label}{'-compiled' if mode == 'compiled' else ''} {router} {threads} threads"
    try:
        out, load = run_measured([peer.python, "-c", code],
                                 torch_peers.child_env(dict(os.environ), mode), args, label)
    except subprocess.CalledProcessError as e:
        return {"error": f"{peer.python} exited with {e.returncode}"}
    res = torch_peers.child_result(out)
    return res if "error" in res else {"ms": res["ms"], "load": load}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="medium",
                    help="the layer: the paper's medium one, or the olmoe preset's fine-grained "
                         "one")
    torch_peers.add_peer_arguments(ap)
    ap.add_argument("--repeats", type=int, default=7, help="timed PyTorch steps per configuration")
    ap.add_argument("--repetitions", type=int, default=3, help="Google Benchmark repetitions")
    torch_peers.add_load_arguments(ap)
    args = ap.parse_args()
    routers = SHAPES[args.shape]["routers"]
    peers = torch_peers.peers_from_args(args)
    os.environ.update(OMP_WAIT_POLICY="PASSIVE")

    ours, our_load = graphmoe_times(args)
    runs = [(p, m) for p in peers for m in p.modes(not args.no_compile)]
    unavailable = {} if args.no_compile else {
        p.label: f"torch {p.version} has no torch.compile" for p in peers if not p.has_compile}
    failed = {}  # label -> why its eager run failed: reported, not compared
    rows, ratios = [], {}
    for threads in (1, 2):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        for router in routers:
            candidates = {p: ours[(router, threads, p)] for p in (0, 1) if (router, threads, p) in ours}
            best_p = min(candidates, key=candidates.get)
            t_ours = candidates[best_p]
            for peer, mode in runs:
                if (mode == "compiled" and peer.label in unavailable) or peer.label in failed:
                    continue
                res = torch_ms(args, peer, mode, router, threads)
                if "error" in res and mode == "compiled":
                    unavailable[peer.label] = res["error"]
                    continue
                if "error" in res:
                    failed[peer.label] = res["error"]
                    continue
                name = peer.label + ("-compiled" if mode == "compiled" else "")
                rows.append((router, threads, t_ours, best_p, name, res["ms"], t_ours / res["ms"],
                             res["load"]))
                if threads == 2:
                    ratios.setdefault(name, {})[router] = t_ours / res["ms"]
    for p in peers:
        print(f"{p.label}: torch {p.version} ({p.python})")
    print(SHAPES[args.shape]["line"])
    print(torch_peers.coretype_line())
    print(f"{'router':<12}{'threads':>8}{'graphmoe ms':>14}{'(parallel)':>12}{'torch':>26}"
          f"{'torch ms':>12}{'ratio':>8}{'other load (ours/torch)':>26}")
    for router, threads, a, p, name, b, r, load in rows:
        par = "experts" if p == 1 else "gemm"
        print(f"{router:<12}{threads:>8}{a:>14.1f}{par:>12}{name:>26}{b:>12.1f}{r:>8.2f}"
              f"{fmt_load(our_load) + ' / ' + fmt_load(load):>26}")
    torch_peers.report_left_out(unavailable, failed)
    summary = lambda rs: " ".join(f"{k}={rs[k]:.2f}" for k in routers if k in rs)  # noqa: E731
    for name, rs in ratios.items():
        print(f"moe_layer fwd+bwd graphmoe/{name}: {summary(rs)}")
    print(f"moe_layer fwd+bwd graphmoe/torch: {summary(ratios[torch_peers.first_compared(peers, ratios, failed)])}")


if __name__ == "__main__":
    main()
