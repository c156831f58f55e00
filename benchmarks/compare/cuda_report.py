#!/usr/bin/env python3
"""CUDA backend report: the GPU targets, from bench_cuda's JSON output.

Reads the file that

    ./build/benchmarks/bench_cuda --benchmark_out=bench_cuda.json --benchmark_out_format=json

writes (or --benchmark_format=json on stdout) and prints:

  * cuBLAS GEMM throughput per element type and shape (TFLOP/s = 2 M K N / time);
  * the MoE layer per router: time, expert TFLOP/s (the expert GEMMs' FLOPs, bench_cuda's
    counter expert_flop, over the layer's time) and that as a fraction of the dense GEMM
    throughput of the same run and element type:
        vs square    the 4096 x 4096 x 4096 GEMM (cuBLAS's large-matrix rate: the yardstick of
                     target (a))
        vs slots     the 4096 x 352 x 352 GEMM (every routed slot through one weight: what the
                     experts' GEMMs could reach at this width if they were one GEMM)
  * the similarity token graph alone, and the LM training step (ms/step, tokens/s);
  * the targets:
        (a) MoE layer fwd+bwd expert throughput / square GEMM throughput >= 0.40 in bf16 (float
            reported beside it);
        (b) similarity-router layer fwd+bwd time / softmax-router layer fwd+bwd time <= 1.10,
            with the attention router's ratio beside it.

Every time is the median over repetitions when the run has aggregates
(--benchmark_repetitions=N), else the median of the runs of that name. A benchmark that ended
with an error is listed with its message. Exit status: 0 whenever the file could be read (met or
missed targets alike); 1 when it is missing or not bench_cuda JSON; 2 for bad arguments.
Python 3 standard library only.

    /usr/bin/python3 benchmarks/compare/cuda_report.py bench_cuda.json
"""
import argparse
import json
import re
import statistics
import sys

TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
TARGET_FRACTION = 0.40   # (a): MoE fwd+bwd expert throughput / dense GEMM throughput, bf16
TARGET_SIM_RATIO = 1.10  # (b): similarity / softmax router layer fwd+bwd time
# (c), at the large shape: bf16 expert throughput / square GEMM >= 0.50; similarity and attention
# router layers at most 1.05x and 1.07x the softmax layer's time (the paper's Table 8 overheads)
TARGET_LARGE_FRACTION = 0.50
TARGET_LARGE_RATIOS = {"similarity": 1.05, "attention": 1.07}
# The targets (large shape): the similarity layer with its tensor-core graph (similarity-tf32 in
# float, similarity-bf16 in bf16) at most 1.10x the softmax layer, attention at most 1.15x; the
# Similarity graph alone (bf16, fwd+bwd) at least 150 TFLOP/s counting its causal products
TARGET_TC_RATIOS = {"float": ("similarity-tf32", 1.10), "bf16": ("similarity-bf16", 1.10)}
TARGET_TC_ATTENTION = 1.15
TARGET_GRAPH_TFLOPS = 150.0
TARGET_LM_TOKENS = 500_000  # (f): paper_medium LM training, bf16 (train_lm --precision bf16)
SQUARE = "square_NN"
SLOTS = "all_slots_NT"


def base_name(name):
    """The registered name: Google Benchmark appends /iterations:N, /repeats:N, /min_time:X and
    /manual_time (or /real_time) to the names of benchmarks that set them."""
    parts = name.split("/")
    while parts and (parts[-1] in ("manual_time", "real_time") or
                     re.fullmatch(r"(iterations|repeats|min_time|min_warmup_time|threads):[0-9.es]+",
                                  parts[-1])):
        parts.pop()
    return "/".join(parts)


class Result:
    """One benchmark: median time in seconds, its counters, or an error message."""

    def __init__(self, name):
        self.name = name
        self.times = []
        self.counters = {}
        self.median_time = None
        self.error = None

    def seconds(self):
        if self.median_time is not None:
            return self.median_time
        return statistics.median(self.times) if self.times else None


