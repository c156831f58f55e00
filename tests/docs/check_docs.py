#!/usr/bin/env python3
"""Checks of the documentation (README.md, CHANGELOG.md, docs/**/*.md), run by ctest (tests/docs).

  check_docs.py paths               every repository path the pages name exists
  check_docs.py links               every relative link and #anchor between pages resolves
  check_docs.py flags NAME=BINARY   every --flag a page gives a program exists in its --help, and
                                    a default a page states for one is --help's
  check_docs.py claims              the pages' router counts are the build's (examples/CMakeLists.txt,
                                    cmake/ci.cmake); graphmoe.hpp's "Not included:" list is what it
                                    leaves out
  check_docs.py limits              README.md <= 250 lines, docs/benchmarks.md <= 400
  check_docs.py history             no file of the tree tells its development order
  check_docs.py extract-cpp OUTDIR  write README.md's C++ blocks to OUTDIR/readme_block_N.cpp and
                                    print one line per block: N and "run" when it has a main()

--root ROOT (default: this file's repository) is the tree to check; the tests of this script
(test_check_docs.py) point it at small broken trees. Every failure is one line
"FILE:LINE: what", and the exit status is 1 when there is any. Python 3 standard library only.
"""
import argparse
import os
import re
import subprocess
import sys

DEFAULT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Paths the pages name: from the repository root, or relative to include/graphmoe (the way the
# pages name headers: `core/tensor.hpp`, `graphmoe/layers/moe.hpp`).
ROOT_DIRS = r"(?:\.ci|include|docs|scripts|tests|benchmarks|examples|tools|cmake)"
INCLUDE_DIRS = r"(?:core|backend|ops|routing|layers|models|train|inference|dist|testing|hf)"
PATH = re.compile(
    r"(?<![\w./~$@-])("
    + ROOT_DIRS + r"/[\w.+/-]*"
    + r"|graphmoe/[\w.+/-]+"
    + r"|" + INCLUDE_DIRS + r"/[\w.+/-]*\.(?:hpp|cuh|h|cu|cpp)"
    + r")")
PLACEHOLDER = set("<*{$[")
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(([^()\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HISTORY = re.compile(r"\b(session [0-9]|sessions [0-9]|issue #?[0-9]|turn [0-9])", re.I)
# Words that tell a change rather than what is, outside CHANGELOG.md and the tests (whose "as
# before the NaN" is a test's own sequence): the pages, the headers, the programs, the scripts.
HISTORY_WORDS = re.compile(r"\b(as before|no longer|became|(?:earlier|later|previous) sessions?'?"
                           r"|used to be)\b", re.I)
PROGRAM_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*")
SKIP_DIRS = {".git", "runs", ".gpu-deps", "__pycache__", "node_modules"}


def pages(root):
    found = [os.path.join(root, "README.md"), os.path.join(root, "CHANGELOG.md")]
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "docs")):
        dirnames.sort()
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".md")]
    return [p for p in found if os.path.isfile(p)]


def lines_of(path):
    """(line number, text, inside a fenced code block, language of that block)"""
    fence, lang = None, ""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            s = line.rstrip("\n")
            m = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", s)
            if m and (fence is None or m.group(1).startswith(fence)):
                if fence is None:
                    fence, lang = m.group(1), m.group(2)
                else:
                    fence, lang = None, ""
                continue
            yield n, s, fence is not None, lang


def rel(root, path):
    return os.path.relpath(path, root)


def check_paths(root):
    errors = []
    for page in pages(root):
        for n, line, _, _ in lines_of(page):
            for m in PATH.finditer(line):
                token = m.group(1)
                after = line[m.end():m.end() + 1]
                if after in PLACEHOLDER:
                    continue
                token = token.rstrip(".,:;")
                if token.startswith("graphmoe/"):
                    candidates = [os.path.join("include", token)]
                elif re.match(INCLUDE_DIRS + "/", token):
                    candidates = [os.path.join("include", "graphmoe", token)]
                else:
                    candidates = [token]
                if not any(os.path.exists(os.path.join(root, c)) for c in candidates):
                    errors.append(f"{rel(root, page)}:{n}: names {token}, which does not exist "
                                  f"(looked for {', '.join(candidates)})")
    return errors


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", lambda m: "_" if m.group(0) == "_" else "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, result = {}, set()
        for _, line, code, _ in lines_of(path):
            m = None if code else HEADING.match(line)
            if m:
                base = slug(m.group(2))
                k = seen.get(base, 0)
                result.add(base if k == 0 else f"{base}-{k}")
                seen[base] = k + 1
        cache[path] = result
    return cache[path]


