#!/usr/bin/env python3
"""Plot graphmoe training and routing CSVs as PNG figures.

    plot_routing.py --out DIR [--title T] LABEL=PATH [LABEL=PATH ...]

Each input is a CSV written by one of the graphmoe programs, named by a label (the router, say).
The kind of each CSV is told by its header line:

  train_lm metrics (examples/train_lm, metrics.csv)
      step,train_loss,val_loss,val_ppl,lr,grad_norm,tokens_per_s, then for each MoE layer L
      layer{L}_entropy_r,layer{L}_entropy_p,layer{L}_graph_entropy,layer{L}_fluctuation,
      layer{L}_max_load_share; any further columns are ignored.
  routing report (one row per MoE layer)
      layer,tokens,entropy_r,entropy_p,entropy_r_ratio,entropy_p_ratio,graph_entropy,self_weight,
      graph_changed_selection,fluct_top1,fluct_topk,max_load_share
      (the ratio and fluct columns are empty when no baseline / compare model was given;
      nan in the files of older builds).
  load (tokens routed to each expert)
      layer,expert,tokens,share
  train_vision metrics (examples/train_vision, metrics.csv)
      step,epoch,train_loss,test_accuracy,lr,grad_norm, then any further columns (ignored).

Numbers may be nan or inf, and a field may be empty (a metric that could not be computed, e.g. the
fluctuation at a run's first evaluation); all three are treated as missing values and not drawn
(an empty id column, layer or expert, is bad input).

Figures written under --out (only those whose inputs were given; each path written is printed):

  curves.png             train_lm: training loss and validation perplexity (log scale) by step.
  fluctuation.png        report: fluct_topk and fluct_top1 per layer, grouped bars per label
                         (nan values are left out; skipped when every value is nan).
  entropy_ratio.png      report: entropy_p_ratio per layer per label, with a line at 1.0
                         (skipped when every value is nan).
  graph_entropy.png      report: graph_entropy and self_weight per layer per label
                         (skipped when every value is nan).
  tokens_per_expert.png  load: one panel per layer, the share of tokens per expert for each label,
                         experts sorted by share (descending) within each label so that the shapes
                         of the load histograms are comparable (the numbers on the bars are the
                         expert ids); the dashed line is the uniform share 1/E.
  vision_curves.png      train_vision: test accuracy by step.

Repeated labels (several seeds of one router: `softmax=a/metrics.csv softmax=b/metrics.csv`) are
drawn as the mean over the repeats, with a shaded band (curves) or error bars (per-layer and
per-expert plots) spanning min..max over the repeats; the legend says so. Curves are aligned on
their step values; per-expert shares are averaged by rank (the i-th largest share of each repeat).
When a --title is given it heads every figure.

Exit status: 0 on success; 2 for bad arguments or bad input (malformed LABEL=PATH, a missing or
unreadable file, a CSV of unknown kind, one with a header but no rows, a row of the wrong width, a
non-numeric value where a number is expected), with a message naming the file, line and column;
no figure is written then. 1 when numpy or matplotlib cannot be imported (on Debian:
apt-get install python3-matplotlib).
"""
import argparse
import csv
import math
import os
import re
import sys
import textwrap
import warnings

try:
    import numpy as np
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as _e:  # an environment problem, not bad input
    sys.exit(f"plot_routing.py: needs numpy and matplotlib ({_e}); on Debian: "
             "apt-get install python3-matplotlib")

PROG = "plot_routing.py"
DPI = 120

LM_PREFIX = ["step", "train_loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s"]
LM_LAYER_COLUMN = re.compile(
    r"layer\d+_(entropy_r|entropy_p|graph_entropy|fluctuation|max_load_share)")
REPORT_HEADER = ["layer", "tokens", "entropy_r", "entropy_p", "entropy_r_ratio", "entropy_p_ratio",
                 "graph_entropy", "self_weight", "graph_changed_selection", "fluct_top1",
                 "fluct_topk", "max_load_share"]
