#!/usr/bin/env python3
"""The tables of docs/results.md from the study's runs (runs/study/<study>/<cell>/s<seed>/).

Every number is the mean +- sample standard deviation over the seeds that finished (n given);
a cell with one seed shows its value alone. Per-layer routing numbers come from each cell's
report.csv (routing_report on WikiText-2 test: fluctuation against the previous epoch's
checkpoint, entropy ratio against the softmax model of the same seed); the model-level ones are
means over the MoE layers. Python 3 standard library only.

    python3 scripts/study/tables.py [--runs runs/study] [STUDY...]
    python3 scripts/study/tables.py --update docs/results.md

--update rewrites every block `<!-- table:NAME -->` ... `<!-- /table -->` of a Markdown file with
the current table NAME (lm, lm-fluctuation, lm-entropy, tau, fix, sigma, plugin, vision,
finetune), leaving the prose around them alone.
"""
import argparse
import csv
import math
import os
import re
import statistics
import sys

RESULT_RE = re.compile(r"(\w+)=([^\s]+)")


def cells(runs, study):
    base = os.path.join(runs, study)
    if not os.path.isdir(base):
        return {}
    out = {}
    for cell in sorted(os.listdir(base)):
        if not os.path.isdir(os.path.join(base, cell)):
            continue
        seeds = []
        for s in sorted(os.listdir(os.path.join(base, cell))):
            d = os.path.join(base, cell, s)
            if os.path.isfile(os.path.join(d, "result.txt")):
                seeds.append(d)
        if seeds:
            out[cell] = seeds
    return out


def result(d):
    with open(os.path.join(d, "result.txt")) as f:
        return dict(RESULT_RE.findall(f.read()))


