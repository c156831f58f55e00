#!/usr/bin/env python3
"""LM training throughput: graphmoe (bench_lm) beside the same Switch LM in PyTorch, one run.

Model: 6 pre-norm blocks, D = 128, 4 heads, every FFN an MoE with E = 8 experts, top-2,
d_ff = 512, GELU (tanh), learned positions, tied embeddings, causal attention, vocabulary 10000,
batch 8 x 128 tokens, float32. One training step: forward (mean cross-entropy), zero_grad,
backward, clip_grad_norm 1.0, AdamW (lr 1e-3, weight decay 0.01 on weight matrices). Token ids
are random with a fixed seed. The PyTorch model is written the usual way: nn.Embedding plus a
learned position table, nn.MultiheadAttention (or, with --attention explicit, q/k/v Linear
layers and an explicit masked softmax), an MoE FFN with a Linear router + softmax + topk +
renormalised gates and a per-expert index_select / index_add_ loop over separate per-expert
weights, the head tied to the embedding, F.cross_entropy, torch.optim.AdamW and
clip_grad_norm_; autograd does the backward.

    /usr/bin/python3 benchmarks/compare/lm_torch.py --build-dir build [--steps 10] [--warmup 3]

Run it with Debian's python3-torch (/usr/bin/python3, torch 1.13): PyPI's newest torch installs
on these machines but does not import (its CUDA libraries are missing). OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and OMP_WAIT_POLICY=PASSIVE are set for both sides, which run as child
processes at 1 and 2 threads. The machine is shared: as gemm_report.py does, each child's run is
compared with the CPU time the whole VM spent meanwhile (/proc/stat) and repeated, after waiting
for a quiet moment, when other processes used more than --max-other-load of the CPUs.

graphmoe's time per step is Google Benchmark's median over --repetitions runs; PyTorch's is the
median of --steps timed steps after --warmup untimed ones. The last line is

    lm_train tokens/s graphmoe/torch: R

with R = graphmoe's tokens/s / PyTorch's tokens/s at 2 threads (above 1: graphmoe is faster).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

B, T, D, H, L, E, K, FF, V = 8, 128, 128, 4, 6, 8, 2, 512, 10000
TOKENS = B * T


# ----------------------------------------------------------------------------- PyTorch side

def torch_step_times(threads, warmup, steps, attention="mha", foreach=False):
    """Median seconds per training step of the PyTorch model; returns (median_s, version, loss)."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    class CausalSelfAttention(nn.Module):
        """Explicit attention: q, k, v, out projections and a masked softmax."""

        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
            self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))

        def forward(self, x):
            b, t, _ = x.shape
            split = lambda z: z.view(b, t, H, D // H).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D // H)
            a = s.masked_fill(self.mask[:t, :t], float("-inf")).softmax(-1) @ v
            return self.o(a.transpose(1, 2).reshape(b, t, D))

    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)
            self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1))

        def forward(self, x):
            t = x.shape[1]
            return self.attn(x, x, x, attn_mask=self.mask[:t, :t], need_weights=False)[0]

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, E)
            self.w1 = nn.ModuleList(nn.Linear(D, FF) for _ in range(E))
            self.w2 = nn.ModuleList(nn.Linear(FF, D) for _ in range(E))

        def forward(self, u):  # u: (N, D)
            p = self.router(u).softmax(-1)
            vals, idx = p.topk(K, dim=-1)
            gates = vals / vals.sum(-1, keepdim=True)
            y = torch.zeros_like(u)
            for e in range(E):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                x = u.index_select(0, tok)
                h = F.gelu(self.w1[e](x), approximate="tanh")
                y = y.index_add(0, tok, self.w2[e](h) * gates[tok, slot].unsqueeze(1))
            return y

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.attn = MHA() if attention == "mha" else CausalSelfAttention()
            self.moe = MoE()

        def forward(self, h):
            h = h + self.attn(self.ln1(h))
            b, t, _ = h.shape
            return h + self.moe(self.ln2(h).view(b * t, D)).view(b, t, D)

    class SwitchLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, D)
            self.pos = nn.Parameter(torch.zeros(T, D))
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D)
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                elif "ln" not in name:  # biases; LayerNorm gains stay 1
                    nn.init.zeros_(p)

        def forward(self, ids, targets):
            t = ids.shape[1]
            h = self.tok(ids) + self.pos[:t]
            for blk in self.blocks:
                h = blk(h)
            logits = self.ln_f(h) @ self.tok.weight.t()  # tied head
            return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    model = SwitchLM()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, foreach=foreach)
    g = torch.Generator().manual_seed(1234)
    stream = torch.randint(0, V, (B, T + 1), generator=g)
    ids, targets = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    def step():
        loss = model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.__version__, loss


# ----------------------------------------------------------------------------- machine load