LOAD_HEADER = ["layer", "expert", "tokens", "share"]
VISION_PREFIX = ["step", "epoch", "train_loss", "test_accuracy", "lr", "grad_norm"]

KIND_NAMES = {
    "lm": "train_lm metrics",
    "report": "routing report",
    "load": "load",
    "vision": "train_vision metrics",
}
KNOWN_HEADERS = (
    f"  train_lm metrics:     {','.join(LM_PREFIX)},layer<L>_entropy_r,...\n"
    f"  routing report:       {','.join(REPORT_HEADER)}\n"
    f"  load:                 {','.join(LOAD_HEADER)}\n"
    f"  train_vision metrics: {','.join(VISION_PREFIX)}[,...]"
)
# Columns holding whole numbers (ids): checked to be finite integers.
INTEGER_COLUMNS = {"report": {"layer"}, "load": {"layer", "expert"}}
SPREAD = "min..max"  # what the band / error bars of repeated labels span


class InputError(Exception):
    """Bad arguments or bad input: reported as one message, exit status 2."""


# ---- reading --------------------------------------------------------------------------------


class Table:
    """One parsed CSV: its label, path, kind and numeric columns (lists of floats)."""

    def __init__(self, label, path, kind, columns):
        self.label = label
        self.path = path
        self.kind = kind
        self.columns = columns  # name -> list of float, one per data row

    def array(self, name):
        """The column as a float array, nan for the missing (nan / inf) values."""
        a = np.asarray(self.columns[name], dtype=float)
        a[~np.isfinite(a)] = np.nan
        return a


def parse_input_spec(spec):
    """'LABEL=PATH' -> (label, path). The label is everything before the first '='."""
    label, sep, path = spec.partition("=")
    label = label.strip()
    if not sep or not label or not path:
        raise InputError(f"malformed input '{spec}': expected LABEL=PATH "
                         "(e.g. softmax=runs/a/metrics.csv)")
    return label, path


def detect_kind(path, header):
    """The CSV kind and the names of its numeric columns, from the header fields."""
    if header == REPORT_HEADER:
        return "report", list(header)
    if header == LOAD_HEADER:
        return "load", list(header)
    if header[:len(LM_PREFIX)] == LM_PREFIX:
        layer_columns = [c for c in header[len(LM_PREFIX):] if LM_LAYER_COLUMN.fullmatch(c)]
        return "lm", LM_PREFIX + layer_columns
    if header[:len(VISION_PREFIX)] == VISION_PREFIX:
        return "vision", list(VISION_PREFIX)
    raise InputError(f"{path}: unknown CSV kind; its header line is\n  {','.join(header)}\n"
                     f"expected one of these headers:\n{KNOWN_HEADERS}")


def parse_number(text, path, line, column, name, integer):
    """A CSV field as a float (nan, inf accepted; an empty field, a metric that could not be
    computed, is nan), or an InputError naming file, line and column."""
    where = f"{path}:{line}: column {column} ('{name}')"
    if not text.strip():
        value = math.nan
    else:
        try:
            value = float(text.strip())
        except ValueError:
            raise InputError(f"{where}: expected a number, got '{text}'") from None
    if integer and not (math.isfinite(value) and value == int(value) and value >= 0):
        raise InputError(f"{where}: expected a non-negative integer, got '{text}'")
    return value


