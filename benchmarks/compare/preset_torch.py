#!/usr/bin/env python3
"""The architecture presets of TransformerLMConfig::preset against a PyTorch implementation.

benchmarks/preset_dump (C++) builds a preset with a router, runs a forward, a backward, gradient
clipping, one AdamW step, the routers' after_optimizer_step and a second forward, and writes the
config, the weights before and after the step and the outputs (docs in preset_dump.cpp). This
script builds the same model in PyTorch from config.json, written the usual way (nn.Module
classes: RMSNorm or LayerNorm, RoPE with rotate_half or interleaved pairs, grouped-query
attention with repeat_kv, QK-norm over the projections or per head, SwiGLU or GELU MLPs, a
top-k MoE with a per-expert loop, softmax or sigmoid router scores, the Similarity token graph,
the selection bias, group-limited routing, shared experts behind a sigmoid gate, the
load-balancing and z-losses and DeepSeek-V3's sequence-wise balance loss; autograd does the
backward), loads weights.safetensors by name
(load_state_dict(strict=True)), and compares:

  logits      max|a - b| / max|b| over the (B, T, V) logits, a = graphmoe, b = PyTorch
  loss        |a - b| / |b| of the total loss (cross-entropy + weighted auxiliary losses)
  experts     the fraction of (MoE layer, token) whose set of chosen experts is identical
  grads       the largest over the parameters of max|a - b| / max|b|, max|b| floored at 1e-6
              of the model's largest gradient (the k projections' bias has a zero gradient in
              exact arithmetic; reported, not checked)
  step params the same over the parameters after the step: gradient clipping, torch.optim.AdamW
              (same lr, betas, eps, weight decay on the parameters graphmoe decays) and the
              expert-bias update (the expert_bias buffers compared too), applied to graphmoe's
              gradients, so that the optimizer is compared alone
  step logits the second forward's logits from those parameters, as logits; step experts the
              second forward's expert choice
  end to end  step params and step logits with PyTorch's own gradients (reported, not checked):
              Adam's first step is lr g / (|g| + eps), which turns the gradients' rounding into
              an O(lr) difference wherever |g| is near eps, so float runs differ there by about
              1e-4 of the parameters' scale (double runs by about 1e-12)

A run fails when logits, loss, step params, step logits or the step-1 loss exceed the tolerance
(1e-5 for float, 1e-10 for double) or an expert choice differs. Conventions matched to graphmoe's
(documented there): the load-balancing loss is E sum_j f_j mean_i p_ij on the router's p (softmax,
or the sigmoid scores as they are), f_j counting every slot; group-limited routing masks the
other groups to -inf; gradients are clipped by clip / norm (clip_grad_norm_ divides by norm +
1e-6, a 1e-9 difference in double); AdamW's first step is torch's own.

    python3 benchmarks/compare/preset_torch.py DIR            # one dump, one line
    python3 benchmarks/compare/preset_torch.py --all --build-dir build [--double]

--all runs build/benchmarks/preset_dump (cmake --build build --target preset_dump: not part of
`all`) for every preset with the softmax and sigmoid-bias
routers, the Similarity graph on two presets, in float (and with --double also in double), and
prints one line per run; exit status 1 if any failed. Needs torch (Debian's python3-torch, run
with /usr/bin/python3) and numpy; safetensors files are read by a small parser here.
"""
import argparse
import copy
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "U8": np.uint8}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


# ---- the model ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(cfg, dim):
    if cfg["norm"] == "rmsnorm":
        return RMSNorm(dim, cfg["norm_eps"])
    return nn.LayerNorm(dim, eps=cfg["norm_eps"])


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin, layout):
    """x (B, H, T, dh); cos, sin (T, dh/2)."""
    if layout == "half-split":
        c = torch.cat((cos, cos), -1)
        s = torch.cat((sin, sin), -1)
        return x * c + rotate_half(x) * s
    a, b = x[..., 0::2], x[..., 1::2]  # interleaved pairs (2i, 2i + 1)
    return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)


