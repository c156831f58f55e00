#!/usr/bin/env python3
"""Whole-model cost of the graph-aware routers against the softmax router (the paper's Table 8).

Runs every benchmark of <build-dir>/benchmarks/bench_model_cost in its own process (so that the
peak resident set, VmHWM, is that benchmark's alone), --repetitions times, and prints a Markdown
table of median time per step and peak memory, each divided by the softmax model's, beside the
paper's Table 8 and the targets of docs/results.md. Python 3 standard library only.

    /usr/bin/python3 benchmarks/compare/model_cost.py --build-dir build-study --repetitions 3
    /usr/bin/python3 benchmarks/compare/model_cost.py --vocab 267735 --forward-only   # the paper's
        WikiText-103 vocabulary, where the LM head is most of a forward (context, not the targets)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

PAPER = {"similarity": (1.048, 1.008), "attention": (1.070, 1.060)}   # (time, memory), Table 8
TARGET = {"similarity": (1.04, 1.01), "attention": (1.05, 1.02)}


def run(binary, name, repetitions, vocab):
    times, peaks = [], []
    env = dict(os.environ, GRAPHMOE_BENCH_VOCAB=str(vocab))
    for _ in range(repetitions):
        out = subprocess.run([binary, f"--benchmark_filter=^{name}/", "--benchmark_format=json"],
                             check=True, capture_output=True, text=True, env=env).stdout
        runs = [b for b in json.loads(out)["benchmarks"] if b.get("run_type") == "iteration"]
        if len(runs) != 1:
            sys.exit(f"model_cost.py: expected one run of {name}, got {len(runs)}")
        times.append(runs[0]["real_time"])
        peaks.append(runs[0]["peak_rss_MiB"])
    return statistics.median(times), statistics.median(peaks), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--vocab", type=int, default=8000,
                    help="LM vocabulary (default 8000, the targets' setting; 2 to 10000000)")
    ap.add_argument("--forward-only", action="store_true", help="skip the training steps")
    a = ap.parse_args()
    if a.repetitions < 1:
        sys.exit("model_cost.py: --repetitions must be >= 1")
    if not 2 <= a.vocab <= 10_000_000:
        sys.exit("model_cost.py: --vocab must be from 2 to 10000000")
    binary = os.path.join(a.build_dir, "benchmarks", "bench_model_cost")
    if not os.access(binary, os.X_OK):
        sys.exit(f"model_cost.py: {binary} not found: build the bench_model_cost target")
    raw = {}
    kinds = ("forward",) if a.forward_only else ("forward", "train_step")
    for kind in kinds:
        for router in ("softmax", "similarity", "attention"):
            raw[f"{kind}/{router}"] = run(binary, f"{kind}/{router}", a.repetitions, a.vocab)
            print(f"{kind}/{router}: {raw[f'{kind}/{router}'][0]:.1f} ms, "
                  f"{raw[f'{kind}/{router}'][1]:.1f} MiB", file=sys.stderr)
    print(f"Medium shape (6 x D 352, 8 heads, E 16, d_ff 352, top-2, T 512, vocabulary {a.vocab}), "
          f"1 thread, median of {a.repetitions} processes each\n")
    print("| router | what | time (ms) | time / softmax | peak RSS (MiB) | memory / softmax "
          "| paper time / memory | target |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        t0, m0, _ = raw[f"{kind}/softmax"]
        for router in ("softmax", "similarity", "attention"):
            t, m, _ = raw[f"{kind}/{router}"]
            # Table 8 is the forward pass's
            paper = ("%.3f / %.3f" % PAPER[router] if router in PAPER else "1 / 1") \
                if kind == "forward" else ""
            # the targets are the forward's at the default vocabulary
            target = ("<= %.2f / <= %.2f" % TARGET[router]
                      if router in TARGET and kind == "forward" and a.vocab == 8000 else "")
            print(f"| {router} | {kind} | {t:.1f} | {t / t0:.3f} | {m:.1f} | {m / m0:.3f} "
                  f"| {paper} | {target} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