def read_table(label, path):
    """Read and check one CSV; raises InputError on any problem."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file (input '{label}={path}')")
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory, not a CSV file (input '{label}={path}')")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            records = [(reader.line_num, row) for row in reader if row]
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file") from None
    except csv.Error as e:
        raise InputError(f"{path}: malformed CSV: {e}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    if not records:
        raise InputError(f"{path}: empty file (no header line)")
    header = [field.strip() for field in records[0][1]]
    kind, numeric = detect_kind(path, header)
    if len(records) == 1:
        raise InputError(f"{path}: {KIND_NAMES[kind]} CSV with a header but no data rows")
    index = {name: header.index(name) for name in numeric}
    integers = INTEGER_COLUMNS.get(kind, set())
    columns = {name: [] for name in numeric}
    for line, row in records[1:]:
        if len(row) != len(header):
            raise InputError(f"{path}:{line}: {len(row)} fields, "
                             f"but the header has {len(header)}")
        for name, i in index.items():
            columns[name].append(parse_number(row[i], path, line, i + 1, name, name in integers))
    table = Table(label, path, kind, columns)
    check_keys(table)
    return table


def check_keys(table):
    """Per-layer and per-expert CSVs must not repeat a row's key."""
    if table.kind == "report":
        keys = [(int(layer),) for layer in table.columns["layer"]]
        what = "layer {}"
    elif table.kind == "load":
        keys = list(zip(map(int, table.columns["layer"]), map(int, table.columns["expert"])))
        what = "layer {}, expert {}"
    else:
        return
    seen = set()
    for key in keys:
        if key in seen:
            raise InputError(f"{table.path}: more than one row for {what.format(*key)}")
        seen.add(key)


def all_layers(by_label):
    """The layer ids of all the tables of {label: [tables]}, ascending."""
    return sorted({int(layer) for tables in by_label.values() for t in tables
                   for layer in t.columns["layer"]})


def group_by_kind(tables):
    """kind -> {label: [tables]} with labels in the order first given."""
    groups = {}
    for t in tables:
        groups.setdefault(t.kind, {}).setdefault(t.label, []).append(t)
    return groups


# ---- aggregation over repeated labels ---------------------------------------------------------


def spread(matrix):
    """Mean, min and max over the rows (repeats) of a (repeats, points) array, ignoring nan."""
    m = np.asarray(matrix, dtype=float)
    with warnings.catch_warnings():  # all-nan columns give nan, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(m, axis=0), np.nanmin(m, axis=0), np.nanmax(m, axis=0)


def align_on(tables, key, value):
    """Union of the `key` values of the tables and a (repeats, len(union)) matrix of `value`.

    Within one table a repeated key keeps its last row (a resumed run re-logs a step)."""
    keys = sorted({k for t in tables for k in t.array(key) if np.isfinite(k)})
    pos = {k: i for i, k in enumerate(keys)}
    matrix = np.full((len(tables), len(keys)), np.nan)
    for r, t in enumerate(tables):
        for k, v in zip(t.array(key), t.array(value)):
            if np.isfinite(k):
                matrix[r, pos[k]] = v
    return np.asarray(keys), matrix


def legend_label(label, repeats, what="band"):
    return label if repeats == 1 else f"{label} (mean of {repeats}, {what} {SPREAD})"


def color_of(labels):
    return {label: f"C{i % 10}" for i, label in enumerate(labels)}


# ---- figures ----------------------------------------------------------------------------------