def load(path):
    """{name: Result} and the JSON context, from bench_cuda's JSON output."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise ValueError("no 'benchmarks' list: not Google Benchmark JSON output")
    results = {}
    for b in data["benchmarks"]:
        name = base_name(b.get("run_name") or b.get("name", ""))
        r = results.setdefault(name, Result(name))
        if b.get("error_occurred") or b.get("skipped"):
            r.error = b.get("error_message") or b.get("skip_message") or "error"
            continue
        if "real_time" not in b:
            continue
        t = float(b["real_time"]) * TIME_UNITS.get(b.get("time_unit", "ns"), 1e-9)
        counters = {k: v for k, v in b.items() if isinstance(v, (int, float))}
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                r.median_time = t
                r.counters = counters
        else:
            r.times.append(t)
            if not r.counters:
                r.counters = counters
    return results, data.get("context", {})


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="bench_cuda's JSON output (--benchmark_out or stdout)")
    args = ap.parse_args()
    try:
        results, context = load(args.json)
    except (OSError, ValueError) as e:
        print(f"cuda_report: cannot read {args.json}: {e}")
        return 1

    def get(name):
        r = results.get(name)
        return r if r is not None and r.error is None and r.seconds() is not None else None

    def flops(name, counter):
        r = get(name)
        if r is None or counter not in r.counters:
            return None
        return r.counters[counter] / r.seconds()

    print("# bench_cuda report")
    print()
    print(f"device: {context.get('cuda_device', '?')}; bf16 GEMM: {context.get('bf16_gemm', '?')}; "
          f"bf16 MoE layer: {context.get('bf16_moe_layer', '?')}; "
          f"host: {context.get('host_name', '?')}, {context.get('date', '?')}")
    print()

    errors = [r for r in results.values() if r.error is not None]
    if errors:
        print("## Errors")
        print()
        for r in errors:
            print(f"- {r.name}: {r.error}")
        print()

    # GEMM: gemm/<type>/<case>/MxKxN
    gemm_rate = {}  # (type, case) -> FLOP/s
    rows = []
    for name in sorted(results):
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "gemm":
            continue
        _, dtype, case, shape = parts
        rate = flops(name, "flop")
        gemm_rate[(dtype, case)] = rate
        r = get(name)
        rows.append([dtype, case, shape.replace("x", " x "),
                     fmt(r.seconds() * 1e6 if r else None, ".1f"),
                     fmt(rate / 1e12 if rate else None, ".2f")])
    if rows:
        print("## cuBLAS GEMM")
        print()
        table(["type", "case", "M x K x N", "time (us)", "TFLOP/s"], rows)

    # MoE layer: moe/<type>/<router>/<fwd|fwdbwd>
    print("## MoE layer (batch 4 x 512, D = 352, E = 16, d_ff = 352, top-2)")
    print()
    rows = []
    moe = {}  # (type, router, pass) -> (seconds, FLOP/s)
    for name in sorted(results):
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "moe":
            continue
        _, dtype, router, pas = parts
        r = get(name)
        rate = flops(name, "expert_flop")
        moe[(dtype, router, pas)] = (r.seconds() if r else None, rate)
        rows.append([dtype, router, pas, fmt(r.seconds() * 1e3 if r else None, ".3f"),
                     fmt(rate / 1e12 if rate else None, ".2f"),
                     fmt(ratio(rate, gemm_rate.get((dtype, SQUARE))), ".1%"),
                     fmt(ratio(rate, gemm_rate.get((dtype, SLOTS))), ".1%")])
    if rows:
        table(["type", "router", "pass", "time (ms)", "expert TFLOP/s", "vs square GEMM",
               "vs 4096 x 352 x 352 GEMM"], rows)
    else:
        print("no MoE layer results")
        print()

    # Large shape: moe_large/<type>/<router>/fwdbwd, and peak working memory of every moe row
    rows = []
    for name in sorted(results):
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "moe_large":
            continue
        _, dtype, router, pas = parts
        r = get(name)
        rate = flops(name, "expert_flop")
        soft = get(f"moe_large/{dtype}/softmax/{pas}")
        peak = r.counters.get("peak_work_bytes") if r else None
        soft_peak = soft.counters.get("peak_work_bytes") if soft else None
        rows.append([dtype, router, fmt(r.seconds() * 1e3 if r else None, ".2f"),
                     fmt(rate / 1e12 if rate else None, ".1f"),
                     fmt(ratio(rate, gemm_rate.get((dtype, SQUARE))), ".1%"),
                     fmt(ratio(r.seconds() if r else None, soft.seconds() if soft else None), ".3f"),
                     fmt(peak / 2**20 if peak is not None else None, ",.0f"),
                     fmt(ratio(peak, soft_peak), ".3f")])
    if rows:
        print("## MoE layer, large shape (batch 16 x 2048, D = 1024, E = 64, d_ff = 4096, top-2), "
              "fwd+bwd")
        print()
        table(["type", "router", "time (ms)", "expert TFLOP/s", "vs square GEMM",
               "time / softmax", "peak work (MiB)", "peak / softmax"], rows)
    rows = []
    for name in sorted(results):
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "moe":
            continue
        _, dtype, router, pas = parts
        r = get(name)
        soft = get(f"moe/{dtype}/softmax/{pas}")
        peak = r.counters.get("peak_work_bytes") if r else None
        soft_peak = soft.counters.get("peak_work_bytes") if soft else None
        rows.append([dtype, router, pas, fmt(peak / 2**20 if peak is not None else None, ",.1f"),
                     fmt(ratio(peak, soft_peak), ".3f")])
    if rows:
        print("## Peak working memory of the MoE layer, medium shape (allocator high-water mark "
              "less parameters and inputs)")
        print()
        table(["type", "router", "pass", "peak work (MiB)", "peak / softmax"], rows)

    # Similarity graph alone and LM training step
    rows = []
    for pas in ("fwd", "fwdbwd"):
        r = get(f"graph/float/similarity/{pas}")
        layer = moe.get(("float", "similarity", pas), (None, None))[0]
        soft = moe.get(("float", "softmax", pas), (None, None))[0]
        extra = (layer - soft) if layer is not None and soft is not None else None
        rows.append([pas, fmt(r.seconds() * 1e3 if r else None, ".3f"),
                     fmt(ratio(r.seconds() if r else None, layer), ".1%"),
                     fmt(extra * 1e3 if extra is not None else None, ".3f")])
    print("## Similarity token graph alone (float)")
    print()
    table(["pass", "time (ms)", "share of the similarity layer",
           "similarity layer - softmax layer (ms)"], rows)

    rows = []
    for router in ("similarity", "similarity-tf32", "similarity-bf16", "attention",
                   "attention-tf32", "attention-bf16"):
        for pas in ("fwd", "fwdbwd"):
            r = get(f"graph_large/float/{router}/{pas}")
            if r is None and f"graph_large/float/{router}/{pas}" not in results:
                continue
            # the layer the graph belongs to: float experts, or bf16 ones for the bf16 graph
            ltype = "bf16" if router.endswith("-bf16") else "float"
            layer = get(f"moe_large/{ltype}/{router}/fwdbwd") if pas == "fwdbwd" else None
            soft = get(f"moe_large/{ltype}/softmax/fwdbwd") if pas == "fwdbwd" else None
            extra = (layer.seconds() - soft.seconds()) if layer and soft else None
            rate = flops(f"graph_large/float/{router}/{pas}", "graph_flop")
            rows.append([router, pas, fmt(r.seconds() * 1e3 if r else None, ".2f"),
                         fmt(rate / 1e12 if rate else None, ".1f"),
                         fmt(extra * 1e3 if extra is not None else None, ".2f")])
    if rows:
        print("## Token graphs alone, large shape (float router; -tf32 / -bf16: the graph's "
              "products on tensor cores)")
        print()
        table(["graph", "pass", "time (ms)", "useful (causal) TFLOP/s",
               "its layer - softmax layer, fwd+bwd (ms)"], rows)

    rows = []
    lm = {}
    for precision in ("float", "bf16"):
        for router in ("softmax", "similarity", "softmax-cap1.25/compact",
                       "softmax-cap1.25/padded", "softmax-cap1.25/padded-graph",
                       "similarity-cap1.25/padded-graph"):
            r = get(f"lm_train/{precision}/{router}")
            if r is None and "/" in router:
                continue  # rows another version of the benchmark may lack
            lm[precision, router] = r.seconds() if r else None
            tok = r.counters.get("tokens/s") if r else None
            rows.append([router, precision, fmt(r.seconds() * 1e3 if r else None, ".2f"),
                         fmt(tok, ",.0f"), fmt(r.counters.get("loss") if r else None, ".3f")])
    print("## LM training step (paper_medium, vocabulary 1024, batch 4 x 512; float, and bf16 "
          "GEMMs with fp32 master weights)")
    print()
    table(["router", "precision", "ms/step", "tokens/s", "loss"], rows)
    lm_ratio = ratio(lm["float", "similarity"], lm["float", "softmax"])
    print(f"similarity / softmax step time (float): {fmt(lm_ratio, '.3f')}")
    print(f"bf16 / float step time (softmax): "
          f"{fmt(ratio(lm['bf16', 'softmax'], lm['float', 'softmax']), '.3f')}")
    for precision in ("float", "bf16"):
        padded = lm.get((precision, "softmax-cap1.25/padded"))
        compact = lm.get((precision, "softmax-cap1.25/compact"))
        if padded and compact:
            print(f"padded / compact expert layout step time (softmax, capacity 1.25, "
                  f"{precision}): {fmt(ratio(padded, compact), '.3f')}")
        graphed = lm.get((precision, "softmax-cap1.25/padded-graph"))
        if padded and graphed:
            print(f"CUDA graph / eager step time (softmax, padded, capacity 1.25, {precision}): "
                  f"{fmt(ratio(graphed, padded), '.3f')}")
    print()

    rows = []
    for router in ("softmax", "similarity", "attention"):
        for batch in (1, 8):
            for prompt in (64, 1024):
                inc = get(f"decode/float/{router}/b{batch}/p{prompt}")
                full = get(f"decode_full/float/{router}/b{batch}/p{prompt}")
                ti = inc.counters.get("tokens/s") if inc else None
                tf = full.counters.get("tokens/s") if full else None
                rows.append([router, str(batch), str(prompt), fmt(ti, ",.0f"), fmt(tf, ",.0f"),
                             fmt(ratio(ti, tf), ".1f")])
    if any(r[3] != "-" for r in rows):
        print("## Decoding (paper_medium, vocabulary 10000, float): tokens/s")
        print()
        table(["router", "batch", "prompt", "incremental", "full forward per token",
               "incremental / full"], rows)
        print()

    # Targets
    print("## Targets")
    print()
    for dtype in ("bf16", "float"):
        _, rate = moe.get((dtype, "softmax", "fwdbwd"), (None, None))
        frac = ratio(rate, gemm_rate.get((dtype, SQUARE)))
        frac_slots = ratio(rate, gemm_rate.get((dtype, SLOTS)))
        if frac is None:
            why = (f"no moe/{dtype}/softmax/fwdbwd result in this file"
                   if (dtype, "softmax", "fwdbwd") not in moe
                   else f"no gemm/{dtype}/{SQUARE} result in this file")
            print(f"(a) {dtype}: not measured: {why}")
            continue
        verdict = ""
        if dtype == "bf16":
            verdict = " (target >= 40%: " + ("met" if frac >= TARGET_FRACTION else "missed") + ")"
        print(f"(a) {dtype}: MoE layer fwd+bwd (softmax router) expert throughput = "
              f"{frac:.1%} of the square GEMM{verdict}; {fmt(frac_slots, '.1%')} of the "
              f"4096 x 352 x 352 GEMM")
        for router in ("similarity", "attention"):
            _, rr = moe.get((dtype, router, "fwdbwd"), (None, None))
            print(f"    {router} router: {fmt(ratio(rr, gemm_rate.get((dtype, SQUARE))), '.1%')} "
                  f"of the square GEMM")
    soft = moe.get(("float", "softmax", "fwdbwd"), (None, None))[0]
    for router, target in (("similarity", TARGET_SIM_RATIO), ("attention", None)):
        t = moe.get(("float", router, "fwdbwd"), (None, None))[0]
        q = ratio(t, soft)
        fwd = ratio(moe.get(("float", router, "fwd"), (None, None))[0],
                    moe.get(("float", "softmax", "fwd"), (None, None))[0])
        label = "(b)" if target else "   "
        verdict = ""
        if target and q is not None:
            verdict = f" (target <= {target:.2f}: " + ("met" if q <= target else "missed") + ")"
        print(f"{label} {router} / softmax router layer time, fwd+bwd: {fmt(q, '.3f')}{verdict}; "
              f"forward: {fmt(fwd, '.3f')}")
    for dtype in ("bf16", "float"):
        soft = get(f"moe_large/{dtype}/softmax/fwdbwd")
        if soft is None:
            print(f"(c) {dtype}, large shape: not measured (no moe_large/{dtype}/softmax/fwdbwd)")
            continue
        frac = ratio(flops(f"moe_large/{dtype}/softmax/fwdbwd", "expert_flop"),
                     gemm_rate.get((dtype, SQUARE)))
        verdict = ""
        if dtype == "bf16" and frac is not None:
            verdict = (f" (target >= {TARGET_LARGE_FRACTION:.0%}: " +
                       ("met" if frac >= TARGET_LARGE_FRACTION else "missed") + ")")
        print(f"(c) {dtype}, large shape: softmax layer fwd+bwd expert throughput = "
              f"{fmt(frac, '.1%')} of the square GEMM{verdict}")
        for router, target in TARGET_LARGE_RATIOS.items():
            r = get(f"moe_large/{dtype}/{router}/fwdbwd")
            q = ratio(r.seconds() if r else None, soft.seconds())
            v = "" if q is None else (f" (target <= {target:.2f}: " +
                                      ("met" if q <= target else "missed") + ")")
            print(f"    {router} / softmax layer time: {fmt(q, '.3f')}{v}")
    # the tensor-core targets
    for dtype, (router, target) in TARGET_TC_RATIOS.items():
        soft = get(f"moe_large/{dtype}/softmax/fwdbwd")
        r = get(f"moe_large/{dtype}/{router}/fwdbwd")
        q = ratio(r.seconds() if r else None, soft.seconds() if soft else None)
        v = "" if q is None else f" (target <= {target:.2f}: " + ("met" if q <= target else "missed") + ")"
        # the Attention graph on tensor cores: every precision measured (bf16 layers: bf16 first)
        names = (("attention-bf16", "attention-tf32") if dtype == "bf16" else ("attention-tf32",))
        names = [a for a in names if get(f"moe_large/{dtype}/{a}/fwdbwd")] or ["attention"]
        parts = []
        for att_name in names:
            att = get(f"moe_large/{dtype}/{att_name}/fwdbwd")
            qa = ratio(att.seconds() if att else None, soft.seconds() if soft else None)
            va = "" if qa is None else (f" (target <= {TARGET_TC_ATTENTION:.2f}: " +
                                        ("met" if qa <= TARGET_TC_ATTENTION else "missed") + ")")
            parts.append(f"{att_name}: {fmt(qa, '.3f')}{va}")
        print(f"(d) {dtype}, large shape: {router} / softmax layer time, fwd+bwd: "
              f"{fmt(q, '.3f')}{v}; " + "; ".join(parts))
    rate = flops("graph_large/float/similarity-bf16/fwdbwd", "graph_flop")
    v = "" if rate is None else (f" (target >= {TARGET_GRAPH_TFLOPS:.0f}: " +
                                 ("met" if rate / 1e12 >= TARGET_GRAPH_TFLOPS else "missed") + ")")
    print(f"(e) Similarity graph alone, bf16 products, large shape, fwd+bwd: "
          f"{fmt(rate / 1e12 if rate else None, '.1f')} TFLOP/s of causal products{v}")
    r = get("lm_train/bf16/softmax")
    tok = r.counters.get("tokens/s") if r else None
    v = "" if tok is None else (f" (target >= {TARGET_LM_TOKENS:,}: " +
                                ("met" if tok >= TARGET_LM_TOKENS else "missed") + ")")
    print(f"(f) medium LM training, bf16 (lm_train/bf16/softmax): {fmt(tok, ',.0f')} tokens/s{v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
