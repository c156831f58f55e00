#!/usr/bin/env python3
"""Decode speed: graphmoe (bench_decode) beside the same MoE LM in PyTorch eager with a KV cache,
one run.

Model: the paper's medium shape, 6 pre-norm blocks, D = 352, 8 heads, every FFN an MoE with
E = 16 experts, top-2, d_ff = 352, GELU (tanh), learned positions, tied head, vocabulary 10000,
max_seq_len 1088, float32, random weights (equal weights are not needed for speed). One decode
step = one new token per sequence of the batch, at the position just after its prompt (prompts of
64 and 1024 random tokens, batch 1 and 8); tokens/s = batch * steps / time.

graphmoe (benchmarks/bench_decode.cpp): a Decoder with one slot per sequence, every slot fed its
prompt first (untimed), then 96 timed steps, each slot rewound to the prompt length every 16
steps (positions prompt .. prompt + 15); and its O(t^2) baseline, one TransformerLM::forward over
(batch, prompt) per generated token (Decoding::FullForward's cost). Routers: softmax, Similarity,
Attention. Google Benchmark's mean over the steps.

PyTorch: written the usual way for inference under torch.inference_mode(): nn.Embedding plus a
learned position table; q/k/v/out nn.Linear layers (with bias) and an explicit softmax attention;
a KV cache two ways, each measured: "cat", the usual past_key_values pattern (per layer a
(B, H, t, dh) key and value tensor, the new token's appended with torch.cat, a new tuple returned
by every step), and "static", preallocated (B, H, max_seq_len, dh) buffers written in place and
read up to the current position (a static cache); the prompt's caches come from one causal
forward over the prompt, untimed; an MoE FFN with an nn.Linear router + softmax + topk +
renormalised gates and a loop over the experts that received a token (index_select, Linear, GELU
tanh, Linear, index_add_), separate nn.Linear weights per expert; the head tied to the embedding.
Routers:
  softmax     p = softmax(W u + b)
  similarity  r = softmax(W u + b); p_t = S_t R with S_t = softmax_j(u_t . u_j / tau) over the
              cached tokens j <= t of the sequence; the routing cache keeps u (D) and r (E) per
              token and layer, kept like the KV cache (cat or static). tau = 1 (graphmoe's
              default, Similarity::Options::tau).
(graphmoe's Attention router has no PyTorch counterpart here: its row is graphmoe alone.)

--arch olmoe: the olmoe preset instead (TransformerLMConfig::olmoe(10000): 4 pre-norm blocks,
D = 256, 8 heads, RMSNorm (eps 1e-6), RoPE base 10000 (rotate_half), QK-norm over the whole q and
k projections, E = 64 SwiGLU experts of width 128 without biases, top-8 with unnormalised gates,
untied head, max_seq_len 576), batch 1, prompts 64 and 512, routers softmax and similarity;
graphmoe's cases BM_decode_incremental_olmoe_<router> (no full-forward baseline). The PyTorch
model is written as Hugging Face's OlmoeForCausalLM: RMSNorm modules, q/k/v/o nn.Linear without
bias, q_norm and k_norm (RMSNorm over the whole projections) before RoPE (cos and sin of the
step's positions from a rotary module, once per forward, applied with rotate_half), the KV cache
as above (cat or static), an explicit causal softmax attention; a sparse MoE block with a router
nn.Linear without bias (as OLMoE's gate and the preset's router), softmax (or
the Similarity mixing above), topk of 8 without renormalisation and a loop over the experts that
received a token, each an nn.Module of gate_proj, up_proj and down_proj (down(silu(gate(x)) *
up(x))); an untied lm_head. Before timing, each torch child also checks that its model has as
many parameters as graphmoe's (bench_decode's params counter).
The timed loop is the same as graphmoe's: --steps steps after --warmup untimed ones, every 16th
step starting again from the prompt's caches (positions prompt .. prompt + 15); tokens/s from the
total time of the timed steps. The next token's id is random (sampling is not timed on either
side). Before timing, each torch child checks its first 16 decoded steps' logits against one
full forward over the prompt and those tokens (relative difference < 1e-4).

Both sides run as child processes at --threads threads (default 2): OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and OMP_WAIT_POLICY=PASSIVE as lm_torch.py sets them, torch.set_num_threads
in the torch child, graphmoe::set_num_threads in bench_decode. Each case is its own process,
rerun when other processes used more than --max-other-load of the CPUs (torch_peers.py); the
"load" columns show what remained (ours / torch).

    python3 benchmarks/compare/decode_torch.py --build-dir build [--steps 96] [--warmup 16]
        [--python PY ...] [--threads 2] [--routers softmax,similarity,attention]
        [--batches 1,8] [--prompts 64,1024] [--arch paper-medium|olmoe]

Every torch found is measured (torch_peers.py; eager only: torch.compile is not tried here). The
table: per router, batch and prompt, graphmoe's incremental tokens/s, each torch's (cat and static),
the ratio to the faster of the two, and graphmoe's full-forward tokens/s with incremental / full
forward. The target line at the end:
graphmoe >= 3x PyTorch at batch 1 on 2 threads (softmax and Similarity, both prompts); with
--arch olmoe the summary and target lines name the preset.
"""
import argparse
import json
import os
import subprocess
import time

