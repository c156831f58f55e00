#!/usr/bin/env python3
"""docs/reference/programs.md from the example programs' --help.

  python3 scripts/program-reference.py --build-dir build            # rewrite the page
  python3 scripts/program-reference.py --build-dir build --check    # exit 1 if it differs

The page holds each program's --help text (its usage line with the bare program name). Parts of
that text depend on the build (the routers and devices compiled in, the thread limit), so
--check compares what the build cannot change: for every program, the set of options the page
lists against the set its --help prints. A flag added, removed or renamed in a program fails the
check until the page is regenerated. Python 3 standard library only.
"""
import argparse
import os
import re
import subprocess
import sys

PROGRAMS = [
    ("train_lm", "Train a language model (WikiText-2 or any text), or fine-tune a Hugging Face model (`--hf`); tutorials: [train a language model](../tutorials/train-lm.md), [upcycle a model](../tutorials/upcycle.md)."),
    ("generate", "Continue a prompt from a `train_lm` checkpoint or a Hugging Face model directory (`--hf`); tutorial: [generate text](../tutorials/generate.md)."),
    ("routing_report", "Per-layer routing report of a `train_lm` checkpoint."),
    ("train_vision", "Train a vision MoE on Fashion-MNIST or the 8x8 digits."),
    ("finetune_classifier", "Fine-tune a classifier (SST-2, SST-5, Banking-77) from a `train_lm` checkpoint or a Hugging Face model directory (`--hf`)."),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reference", "programs.md")
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def help_text(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"{binary} --help exited with {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def options(text):
    """The options a --help text defines: the first token(s) of each option line."""
    found = set()
    for line in text.splitlines():
        m = re.match(r"\s+((?:-\w,)?--[a-z0-9][a-z0-9-]*)", line)
        if m:
            found.add(m.group(1).split(",")[-1])
    return found


def normalise(name, text):
    return re.sub(r"^Usage: \S+", f"Usage: {name}", text, count=1, flags=re.M).rstrip() + "\n"


def render(helps):
    parts = ["# Example programs' flags\n",
             "Generated from each program's `--help` by `python3 scripts/program-reference.py "
             "--build-dir build`; do not edit by hand. The test `docs: programs.md lists every "
             "program's flags` fails when a program's options differ from this page. Some "
             "descriptions depend on the build (the routers and devices compiled in); the "
             "binaries' own `--help` is the last word. Values are checked as shown (ranges, "
             "choices); a bad value is refused before anything runs "
             "([reliability](../reliability.md#command-lines-the-examples)).\n"]
    for name, what in PROGRAMS:
        parts.append(f"## {name}\n\n{what}\n\n```text\n{normalise(name, helps[name])}```\n")
    return "\n".join(parts)


def page_options(page):
    """Program name -> options listed in the page's code block for it."""
    result, current, block = {}, None, False
    for line in page.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            result[current] = set()
        elif line.startswith("```"):
            block = not block
        elif block and current:
            result[current] |= options(line)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--page", default=PAGE)
    ap.add_argument("--program", action="append", default=[], metavar="NAME=PATH",
                    help="a program's binary (default: BUILD_DIR/examples/NAME)")
    args = ap.parse_args()
    paths = {name: os.path.join(args.build_dir, "examples", name) for name, _ in PROGRAMS}
    for item in args.program:
        name, _, path = item.partition("=")
        paths[name] = path
    helps = {name: help_text(paths[name]) for name, _ in PROGRAMS}
    if not args.check:
        with open(args.page, "w") as f:
            f.write(render(helps))
        print(f"wrote {args.page}")
        return 0
    with open(args.page) as f:
        listed = page_options(f.read())
    failed = False
    for name, _ in PROGRAMS:
        have, page = options(helps[name]), listed.get(name)
        if page is None:
            print(f"{args.page}: no section for {name}")
            failed = True
            continue
        for flag in sorted(have - page):
            print(f"{args.page}: {name} has {flag}, the page does not list it")
            failed = True
        for flag in sorted(page - have):
            print(f"{args.page}: the page lists {name} {flag}, the program has no such option")
            failed = True
    if failed:
        print("regenerate the page: python3 scripts/program-reference.py --build-dir <build>")
        return 1
    print(f"{args.page}: the options of {len(PROGRAMS)} programs match their --help")
    return 0


if __name__ == "__main__":
    sys.exit(main())