def new_figure(nrows, ncols, width, height, title, **kwargs):
    """A figure of nrows x ncols axes (a 2-d array) headed by `title`, wrapped to the width."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, **kwargs)
    fig.suptitle(textwrap.fill(title, width=max(40, int(width * 10))))
    return fig, axes


def legend_on_top(ax, max_columns=3, fontsize="small"):
    """A legend in a row (or rows) at the top of the axes, with head room made for it."""
    labels = ax.get_legend_handles_labels()[1]
    entries = len(labels)
    # long labels ("similarity (mean of 3, error bars min..max)") go one to a row
    if labels and max(len(x) for x in labels) > 24:
        max_columns = 1
    ncol = max(1, min(entries, max_columns))
    rows = math.ceil(entries / ncol)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + (hi - lo) * (0.06 + 0.1 * rows))
    ax.legend(fontsize=fontsize, loc="upper center", ncol=ncol)


def save(fig, out_dir, name):
    """Write the figure as out_dir/name, close it and print the path."""
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(path)
    return path


def headed(title, main):
    return f"{title}: {main}" if title else main


def no_data(ax, text="no finite values"):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def draw_curve(ax, by_label, colors, key, value, log=False):
    """Mean curve per label (value against key), with a min..max band over repeats."""
    drawn = False
    for label, tables in by_label.items():
        x, matrix = align_on(tables, key, value)
        if log:
            matrix[matrix <= 0] = np.nan
        mean, lo, hi = spread(matrix)
        if not np.isfinite(mean).any():
            continue
        ok = np.isfinite(mean)
        marker = "o" if ok.sum() <= 40 else None
        ax.plot(x[ok], mean[ok], color=colors[label], marker=marker, markersize=3,
                label=legend_label(label, len(tables)))
        if len(tables) > 1:
            ax.fill_between(x[ok], lo[ok], hi[ok], color=colors[label], alpha=0.2, linewidth=0)
        drawn = True
    if drawn:
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    else:
        no_data(ax)
    ax.set_xlabel(key)
    ax.grid(True, alpha=0.3)


def layer_values(by_label, column):
    """The layers (union over all tables) and per label (mean, lo, hi, repeats) over them."""
    layers = all_layers(by_label)
    pos = {layer: i for i, layer in enumerate(layers)}
    series = {}
    for label, tables in by_label.items():
        matrix = np.full((len(tables), len(layers)), np.nan)
        for r, t in enumerate(tables):
            for layer, v in zip(t.columns["layer"], t.array(column)):
                matrix[r, pos[int(layer)]] = v
        series[label] = (*spread(matrix), len(tables))
    return layers, series


def all_nan(by_label, columns):
    """Whether every value of these columns in every table is nan (or inf)."""
    return all(not np.isfinite(t.array(c)).any()
               for tables in by_label.values() for t in tables for c in columns)


def error_extent(mean, lo, hi):
    return np.vstack([mean - lo, hi - mean])


def draw_layer_bars(ax, by_label, colors, column):
    """Grouped bars: x = layer, one bar per label (nan left out), error bars min..max over
    repeats."""
    layers, series = layer_values(by_label, column)
    x = np.arange(len(layers))
    width = 0.8 / len(series)
    drawn = False
    for i, (label, (mean, lo, hi, repeats)) in enumerate(series.items()):
        ok = np.isfinite(mean)
        if not ok.any():
            continue
        offset = (i - (len(series) - 1) / 2) * width
        yerr = error_extent(mean, lo, hi)[:, ok] if repeats > 1 else None
        ax.bar(x[ok] + offset, mean[ok], width, yerr=yerr, capsize=2, color=colors[label],
               label=legend_label(label, repeats, "error bars"))
        drawn = True
    finish_layer_axis(ax, layers, column, drawn)


def draw_layer_points(ax, by_label, colors, column):
    """Markers joined by lines: x = layer, one series per label (slightly dodged), error bars
    min..max over repeats."""
    layers, series = layer_values(by_label, column)
    x = np.arange(len(layers), dtype=float)
    drawn = False
    for i, (label, (mean, lo, hi, repeats)) in enumerate(series.items()):
        ok = np.isfinite(mean)
        if not ok.any():
            continue
        dodge = (i - (len(series) - 1) / 2) * 0.06
        yerr = error_extent(mean, lo, hi)[:, ok] if repeats > 1 else None
        ax.errorbar(x[ok] + dodge, mean[ok], yerr=yerr, color=colors[label], marker="o",
                    markersize=4, capsize=3, label=legend_label(label, repeats, "error bars"))
        drawn = True
    finish_layer_axis(ax, layers, column, drawn)


def finish_layer_axis(ax, layers, column, drawn):
    ax.set_xticks(np.arange(len(layers)))
    ax.set_xticklabels([str(layer) for layer in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel(column)
    ax.set_title(column)
    ax.set_xlim(-0.5, len(layers) - 0.5)
    ax.grid(True, axis="y", alpha=0.3)
    if drawn:
        legend_on_top(ax)
    else:
        no_data(ax, "no values (all nan)")


def layer_figure_width(by_label, per_label):
    """Inches for per-layer axes: per_label inches per label and layer, within 7..16."""
    layers = all_layers(by_label)
    return min(16.0, max(7.0, 1.5 + len(layers) * (0.4 + per_label * len(by_label))))


def plot_curves(by_label, colors, out_dir, title):
    fig, axes = new_figure(1, 2, 12, 4.5, headed(title, "training loss and validation perplexity"))
    draw_curve(axes[0, 0], by_label, colors, "step", "train_loss")
    axes[0, 0].set_ylabel("training loss")
    axes[0, 0].set_title("training loss")
    draw_curve(axes[0, 1], by_label, colors, "step", "val_ppl", log=True)
    axes[0, 1].set_ylabel("validation perplexity (log scale)")
    axes[0, 1].set_title("validation perplexity")
    return save(fig, out_dir, "curves.png")


def plot_vision(by_label, colors, out_dir, title):
    fig, axes = new_figure(1, 1, 7, 4.5, headed(title, "test accuracy"))
    draw_curve(axes[0, 0], by_label, colors, "step", "test_accuracy")
    axes[0, 0].set_ylabel("test accuracy")
    return save(fig, out_dir, "vision_curves.png")


def skipped(name, why):
    print(f"{PROG}: note: {name} not written: {why}", file=sys.stderr)


def plot_fluctuation(by_label, colors, out_dir, title):
    columns = ["fluct_topk", "fluct_top1"]
    if all_nan(by_label, columns):
        skipped("fluctuation.png",
                "fluct_topk and fluct_top1 are nan everywhere (no compare model)")
        return None
    width = layer_figure_width(by_label, 0.3)
    fig, axes = new_figure(2, 1, width, 7, headed(title, "routing fluctuation per layer"))
    for ax, column in zip(axes[:, 0], columns):
        draw_layer_bars(ax, by_label, colors, column)
    return save(fig, out_dir, "fluctuation.png")


def plot_entropy_ratio(by_label, colors, out_dir, title):
    if all_nan(by_label, ["entropy_p_ratio"]):
        skipped("entropy_ratio.png", "entropy_p_ratio is nan everywhere (no baseline model)")
        return None
    fig, axes = new_figure(1, 1, layer_figure_width(by_label, 0.1), 4.5,
                           headed(title, "routing entropy ratio to the baseline per layer"))
    ax = axes[0, 0]
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1,
               label="1.0: the baseline's entropy")
    draw_layer_points(ax, by_label, colors, "entropy_p_ratio")
    return save(fig, out_dir, "entropy_ratio.png")


def plot_graph_entropy(by_label, colors, out_dir, title):
    columns = ["graph_entropy", "self_weight"]
    if all_nan(by_label, columns):
        skipped("graph_entropy.png", "graph_entropy and self_weight are nan everywhere")
        return None
    fig, axes = new_figure(1, 2, min(16.0, 1.4 * layer_figure_width(by_label, 0.1)), 4.5,
                           headed(title, "token graph per layer"))
    for ax, column in zip(axes[0], columns):
        draw_layer_points(ax, by_label, colors, column)
    return save(fig, out_dir, "graph_entropy.png")


def load_shares(by_label):
    """Per layer, per label: (mean, lo, hi by rank, expert ids of the single repeat or None)."""
    result = {}
    for layer in all_layers(by_label):
        per_label = {}
        for label, tables in by_label.items():
            ranked = []
            for t in tables:
                rows = [(share, int(expert)) for at, expert, share
                        in zip(t.columns["layer"], t.columns["expert"], t.array("share"))
                        if int(at) == layer]
                # descending share, nan last, ties by expert id
                rows.sort(key=lambda r: (math.isnan(r[0]), 0 if math.isnan(r[0]) else -r[0], r[1]))
                ranked.append(rows)
            n = max(len(r) for r in ranked)
            if n == 0:
                continue
            matrix = np.full((len(tables), n), np.nan)
            for i, rows in enumerate(ranked):
                matrix[i, :len(rows)] = [s for s, _ in rows]
            ids = [e for _, e in ranked[0]] if len(tables) == 1 else None
            per_label[label] = (*spread(matrix), ids, len(tables))
        result[layer] = per_label
    return result


def plot_tokens_per_expert(by_label, colors, out_dir, title):
    shares = load_shares(by_label)
    layers = list(shares)
    ncols = min(4, math.ceil(math.sqrt(len(layers))))  # 2 -> 2 x 1, 6 -> 3 x 2, 12 -> 4 x 3
    nrows = math.ceil(len(layers) / ncols)
    experts = max((len(v[0]) for per in shares.values() for v in per.values()), default=1)
    # expert ids on the bars: only for labels given once, and while they stay legible
    show_ids = experts * len(by_label) <= 36
    any_ids = show_ids and any(len(ts) == 1 for ts in by_label.values())
    panel_w = min(6.0, max(3.5, 0.5 + 0.22 * experts * len(by_label)))
    main = ("share of tokens per expert; experts sorted by share (descending) within each label"
            + ("; numbers on the bars: expert ids" if any_ids else ""))
    fig, axes = new_figure(nrows, ncols, panel_w * ncols, 3.2 * nrows + 0.8,
                           headed(title, main), sharey=True)
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    for ax, layer in zip(axes.flat, layers):
        per_label = shares[layer]
        width = 0.8 / max(1, len(per_label))
        counts = {len(v[0]) for v in per_label.values()}
        for i, (label, (mean, lo, hi, ids, repeats)) in enumerate(per_label.items()):
            x = np.arange(1, len(mean) + 1) + (i - (len(per_label) - 1) / 2) * width
            ok = np.isfinite(mean)
            yerr = error_extent(mean, lo, hi)[:, ok] if repeats > 1 else None
            bars = ax.bar(x[ok], mean[ok], width, yerr=yerr, capsize=2, color=colors[label],
                          label=legend_label(label, repeats, "error bars"))
            if ids is not None and show_ids:
                ax.bar_label(bars, labels=[str(e) for e, good in zip(ids, ok) if good],
                             fontsize=6, padding=1)
        if len(counts) == 1:
            e = counts.pop()
            ax.axhline(1.0 / e, color="gray", linestyle="--", linewidth=1, label=f"uniform 1/{e}")
            ax.set_xticks(np.arange(1, e + 1))
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("experts by share (rank)")
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("share of tokens")
    first = axes.flat[0]  # one legend (the y axis is shared: its head room serves every panel)
    legend_on_top(first, max_columns=1, fontsize="x-small")
    return save(fig, out_dir, "tokens_per_expert.png")


# ---- command line -----------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Plot graphmoe training and routing CSVs (train_lm / train_vision metrics.csv, "
                    "routing reports, expert loads) as PNG figures. Repeated labels are averaged "
                    f"(band / error bars: {SPREAD} over the repeats).",
        epilog="Example: plot_routing.py --out plots softmax=runs/s/metrics.csv "
               "similarity=runs/g/metrics.csv softmax=report_s.csv similarity=report_g.csv")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory for the PNGs (created when missing)")
    parser.add_argument("--title", default="", metavar="T", help="heading for every figure")
    parser.add_argument("inputs", nargs="+", metavar="LABEL=PATH",
                        help="a CSV and its label; the CSV kind is detected from its header")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        tables = [read_table(*parse_input_spec(spec)) for spec in args.inputs]
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            raise InputError(f"{args.out}: cannot create the output directory: "
                             f"{e.strerror or e}") from None
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    labels = list(dict.fromkeys(t.label for t in tables))
    colors = color_of(labels)
    groups = group_by_kind(tables)
    plt.rcParams["figure.dpi"] = DPI
    if "lm" in groups:
        plot_curves(groups["lm"], colors, args.out, args.title)
    if "report" in groups:
        plot_fluctuation(groups["report"], colors, args.out, args.title)
        plot_entropy_ratio(groups["report"], colors, args.out, args.title)
        plot_graph_entropy(groups["report"], colors, args.out, args.title)
    if "load" in groups:
        plot_tokens_per_expert(groups["load"], colors, args.out, args.title)
    if "vision" in groups:
        plot_vision(groups["vision"], colors, args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
