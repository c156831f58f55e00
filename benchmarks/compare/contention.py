#!/usr/bin/env python3
"""LM training beside a busy process: bench_lm's tokens/s at 2 threads, alone and beside one
process that spins on one core, in alternation, and their ratio.

Users share machines. With 2 cores and one of them taken by another process, a fair share is
1.5 cores of 2 (each of the 3 runnable threads gets 2/3 of a core), so a job that scales well keeps
about 50-75% of its idle speed; the issue's bar is 40%. An OpenMP runtime whose idle workers spin
at barriers while their partner thread is descheduled can fall far below that.

    python3 benchmarks/compare/contention.py --build-dir build [--repeats 3] [--router softmax]
    python3 benchmarks/compare/contention.py --build-dir build --env OMP_WAIT_POLICY=active

The busy process is `sh -c 'while :; do :; done'` pinned with taskset to --busy-core. Before each
run the script samples /proc/stat: the CPU time that other processes used while bench_lm ran
is printed as `other` (in cores); with the busy process it should be about 1.0, alone about 0.
Runs where `other` is far from that (other users of the machine) are flagged, not dropped.
--env NAME=VALUE sets variables for bench_lm only (e.g. to compare OpenMP wait policies).

The last line is

    lm_train contended/idle tokens/s: R

with R the median over repeats of (tokens/s beside the busy process) / (tokens/s alone).
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from gemm_report import children_cpu_seconds, cpu_jiffies, other_load


def run_bench(bench, router, threads, min_time, env):
    """tokens/s of one bench_lm run and the CPU (in cores) other processes used meanwhile."""
    flt = f"^BM_lm_train_{router}/threads:{threads}/"
    j0, c0, t0 = cpu_jiffies(), children_cpu_seconds(), time.time()
    out = subprocess.run([bench, f"--benchmark_filter={flt}", f"--benchmark_min_time={min_time}",
                          "--benchmark_format=console"],
                         capture_output=True, text=True, env=env, check=False)
    j1, c1, t1 = cpu_jiffies(), children_cpu_seconds(), time.time()
    load = other_load(j0, j1, c1 - c0, t1 - t0)
    if out.returncode != 0:
        sys.exit(f"contention.py: {bench} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    m = re.search(r"tokens/s=([0-9.]+)(k?)/s", out.stdout)
    if not m:
        sys.exit(f"contention.py: no tokens/s in bench_lm's output for {flt}:\n{out.stdout[-2000:]}")
    tps = float(m.group(1)) * (1000.0 if m.group(2) == "k" else 1.0)
    return tps, (load or 0.0) * (os.cpu_count() or 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--router", default="softmax", choices=["softmax", "similarity"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy-core", type=int, default=0)
    ap.add_argument("--min-time", type=float, default=2.0, help="bench_lm's --benchmark_min_time")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    a = ap.parse_args()
    if not 1 <= a.repeats <= 100:
        sys.exit("contention.py: --repeats must be in [1, 100]")
    if not 0 < a.min_time <= 60:
        sys.exit("contention.py: --min-time must be in (0, 60]")
    if a.busy_core < 0 or a.busy_core >= os.cpu_count():
        sys.exit(f"contention.py: --busy-core must be in [0, {os.cpu_count() - 1}]")
    bench = os.path.join(a.build_dir, "benchmarks", "bench_lm")
    if not os.access(bench, os.X_OK):
        sys.exit(f"contention.py: {bench} not found (build the bench_lm target)")
    if shutil.which("taskset") is None:
        sys.exit("contention.py: taskset (util-linux) is needed to pin the busy process")
    env = dict(os.environ)
    for kv in a.env:
        if "=" not in kv:
            sys.exit(f"contention.py: --env wants NAME=VALUE, got '{kv}'")
        k, v = kv.split("=", 1)
        env[k] = v
    # OpenBLAS's own kernel choice, unless it falls back to SSE3 on a CPU it does not know
    env.pop("OPENBLAS_CORETYPE", None)
    here = os.path.dirname(os.path.abspath(__file__))
    ct = subprocess.run(["bash", os.path.join(here, "..", "..", "scripts", "openblas-coretype.sh")],
                        capture_output=True, text=True, env=env).stdout.strip()
    if ct:
        env["OPENBLAS_CORETYPE"] = ct
    shown = " ".join(a.env) or "(none)"
    print(f"bench_lm {a.router}, {a.threads} threads; extra environment: {shown}; "
          f"OPENBLAS_CORETYPE={env.get('OPENBLAS_CORETYPE', '(OpenBLAS default)')}")
    print("| repeat | alone tok/s | other (cores) | beside busy tok/s | other (cores) | ratio |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for rep in range(a.repeats):
        alone, other_alone = run_bench(bench, a.router, a.threads, a.min_time, env)
        spin = subprocess.Popen(["taskset", "-c", str(a.busy_core), "sh", "-c",
                                 "while :; do :; done"])
        try:
            time.sleep(0.3)
            shared, other_shared = run_bench(bench, a.router, a.threads, a.min_time, env)
        finally:
            spin.kill()
            spin.wait()
        flag = " (other users?)" if other_alone > 0.2 or other_shared > 1.2 else ""
        ratios.append(shared / alone)
        print(f"| {rep + 1} | {alone:,.0f} | {other_alone:.2f} | {shared:,.0f} | {other_shared:.2f} | "
              f"{shared / alone:.2f}{flag} |")
    spread = f" (min {min(ratios):.2f}, max {max(ratios):.2f})" if len(ratios) > 1 else ""
    print(f"median over {len(ratios)} repeats{spread}; target >= 0.40")
    print(f"lm_train contended/idle tokens/s: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