def cpu_jiffies():
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def children_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_until_idle(threshold, timeout=300.0):
    """Waits (up to timeout seconds) for a 2-second window with load below threshold."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        a = cpu_jiffies()
        time.sleep(2.0)
        b = cpu_jiffies()
        if a is None or b is None or (b[0] - a[0]) / max(1, b[1] - a[1]) < threshold:
            return


def run_measured(cmd, env, args, label):
    """Runs cmd; reruns it while other processes took more than args.max_other_load of the CPUs.
    Returns (stdout, other load fraction or None)."""
    load = None
    for attempt in range(args.retries + 1):
        if attempt > 0 or args.wait_idle:
            wait_until_idle(args.max_other_load, args.idle_timeout)
        j0, c0, t0 = cpu_jiffies(), children_cpu_seconds(), time.time()
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
        j1, c1, t1 = cpu_jiffies(), children_cpu_seconds(), time.time()
        if j0 is None or j1 is None:
            return out, None
        busy = (j1[0] - j0[0]) / os.sysconf("SC_CLK_TCK")
        load = max(0.0, busy - (c1 - c0)) / ((t1 - t0) * (os.cpu_count() or 1))
        if load <= args.max_other_load:
            break
        print(f"  {label}: other processes used {100 * load:.0f}% of the CPUs, rerunning",
              file=sys.stderr)
    return out, load


# ----------------------------------------------------------------------------- graphmoe side

def graphmoe_step_ms(args, router, threads, env):
    exe = os.path.join(args.build_dir, "benchmarks", "bench_lm")
    cmd = [exe, f"--benchmark_filter=^BM_lm_train_{router}/threads:{threads}/",
           "--benchmark_format=json"]
    if args.repetitions > 1:
        cmd += [f"--benchmark_repetitions={args.repetitions}",
                "--benchmark_report_aggregates_only=true"]
    out, load = run_measured(cmd, env, args, f"graphmoe {router} {threads} threads")
    for b in json.loads(out)["benchmarks"]:
        if (b.get("aggregate_name") == "median" if args.repetitions > 1
                else b.get("run_type", "iteration") == "iteration"):
            assert b["time_unit"] == "ms", b["time_unit"]
            return b["real_time"], load
    raise RuntimeError(f"no median in bench_lm's output for {router} at {threads} threads")


def torch_step_ms(args, threads, env):
    here = os.path.dirname(os.path.abspath(__file__))
    # torch must see the thread settings at import: run it in a child process
    code = (f"import sys; sys.path.insert(0, {here!r}); import lm_torch as m;"
            f"s, v, l = m.torch_step_times({threads}, {args.warmup}, {args.steps}, "
            f"{args.attention!r}, {args.foreach}); print(s, v, l)")
    out, load = run_measured([args.python, "-c", code], env, args, f"torch {threads} threads")
    s, version, loss = out.split()
    return float(s) * 1e3, version, float(loss), load


def fmt_load(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="graphmoe build tree with bench_lm")
    ap.add_argument("--python", default=sys.executable, help="Python with torch for the torch side")
    ap.add_argument("--warmup", type=int, default=3, help="untimed PyTorch steps")
    ap.add_argument("--steps", type=int, default=10, help="timed PyTorch steps (median)")
    ap.add_argument("--repetitions", type=int, default=3, help="Google Benchmark repetitions")
    ap.add_argument("--attention", choices=("mha", "explicit"), default="mha",
                    help="PyTorch attention: nn.MultiheadAttention or explicit masked softmax")
    ap.add_argument("--foreach", action="store_true",
                    help="torch.optim.AdamW(foreach=True) (torch 1.13's default is False)")
    ap.add_argument("--similarity", action="store_true",
                    help="also time graphmoe's Similarity-router LM (for reference)")
    ap.add_argument("--max-other-load", type=float, default=0.05,
                    help="rerun a side when other processes used more than this share of CPUs")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--idle-timeout", type=float, default=300.0,
                    help="seconds to wait for a quiet moment before a rerun")
    ap.add_argument("--wait-idle", action="store_true",
                    help="wait for a quiet 2-second window before every run")
    args = ap.parse_args()

    rows, version = [], None
    ratio = None
    for threads in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   OMP_WAIT_POLICY="PASSIVE")
        ours, our_load = graphmoe_step_ms(args, "softmax", threads, env)
        sim = graphmoe_step_ms(args, "similarity", threads, env) if args.similarity else (None, None)
        theirs, version, loss, their_load = torch_step_ms(args, threads, env)
        r = (TOKENS / ours) / (TOKENS / theirs)
        rows.append((threads, ours, theirs, r, sim[0], our_load, their_load, sim[1], loss))
        if threads == 2:
            ratio = r
    print(f"torch {version} ({args.attention} attention, AdamW foreach={args.foreach}); "
          f"Switch LM L={L} D={D} H={H} E={E} top-{K} d_ff={FF} V={V}, batch {B} x {T}, float32")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    hdr = (f"{'threads':>7} {'graphmoe ms/step':>17} {'graphmoe tok/s':>15} {'torch ms/step':>14} "
           f"{'torch tok/s':>12} {'ratio':>6} {'other load (ours/torch)':>24}")
    if args.similarity:
        hdr += f" {'similarity ms/step':>19} {'tok/s':>8}"
    print(hdr)
    for threads, ours, theirs, r, sim, ol, tl, sl, loss in rows:
        line = (f"{threads:>7} {ours:>17.1f} {TOKENS / ours * 1e3:>15.0f} {theirs:>14.1f} "
                f"{TOKENS / theirs * 1e3:>12.0f} {r:>6.2f} {fmt_load(ol) + ' / ' + fmt_load(tl):>24}")
        if args.similarity:
            line += f" {sim:>19.1f} {TOKENS / sim * 1e3:>8.0f}"
        print(line)
    print(f"lm_train tokens/s graphmoe/torch: {ratio:.2f}")


if __name__ == "__main__":
    main()
