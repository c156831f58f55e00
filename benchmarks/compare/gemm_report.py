#!/usr/bin/env python3
"""GEMM report: graphmoe::gemm against OpenBLAS cblas_sgemm, from bench_gemm's JSON output.

Runs every case of <build-dir>/benchmarks/bench_gemm with --benchmark_format=json, and of
bench_gemm_eigen and bench_gemm_eigen_native (the same graphmoe::gemm on Eigen's own kernel,
with the project's flags and with -march=native) when they were built, and prints a Markdown
table:

    shape (M x K x N) | threads | graphmoe GFLOP/s | OpenBLAS GFLOP/s | ratio | Eigen kernel ...

ratio = graphmoe / OpenBLAS. Each number is the median of --repetitions runs. The OpenBLAS
kernel family in use (OPENBLAS_VERBOSE=2, e.g. "Core: Haswell") is printed above the table;
OPENBLAS_CORETYPE in the environment overrides it, as for any OpenBLAS program.

Each case runs as its own process. On Linux the script compares the CPU time the whole machine
spent during the run (/proc/stat) with the CPU time of the benchmark itself: the difference is
load from other processes, which on a small shared machine distorts the result. A case whose
other load exceeds --max-other-load (a fraction of all CPUs) is waited out and rerun, up to
--retries times; the table's last column gives the other load of the run it reports.
Python 3 standard library only.

    python3 benchmarks/compare/gemm_report.py --build-dir build --repetitions 5 --retries 10
"""
import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time

NAME_RE = re.compile(r"^(BM_\w+)/M:(\d+)/K:(\d+)/N:(\d+)/threads:(\d+)")


def cpu_jiffies():
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def children_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def other_load(before, after, own_cpu, wall):
    """Fraction of all CPUs used by other processes between two cpu_jiffies() samples."""
    if before is None or after is None or wall <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    busy = (after[0] - before[0]) / hz
    return max(0.0, busy - own_cpu) / (wall * ncpu)