def check_links(root):
    errors = []
    for page in pages(root):
        for n, line, code, _ in lines_of(page):
            if code:
                continue
            line = re.sub(r"`[^`]*`", "", line)
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = page if not file_part else os.path.normpath(
                    os.path.join(os.path.dirname(page), file_part))
                if not os.path.exists(dest):
                    errors.append(f"{rel(root, page)}:{n}: link to {target}: {rel(root, dest)} "
                                  "does not exist")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    errors.append(f"{rel(root, page)}:{n}: link to {target}: {rel(root, dest)} "
                                  f"has no heading with anchor #{anchor}")
    return errors


def commands(line):
    """The shell segments of one logical command line."""
    line = re.sub(r"(^|\s)#.*$", "", line)
    return [s for s in re.split(r"\|\||&&|[|;]", line) if s.strip()]


PAGE_PROGRAM = re.compile(r"<!--\s*docs-check:\s*flags\s+([\w-]+)((?:\s+not\s+--[\w-]+)*)\s*-->")


def program_flags(root, programs):
    """(page, line, program, flag) for every --flag a page passes to one of the programs: on a
    command line that runs the program (a code block's line or an inline `code` span), and, in a
    page that declares its program (<!-- docs-check: flags NAME [not --flag ...] -->), every
    --flag of its prose."""
    found = []
    for page in pages(root):
        if os.path.basename(page) == "programs.md":
            continue  # generated from --help; scripts/program-reference.py --check covers it
        pending, start = "", 0
        page_program, page_skip = None, set()
        for n, line, code, _ in lines_of(page):
            m = PAGE_PROGRAM.search(line)
            if m and not code:
                page_program = m.group(1)
                page_skip = set(re.findall(r"--[\w-]+", m.group(2)))
                continue
            if page_program in programs and not code:
                for span in re.findall(r"`([^`]+)`", line):
                    if any(os.path.basename(t) in programs for t in span.split()):
                        continue  # a command line: handled below
                    for t in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", span):
                        if t not in page_skip:
                            found.append((page, n, page_program, t))
            texts = []
            if code:
                if pending:
                    pending += " " + line.strip()
                else:
                    pending, start = line.strip(), n
                if pending.endswith("\\"):
                    pending = pending[:-1]
                    continue
                texts, pending = [(start, pending)], ""
            else:
                texts = [(n, span) for span in re.findall(r"`([^`]+)`", line)]
            for ln, text in texts:
                for segment in commands(text):
                    tokens = segment.split()
                    for i, tok in enumerate(tokens):
                        name = os.path.basename(tok)
                        if name in programs:
                            for t in tokens[i + 1:]:
                                m = PROGRAM_FLAG.match(t)
                                if m:
                                    found.append((page, ln, name, m.group(0)))
                            break
    return found


# "`--flag` ... (default X)" / "`--flag` ... the default is X" in a page that declares its program.
STATED_DEFAULT = re.compile(r"`(--[a-z0-9][a-z0-9-]*)`[^`\n]{0,80}?\bdefault(?: is)? `?([^`\s,;)]+)`?")


def stated_defaults(root, programs):
    """(page, line, program, flag, value) for every default a page states for its program's flag."""
    found = []
    for page in pages(root):
        page_program = None
        for n, line, code, _ in lines_of(page):
            m = PAGE_PROGRAM.search(line)
            if m and not code:
                page_program = m.group(1)
                continue
            if page_program in programs and not code:
                for m in STATED_DEFAULT.finditer(line):
                    found.append((page, n, page_program, m.group(1), m.group(2).rstrip(".")))
    return found


def help_text(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"{binary} --help exited with {out.returncode}")
    return out.stdout