import torch_peers
from torch_peers import fmt_load, run_measured

L, D, H, E, K, FF, V, MAX_SEQ = 6, 352, 8, 16, 2, 352, 10000, 1088
TAU = 1.0
REWIND_EVERY = 16
BATCHES = (1, 8)
PROMPTS = (64, 1024)
GRAPHMOE_ROUTERS = ("softmax", "similarity", "attention")
TORCH_ROUTERS = ("softmax", "similarity")
CACHE_MODES = ("cat", "static")
TARGET = 3.0
# --arch olmoe: TransformerLMConfig::olmoe(10000) with max_seq_len 576 (bench_decode's olmoe cases;
# FF is the experts' width, EPS the RMSNorm and QK-norm eps, THETA the RoPE base)
OLMOE = dict(L=4, D=256, H=8, E=64, K=8, FF=128, V=10000, MAX_SEQ=576, EPS=1e-6, THETA=10000.0)
# per arch: the shape, the cases bench_decode registers (batches, prompts, routers) and the
# prefix of its case names
ARCHS = {
    "paper-medium": dict(shape=dict(L=L, D=D, H=H, E=E, K=K, FF=FF, V=V, MAX_SEQ=MAX_SEQ),
                         batches=BATCHES, prompts=PROMPTS, routers=GRAPHMOE_ROUTERS, case=""),
    "olmoe": dict(shape=OLMOE, batches=(1,), prompts=(64, 512), routers=TORCH_ROUTERS,
                  case="olmoe_"),
}


# ----------------------------------------------------------------------------- PyTorch side

def cache_ops(torch, cache_mode):
    """(causal_mask, append, route) of both models, with the cache kept as cache_mode says."""

    def causal_mask(t, n):
        """(t, n) True above the diagonal of the last t rows of an (n, n) causal mask."""
        return torch.ones(t, n, dtype=torch.bool).triu(n - t + 1)

    def append(past, a, b, start, dim):
        """The caches of a and b along dim after this call's t positions: (a_all, b_all, new past).
        cache "cat": past is None (the prompt) or the previous (a, b), extended by torch.cat into
        new tensors (past_key_values); "static": past holds preallocated (.., MAX_SEQ, ..)
        buffers, written in place at start .. start + t - 1 and read up to there."""
        if cache_mode == "static" and past is not None:
            a_buf, b_buf = past
            end = start + a.shape[dim]
            a_buf.narrow(dim, start, a.shape[dim]).copy_(a)
            b_buf.narrow(dim, start, b.shape[dim]).copy_(b)
            return a_buf.narrow(dim, 0, end), b_buf.narrow(dim, 0, end), past
        if past is not None:
            a, b = torch.cat([past[0], a], dim=dim), torch.cat([past[1], b], dim=dim)
        return a, b, (a, b)

    def route(router, u, r, past, start):
        """(p, the new routing cache) of the scores r (B, t, E) of tokens u (B, t, D): r itself, or
        for the Similarity router p_t = S_t R, S_t = softmax_j(u_t . u_j / TAU) over the cached
        tokens j <= t (the routing cache keeps u and r)."""
        if router != "similarity":
            return r, None
        uc, rc, cache = append(past, u, r, start, dim=1)
        t = u.shape[1]
        s = (u @ uc.transpose(1, 2)) / TAU  # (B, t, n)
        if t > 1:
            s = s.masked_fill(causal_mask(t, uc.shape[1]), float("-inf"))
        return s.softmax(-1) @ rc, cache

    return causal_mask, append, route