def wait_until_idle(threshold, timeout=600.0):
    """Waits (up to timeout seconds) for a 2-second window with load below threshold."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        a = cpu_jiffies()
        time.sleep(2.0)
        b = cpu_jiffies()
        if a is None or b is None:
            return
        if (b[0] - a[0]) / max(1, b[1] - a[1]) < threshold:
            return


def list_cases(binary):
    """The GEMM case names of a binary, and what OpenBLAS says about its kernel (or "")."""
    env = dict(os.environ, OPENBLAS_VERBOSE="2")
    proc = subprocess.run([binary, "--benchmark_list_tests=true"], check=True, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = [line.strip() for line in proc.stdout.splitlines() if NAME_RE.match(line.strip())]
    core = " ".join(line.strip() for line in proc.stderr.splitlines() if line.startswith("Core:"))
    return names, core


def run_case(binary, name, args):
    cmd = [binary, "--benchmark_format=json", f"--benchmark_filter=^{name}$"]
    if args.repetitions > 1:
        cmd += [f"--benchmark_repetitions={args.repetitions}",
                "--benchmark_report_aggregates_only=true"]
    if args.min_time is not None:
        cmd.append(f"--benchmark_min_time={args.min_time}")
    for attempt in range(args.retries + 1):
        if attempt > 0:
            wait_until_idle(args.max_other_load)
        j0, c0, t0 = cpu_jiffies(), children_cpu_seconds(), time.time()
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        j1, c1, t1 = cpu_jiffies(), children_cpu_seconds(), time.time()
        load = other_load(j0, j1, c1 - c0, t1 - t0)
        if load is None or load <= args.max_other_load:
            break
        print(f"  {name}: other processes used {100 * load:.0f}% of the CPUs, rerunning",
              file=sys.stderr)
    report = json.loads(out)
    gflops, label = None, ""
    for b in report["benchmarks"]:
        wanted = (b.get("aggregate_name") == "median" if args.repetitions > 1
                  else b.get("run_type", "iteration") == "iteration")
        if wanted and "FLOPS" in b:
            gflops, label = b["FLOPS"] / 1e9, b.get("label", "")
    print(f"  {name}: {gflops:.1f} GFLOP/s" + ("" if load is None else f", other load {100 * load:.0f}%"),
          file=sys.stderr)
    return gflops, label, load, report.get("context", {})


def case_order(case):
    """Table order: by threads, then largest GEMM first, then (M, K, N)."""
    m, k, n, t = case
    return (t, -m * k * n, case)


def fmt(x):
    return "-" if x is None else f"{x:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="graphmoe build tree (default: build)")
    ap.add_argument("--repetitions", type=int, default=5, help="runs per case; the median is reported")
    ap.add_argument("--min-time", default=None, help="--benchmark_min_time for the binaries")
    ap.add_argument("--retries", type=int, default=0,
                    help="reruns of a case disturbed by other processes (default 0)")
    ap.add_argument("--max-other-load", type=float, default=0.05,
                    help="share of all CPUs other processes may use during a run (default 0.05)")
    args = ap.parse_args()

    bench_dir = os.path.join(args.build_dir, "benchmarks")
    # (binary, column of its graphmoe results); the Eigen columns are titled by the binaries'
    # labels ("Eigen kernel" or "Eigen kernel, -march=native", see benchmarks/CMakeLists.txt)
    binaries = [("bench_gemm", "ours"), ("bench_gemm_eigen", "eigen"),
                ("bench_gemm_eigen_native", "native")]
    if not os.access(os.path.join(bench_dir, "bench_gemm"), os.X_OK):
        sys.exit(f"gemm_report: {bench_dir}/bench_gemm not found; build it with\n  cmake --build "
                 f"{args.build_dir} --target bench_gemm bench_gemm_eigen bench_gemm_eigen_native")
    binaries = [b for b in binaries if os.access(os.path.join(bench_dir, b[0]), os.X_OK)]

    # Collect every run first, then run them case by case, so that the libraries compared in
    # one row run back to back under the same machine conditions.
    runs, blas_core = [], ""
    for binary_name, ours_column in binaries:
        binary = os.path.join(bench_dir, binary_name)
        names, core = list_cases(binary)
        if binary_name == "bench_gemm":
            blas_core = core
        for name in names:
            m = NAME_RE.match(name)
            fn, case = m.group(1), tuple(int(v) for v in m.groups()[1:])
            runs.append((case, "blas" if fn == "BM_cblas_sgemm" else ours_column, binary, name))
    runs.sort(key=lambda r: case_order(r[0]))  # stable: keeps the column order within a case

    results, labels, loads, context = {}, {}, {}, {}
    for case, column, binary, name in runs:
        gflops, label, load, ctx = run_case(binary, name, args)
        results[(column, case)] = gflops
        labels.setdefault(column, label)
        if load is not None:
            loads[case] = max(loads.get(case, 0.0), load)
        context = context or ctx

    cases = sorted({case for _, case in results}, key=case_order)
    print(f"host: {context.get('host_name', platform.node())}, {context.get('num_cpus', '?')} "
          f"CPUs at {context.get('mhz_per_cpu', '?')} MHz (as reported by Google Benchmark); "
          f"median of {args.repetitions} repetitions per case")
    if blas_core:
        print(f"OpenBLAS: {blas_core}" + (f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
                                          if os.environ.get("OPENBLAS_CORETYPE") else ""))
    if not any(col == "blas" for col, _ in results):
        print("note: bench_gemm was built without cblas (OpenBLAS not found); no OpenBLAS column")
    print()
    header = ["shape (M x K x N)", "threads", "graphmoe GFLOP/s", "OpenBLAS GFLOP/s", "ratio"]
    extra_columns = [(col, f"{labels.get(col) or col} GFLOP/s")
                     for _, col in binaries if col != "ours"]
    header += [title for _, title in extra_columns]
    if loads:
        header.append("max other load")
    rows = []
    for case in cases:
        m, k, n, t = case
        ours, blas = results.get(("ours", case)), results.get(("blas", case))
        row = [f"{m} x {k} x {n}", str(t), fmt(ours), fmt(blas),
               f"{ours / blas:.2f}" if ours and blas else "-"]
        row += [fmt(results.get((col, case))) for col, _ in extra_columns]
        if loads:
            row.append(f"{100 * loads.get(case, 0.0):.0f}%")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