def help_defaults(text):
    """{--flag: default} of a CLI11 --help ("  --threads INT:[1, 8]=2   CPU threads")."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\s+(?:-\w,)?(--[a-z0-9][a-z0-9-]*) [A-Z]+"
                        r"(?::(?:\[[^\]]*\]|\{[^}]*\}|[^=\s]+))?=(\S+)",
                        text, re.M)}


def help_options(text):
    return {m.group(1).split(",")[-1] for m in
            re.finditer(r"^\s+((?:-\w,)?--[a-z0-9][a-z0-9-]*)", text, re.M)}


def check_flags(root, specs):
    binaries = dict(s.split("=", 1) for s in specs)
    helps = {name: help_text(path) for name, path in binaries.items()}
    have = {name: help_options(text) for name, text in helps.items()}
    errors, count = [], 0
    for page, n, name, flag in program_flags(root, set(binaries)):
        count += 1
        if flag not in have[name]:
            errors.append(f"{rel(root, page)}:{n}: {name} {flag}: {name} --help has no {flag}")
    defaults = {name: help_defaults(text) for name, text in helps.items()}
    for page, n, name, flag, value in stated_defaults(root, set(binaries)):
        said = defaults[name].get(flag)
        if said is not None and said != value:
            errors.append(f"{rel(root, page)}:{n}: {name} {flag}: the page says the default is "
                          f"{value}, {name} --help says {said}")
    if not errors:
        print(f"{count} flags given to {', '.join(sorted(binaries))} in the pages, all in --help")
    return errors


NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
ROUTER_COUNT = re.compile(r"\b(?:any of the|all) (\w+)(?: routers\b|\.)|\b(\w+) of the (\w+) routers\b"
                          r"|ci\.cmake` keeps (\w+)\b", re.I)


def cmake_list(path, name):
    """The items of `set(NAME a b c ...)` or `set(NAME "a;b;c" ...)` in a CMake file."""
    with open(path, encoding="utf-8") as f:
        m = re.search(r"set\(" + name + r"\s+((?:\"[^\"]*\")|[^)]*?)(?:\s+CACHE|\))", f.read())
    if not m:
        raise SystemExit(f"{path}: no set({name} ...)")
    return [t for t in re.split(r"[\s;\"]+", m.group(1)) if t]


def check_claims(root):
    """The pages' counts of the example programs' routers: "any of the N routers", "build all N",
    "K of the N routers" (K: cmake/ci.cmake's), "`cmake/ci.cmake` keeps K"."""
    every = len(cmake_list(os.path.join(root, "examples", "CMakeLists.txt"), "_graphmoe_all_routers"))
    ci = len(cmake_list(os.path.join(root, "cmake", "ci.cmake"), "GRAPHMOE_EXAMPLE_ROUTERS"))
    errors = []

    def number(word):
        return int(word) if word.isdigit() else NUMBERS.get(word.lower())
    for page in pages(root):
        if os.path.basename(page) == "CHANGELOG.md":
            continue
        for n, line, code, _ in lines_of(page):
            for m in ROUTER_COUNT.finditer(line):
                said = [(m.group(1), every), (m.group(2), ci), (m.group(3), every), (m.group(4), ci)]
                for word, want in said:
                    if word is not None and number(word) is not None and number(word) != want:
                        errors.append(f"{rel(root, page)}:{n}: \"{m.group(0)}\": the examples "
                                      f"have {every} routers, cmake/ci.cmake keeps {ci}")
    return errors


def header_closure(include_dir, start):
    """Every graphmoe header that `start` includes, directly or not (#if branches alike)."""
    seen, todo = set(), [start]
    while todo:
        h = todo.pop()
        if h in seen:
            continue
        seen.add(h)
        path = os.path.join(include_dir, h)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                todo += re.findall(r'^\s*#\s*include\s+[<"](graphmoe/[^>"]+)[>"]', f.read(), re.M)
    return seen


def check_umbrella(root):
    """graphmoe.hpp's comment lists ("Not included: a, b, ...") exactly the public headers that
    it does not reach, less those the listed ones reach."""
    include_dir = os.path.join(root, "include")
    umbrella = os.path.join(include_dir, "graphmoe", "graphmoe.hpp")
    if not os.path.exists(umbrella):
        return []
    with open(umbrella, encoding="utf-8") as f:
        comment = "".join(l[2:] for l in f if l.startswith("//"))
    m = re.search(r"Not included:(.*?)\.\s*(?:\n\s*\n|$)", comment, re.S)
    if not m:
        return ["include/graphmoe/graphmoe.hpp: no \"Not included: ...\" list in its comment"]
    listed = set(re.findall(r"graphmoe/[\w/]+\.(?:hpp|cuh)", m.group(1)))
    public = set()
    for dirpath, _, files in os.walk(os.path.join(include_dir, "graphmoe")):
        for f in files:
            h = os.path.relpath(os.path.join(dirpath, f), include_dir).replace(os.sep, "/")
            if f.endswith((".hpp", ".cuh")) and "/detail/" not in h:
                public.add(h)
    reached = header_closure(include_dir, "graphmoe/graphmoe.hpp")
    errors = [f"include/graphmoe/graphmoe.hpp: lists {h} as not included, and it is"
              for h in sorted(listed & reached)]
    errors += [f"include/graphmoe/graphmoe.hpp: lists {h}, which does not exist"
               for h in sorted(listed - public)]
    covered = set().union(*(header_closure(include_dir, h) for h in listed)) if listed else set()
    errors += [f"include/graphmoe/graphmoe.hpp: leaves out {h} without listing it"
               for h in sorted(public - reached - covered)]
    return errors


def check_limits(root):
    errors = []
    for path, limit in (("README.md", 250), ("docs/benchmarks.md", 400)):
        if not os.path.exists(os.path.join(root, path)):
            continue
        with open(os.path.join(root, path), encoding="utf-8") as f:
            count = sum(1 for _ in f)
        if count > limit:
            errors.append(f"{path}:{count}: {count} lines, at most {limit}")
    return errors


def check_history(root):
    errors = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith("build"))
        for f in sorted(filenames):
            path = os.path.join(dirpath, f)
            try:
                with open(path, encoding="utf-8") as fh:
                    words = f != "CHANGELOG.md" and not rel(root, path).startswith("tests" + os.sep)
                    for n, line in enumerate(fh, 1):
                        m = HISTORY.search(line) or (words and HISTORY_WORDS.search(line))
                        if m:
                            errors.append(f"{rel(root, path)}:{n}: \"{m.group(0)}\": describe "
                                          "what the code does, not when or in which work item")
            except (UnicodeDecodeError, OSError):
                continue
    return errors


