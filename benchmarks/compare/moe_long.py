#!/usr/bin/env python3
"""The MoE layer on one long sequence: the graph routers' time and memory against the softmax router.

Runs every benchmark of <build-dir>/benchmarks/bench_moe_long at the chosen lengths in its own
process, --repetitions times, and prints a Markdown table of the median CPU time per forward +
backward (the machine is shared: wall time includes other jobs' turns on the cores; the wall
time is printed beside it) and the median layer peak (layer_peak_MiB: VmHWM during the layer's first forward +
backward minus VmRSS before it; see bench_moe_long.cpp), each divided by the softmax layer's at
the same T, with the spread (min-max) over the repetitions, beside the targets
(memory <= 1.1x, time <= 1.3x at T = 8,192). Python 3 standard library only.

    /usr/bin/python3 benchmarks/compare/moe_long.py --build-dir build --lengths 8192 --repetitions 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROUTERS = [("softmax", 0), ("similarity", 1), ("similarity", 2), ("attention", 1), ("attention", 2)]
MEMORY = {0: "-", 1: "Store", 2: "Recompute"}
TARGET = (1.3, 1.1)   # (time, memory) at T = 8,192


def run(binary, router, length, memory, repetitions):
    name = f"moe_long/{router}/T:{length}/memory:{memory}/"
    times, walls, peaks = [], [], []
    for _ in range(repetitions):
        out = subprocess.run(["nice", "-n", "19", binary, f"--benchmark_filter=^{name}",
                              "--benchmark_format=json"],
                             check=True, capture_output=True, text=True).stdout
        runs = [b for b in json.loads(out)["benchmarks"] if b.get("run_type") == "iteration"]
        if len(runs) != 1:
            sys.exit(f"moe_long.py: expected one run of {name}, got {len(runs)}")
        times.append(runs[0]["cpu_time"])
        walls.append(runs[0]["real_time"])
        peaks.append(runs[0]["layer_peak_MiB"])
        print(f"{name}: CPU {times[-1]:.0f} ms, wall {walls[-1]:.0f} ms, layer peak {peaks[-1]:.1f} MiB, process peak "
              f"{runs[0]['peak_rss_MiB']:.0f} MiB", file=sys.stderr)
    return {"times": times, "walls": walls, "peaks": peaks}


def spread(xs, digits=0):
    return f"{min(xs):.{digits}f}-{max(xs):.{digits}f}" if len(xs) > 1 else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--lengths", default="8192", help="comma-separated T (bench_moe_long's: "
                    "256, 512, 1024, 2048, 4096, 8192)")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--binary", help="another build of bench_moe_long (e.g. an older commit's)")
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--from-json", help="print the table of an earlier --json file, running nothing")
    a = ap.parse_args()
    if a.repetitions < 1:
        sys.exit("moe_long.py: --repetitions must be >= 1")
    lengths = [int(x) for x in a.lengths.split(",")]
    binary = a.binary or os.path.join(a.build_dir, "benchmarks", "bench_moe_long")
    raw = {}
    if a.from_json:
        with open(a.from_json) as f:
            raw = json.load(f)
        binary = raw.pop("binary", a.from_json)
        a.repetitions = len(next(iter(raw.values()))["times"])
        lengths = sorted({int(k.split("/T:")[1].split("/")[0]) for k in raw})
    elif not os.access(binary, os.X_OK):
        sys.exit(f"moe_long.py: {binary} not found: build the bench_moe_long target")
    else:
        for length in lengths:
            for router, memory in ROUTERS:
                raw[f"{router}/T:{length}/memory:{memory}"] = run(binary, router, length, memory,
                                                                  a.repetitions)
    print(f"MoE layer forward + backward, one causal sequence of T tokens, D 352, E 16, d_ff 352, "
          f"top-2, float, 1 thread; median of {a.repetitions} processes each (spread: min-max); "
          f"binary {binary}\n")
    print("| T | router | graph memory | CPU time (ms) | spread | wall (ms) | time / softmax "
          "| layer peak (MiB) | spread | memory / softmax | target time / memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        base = raw[f"softmax/T:{length}/memory:0"]
        t0, m0 = statistics.median(base["times"]), statistics.median(base["peaks"])
        for router, memory in ROUTERS:
            r = raw[f"{router}/T:{length}/memory:{memory}"]
            t, m = statistics.median(r["times"]), statistics.median(r["peaks"])
            target = ("<= %.1f / <= %.1f" % TARGET) if router != "softmax" and length == 8192 else ""
            print(f"| {length} | {router} | {MEMORY[memory]} | {t:.0f} | {spread(r['times'])} "
                  f"| {statistics.median(r['walls']):.0f} | {t / t0:.2f} | {m:.1f} | {spread(r['peaks'], 1)} | {m / m0:.2f} | {target} |")
    if a.json and not a.from_json:
        with open(a.json, "w") as f:
            json.dump(dict(raw, binary=binary), f, indent=1)


if __name__ == "__main__":
    main()