def repeat_kv(x, n_rep):
    """(B, Hkv, T, dh) -> (B, Hkv n_rep, T, dh), each key/value head for its group's query heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, h = cfg["d_model"], cfg["num_heads"]
        self.h, self.hkv, self.dh = h, cfg["num_kv_heads"], d // h
        dkv = self.hkv * self.dh
        self.q_proj = nn.Linear(d, d, bias=cfg["qkv_bias"])
        self.k_proj = nn.Linear(d, dkv, bias=cfg["qkv_bias"])
        self.v_proj = nn.Linear(d, dkv, bias=cfg["qkv_bias"])
        self.out_proj = nn.Linear(d, d, bias=cfg["out_bias"])
        self.qk_norm = cfg["qk_norm"]
        if self.qk_norm == "full":  # OLMoE: over the whole projections
            self.q_norm = RMSNorm(d, cfg["qk_norm_eps"])
            self.k_norm = RMSNorm(dkv, cfg["qk_norm_eps"])
        elif self.qk_norm == "per-head":  # Qwen3: each head, one shared weight
            self.q_norm = RMSNorm(self.dh, cfg["qk_norm_eps"])
            self.k_norm = RMSNorm(self.dh, cfg["qk_norm_eps"])
        self.theta, self.layout = cfg["rope_theta"], cfg["rope_layout"]

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.h, self.dh).transpose(1, 2)
        k = k.view(b, t, self.hkv, self.dh).transpose(1, 2)
        v = v.view(b, t, self.hkv, self.dh).transpose(1, 2)
        if self.qk_norm == "per-head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.theta > 0:  # the angles in float64, then the model's dtype (as graphmoe)
            inv = 1.0 / (self.theta ** (torch.arange(0, self.dh, 2, dtype=torch.float64) / self.dh))
            ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
            q, k = apply_rope(q, cos, sin, self.layout), apply_rope(k, cos, sin, self.layout)
        k, v = repeat_kv(k, self.h // self.hkv), repeat_kv(v, self.h // self.hkv)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.dh)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(o)


def activate(cfg, h):
    if cfg["activation"] == "swiglu":  # [gate | up] rows of the first projection
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u
    return F.gelu(h, approximate="tanh" if cfg["gelu"] == "tanh" else "none")


class MLP(nn.Module):
    def __init__(self, cfg, width):
        super().__init__()
        mult = 2 if cfg["activation"] == "swiglu" else 1
        self.cfg = cfg
        self.fc1 = nn.Linear(cfg["d_model"], mult * width, bias=cfg["ffn_bias"])
        self.fc2 = nn.Linear(width, cfg["d_model"], bias=cfg["ffn_bias"])

    def forward(self, x):
        return self.fc2(activate(self.cfg, self.fc1(x)))


class Experts(nn.Module):
    """E experts stacked as graphmoe stores them: w1 (E, mult F, D), w2 (E, D, F)."""

    def __init__(self, cfg):
        super().__init__()
        e, d, f = cfg["num_experts"], cfg["d_model"], cfg["expert_d_ff"]
        mult = 2 if cfg["activation"] == "swiglu" else 1
        self.cfg = cfg
        self.w1 = nn.Parameter(torch.empty(e, mult * f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        if cfg["ffn_bias"]:
            self.b1 = nn.Parameter(torch.empty(e, mult * f))
            self.b2 = nn.Parameter(torch.empty(e, d))

    def expert(self, e, x):
        h = x @ self.w1[e].t()
        if self.cfg["ffn_bias"]:
            h = h + self.b1[e]
        y = activate(self.cfg, h) @ self.w2[e].t()
        if self.cfg["ffn_bias"]:
            y = y + self.b2[e]
        return y


class Selector(nn.Module):
    def __init__(self, cfg, biased):
        super().__init__()
        if biased:
            self.register_buffer("expert_bias", torch.zeros(cfg["num_experts"]))
        self.biased = biased


class Router(nn.Module):
    def __init__(self, cfg, has_bias):
        super().__init__()
        router = cfg["router"]
        self.cfg = cfg
        self.sigmoid = router.startswith("sigmoid-bias")
        self.similarity = router.endswith("similarity")
        self.weight = nn.Parameter(torch.empty(cfg["num_experts"], cfg["d_model"]))
        self.bias = nn.Parameter(torch.empty(cfg["num_experts"])) if has_bias else None
        self.selector = Selector(cfg, self.sigmoid)

    def forward(self, u, seq):
        """u (N, D) -> indices (N, k), gates (N, k), p (N, E), gamma (N, E)."""
        cfg = self.cfg
        gamma = F.linear(u, self.weight, self.bias)
        r = gamma.sigmoid() if self.sigmoid else gamma.softmax(-1)
        p = r
        if self.similarity:  # S = softmax(U U^T / tau) within each sequence, causal
            assert cfg["tau_mode"] == 0, "fixed tau only"
            n, d = u.shape
            us = u.view(n // seq, seq, d)
            logits = us @ us.transpose(1, 2) / cfg["tau"]
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()
            s = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            p = (s @ r.view(n // seq, seq, -1)).view(n, -1)
        choose = p.detach()
        if self.sigmoid:  # the bias selects only
            choose = choose + self.selector.expert_bias
        ng, tg = cfg["n_group"], cfg["topk_group"]
        if ng > 1:  # DeepSeek-V3: group score = sum of its two largest, keep topk_group groups
            n, e = choose.shape
            grouped = choose.view(n, ng, e // ng)
            gscore = grouped.topk(min(2, e // ng), dim=-1).values.sum(-1)
            keep = torch.zeros(n, ng, dtype=torch.bool)
            keep.scatter_(1, gscore.topk(tg, dim=-1).indices, True)
            choose = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
        indices = choose.topk(cfg["k"], dim=-1).indices
        values = p.gather(1, indices)
        gates = values / values.sum(-1, keepdim=True) if cfg["norm_topk_prob"] else values
        gates = gates * cfg["routed_scaling_factor"]
        return indices, gates, p, gamma


class MoE(nn.Module):
    def __init__(self, cfg, has_router_bias):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, has_router_bias)
        self.experts = Experts(cfg)

    def forward(self, u, seq):
        cfg = self.cfg
        indices, gates, p, gamma = self.router(u, seq)
        y = torch.zeros_like(u)
        for e in range(cfg["num_experts"]):
            tok, slot = (indices == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            out = self.experts.expert(e, u[tok]) * gates[tok, slot][:, None]
            y = y.index_add(0, tok, out)
        n, e_ = p.shape
        aux = u.new_zeros(())
        if cfg["load_balance_coef"] > 0:  # Switch: E sum_j f_j P_j, f from every slot
            f = torch.bincount(indices.flatten(), minlength=e_).to(u.dtype) / indices.numel()
            aux = aux + cfg["load_balance_coef"] * e_ * (f * p.mean(0)).sum()
        sa = cfg.get("seq_aux_loss_coef", 0.0)
        if sa > 0:  # DeepSeek-V3's sequence-wise loss: mean over sequences of sum_j f_j P_j
            k, seqs = indices.shape[1], n // seq
            counts = F.one_hot(indices.reshape(seqs, seq * k), e_).sum(1).to(u.dtype)
            f = counts * e_ / (k * seq)  # (seqs, E), constant
            pn = (p / p.sum(-1, keepdim=True)).view(seqs, seq, e_).mean(1)  # scores normalised
            aux = aux + sa * (f * pn).sum(-1).mean()
        if cfg["z_loss_coef"] > 0:  # ST-MoE: mean of logsumexp(gamma)^2
            aux = aux + cfg["z_loss_coef"] * gamma.logsumexp(-1).pow(2).mean()
        self.last_indices = indices.detach()
        return y, aux


class Block(nn.Module):
    def __init__(self, cfg, moe, has_router_bias):
        super().__init__()
        self.is_moe = moe
        self.ln1 = make_norm(cfg, cfg["d_model"])
        self.attn = Attention(cfg)
        self.ln2 = make_norm(cfg, cfg["d_model"])
        if moe:
            self.moe = MoE(cfg, has_router_bias)
            if cfg["shared_d_ff"] > 0:
                self.shared_expert = MLP(cfg, cfg["shared_d_ff"])
                if cfg["shared_expert_gate"]:
                    self.shared_expert_gate = nn.Linear(cfg["d_model"], 1, bias=False)
        else:
            self.ffn = MLP(cfg, cfg["d_ff"])
        self.cfg = cfg

    def forward(self, h):
        b, t, d = h.shape
        h = h + self.attn(self.ln1(h))
        u = self.ln2(h).reshape(b * t, d)
        aux = h.new_zeros(())
        if self.is_moe:
            f, aux = self.moe(u, t)
            if self.cfg["shared_d_ff"] > 0:
                s = self.shared_expert(u)
                if self.cfg["shared_expert_gate"]:
                    s = torch.sigmoid(self.shared_expert_gate(u)) * s
                f = f + s
        else:
            f = self.ffn(u)
        return h + f.view(b, t, d), aux


class LM(nn.Module):
    def __init__(self, cfg, names):
        super().__init__()
        self.cfg = cfg
        d = cfg["d_model"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], d)
        if cfg["rope_theta"] == 0:
            self.pos_emb = nn.Embedding(cfg["max_seq_len"], d)
        moe_layers = set(cfg["moe_layers"])
        self.blocks = nn.ModuleList(
            Block(cfg, i in moe_layers, f"blocks.{i}.moe.router.bias" in names)
            for i in range(cfg["num_layers"]))
        self.ln_f = make_norm(cfg, d)
        if not cfg["tie_embeddings"]:
            self.lm_head = nn.Linear(d, cfg["vocab_size"], bias=False)

    def forward(self, ids, targets):
        b, t = ids.shape
        h = self.tok_emb(ids)
        if self.cfg["rope_theta"] == 0:
            h = h + self.pos_emb.weight[:t]
        aux = h.new_zeros(())
        for blk in self.blocks:
            h, a = blk(h)
            aux = aux + a
        x = self.ln_f(h)
        w = self.tok_emb.weight if self.cfg["tie_embeddings"] else self.lm_head.weight
        logits = x @ w.t()
        task = F.cross_entropy(logits.view(b * t, -1), targets.view(-1).long(), ignore_index=-100)
        return logits, task, aux

    def selections(self):
        return {i: blk.moe.last_indices for i, blk in enumerate(self.blocks) if blk.is_moe}


# ---- one comparison ----------------------------------------------------------------------------


def rel(a, b, floor=0.0):
    a, b = a.double(), b.double()
    den = max(b.abs().max().item(), floor)
    return (a - b).abs().max().item() / (den if den > 0 else 1.0)


def same_sets(a, b):
    """fraction of rows of a, b (N, k) with the same set of experts"""
    return (a.sort(-1).values == b.sort(-1).values).all(-1).double().mean().item()


def adamw_step(cfg, model, params, sel0, dtype):
    """clip_grad_norm_, torch.optim.AdamW and the expert-bias update on model's .grad; returns the
    gradient norm before clipping"""
    oc = cfg["optimizer"]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # graphmoe's clip_grad_norm: g *= clip / norm when norm > clip (exactly; clip_grad_norm_
    # divides by norm + 1e-6, which moves Adam's first step by 1e-9 relative in double)
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for _, p in trainable)).item()
    if oc["clip"] > 0 and norm > oc["clip"]:
        for _, p in trainable:
            p.grad.mul_(torch.tensor(oc["clip"] / norm, dtype=p.grad.dtype))
    groups = [{"params": [p for n, p in trainable if params[n]["decay"]],
               "weight_decay": oc["weight_decay"]},
              {"params": [p for n, p in trainable if not params[n]["decay"]],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=oc["lr"], betas=(oc["beta1"], oc["beta2"]), eps=oc["eps"])
    opt.step()
    with torch.no_grad():  # auxiliary-loss-free balancing: b += rate sign(mean load - load)
        for i, blk in enumerate(model.blocks):
            if blk.is_moe and blk.moe.router.selector.biased:
                e = cfg["num_experts"]
                loads = torch.bincount(sel0[i].flatten(), minlength=e).double()
                if loads.sum() > 0:
                    sign = torch.sign(loads.sum() / e - loads)
                    b = blk.moe.router.selector.expert_bias
                    b.copy_((b.double() + cfg["bias_update_rate"] * sign).to(dtype))
    return norm


def compare(dump_dir):
    cfg = json.load(open(os.path.join(dump_dir, "config.json")))
    res = json.load(open(os.path.join(dump_dir, "results.json")))
    w0 = read_safetensors(os.path.join(dump_dir, "weights.safetensors"))
    w1 = read_safetensors(os.path.join(dump_dir, "weights_step1.safetensors"))
    g0 = read_safetensors(os.path.join(dump_dir, "grads.safetensors"))
    outs = read_safetensors(os.path.join(dump_dir, "outputs.safetensors"))
    dtype = torch.float64 if cfg["dtype"] == "float64" else torch.float32
    torch.manual_seed(0)
    model = LM(cfg, set(w0)).to(dtype)
    sd = model.state_dict()
    missing = set(sd) ^ set(w0)
    assert not missing, f"names differ between graphmoe and the torch model: {sorted(missing)}"
    model.load_state_dict({k: v for k, v in w0.items()}, strict=True)
    params = {p["name"]: p for p in cfg["params"]}
    named = dict(model.named_parameters())
    for name, p in named.items():
        p.requires_grad_(params[name]["trainable"])
    ids, targets = outs["ids"].long(), outs["targets"].long()

    logits, task, aux = model(ids, targets)
    loss = task + aux
    r = {"logits": rel(outs["logits"], logits.detach()),
         "loss": abs(res["loss"]["total"] - loss.item()) / abs(loss.item())}
    sel0 = model.selections()
    agree = [same_sets(outs[f"blocks.{i}.indices"].long(), s) for i, s in sel0.items()]
    r["experts"] = float(np.mean(agree)) if agree else 1.0
    model.zero_grad()
    loss.backward()
    # per parameter, the denominator floored at 1e-6 of the largest gradient: the k projections'
    # bias has a zero gradient in exact arithmetic (softmax is invariant to q . b_k), 1e-20 of
    # rounding on either side
    gmax = max(p.grad.abs().max().item() for p in named.values() if p.requires_grad)
    r["grads"] = max(rel(g0[n], p.grad, 1e-6 * gmax) for n, p in named.items() if p.requires_grad)

    # the step twice: on PyTorch's gradients (the run end to end) and on graphmoe's (the optimizer,
    # clipping and bias update alone, free of the gradients' rounding, which Adam's first step
    # amplifies where |g| is near eps)
    twin = copy.deepcopy(model)
    for n, p in twin.named_parameters():
        if p.requires_grad:
            p.grad = g0[n].to(dtype).clone()
    norm = adamw_step(cfg, model, params, sel0, dtype)
    r["grad_norm"] = abs(norm - res["grad_norm"]) / norm
    adamw_step(cfg, twin, params, sel0, dtype)
    r["step_on_graphmoe_grads"] = max(rel(w1[n], twin.state_dict()[n]) for n in w1)
    sd1 = model.state_dict()
    r["step"] = max(rel(w1[n], sd1[n]) for n in w1)
    with torch.no_grad():
        logits1, _, _ = model(ids, targets)
        r["step_logits_e2e"] = rel(outs["logits_step1"], logits1)
        logits1, task1, aux1 = twin(ids, targets)
    r["step_logits"] = rel(outs["logits_step1"], logits1)
    r["step_loss"] = abs(res["loss_step1"]["total"] - (task1 + aux1).item()) / abs((task1 + aux1).item())
    sel1 = twin.selections()
    agree1 = [same_sets(outs[f"blocks.{i}.indices_step1"].long(), s) for i, s in sel1.items()]
    r["experts_step1"] = float(np.mean(agree1)) if agree1 else 1.0
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    ok = (max(r["logits"], r["loss"], r["step_on_graphmoe_grads"], r["step_logits"],
              r["step_loss"]) <= tol
          and r["experts"] == 1.0 and r["experts_step1"] == 1.0)
    r["ok"] = ok
    label = cfg["router"] + ("" if cfg["tau"] == 1.0 or not cfg["router"].endswith("similarity")
                             else f" (tau {cfg['tau']:g})")
    line = (f"preset {cfg['arch']} {label} {'double' if dtype == torch.float64 else 'float'}: "
            f"logits rel {r['logits']:.1e}, loss rel {r['loss']:.1e}, "
            f"experts {100 * r['experts']:.1f}%, grads rel {r['grads']:.1e}, "
            f"step params rel {r['step_on_graphmoe_grads']:.1e}, step logits rel {r['step_logits']:.1e}, "
            f"step experts {100 * r['experts_step1']:.1f}%; end to end: step params rel {r['step']:.1e}, "
            f"step logits rel {r['step_logits_e2e']:.1e} {'OK' if ok else 'FAIL'}")
    return ok, line, r


RUNS = ([(a, "softmax", 1.0) for a in
         ["gpt", "llama", "mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3"]] +
        [(a, "sigmoid-bias", 1.0) for a in
         ["gpt", "llama", "mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3"]] +
        [("olmoe", "similarity", 1.0), ("olmoe", "similarity", 16.0),
         ("deepseek-v3", "sigmoid-bias-similarity", 16.0)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", help="a preset_dump output directory")
    ap.add_argument("--all", action="store_true", help="run preset_dump for every preset and router")
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--double", action="store_true", help="with --all: also every run in double")
    ap.add_argument("--keep", help="with --all: keep the dumps under this directory")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.all:
        if not args.dir:
            ap.error("give a dump directory or --all")
        ok, line, _ = compare(args.dir)
        print(line)
        return 0 if ok else 1
    exe = os.path.join(args.build_dir, "benchmarks", "preset_dump")
    root = args.keep or tempfile.mkdtemp(prefix="preset_torch.")
    failed = 0
    try:
        for prec in (["float", "double"] if args.double else ["float"]):
            for arch, router, tau in RUNS:
                out = os.path.join(root, f"{arch}-{router}-{tau:g}-{prec}")
                cmd = [exe, "--arch", arch, "--router", router, "--tau", str(tau), "--out", out]
                if prec == "double":
                    cmd.append("--double")
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"preset {arch} {router} {prec}: preset_dump failed: {p.stderr.strip()}")
                    failed += 1
                    continue
                ok, line, _ = compare(out)
                print(line, flush=True)
                failed += 0 if ok else 1
                if not args.keep:
                    shutil.rmtree(out)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{failed} failed" if failed else "all OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