def medium_model(router, cache_mode):
    """The paper-medium MoE LM (module docstring): model(ids, start, past) -> logits, caches."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dh = D // H
    causal_mask, append, route = cache_ops(torch, cache_mode)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

        def forward(self, x, past, start):
            b, t, _ = x.shape
            split = lambda z: z.view(b, t, H, dh).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            k, v, kv = append(past, k, v, start, dim=2)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            if t > 1:  # the prompt: causal mask (a decode step reads every cached position)
                s = s.masked_fill(causal_mask(t, k.shape[2]), float("-inf"))
            a = s.softmax(-1) @ v
            return self.o(a.transpose(1, 2).reshape(b, t, D)), kv

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(D, E)
            self.w1 = nn.ModuleList(nn.Linear(D, FF) for _ in range(E))
            self.w2 = nn.ModuleList(nn.Linear(FF, D) for _ in range(E))

        def forward(self, u, past, start):  # u: (B, t, D)
            b, t, _ = u.shape
            r = self.router(u).softmax(-1)  # (B, t, E)
            p, cache = route(router, u, r, past, start)
            x = u.reshape(b * t, D)
            p = p.reshape(b * t, E)
            vals, idx = p.topk(K, dim=-1)
            gates = vals / vals.sum(-1, keepdim=True)
            y = torch.zeros_like(x)
            for e in idx.unique().tolist():  # the experts that received a token
                tok, slot = (idx == e).nonzero(as_tuple=True)
                xe = x.index_select(0, tok)
                he = F.gelu(self.w1[e](xe), approximate="tanh")
                y.index_add_(0, tok, self.w2[e](he) * gates[tok, slot].unsqueeze(1))
            return y.view(b, t, D), cache

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.attn = Attention()
            self.moe = MoE()

        def forward(self, h, past, start):
            a, kv = self.attn(self.ln1(h), None if past is None else past[0], start)
            h = h + a
            f, rc = self.moe(self.ln2(h), None if past is None else past[1], start)
            return h + f, (kv, rc)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, D)
            self.pos = nn.Parameter(torch.zeros(MAX_SEQ, D))
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D)
            for name, prm in self.named_parameters():
                if prm.dim() >= 2:
                    nn.init.normal_(prm, std=0.02)
                elif "ln" not in name:
                    nn.init.zeros_(prm)

        def forward(self, ids, start, past=None):
            """ids (B, t) at positions start .. start + t - 1 -> logits (B, t, V), new caches."""
            t = ids.shape[1]
            h = self.tok(ids) + self.pos[start:start + t]
            new = []
            for i, blk in enumerate(self.blocks):
                h, c = blk(h, None if past is None else past[i], start)
                new.append(c)
            return self.ln_f(h) @ self.tok.weight.t(), tuple(new)

    return LM()


def olmoe_model(router, cache_mode):
    """The olmoe preset written as Hugging Face's OlmoeForCausalLM (module docstring, --arch):
    model(ids, start, past) -> logits, caches."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    nl, d, h, e_, k_, ff, v_ = (OLMOE[n] for n in ("L", "D", "H", "E", "K", "FF", "V"))
    eps, theta = OLMOE["EPS"], OLMOE["THETA"]
    dh = d // h
    causal_mask, append, route = cache_ops(torch, cache_mode)

    class RMSNorm(nn.Module):  # OlmoeRMSNorm
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + eps))

    class RotaryEmbedding(nn.Module):  # OlmoeRotaryEmbedding: cos, sin (t, dh) of the positions
        def __init__(self):
            super().__init__()
            inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
            self.register_buffer("inv_freq", inv, persistent=False)

        def forward(self, start, t):
            pos = torch.arange(start, start + t, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):  # OlmoeAttention (multi-head: num_key_value_heads = H)
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                nn.Linear(d, d, bias=False) for _ in range(4))
            self.q_norm, self.k_norm = RMSNorm(d), RMSNorm(d)

        def forward(self, x, cos, sin, past, start):
            b, t, _ = x.shape
            split = lambda z: z.view(b, t, h, dh).transpose(1, 2)  # noqa: E731
            q = split(self.q_norm(self.q_proj(x)))
            k = split(self.k_norm(self.k_proj(x)))
            v = split(self.v_proj(x))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            k, v, kv = append(past, k, v, start, dim=2)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            if t > 1:  # the prompt: causal mask (a decode step reads every cached position)
                s = s.masked_fill(causal_mask(t, k.shape[2]), float("-inf"))
            a = s.softmax(-1) @ v
            return self.o_proj(a.transpose(1, 2).reshape(b, t, d)), kv

    class MLP(nn.Module):  # OlmoeMLP: one SwiGLU expert
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(d, ff, bias=False)
            self.up_proj = nn.Linear(d, ff, bias=False)
            self.down_proj = nn.Linear(ff, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class MoE(nn.Module):  # OlmoeSparseMoeBlock
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, e_, bias=False)  # the preset's router: no bias
            self.experts = nn.ModuleList(MLP() for _ in range(e_))

        def forward(self, u, past, start):  # u: (B, t, D)
            b, t, _ = u.shape
            r = self.gate(u).softmax(-1)  # (B, t, E)
            p, cache = route(router, u, r, past, start)
            x = u.reshape(b * t, d)
            p = p.reshape(b * t, e_)
            gates, idx = p.topk(k_, dim=-1)  # norm_topk_prob = False: the gates as they are
            y = torch.zeros_like(x)
            for e in idx.unique().tolist():  # the experts that received a token
                tok, slot = (idx == e).nonzero(as_tuple=True)
                y.index_add_(0, tok, self.experts[e](x[tok]) * gates[tok, slot, None])
            return y.view(b, t, d), cache

    class DecoderLayer(nn.Module):  # OlmoeDecoderLayer
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
            self.self_attn = Attention()
            self.mlp = MoE()

        def forward(self, x, cos, sin, past, start):
            a, kv = self.self_attn(self.input_layernorm(x), cos, sin,
                                   None if past is None else past[0], start)
            x = x + a
            f, rc = self.mlp(self.post_attention_layernorm(x), None if past is None else past[1],
                             start)
            return x + f, (kv, rc)

    class LM(nn.Module):  # OlmoeForCausalLM
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(v_, d)
            self.rotary_emb = RotaryEmbedding()
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(nl))
            self.norm = RMSNorm(d)
            self.lm_head = nn.Linear(d, v_, bias=False)  # untied
            for prm in self.parameters():  # no biases; RMSNorm gains stay 1
                if prm.dim() >= 2:
                    nn.init.normal_(prm, std=0.02)

        def forward(self, ids, start, past=None):
            """ids (B, t) at positions start .. start + t - 1 -> logits (B, t, V), new caches."""
            x = self.embed_tokens(ids)
            cos, sin = self.rotary_emb(start, ids.shape[1])
            new = []
            for i, layer in enumerate(self.layers):
                x, c = layer(x, cos, sin, None if past is None else past[i], start)
                new.append(c)
            return self.lm_head(self.norm(x)), tuple(new)

    return LM()


