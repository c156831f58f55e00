#!/usr/bin/env python3
"""The table of the modern routers' study (scripts/study/modern.sh) from its finished runs.

    /usr/bin/python3 scripts/study/modern_table.py --runs runs/study/modern [CELL...]

One Markdown row per cell: the number of finished seeds n, then the mean +- sample standard
deviation over them (a value alone when n = 1) of the validation perplexity, the fluctuation
(share of the 1,024 probe tokens whose top-k set changed over the last 100 steps, mean over the
MoE layers) and the graph's row entropy (train_lm's result line), the routing entropy of p (mean
over the MoE layers of the last evaluation's layer<L>_entropy_p, in nats, of each row normalised
by its sum) and the load: the busiest expert's load over the mean load, the worst MoE layer at
the last evaluation (layer<L>_max_load_share times E). Python 3 standard library only.
"""
import argparse
import csv
import os
import re
import statistics

RESULT_RE = re.compile(r"(\w+)=([^\s]+)")


def seeds(runs, cell):
    base = os.path.join(runs, cell)
    if not os.path.isdir(base):
        return []
    return [os.path.join(base, s) for s in sorted(os.listdir(base))
            if os.path.isfile(os.path.join(base, s, "result.txt"))]


def run_values(d):
    with open(os.path.join(d, "result.txt")) as f:
        res = dict(RESULT_RE.findall(f.read()))
    with open(os.path.join(d, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    last = rows[-1]
    ent = [float(last[c]) for c in last if c.endswith("_entropy_p") and last[c] != ""]
    share = [float(last[c]) for c in last if c.endswith("_max_load_share") and last[c] != ""]
    e = int(res["experts"]) if "experts" in res else None
    fl = res.get("fluctuation", "n/a")
    return {
        "val_ppl": float(res["val_ppl"]),
        "fluctuation": float(fl) if fl != "n/a" else None,
        "graph_entropy": float(res["graph_entropy"]),
        "entropy_p": sum(ent) / len(ent) if ent else None,
        "load": max(share) * e if share and e else None,
    }


def fmt(vals, digits):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.mean(vals):.{digits}f} +- {statistics.stdev(vals):.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="runs/study/modern")
    ap.add_argument("cells", nargs="*")
    a = ap.parse_args()
    cells = a.cells or sorted(os.listdir(a.runs))
    print("| cell | n | val ppl | fluctuation | graph entropy | routing entropy | max / mean load |")
    print("|---|---|---|---|---|---|---|")
    for cell in cells:
        ds = seeds(a.runs, cell)
        if not ds:
            continue
        v = [run_values(d) for d in ds]
        col = lambda k: [x[k] for x in v]
        print(f"| {cell} | {len(ds)} | {fmt(col('val_ppl'), 2)} | {fmt(col('fluctuation'), 3)} | "
              f"{fmt(col('graph_entropy'), 3)} | {fmt(col('entropy_p'), 3)} | {fmt(col('load'), 2)} |")


if __name__ == "__main__":
    main()
