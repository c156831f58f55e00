#!/usr/bin/env python3
"""Soak test of train_lm: kill / resume cycles with every router, and resident memory over a long run.

For each router (all nine by default):
  1. reference: train_lm for --steps steps in one go, a checkpoint every --every steps;
  2. soak: the same command with --resume, started again and again and killed with SIGKILL at a
     random moment (uniform in [0.2 s, --kill-fraction x the reference's run time]) while fewer
     than --cycles-min kills have happened, then left to run to the end (a start that ends
     before its kill ends the cycles early: the report gives the number of kills);
  3. the soak's final checkpoint must equal the reference's byte for byte (every tensor, the
     optimizer state and the metadata: resume continues bit for bit), and no temporary file of a
     killed save may be left beside it.
Then, for --memory-routers, one run of --memory-steps steps whose resident set size (VmRSS, read
from /proc every 0.1 s) must not grow: the largest value in the last half of the run at most
--rss-tolerance (default 5%) above the largest in the first half, past a warm-up tenth.

Outside ctest (it takes minutes): docs/reliability.md, "Soak", has the command and the last
results. The corpus is the first --lines lines of WikiText-2's validation split (../shared/data
holds no training split), the model tiny (2 layers, D = 32); the kill times come from --seed.

  /usr/bin/python3 scripts/soak.py --build-dir build [--routers softmax,similarity] [--cycles-min 3]

Exit status 0 when every check passed, 1 otherwise (each failure printed), 2 for bad arguments
or a missing train_lm.
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROUTERS = ["softmax", "similarity", "attention", "xmoe", "xmoe-similarity", "xmoe-attention",
           "smoe-dropout", "smoe-dropout-similarity", "smoe-dropout-attention"]


def model_args(corpus, out, steps, every, threads):
    return ["--train", corpus, "--test", "", "--valid-fraction", "0.1", "--layers", "2",
            "--d-model", "32", "--heads", "2", "--d-ff", "32", "--experts", "4", "--top-k", "2",
            "--seq", "32", "--batch", "4", "--steps", str(steps), "--warmup", "5",
            "--eval-every", "0", "--checkpoint-every", str(every), "--threads", str(threads),
            "--out", out]


def run_to_end(cmd, timeout):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    return r.returncode, r.stderr


def vmrss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def soak_router(exe, router, corpus, work, args, rng):
    """Returns (ok, message)."""
    ref_dir = os.path.join(work, router, "ref")
    soak_dir = os.path.join(work, router, "soak")
    base = [exe, "--router", router]
    t0 = time.time()
    rc, err = run_to_end(base + model_args(corpus, ref_dir, args.steps, args.every, args.threads),
                         args.timeout)
    ref_seconds = time.time() - t0
    if rc != 0:
        return False, f"reference run failed (exit {rc}): {err.strip()[-400:]}"
    kills = 0
    starts = 0
    cmd = base + model_args(corpus, soak_dir, args.steps, args.every, args.threads) + ["--resume"]
    while True:
        starts += 1
        if starts > args.max_starts:
            return False, f"did not finish after {args.max_starts} starts"
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # kill at a random moment within the reference's run time, until --cycles-min kills
        # happened; after that, let it finish
        if kills < args.cycles_min:
            delay = rng.uniform(0.2, max(0.3, ref_seconds * args.kill_fraction))
            try:
                p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                p.stderr.close()
                kills += 1
                continue
        try:
            _, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return False, "a resumed run did not finish in time"
        if p.returncode != 0:
            return False, f"a resumed run failed (exit {p.returncode}): {err.strip()[-400:]}"
        break
    ref = open(os.path.join(ref_dir, "checkpoint.safetensors"), "rb").read()
    got = open(os.path.join(soak_dir, "checkpoint.safetensors"), "rb").read()
    leftovers = [f for f in os.listdir(soak_dir) if ".tmp." in f]
    if leftovers:
        return False, f"temporary files left after {kills} kills: {leftovers}"
    if ref != got:
        return False, (f"after {kills} kills and {starts} starts the final checkpoint differs from "
                       f"the uninterrupted run's ({len(got)} vs {len(ref)} bytes)")
    return True, f"{kills} kills, {starts} starts, final checkpoint identical ({len(ref)} bytes)"


def memory_router(exe, router, corpus, work, args):
    out = os.path.join(work, router, "memory")
    cmd = [exe, "--router", router] + model_args(corpus, out, args.memory_steps, 50, args.threads)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while p.poll() is None:
        v = vmrss_kib(p.pid)
        if v is not None:
            samples.append(v)
        time.sleep(0.1)
    err = p.stderr.read()
    p.stderr.close()
    if p.returncode != 0:
        return False, f"the run failed (exit {p.returncode}): {err.strip()[-400:]}"
    if len(samples) < 20:
        return False, f"only {len(samples)} samples: use more --memory-steps"
    n = len(samples)
    first = samples[n // 10: n // 2]
    last = samples[n // 2:]
    a, b = max(first), max(last)
    growth = b / a - 1
    msg = (f"{n} samples, max RSS {a / 1024:.1f} MiB in the first half, {b / 1024:.1f} MiB in "
           f"the second ({growth:+.1%})")
    return growth <= args.rss_tolerance, msg


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--data-dir", default=None, help="default: ../shared/data beside the repository")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--memory-routers", default="softmax,similarity,attention")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--cycles-min", type=int, default=4, help="kills per router at least")
    ap.add_argument("--kill-fraction", type=float, default=0.5,
                    help="kill within this fraction of the reference run's time")
    ap.add_argument("--max-starts", type=int, default=100)
    ap.add_argument("--memory-steps", type=int, default=600)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--lines", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    for name in ("steps", "every", "cycles_min", "max_starts", "memory_steps", "lines", "threads"):
        if getattr(args, name) < 0 or (name != "cycles_min" and getattr(args, name) == 0):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.kill_fraction <= 10 or not 0 <= args.rss_tolerance < 10 or args.timeout <= 0:
        ap.error("--kill-fraction, --rss-tolerance or --timeout out of range")
    routers = [r for r in args.routers.split(",") if r]
    mem_routers = [r for r in args.memory_routers.split(",") if r]
    for r in routers + mem_routers:
        if r not in ROUTERS:
            ap.error(f"unknown router '{r}' (one of {', '.join(ROUTERS)})")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = os.path.join(args.build_dir, "examples", "train_lm")
    if not os.access(exe, os.X_OK):
        print(f"soak: no train_lm at {exe} (build the examples first)", file=sys.stderr)
        return 2
    data = args.data_dir or os.path.join(os.path.dirname(repo), "shared", "data")
    src = os.path.join(data, "wikitext-2", "wiki.valid.tokens")
    if not os.path.isfile(src):
        print(f"soak: no WikiText-2 at {src} (--data-dir)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="graphmoe_soak_")
    corpus = os.path.join(work, "corpus.txt")
    with open(src, encoding="utf-8") as fin, open(corpus, "w", encoding="utf-8") as fout:
        for i, line in enumerate(fin):
            if i >= args.lines:
                break
            fout.write(line)
    rng = random.Random(args.seed)
    failed = 0
    t0 = time.time()
    for r in routers:
        ok, msg = soak_router(exe, r, corpus, work, args, rng)
        failed += not ok
        print(f"soak {r}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    for r in mem_routers:
        ok, msg = memory_router(exe, r, corpus, work, args)
        failed += not ok
        print(f"memory {r}: {'ok' if ok else 'FAILED'}: {msg}", flush=True)
    print(f"soak: {len(routers)} routers soaked, {len(mem_routers)} memory runs, {failed} failed, "
          f"{time.time() - t0:.0f} s")
    if args.keep:
        print(f"soak: work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