def torch_decode(router, batch, prompt, threads, steps, warmup, cache_mode="cat",
                 arch="paper-medium", expect_params=None):
    """Decode tokens/s of the PyTorch model: a dict with tokens_per_s, step_ms, version, check and
    params. expect_params: graphmoe's parameter count, checked before timing (None: not checked)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    sh = ARCHS[arch]["shape"]
    nl, d, h, e, v, max_seq = (sh[n] for n in ("L", "D", "H", "E", "V", "MAX_SEQ"))
    model = (olmoe_model if arch == "olmoe" else medium_model)(router, cache_mode).eval()
    params = sum(prm.numel() for prm in model.parameters())
    if expect_params is not None and params != expect_params:
        raise AssertionError(f"the PyTorch {arch} model has {params} parameters, graphmoe's "
                             f"{expect_params}")
    g = torch.Generator().manual_seed(1234)
    prompt_ids = torch.randint(0, v, (batch, prompt), generator=g)
    gen = torch.randint(0, v, (batch, REWIND_EVERY), generator=g)
    with torch.inference_mode():
        past = None
        if cache_mode == "static":
            def buffers(shape_a, shape_b):
                return (torch.zeros(shape_a), torch.zeros(shape_b))
            past = tuple((buffers((batch, h, max_seq, d // h), (batch, h, max_seq, d // h)),
                          buffers((batch, max_seq, d), (batch, max_seq, e))
                          if router == "similarity" else None) for _ in range(nl))
        logits, prompt_cache = model(prompt_ids, 0, past)  # prefill, untimed
        cache, k = prompt_cache, 0

        def step():
            nonlocal cache, k
            if k == REWIND_EVERY:
                cache, k = prompt_cache, 0
            out, cache = model(gen[:, k:k + 1], prompt + k, cache)
            k += 1
            return out

        # the check: REWIND_EVERY decoded tokens' logits against one full forward over the prompt
        # and those tokens (no cache), then the warmup steps
        ref, _ = model(torch.cat([prompt_ids, gen], dim=1), 0, None)
        got = torch.cat([step() for _ in range(REWIND_EVERY)], dim=1)
        err = ((got - ref[:, prompt:]).abs().max() / ref[:, prompt:].abs().max()).item()
        if not err < 1e-4:
            raise AssertionError(f"decoded logits differ from the full forward's by {err:.3g}")
        for _ in range(warmup):
            step()
        cache, k = prompt_cache, 0
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        elapsed = time.perf_counter() - t0
    assert out.shape == (batch, 1, v)
    return {"tokens_per_s": batch * steps / elapsed, "step_ms": elapsed / steps * 1e3,
            "version": torch.__version__, "check": err, "params": params}


# ----------------------------------------------------------------------------- graphmoe side

def graphmoe_case(args, kind, router, batch, prompt, env):
    """{"tokens_per_s", "step_ms", "load"} plus the cache counters (and params) of one
    bench_decode case of --arch."""
    exe = os.path.join(args.build_dir, "benchmarks", "bench_decode")
    name = (f"BM_decode_{kind}_{ARCHS[args.arch]['case']}{router}/batch:{batch}/prompt:{prompt}/"
            f"threads:{args.threads}/")
    cmd = [exe, f"--benchmark_filter=^{name}", "--benchmark_format=json"]
    out, load = run_measured(cmd, env, args,
                             f"graphmoe {args.arch} {kind} {router} {batch} x {prompt}")
    runs = [b for b in json.loads(out)["benchmarks"] if b.get("run_type", "iteration") == "iteration"]
    if len(runs) != 1:
        raise RuntimeError(f"bench_decode ran {len(runs)} cases for {name} (threads registered: 2)")
    b = runs[0]
    assert b["time_unit"] == "ms", b["time_unit"]
    res = {"tokens_per_s": b["items_per_second"], "step_ms": b["real_time"], "load": load}
    for c in ("kv_values/token", "routing_values/token", "cache_MiB", "params"):
        if c in b:
            res[c] = b[c]
    return res


def torch_case(args, peer, router, batch, prompt, cache_mode, env, expect_params=None):
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import decode_torch as m;"
            f"print(json.dumps(m.torch_decode({router!r}, {batch}, {prompt}, {args.threads}, "
            f"{args.steps}, {args.warmup}, {cache_mode!r}, {args.arch!r}, {expect_params!r})))")
    try:
        out, load = run_measured([peer.python, "-c", code], env, args,
                                 f"{peer.label} {args.arch} {cache_mode} {router} {batch} x "
                                 f"{prompt}")
    except subprocess.CalledProcessError as e:
        return {"error": f"{peer.python} exited with {e.returncode}"}
    res = torch_peers.child_result(out)
    res["load"] = load
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="graphmoe build tree with bench_decode")
    torch_peers.add_peer_arguments(ap)
    ap.add_argument("--threads", type=int, default=2,
                    help="threads of both sides (bench_decode registers 2)")
    ap.add_argument("--steps", type=int, default=96, help="timed PyTorch decode steps")
    ap.add_argument("--warmup", type=int, default=16, help="untimed PyTorch decode steps")
    ap.add_argument("--no-full-forward", action="store_true",
                    help="skip graphmoe's full-forward baseline")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of both sides (lm_torch.py: PASSIVE)")
    ap.add_argument("--arch", choices=tuple(ARCHS), default="paper-medium",
                    help="the model: the paper's medium shape, or the olmoe preset (batch 1, "
                         "prompts 64 and 512, softmax and similarity; no full-forward baseline)")
    ap.add_argument("--routers", help="comma-separated subset of " + ",".join(GRAPHMOE_ROUTERS)
                    + " (default: every router of --arch)")
    ap.add_argument("--batches", help="e.g. 1 (default: every batch of --arch)")
    ap.add_argument("--prompts", help="e.g. 64 (default: every prompt of --arch)")
    torch_peers.add_load_arguments(ap)
    args = ap.parse_args()
    arch = ARCHS[args.arch]
    routers = [r for r in (args.routers or ",".join(arch["routers"])).split(",") if r]
    if any(r not in arch["routers"] for r in routers):
        ap.error(f"--routers: choose from {','.join(arch['routers'])} (--arch {args.arch})")
    batches = [int(b) for b in (args.batches or ",".join(map(str, arch["batches"]))).split(",")]
    prompts = [int(p) for p in (args.prompts or ",".join(map(str, arch["prompts"]))).split(",")]
    if (any(b not in arch["batches"] for b in batches)
            or any(p not in arch["prompts"] for p in prompts)):
        ap.error(f"bench_decode registers batches {arch['batches']} and prompts {arch['prompts']} "
                 f"for --arch {args.arch}")
    if args.arch == "olmoe":  # bench_decode has no full-forward case of the preset
        args.no_full_forward = True
    sh = arch["shape"]
    peers = torch_peers.peers_from_args(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY=args.omp_wait_policy)

    cases = [(r, b, p) for r in routers for b in batches for p in prompts]
    ours, full, theirs, failed = {}, {}, {}, {}
    for router, batch, prompt in cases:
        ours[(router, batch, prompt)] = graphmoe_case(args, "incremental", router, batch, prompt,
                                                      env)
        if not args.no_full_forward:
            full[(router, batch, prompt)] = graphmoe_case(args, "full_forward", router, batch,
                                                          prompt, env)
        if router not in TORCH_ROUTERS:
            continue
        # the olmoe cases report graphmoe's parameter count: each torch child checks its own
        expect = ours[(router, batch, prompt)].get("params")
        expect = None if expect is None else int(expect)
        for peer in peers:
            for mode in CACHE_MODES:
                if peer.label in failed:
                    continue
                res = torch_case(args, peer, router, batch, prompt, mode, env, expect)
                if "error" in res:
                    failed[peer.label] = res["error"]
                else:
                    theirs[(peer.label, mode, router, batch, prompt)] = res

    started = time.strftime("%Y-%m-%d %H:%M")
    for p in peers:
        print(f"{p.label}: torch {p.version} ({p.python}), eager, torch.inference_mode")
    if args.arch == "olmoe":
        counts = sorted({int(o["params"]) for o in ours.values() if "params" in o})
        print(f"olmoe preset (TransformerLMConfig::olmoe) L={sh['L']} D={sh['D']} H={sh['H']} "
              f"E={sh['E']} top-{sh['K']} unnormalised, router without bias, SwiGLU experts "
              f"d_ff={sh['FF']}, RMSNorm, QK-norm full, RoPE {sh['THETA']:g} half-split, untied "
              f"head, V={sh['V']} max_seq_len={sh['MAX_SEQ']}, {'/'.join(map(str, counts))} "
              f"parameters (every torch model checked equal), float32, random weights; "
              f"{args.threads} threads, OMP_WAIT_POLICY={args.omp_wait_policy}")
    else:
        print(f"MoE LM L={L} D={D} H={H} E={E} top-{K} d_ff={FF} V={V} max_seq_len={MAX_SEQ}, "
              f"float32, random weights; {args.threads} threads, "
              f"OMP_WAIT_POLICY={args.omp_wait_policy}")
    print(f"one step = one new token per sequence, at positions prompt .. prompt + "
          f"{REWIND_EVERY - 1}; graphmoe: 96 steps (Google Benchmark), torch: {args.steps} steps "
          f"after {args.warmup}; Similarity tau = {TAU:g} on both sides")
    print("torch cat: the past_key_values pattern (torch.cat per step); torch static: "
          "preallocated caches written in place; ratio = graphmoe / the faster torch")
    if args.arch == "olmoe":
        print("full fwd: not run (bench_decode has no full-forward case of the olmoe preset)")
    else:
        print("full fwd: graphmoe's TransformerLM::forward over (batch, prompt) per generated "
              "token (Decoding::FullForward's cost); incr/full = incremental tokens/s / full fwd "
              "tokens/s")
    print(torch_peers.coretype_line())
    print(f"finished {started}")
    print()
    hdr = (f"| {'router':<10} | {'batch':>5} | {'prompt':>6} | {'graphmoe tok/s':>14} | "
           f"{'ms/step':>7} | {'torch':<16} | {'cat tok/s':>9} | {'static tok/s':>12} | "
           f"{'ratio':>5} | {'full fwd tok/s':>14} | {'incr/full':>9} | {'load ours/cat/static':>20} |")
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    ratios = {}
    for router, batch, prompt in cases:
        o = ours[(router, batch, prompt)]
        f = full.get((router, batch, prompt))
        ff = (f"{f['tokens_per_s']:>14.2f} | {o['tokens_per_s'] / f['tokens_per_s']:>9.1f}"
              if f else f"{'-':>14} | {'-':>9}")
        labels = [p.label for p in peers if (p.label, "cat", router, batch, prompt) in theirs]
        for lbl in labels or ["-"]:
            tc = f"{'-':<16} | {'-':>9} | {'-':>12} | {'-':>5}"
            loads = [fmt_load(o["load"])]
            if lbl != "-":
                t = {m: theirs.get((lbl, m, router, batch, prompt)) for m in CACHE_MODES}
                best = max(x["tokens_per_s"] for x in t.values() if x)
                r = o["tokens_per_s"] / best
                ratios[(lbl, router, batch, prompt)] = r
                cols = [f"{t[m]['tokens_per_s']:.1f}" if t[m] else "-" for m in CACHE_MODES]
                tc = f"{lbl:<16} | {cols[0]:>9} | {cols[1]:>12} | {r:>5.2f}"
                loads += [fmt_load(t[m]["load"]) if t[m] else "-" for m in CACHE_MODES]
            print(f"| {router:<10} | {batch:>5} | {prompt:>6} | {o['tokens_per_s']:>14.1f} | "
                  f"{o['step_ms']:>7.2f} | {tc} | {ff} | {'/'.join(loads):>20} |")
    print()
    print(f"graphmoe's caches (values per cached token, summed over the {sh['L']} layers; MiB: "
          f"all slots at max_seq_len {sh['MAX_SEQ']}, float):")
    for router in routers:
        for batch in batches:
            o = ours[(router, batch, prompts[0])]
            print(f"  {router:<10} batch {batch}: KV {o.get('kv_values/token', 0):.0f}, routing "
                  f"{o.get('routing_values/token', 0):.0f}, {o.get('cache_MiB', 0):.1f} MiB")
    torch_peers.report_left_out({}, failed)
    print()
    # the paper-medium lines unnamed; the olmoe ones name the preset
    tag, on = ("", "") if args.arch == "paper-medium" else (f"{args.arch} ", f" on {args.arch}")
    for (lbl, router, batch, prompt), r in ratios.items():
        print(f"decode tokens/s graphmoe/{lbl} {tag}{router} batch {batch} prompt {prompt}: "
              f"{r:.2f}")
    b1 = {k: r for k, r in ratios.items() if k[2] == 1}
    if b1:
        worst = min(b1.values())
        print(f"target graphmoe >= {TARGET:g}x PyTorch{on} at batch 1, {args.threads} threads: "
              f"{'met' if worst >= TARGET else 'missed'} (lowest batch-1 ratio {worst:.2f})")


if __name__ == "__main__":
    main()