def extract_cpp(root, outdir):
    os.makedirs(outdir, exist_ok=True)
    blocks, current = [], None
    for _, line, code, lang in lines_of(os.path.join(root, "README.md")):
        if code and lang in ("cpp", "c++"):
            if current is None:
                current = []
                blocks.append(current)
            current.append(line)
        else:
            current = None
    for i, block in enumerate(blocks, 1):
        text = "\n".join(block) + "\n"
        path = os.path.join(outdir, f"readme_block_{i}.cpp")
        old = open(path).read() if os.path.exists(path) else None
        if old != text:  # rewrite only on change, so the build does not recompile
            with open(path, "w") as f:
                f.write(text)
        kind = "run" if re.search(r"\bint\s+main\s*\(", text) else "compile"
        print(f"{i} {kind}")
    return []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=DEFAULT_ROOT)
    ap.add_argument("check", choices=["paths", "links", "flags", "limits", "history", "claims",
                                      "extract-cpp"])
    ap.add_argument("args", nargs="*")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    if a.check == "paths":
        errors = check_paths(root)
    elif a.check == "links":
        errors = check_links(root)
    elif a.check == "flags":
        errors = check_flags(root, a.args)
    elif a.check == "limits":
        errors = check_limits(root)
    elif a.check == "history":
        errors = check_history(root)
    elif a.check == "claims":
        errors = check_claims(root) + check_umbrella(root)
    else:
        errors = extract_cpp(root, a.args[0])
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} problem(s)")
        return 1
    if a.check not in ("flags", "extract-cpp"):
        print(f"{a.check}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
