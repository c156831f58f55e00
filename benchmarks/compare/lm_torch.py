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

    python3 benchmarks/compare/lm_torch.py --build-dir build [--steps 10] [--warmup 3]
        [--python PY ...] [--no-compile] [--arch olmoe]

--arch olmoe: the olmoe preset instead (TransformerLMConfig::olmoe with a vocabulary of 10000:
4 blocks, D = 256, 8 heads, RMSNorm, RoPE 10,000, QK-norm over the projections, SwiGLU, E = 64
experts of width 128, top-8 with unnormalised gates, the load-balancing loss 0.01 and z-loss
0.001, untied head), batch 8 x 128, graphmoe's rows BM_lm_train_olmoe_<router> of bench_lm. The
PyTorch model is preset_torch.py's (nn.Module classes as Hugging Face's OlmoeForCausalLM: RMSNorm,
q/k/v/o projections, QK-norm, rotate_half RoPE, an explicit causal softmax, a router Linear,
softmax, topk, a per-expert loop of SwiGLU experts with index_add, the two auxiliary losses;
autograd), built from the config.json that build/benchmarks/preset_dump writes for the same
preset and shape (`cmake --build build --target preset_dump`) and loaded with graphmoe's initial
weights: before timing, each torch child checks that its first loss equals graphmoe's (relative
difference < 1e-4), so that both sides train the same model.

Every torch found is measured (torch_peers.py): by default Debian's python3-torch
(/usr/bin/python3, torch 1.13), the current PyPI torch of scripts/install-torch-current.sh
(~/.cache/graphmoe/venv-torch, or $GRAPHMOE_TORCH_VENV), and the python running the script; or
the --python interpreters given. One that is missing or whose torch does not import is reported
and skipped. A torch with torch.compile is measured twice: eager, and with the model through
torch.compile (default inductor backend; optimizer and clipping eager), its first
max(--warmup, --compile-warmup) steps untimed; where torch.compile is missing or fails, the
script prints "<torch> compiled: unavailable (reason)". OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and
OMP_WAIT_POLICY=PASSIVE are set for both sides, which run as child processes (each torch under
its own interpreter; compiled ones with TORCHINDUCTOR_COMPILE_THREADS=1, so that compilation
stays in the child) at 1 and 2 threads. The machine is shared: as gemm_report.py does, each
child's run is compared with the CPU time the whole VM spent meanwhile (/proc/stat) and repeated,
after waiting for a quiet moment, when other processes used more than --max-other-load of the
CPUs. OPENBLAS_CORETYPE is passed on as set; the output names it beside what
scripts/openblas-coretype.sh advises for the CPU.

graphmoe's time per step is Google Benchmark's median over --repetitions runs, measured once and
compared with every torch; PyTorch's is the median of --steps timed steps after --warmup untimed
ones. The summary lines are one per torch and mode, then the line kept from the single-torch
script, last:

    lm_train tokens/s graphmoe/torch-1.13.0a0: R
    lm_train tokens/s graphmoe/torch-2.15.0: R
    lm_train tokens/s graphmoe/torch-2.15.0-compiled: R
    lm_train tokens/s graphmoe/torch: R

with R = graphmoe's tokens/s / PyTorch's tokens/s at 2 threads (above 1: graphmoe is faster),
and the last line's R against the first torch found whose runs succeeded, eager (Debian's 1.13 by
default). A torch whose eager run fails is reported ("<torch>: failed, not compared") and left out.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import tempfile
import time

import torch_peers
from torch_peers import fmt_load, run_measured

B, T, D, H, L, E, K, FF, V = 8, 128, 128, 4, 6, 8, 2, 512, 10000
TOKENS = B * T


# ----------------------------------------------------------------------------- PyTorch side

def torch_step_times(threads, warmup, steps, attention="mha", foreach=False, mode="eager"):
    """Median seconds per training step of the PyTorch model, as a dict: seconds, version, loss;
    or version and error where mode "compiled" cannot run (torch.compile missing or failing)."""
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
    run = model
    if mode == "compiled":
        run, reason = torch_peers.compile_or_reason(torch, model)
        if run is None:
            return {"version": torch.__version__, "error": reason}
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, foreach=foreach)
    g = torch.Generator().manual_seed(1234)
    stream = torch.randint(0, V, (B, T + 1), generator=g)
    ids, targets = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    def step():
        loss = run(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return timed_steps(torch, step, warmup, steps, mode)


def timed_steps(torch, step, warmup, steps, mode, check=None):
    """warmup untimed calls of step (after check(first loss), which returns an error text or None),
    then the median seconds of steps timed ones: {"seconds", "version", "loss"}, or {"version",
    "error"} where the check fails or a compiled model fails to run."""
    try:
        for i in range(warmup):
            loss = step()
            reason = check(loss) if check is not None and i == 0 else None
            if reason:
                return {"version": torch.__version__, "error": reason}
    except Exception as e:  # torch.compile's errors surface at the first call
        if mode != "compiled":
            raise
        return {"version": torch.__version__, "error": torch_peers.error_reason(e)}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "version": torch.__version__, "loss": loss}


