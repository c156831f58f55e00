#!/usr/bin/env python3
"""Expert balance of the olmoe preset: sigmoid scores with bias balancing and no auxiliary loss,
beside softmax top-k with the preset's auxiliary loss, on the main job's corpus.

    /usr/bin/python3 benchmarks/compare/olmoe_balance.py --build-dir build [--steps 500]
        [--eval-every 25] [--seeds 1] [--out runs/balance] [--figure docs/figures/balance]
        [--configs softmax sigmoid-bias sigmoid-bias-rate0.01]

Trains, with build/examples/train_lm, the olmoe preset (4 blocks, D = 256, E = 64, k = 8, expert
d_ff = 128, RMSNorm, RoPE, QK-norm, SwiGLU; docs/reference/architectures.md) twice per seed, the
same hyper-parameters for both (those of scripts/main-job.sh: sequences of 64 tokens, batch 16,
lr 2e-3 to 2e-4 after 50 warm-up steps):

    softmax                --router softmax       --load-balance 0.01 (the preset's)
    sigmoid-bias           --router sigmoid-bias  --load-balance 0    (bias rate 1e-3)
    sigmoid-bias-rate0.01  the same with --bias-update-rate 0.01
(z-loss 0.001 for all, the preset's). A run whose metrics.csv reached --steps is not repeated.

At every evaluation train_lm routes a fixed probe batch (the first validation batch, 1,024
tokens) and logs each MoE layer's busiest expert's share of the token slots (metrics.csv,
layer<L>_max_load_share); max load / mean load = share * E. The report prints, per router and
seed, that ratio at the last evaluation (worst layer and mean over layers) and the validation
perplexity; the figure (balance.png under --figure) draws the worst layer's ratio by step, with
the target line at 1.25. The corpus is runs/data/kjv.tokens (scripts/prepare-kjv.sh makes it).
"""
import argparse
import csv
import os
import subprocess
import sys

E = 64
ROUTERS = {
    "softmax": ["--router", "softmax", "--load-balance", "0.01"],
    "sigmoid-bias": ["--router", "sigmoid-bias", "--load-balance", "0"],
    # the same with a 10x faster bias (DeepSeek-V3's 1e-3 is set for runs of ~10^5 steps)
    "sigmoid-bias-rate0.01": ["--router", "sigmoid-bias", "--load-balance", "0",
                              "--bias-update-rate", "0.01"],
}


def finished(out, steps):
    path = os.path.join(out, "metrics.csv")
    if not os.path.isfile(path):
        return False
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return bool(rows) and int(float(rows[-1]["step"])) == steps


def read_metrics(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"olmoe_balance.py: {path} has no rows")
    cols = [c for c in rows[0] if c.endswith("_max_load_share")]
    if not cols:
        sys.exit(f"olmoe_balance.py: {path} has no layer<L>_max_load_share column")
    steps, worst, mean, ppl = [], [], [], []
    for r in rows:
        ratios = [float(r[c]) * E for c in cols]
        steps.append(int(float(r["step"])))
        worst.append(max(ratios))
        mean.append(sum(ratios) / len(ratios))
        ppl.append(float(r["val_ppl"]))
    return steps, worst, mean, ppl


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--corpus", default="runs/data/kjv.tokens")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/balance")
    ap.add_argument("--figure", default="docs/figures/balance")
    ap.add_argument("--reuse", action="store_true", help="read existing runs under --out instead of training")
    ap.add_argument("--configs", nargs="+", choices=list(ROUTERS), default=list(ROUTERS),
                    help="the configurations to train and report (default: all)")
    a = ap.parse_args()
    exe = os.path.join(a.build_dir, "examples", "train_lm")
    if not a.reuse:
        if not os.access(exe, os.X_OK):
            sys.exit(f"olmoe_balance.py: {exe} not found (build the examples)")
        if not os.path.isfile(a.corpus):
            sys.exit(f"olmoe_balance.py: {a.corpus} not found (scripts/prepare-kjv.sh {a.corpus})")
    common = ["--train", a.corpus, "--test", "", "--valid-fraction", "0.05", "--max-vocab", "8000",
              "--arch", "olmoe", "--seq", "64", "--batch", "16", "--steps", str(a.steps),
              "--warmup", "50", "--lr", "2e-3", "--min-lr", "2e-4", "--eval-every", str(a.eval_every),
              "--eval-batches", "20", "--threads", str(a.threads), "--sample-tokens", "0"]
    results = {}
    for name in a.configs:
        args = ROUTERS[name]
        for seed in a.seeds:
            out = os.path.join(a.out, f"{name}-s{seed}")
            if not a.reuse and not finished(out, a.steps):  # a finished run is kept
                os.makedirs(out, exist_ok=True)
                cmd = [exe, *common, *args, "--seed", str(seed), "--out", out]
                print("+", " ".join(cmd), flush=True)
                with open(os.path.join(out, "stdout.txt"), "w") as log:
                    subprocess.run(cmd, check=True, stdout=log)
            results[(name, seed)] = read_metrics(os.path.join(out, "metrics.csv"))

    print(f"olmoe preset (E = {E}, k = 8), King James Bible, {a.steps} steps, probe batch of 1,024 tokens")
    print(f"{'router':<22} {'seed':>4} {'max/mean load, worst layer':>27} {'mean over layers':>17} {'val ppl':>8}")
    for (name, seed), (steps, worst, mean, ppl) in results.items():
        print(f"{name:<22} {seed:>4} {worst[-1]:>27.3f} {mean[-1]:>17.3f} {ppl[-1]:>8.2f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("olmoe_balance.py: matplotlib missing (apt-get install python3-matplotlib); no figure")
        return
    os.makedirs(a.figure, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, seed), (steps, worst, mean, ppl) in results.items():
        ax.plot(steps, worst, label=f"{name} (seed {seed}), worst layer")
    ax.axhline(1.25, color="gray", linestyle="--", linewidth=1, label="1.25 x mean")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's load / mean load")
    ax.set_title(f"olmoe preset on the King James Bible: expert balance (E = {E}, k = 8)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path = os.path.join(a.figure, "balance.png" if a.configs == list(ROUTERS)
                        else "balance-" + "-".join(a.configs) + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print("wrote", path)


if __name__ == "__main__":
    main()
