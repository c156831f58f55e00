#!/usr/bin/env python3
"""The include graph of include/graphmoe: no upward include, no folder cycle.

    python3 tools/check_includes.py [INCLUDE_DIR]      (default: include/ beside this script)

Every `#include "graphmoe/..."` line of every header under INCLUDE_DIR/graphmoe is an edge
from the including header's folder to the included header's folder. The folders are layered
(docs/design.md, "Folders"); a header may include headers of its own folder and of lower
layers only:

    0  config.hpp
    1  core/              tensors, shapes, backend tags, small shared types
    2  backend/cpu/  backend/cuda/  (and any other backend/<name>/): implementations, one folder
                          per backend; a backend never includes another backend
    3  ops/               each op's contract and checks once, then the call into the backend
    4  dist/              transports (MPI) and the expert exchange
    5  routing/           policies, token graphs, the router
    6  layers/
    7  models/
    8  train/  inference/  (separate folders of one layer: neither includes the other)
    9  testing/  hf/      the public gradient checker, for users' policies and layers; the
                          Hugging Face reader (on models/ and train/'s safetensors headers)
   10  graphmoe.hpp, cuda.cuh   the umbrella headers

Two rules come on top of the ranks:
  - only ops/ and the umbrella headers include a backend, and ops/ only the CPU backend (the
    one every build has); a CUDA translation unit gets backend/cuda/ from cuda.cuh. So dist/,
    routing/, layers/, models/ and train/ are written against ops/ and core/ alone;
  - the folder graph has no cycle (implied by the ranks; checked and reported on its own so that
    a change of the rank table cannot hide one).

And two on the backends: no header under backend/cuda/ reaches Eigen, directly or through
the headers it includes (nvcc would otherwise compile Eigen for the device; the CPU backend and
core/eigen.hpp are Eigen's only entry points); and a backend calls its own system, never back up
into the op layer: a call in a backend header of a function that ops/ defines (gemm, axpy,
gelu_forward, ...; the functions at namespace scope of ops/*.hpp outside namespace detail) must
pass a backend tag first (`gemm(cpu{}, ...)`, `axpy(B{}, ...)`). An untagged call would resolve
at instantiation to the op layer's checked entry point, an upward call that the include graph
does not show. Found by reading the code (comments and strings left out): a name followed by
`(` that is not a member call, not qualified by anything but graphmoe::, and not a declaration.

Exits 1 naming every offending include (file, line, included header, the rule), 0 when clean.
A header in a folder the table does not know is an error too, so a new folder gets a rank.
"""
import os
import re
import sys

