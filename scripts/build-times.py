#!/usr/bin/env python3
"""Where a Ninja build's time went: seconds per translation unit, summed by kind, from .ninja_log.

    python3 scripts/build-times.py [BUILD_DIR] [--top N]

BUILD_DIR defaults to build (a Ninja build: scripts/test.sh configures one when ninja is
installed). Each output's last build counts once. The times are wall seconds per command; with
-j2 on two otherwise idle cores they are about its CPU seconds. Prints one line per kind (header
checks, tests, the CUDA emulation's tests, examples, the examples' syntax checks, benchmarks,
the CPU kernels graphmoe_cpu_kernels compiles once,
nvcc, links) and the N slowest translation units (default 15).
"""
import argparse
import os
import sys


def kind(output):
    if "header_check/" in output:
        return "header checks (one TU per public header)"
    if output.endswith(".cu.o"):
        return "nvcc (CUDA header check, CUDA loops, bench_cuda)"
    if "graphmoe_cpu_kernels.dir/" in output:
        return "CPU kernels compiled once (graphmoe_cpu_kernels)"
    if "syntax_check" in output:
        return "examples: -fsyntax-only checks"
    if output.startswith("tests/CMakeFiles/test_emu") or "emulation" in output:
        return "tests under the CUDA emulation"
    if output.startswith("tests/"):
        return "tests (other)" if output.endswith(".o") else "links and generated files"
    if output.startswith("examples/") and output.endswith(".o"):
        return "examples"
    if output.startswith("benchmarks/") and output.endswith(".o"):
        return "benchmarks"
    return "links and generated files"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir", nargs="?", default="build")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    if a.top < 0:
        sys.exit("build-times.py: --top must be >= 0")
    log = os.path.join(a.build_dir, ".ninja_log")
    if not os.path.isfile(log):
        sys.exit(f"build-times.py: no {log} (a Ninja build folder is needed: cmake -G Ninja)")
    last = {}
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4 or not parts[0].isdigit() or not parts[1].isdigit():
                continue
            last[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    sums, counts = {}, {}
    for out, s in last.items():
        k = kind(out)
        sums[k] = sums.get(k, 0.0) + s
        counts[k] = counts.get(k, 0) + 1
    total = sum(sums.values())
    print(f"| kind | steps | seconds | share |\n|---|---:|---:|---:|")
    for k in sorted(sums, key=sums.get, reverse=True):
        print(f"| {k} | {counts[k]} | {sums[k]:.0f} | {100 * sums[k] / total:.0f}% |")
    print(f"| total | {sum(counts.values())} | {total:.0f} | |")
    if a.top:
        print(f"\n| slowest translation units | seconds |\n|---|---:|")
        for out, s in sorted(last.items(), key=lambda kv: kv[1], reverse=True)[: a.top]:
            print(f"| `{out.split('/')[-1].removesuffix('.o')}` | {s:.0f} |")


if __name__ == "__main__":
    main()