def torch_preset_step_times(threads, warmup, steps, dump_dir, foreach=False, mode="eager"):
    """torch_step_times for a preset_dump directory (--arch): preset_torch.py's model of the
    preset, graphmoe's initial weights, the dump's ids and targets; the first step's loss checked
    against graphmoe's."""
    import sys

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import preset_torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(dump_dir, "config.json")))
    want = json.load(open(os.path.join(dump_dir, "results.json")))["loss"]["total"]
    w0 = preset_torch.read_safetensors(os.path.join(dump_dir, "weights.safetensors"))
    outs = preset_torch.read_safetensors(os.path.join(dump_dir, "outputs.safetensors"))
    model = preset_torch.LM(cfg, set(w0))
    model.load_state_dict(w0, strict=True)
    params = {p["name"]: p for p in cfg["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if params[n]["trainable"]]
    for n, p in model.named_parameters():
        p.requires_grad_(params[n]["trainable"])
    run = model
    if mode == "compiled":
        run, reason = torch_peers.compile_or_reason(torch, model)
        if run is None:
            return {"version": torch.__version__, "error": reason}
    oc = cfg["optimizer"]
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in trainable if params[n]["decay"]], "weight_decay": oc["weight_decay"]},
         {"params": [p for n, p in trainable if not params[n]["decay"]], "weight_decay": 0.0}],
        lr=oc["lr"], betas=(oc["beta1"], oc["beta2"]), eps=oc["eps"], foreach=foreach)
    ids, targets = outs["ids"].long(), outs["targets"].long()

    def step():
        _, task, aux = run(ids, targets)
        loss = task + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], oc["clip"])
        opt.step()
        return loss.item()

    def check(first):
        if abs(first - want) > 1e-4 * abs(want):
            return f"first loss {first:.6f} differs from graphmoe's {want:.6f}"
        return None

    return timed_steps(torch, step, max(warmup, 1), steps, mode, check)


def preset_dump(args, dump_dir):
    """The config, initial weights and batch of --arch at this script's shape (preset_dump)."""
    exe = os.path.join(args.build_dir, "benchmarks", "preset_dump")
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"lm_torch.py: --arch needs {exe} "
                         f"(cmake --build {args.build_dir} --target preset_dump)")
    subprocess.run([exe, "--arch", args.arch, "--router", "softmax", "--vocab", str(V),
                    "--seq", str(T), "--batch", str(B), "--d-model", "0", "--blocks", "0",
                    "--lr", "1e-3", "--clip", "1", "--weight-decay", "0.01", "--out", dump_dir],
                   check=True, stdout=subprocess.DEVNULL)
    return json.load(open(os.path.join(dump_dir, "config.json")))


# ----------------------------------------------------------------------------- graphmoe side