RANKS = {
    "config.hpp": 0,
    "core": 1,
    "backend": 2,  # backend/<name>: see folder_of
    "ops": 3,
    "dist": 4,
    "routing": 5,
    "layers": 6,
    "models": 7,
    "train": 8,
    "inference": 8,  # generation and sampling: on models/, independent of train/
    "testing": 9,
    "hf": 9,  # Hugging Face model directories: on models/ and train/checkpoint.hpp
    "graphmoe.hpp": 10,
    "cuda.cuh": 10,
}
UMBRELLAS = {"graphmoe.hpp", "cuda.cuh"}
# backend/cuda headers allowed to reach Eigen, each with its reason (nvcc sees Eigen as host code
# there: graphmoe::cuda defines EIGEN_NO_CUDA for every .cu translation unit).
EIGEN_ALLOWED = {
    "backend/cuda/aux_losses.cuh": "evaluates the auxiliary losses on host copies with the CPU's "
                                   "own arithmetic (core/aux_losses.hpp), so both backends give "
                                   "the same values bit for bit",
}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"](graphmoe/[^">]+)[">]')
# an op-layer entry point: a function defined at column 0 of an ops/ header
OP_FUNCTION_RE = re.compile(r'^(?:inline\s+|constexpr\s+)*[A-Za-z_][\w:<>, ]*?[\s&*]+([a-z_][a-z0-9_]*)\s*\(')
# a backend tag as a call's first argument
TAG_RE = re.compile(r'^\s*(?:graphmoe::)?(?:cpu|cuda|B|Bk|Backend)\s*(?:\{\}|\(\))?\s*$')
CALL_RE = re.compile(r'(?<![\w.>:])((?:graphmoe::)?)([a-z_][a-z0-9_]*)\s*\(')
NOT_A_TYPE = {"return", "else", "do", "case", "co_return", "throw"}


def op_functions(base):
    """The names of the op layer's entry points (ops/*.hpp, outside namespace detail)."""
    names = set()
    ops = os.path.join(base, "ops")
    if not os.path.isdir(ops):
        return names
    for name in sorted(os.listdir(ops)):
        if not name.endswith(".hpp"):
            continue
        in_detail = False
        with open(os.path.join(ops, name), encoding="utf-8") as f:
            for line in f:
                if line.startswith("namespace detail"):
                    in_detail = True
                elif line.startswith("}  // namespace detail"):
                    in_detail = False
                elif not in_detail and not line.startswith(("return", "if", "for", "while")):
                    m = OP_FUNCTION_RE.match(line)
                    if m:
                        names.add(m.group(1))
    return names


def code_only(text):
    """text with string literals emptied and // comments removed (line numbers kept)."""
    lines = []
    for line in text.split("\n"):
        line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
        cut = line.find("//")
        lines.append(line if cut < 0 else line[:cut])
    return "\n".join(lines)


def untagged_op_calls(rel, text, names):
    """Calls in a backend header of op-layer functions without a backend tag first."""
    code = code_only(text)
    found = []
    for m in CALL_RE.finditer(code):
        name = m.group(2)
        if name not in names:
            continue
        before = code[:m.start()].rstrip()
        word = re.search(r"(\w+)$", before)
        if before and (before[-1] in ">*&" or (word and word.group(1) not in NOT_A_TYPE)):
            continue  # a declaration: a return type precedes the name
        i = j = m.end()
        depth = 0
        while j < len(code):
            c = code[j]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0:
                break
            j += 1
        if TAG_RE.match(code[i:j]):
            continue
        line = code.count("\n", 0, m.start()) + 1
        found.append(f"{rel}:{line}: calls {m.group(1)}{name}({code[i:j].strip()[:30]}, ...) "
                     "without a backend tag: a backend calls its own system "
                     f"({name}(<tag>{{}}, ...)), not the op layer")
    return found
EIGEN_RE = re.compile(r'^\s*#\s*include\s*[<"](Eigen|unsupported/Eigen)/')


def folder_of(rel):
    """The layer folder of a path relative to include/graphmoe ('backend/cuda', 'routing', ...)."""
    parts = rel.split("/")
    if len(parts) == 1:
        return parts[0]
    if parts[0] == "backend":
        return "backend/" + parts[1] if len(parts) > 2 else "backend"
    return parts[0]


def rank_of(folder):
    return RANKS.get(folder.split("/")[0])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "include")
    base = os.path.join(root, "graphmoe")
    if not os.path.isdir(base):
        print(f"check_includes: no graphmoe/ under '{root}'", file=sys.stderr)
        return 2
    errors = []
    ops = op_functions(base)
    edges = {}  # (from folder, to folder) -> first example
    includes = {}  # header -> the graphmoe headers it includes
    eigen = set()  # headers that include Eigen directly
    headers = 0
    for dirpath, _, files in os.walk(base):
        for name in sorted(files):
            if not name.endswith((".hpp", ".cuh", ".h")):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            headers += 1
            src = folder_of(rel)
            if rank_of(src) is None or src == "backend":
                errors.append(f"{rel}: folder '{src}' has no rank in tools/check_includes.py")
                continue
            if src.startswith("backend/"):
                with open(path, encoding="utf-8") as f:
                    errors.extend(untagged_op_calls(rel, f.read(), ops))
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if EIGEN_RE.match(line):
                        eigen.add(rel)
                    m = INCLUDE_RE.match(line)
                    if not m:
                        continue
                    target = m.group(1)[len("graphmoe/"):]
                    includes.setdefault(rel, []).append(target)
                    where = f"{rel}:{lineno}: includes graphmoe/{target}"
                    if not os.path.isfile(os.path.join(base, target)):
                        errors.append(f"{where}: no such header")
                        continue
                    dst = folder_of(target)
                    if dst == src:
                        continue
                    edges.setdefault((src, dst), where)
                    rs, rd = rank_of(src), rank_of(dst)
                    if rd is None:
                        errors.append(f"{where}: folder '{dst}' has no rank")
                    elif rd > rs:
                        errors.append(f"{where}: upward include ({src} is layer {rs}, {dst} is "
                                      f"layer {rd})")
                    elif rd == rs and src not in UMBRELLAS:
                        errors.append(f"{where}: {src} and {dst} are separate folders of one layer "
                                      "(a backend never includes another backend)")
                    elif dst.startswith("backend/") and src not in UMBRELLAS and not (
                            src == "ops" and dst == "backend/cpu"):
                        errors.append(f"{where}: only ops/ (the CPU backend) and the umbrella "
                                      "headers include a backend; include the op from ops/")
    # the CUDA system never reaches Eigen
    def eigen_path(h, seen):
        if h in eigen:
            return [h]
        for t in includes.get(h, []):
            if t not in seen:
                seen.add(t)
                p = eigen_path(t, seen)
                if p:
                    return [h] + p
        return None
    for rel in sorted(includes):
        if folder_of(rel) == "backend/cuda" and rel not in EIGEN_ALLOWED:
            path = eigen_path(rel, {rel})
            if path:
                errors.append(f"{rel}: reaches Eigen through " + " -> ".join(path[1:]) +
                              " (a backend/cuda header must compile without Eigen)")
    # folder cycles (Tarjan's strongly connected components)
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    for comp in sccs:
        pairs = [edges[(a, b)] for a in comp for b in comp if (a, b) in edges]
        errors.append("folder cycle " + " <-> ".join(comp) + ": " + "; ".join(pairs))
    if errors:
        print(f"check_includes: {len(errors)} problem(s) in {headers} headers:")
        for e in errors:
            print("  " + e)
        return 1
    print(f"check_includes: {headers} headers, {len(edges)} folder edges, no upward include, "
          "no folder cycle, no untagged call from a backend into the op layer "
          f"({len(ops)} op functions), no backend/cuda header reaches Eigen (allowed: "
          + "; ".join(f"{h}: {why}" for h, why in EIGEN_ALLOWED.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