def report(d):
    path = os.path.join(d, "report.csv")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        # an empty field (a metric that could not be computed) reads as nan
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def num(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def stat(values, fmt="%.3f"):
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return fmt % values[0]
    return (fmt + " +- " + fmt) % (statistics.mean(values), statistics.stdev(values))


def layer_mean(rep, key):
    if rep is None:
        return math.nan
    vals = [r[key] for r in rep if not math.isnan(r[key])]
    return statistics.mean(vals) if vals else math.nan


LM_COLS = [("test ppl", lambda r, p: num(r.get("test_ppl")), "%.2f"),
           ("attacked test ppl", lambda r, p: num(r.get("attacked_test_ppl")), "%.2f"),
           ("val ppl", lambda r, p: num(r.get("val_ppl")), "%.2f"),
           ("fluctuation top-k", lambda r, p: layer_mean(p, "fluct_topk"), "%.3f"),
           ("fluctuation top-1", lambda r, p: layer_mean(p, "fluct_top1"), "%.3f"),
           ("H(p) / softmax's", lambda r, p: layer_mean(p, "entropy_p_ratio"), "%.3f"),
           ("graph entropy", lambda r, p: layer_mean(p, "graph_entropy"), "%.3f"),
           ("S[i,i]", lambda r, p: layer_mean(p, "self_weight"), "%.3f"),
           ("graph changed top-k", lambda r, p: layer_mean(p, "graph_changed_selection"), "%.3f"),
           ("max expert share", lambda r, p: layer_mean(p, "max_load_share"), "%.3f"),
           ("wall s", lambda r, p: num(r.get("wall_s")), "%.0f")]


def lm_table(runs, study, order=None):
    cs = cells(runs, study)
    if not cs:
        return f"(no finished cells under {runs}/{study})\n"
    names = [c for c in (order or []) if c in cs] + [c for c in cs if c not in (order or [])]
    lines = ["| cell | seeds | " + " | ".join(c[0] for c in LM_COLS) + " |",
             "|---" * (len(LM_COLS) + 2) + "|"]
    for c in names:
        rs = [(result(d), report(d)) for d in cs[c]]
        lines.append(f"| {c} | {len(rs)} | " + " | ".join(stat([f(r, p) for r, p in rs], fmt) for _, f, fmt in LM_COLS) + " |")
    return "\n".join(lines) + "\n"


def per_layer_table(runs, study, key, order=None):
    cs = cells(runs, study)
    rows = {}
    layers = set()
    for c, ds in cs.items():
        per = {}
        for d in ds:
            rep = report(d)
            for r in rep or []:
                per.setdefault(int(r["layer"]), []).append(r[key])
        rows[c] = per
        layers |= set(per)
    if not layers:
        return f"(no reports under {runs}/{study})\n"
    layers = sorted(layers)
    names = [c for c in (order or []) if c in rows] + [c for c in rows if c not in (order or [])]
    lines = ["| cell | " + " | ".join(f"layer {l}" for l in layers) + " |", "|---" * (len(layers) + 1) + "|"]
    for c in names:
        lines.append(f"| {c} | " + " | ".join(stat(rows[c].get(l, [])) for l in layers) + " |")
    return "\n".join(lines) + "\n"


def vision_table(runs):
    cs = cells(runs, "vision")
    if not cs:
        return "(no finished vision cells)\n"
    keys = ["test_accuracy", "gaussian_noise_accuracy", "blur_accuracy", "contrast_accuracy", "wall_s"]
    lines = ["| router | seeds | clean | Gaussian noise | blur | contrast | wall s |", "|---|---|---|---|---|---|---|"]
    for c in ["softmax", "similarity", "attention"] + [c for c in cs if c not in ("softmax", "similarity", "attention")]:
        if c not in cs:
            continue
        rs = [result(d) for d in cs[c]]
        lines.append(f"| {c} | {len(rs)} | " + " | ".join(stat([num(r.get(k)) for r in rs], "%.0f" if k == "wall_s" else "%.4f") for k in keys) + " |")
    return "\n".join(lines) + "\n"


def finetune_table(runs):
    cs = cells(runs, "finetune")
    if not cs:
        return "(no finished fine-tuning cells)\n"
    tasks = ["sst2", "sst5", "banking77"]
    lines = ["| router | SST-2 | SST-5 | Banking-77 |", "|---|---|---|---|"]
    for router in ["softmax", "similarity", "attention"]:
        vals = []
        for t in tasks:
            ds = cs.get(f"{router}-{t}", [])
            v = stat([num(result(d).get("test_accuracy")) for d in ds], "%.4f")
            vals.append(v + (f" (n={len(ds)})" if ds else ""))
        lines.append(f"| {router} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


ORDER = ["softmax", "similarity", "attention", "tau0.1", "tau1", "tau2", "tau11.3",
         "learned-tau", "exclude-self", "sigma0.1", "sigma11.3"]


def table(runs, name):
    if name == "vision":
        return vision_table(runs)
    if name == "finetune":
        return finetune_table(runs)
    if name == "lm-fluctuation":
        return per_layer_table(runs, "lm", "fluct_topk", ORDER)
    if name == "lm-entropy":
        return per_layer_table(runs, "lm", "entropy_p_ratio", ORDER)
    if name in ("lm", "tau", "fix", "sigma", "plugin"):
        return lm_table(runs, name, ORDER)
    sys.exit(f"tables.py: unknown table '{name}'")


def update(path, runs):
    text = open(path).read()
    pattern = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
    text, n = pattern.subn(lambda m: m.group(1) + table(runs, m.group(2)) + m.group(4), text)
    with open(path, "w") as f:
        f.write(text)
    print(f"tables.py: {n} tables updated in {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/study")
    ap.add_argument("--update", metavar="FILE", help="rewrite the table blocks of this Markdown file")
    ap.add_argument("studies", nargs="*", default=["lm", "tau", "fix", "sigma", "plugin", "vision", "finetune"])
    a = ap.parse_args()
    if a.update:
        update(a.update, a.runs)
        return
    order = ["softmax", "similarity", "attention"]
    for s in a.studies:
        print(f"## {s}\n")
        if s == "vision":
            print(vision_table(a.runs))
        elif s == "finetune":
            print(finetune_table(a.runs))
        elif s in ("lm", "tau", "fix", "sigma", "plugin"):
            print(lm_table(a.runs, s, ORDER))
            if s == "lm":
                print("Fluctuation (top-k) per layer, last two epochs:\n")
                print(per_layer_table(a.runs, s, "fluct_topk", order))
                print("H(p) / softmax's H(p) per layer:\n")
                print(per_layer_table(a.runs, s, "entropy_p_ratio", order))
        else:
            sys.exit(f"tables.py: unknown study '{s}'")


if __name__ == "__main__":
    main()