def graphmoe_step_ms(args, router, threads, env):
    exe = os.path.join(args.build_dir, "benchmarks", "bench_lm")
    name = f"{args.arch}_{router}" if args.arch else router
    cmd = [exe, f"--benchmark_filter=^BM_lm_train_{name}/threads:{threads}/",
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


def torch_step_ms(args, peer, mode, threads, env):
    """{"ms", "loss", "load"} of one torch child, or {"error"} where it cannot run."""
    here = os.path.dirname(os.path.abspath(__file__))
    warmup = max(args.warmup, args.compile_warmup) if mode == "compiled" else args.warmup
    # torch must see the thread settings at import: run it in a child process
    if args.arch:
        call = (f"m.torch_preset_step_times({threads}, {warmup}, {args.steps}, "
                f"{args.dump_dir!r}, {args.foreach}, {mode!r})")
    else:
        call = (f"m.torch_step_times({threads}, {warmup}, {args.steps}, "
                f"{args.attention!r}, {args.foreach}, {mode!r})")
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import lm_torch as m;"
            f"print(json.dumps({call}))")
    label = f"{peer.label}{'-compiled' if mode == 'compiled' else ''} {threads} threads"
    try:
        out, load = run_measured([peer.python, "-c", code], torch_peers.child_env(env, mode), args,
                                 label)
    except subprocess.CalledProcessError as e:
        return {"error": f"{peer.python} exited with {e.returncode}"}
    res = torch_peers.child_result(out)
    if "error" in res:
        return res
    return {"ms": res["seconds"] * 1e3, "loss": res["loss"], "load": load}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="graphmoe build tree with bench_lm")
    torch_peers.add_peer_arguments(ap)
    ap.add_argument("--warmup", type=int, default=3, help="untimed PyTorch steps")
    ap.add_argument("--compile-warmup", type=int, default=5,
                    help="untimed steps of a compiled run (compilation and recompilation)")
    ap.add_argument("--steps", type=int, default=10, help="timed PyTorch steps (median)")
    ap.add_argument("--repetitions", type=int, default=3, help="Google Benchmark repetitions")
    ap.add_argument("--attention", choices=("mha", "explicit"), default="mha",
                    help="PyTorch attention: nn.MultiheadAttention or explicit masked softmax")
    ap.add_argument("--foreach", action="store_true",
                    help="torch.optim.AdamW(foreach=True) (torch 1.13's default is False)")
    ap.add_argument("--similarity", action="store_true",
                    help="also time graphmoe's Similarity-router LM (for reference)")
    ap.add_argument("--arch", choices=("olmoe",),
                    help="a preset instead of the Switch LM (needs preset_dump in the build)")
    torch_peers.add_load_arguments(ap)
    args = ap.parse_args()
    peers = torch_peers.peers_from_args(args)
    if args.arch:
        tmp = tempfile.TemporaryDirectory(prefix="lm_torch.")
        args.dump_dir = tmp.name
        cfg = preset_dump(args, args.dump_dir)
        model_line = (f"{args.arch} preset L={cfg['num_layers']} D={cfg['d_model']} "
                      f"H={cfg['num_heads']} E={cfg['num_experts']} top-{cfg['k']} "
                      f"expert d_ff={cfg['expert_d_ff']} V={V}, "
                      f"{sum(math.prod(p['shape']) for p in cfg['params'])} parameters")
    else:
        model_line = f"Switch LM L={L} D={D} H={H} E={E} top-{K} d_ff={FF} V={V}"

    runs = [(p, m) for p in peers for m in p.modes(not args.no_compile)]
    unavailable = {} if args.no_compile else {
        p.label: f"torch {p.version} has no torch.compile" for p in peers if not p.has_compile}
    failed = {}  # label -> why its eager run failed: reported, not compared
    ours, theirs = {}, {}
    for threads in (1, 2):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   OMP_WAIT_POLICY="PASSIVE")
        ours[threads] = graphmoe_step_ms(args, "softmax", threads, env)
        if args.similarity:
            ours[threads] += graphmoe_step_ms(args, "similarity", threads, env)
        for peer, mode in runs:
            if (mode == "compiled" and peer.label in unavailable) or peer.label in failed:
                continue
            res = torch_step_ms(args, peer, mode, threads, env)
            if "error" in res and mode == "compiled":
                unavailable[peer.label] = res["error"]
            elif "error" in res:
                failed[peer.label] = res["error"]
            else:
                theirs[(peer.label, mode, threads)] = res

    for p in peers:
        print(f"{p.label}: torch {p.version} ({p.python})")
    print(f"PyTorch: {'preset_torch.py' if args.arch else args.attention + ' attention'}, "
          f"AdamW foreach={args.foreach}; {model_line}, batch {B} x {T}, float32")
    print(torch_peers.coretype_line())
    hdr = (f"{'threads':>7} {'graphmoe ms/step':>17} {'graphmoe tok/s':>15} {'torch':>24} "
           f"{'torch ms/step':>14} {'torch tok/s':>12} {'ratio':>6} {'other load (ours/torch)':>24}")
    if args.similarity:
        hdr += f" {'similarity ms/step':>19} {'tok/s':>8}"
    print(hdr)
    ratios = {}
    for threads in (1, 2):
        o = ours[threads]
        for peer, mode in runs:
            t = theirs.get((peer.label, mode, threads))
            if t is None:
                continue
            name = peer.label + ("-compiled" if mode == "compiled" else "")
            r = (TOKENS / o[0]) / (TOKENS / t["ms"])
            if threads == 2:
                ratios[name] = r
            line = (f"{threads:>7} {o[0]:>17.1f} {TOKENS / o[0] * 1e3:>15.0f} {name:>24} "
                    f"{t['ms']:>14.1f} {TOKENS / t['ms'] * 1e3:>12.0f} {r:>6.2f} "
                    f"{fmt_load(o[1]) + ' / ' + fmt_load(t['load']):>24}")
            if args.similarity:
                line += f" {o[2]:>19.1f} {TOKENS / o[2] * 1e3:>8.0f}"
            print(line)
    torch_peers.report_left_out(unavailable, failed)
    for name, r in ratios.items():
        print(f"lm_train tokens/s graphmoe/{name}: {r:.2f}")
    print(f"lm_train tokens/s graphmoe/torch: {ratios[torch_peers.first_compared(peers, ratios, failed)]:.2f}")


if __name__ == "__main__":
    main()
