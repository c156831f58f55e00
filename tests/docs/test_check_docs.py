#!/usr/bin/env python3
"""Each check of check_docs.py and scripts/program-reference.py fails on a small broken tree and
passes on its mended copy, so a check that stopped finding anything would fail here."""
import os
import stat
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "check_docs.py")
REFERENCE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "program-reference.py")
failures = []


def tree(files):
    root = tempfile.mkdtemp(prefix="check_docs_")
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
        if path.endswith(".sh"):
            os.chmod(full, os.stat(full).st_mode | stat.S_IXUSR)
    return root


def expect(what, args, status, needle=""):
    out = subprocess.run([sys.executable] + args, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != status or needle not in text:
        failures.append(f"{what}: exit {out.returncode} (want {status}), output:\n{text}")


HELP = "#!/bin/sh\nprintf 'Usage: prog [OPTIONS]\\n\\nOptions:\\n  -h,--help   help\\n  --steps INT  steps\\n'\n"
GOOD = {
    "README.md": "# T\n\nSee `docs/a.md`, `core/x.hpp` and [a](docs/a.md#part-one).\n\n"
                 "```sh\nprog --steps 3\n```\n",
    "docs/a.md": "# A\n\n## Part one\n\n[back](../README.md) [self](#a)\n",
    "include/graphmoe/core/x.hpp": "",
    "bin/prog.sh": HELP,
}


def variant(**changes):
    files = dict(GOOD)
    files.update(changes)
    return tree(files)


good = tree(GOOD)
prog = os.path.join(good, "bin", "prog.sh")
for check in ("paths", "links", "limits", "history"):  # claims: below, with its CMake files
    expect(f"{check} on a good tree", [CHECK, "--root", good, check], 0)
expect("flags on a good tree", [CHECK, "--root", good, "flags", f"prog={prog}"], 0, "1 flags")

bad = variant(**{"README.md": GOOD["README.md"].replace("core/x.hpp", "core/y.hpp")})
expect("paths: a missing header", [CHECK, "--root", bad, "paths"], 1, "core/y.hpp")
bad = variant(**{"README.md": GOOD["README.md"].replace("docs/a.md`", "docs/b.md`")})
expect("paths: a missing page", [CHECK, "--root", bad, "paths"], 1, "docs/b.md")
bad = variant(**{"README.md": GOOD["README.md"].replace("(docs/a.md#part-one)", "(docs/c.md)")})
expect("links: a missing file", [CHECK, "--root", bad, "links"], 1, "docs/c.md")
bad = variant(**{"README.md": GOOD["README.md"].replace("#part-one", "#part-two")})
expect("links: a missing anchor", [CHECK, "--root", bad, "links"], 1, "#part-two")
bad = variant(**{"docs/a.md": GOOD["docs/a.md"].replace("(#a)", "(#b)")})
expect("links: a missing anchor in the page", [CHECK, "--root", bad, "links"], 1, "#b")
bad = variant(**{"README.md": GOOD["README.md"].replace("--steps 3", "--steps 3 --stpes 4")})
expect("flags: a flag the program lacks",
       [CHECK, "--root", bad, "flags", f"prog={os.path.join(bad, 'bin', 'prog.sh')}"], 1, "--stpes")
bad = variant(**{"docs/a.md": "<!-- docs-check: flags prog not --other -->\n" + GOOD["docs/a.md"]
                 + "Use `--steps` and `--other`.\n"})
expect("flags: a page's declared program, a known flag",
       [CHECK, "--root", bad, "flags", f"prog={os.path.join(bad, 'bin', 'prog.sh')}"], 0, "2 flags")
bad = variant(**{"docs/a.md": "<!-- docs-check: flags prog -->\n" + GOOD["docs/a.md"]
                 + "Use `--stepz`.\n"})
expect("flags: a page's declared program, a flag it lacks",
       [CHECK, "--root", bad, "flags", f"prog={os.path.join(bad, 'bin', 'prog.sh')}"], 1, "--stepz")
bad = variant(**{"README.md": GOOD["README.md"] + "x\n" * 260})
expect("limits: a long README", [CHECK, "--root", bad, "limits"], 1, "at most 250")
bad = variant(**{"docs/a.md": GOOD["docs/a.md"] + "Done in sess" + "ion 3.\n"})
expect("history: a session number", [CHECK, "--root", bad, "history"], 1, "docs/a.md:6")
bad = variant(**{"docs/a.md": GOOD["docs/a.md"] + "int f() { return 0; }\n"})
expect("history: `return 0` is no history", [CHECK, "--root", bad, "history"], 0)
bad = variant(**{"docs/a.md": GOOD["docs/a.md"] + "It is checked as before.\n"})
expect("history: 'as before' in a page", [CHECK, "--root", bad, "history"], 1, "docs/a.md:6")
bad = variant(**{"tests/t.cpp": "// the same weights as before the NaN\n",
                 "CHANGELOG.md": "# Changelog\n\nThe reader no longer crashes.\n"})
expect("history: the words in a test and in CHANGELOG.md", [CHECK, "--root", bad, "history"], 0)

# claims: the router counts against examples/CMakeLists.txt and cmake/ci.cmake.
ROUTERS = {"examples/CMakeLists.txt": "set(_graphmoe_all_routers A B\n    C D)\n",
           "cmake/ci.cmake": 'set(GRAPHMOE_EXAMPLE_ROUTERS "A;B"\n    CACHE STRING "x")\n'}
ok = variant(**ROUTERS, **{"docs/a.md": GOOD["docs/a.md"] + "Pick any of the four routers; "
                           "CI builds 2 of the 4 routers (`cmake/ci.cmake` keeps two).\n"})
expect("claims: true counts", [CHECK, "--root", ok, "claims"], 0)
for wrong in ("any of the nine routers", "3 of the 4 routers", "`cmake/ci.cmake` keeps three",
              "Leave it out to build all nine."):
    bad = variant(**ROUTERS, **{"docs/a.md": GOOD["docs/a.md"] + wrong + "\n"})
    expect(f"claims: '{wrong}'", [CHECK, "--root", bad, "claims"], 1, "docs/a.md:6")

# claims: the umbrella header's "Not included:" list against what it reaches.
UMBRELLA = "// the umbrella\n// Not included: graphmoe/b.hpp.\n//\n#include \"graphmoe/core/x.hpp\"\n"
ok = variant(**ROUTERS, **{"include/graphmoe/graphmoe.hpp": UMBRELLA, "include/graphmoe/b.hpp": ""})
expect("claims: the umbrella's list is true", [CHECK, "--root", ok, "claims"], 0)
bad = variant(**ROUTERS, **{"include/graphmoe/graphmoe.hpp": UMBRELLA, "include/graphmoe/b.hpp": "",
                            "include/graphmoe/c.hpp": ""})
expect("claims: a header the umbrella leaves out unlisted", [CHECK, "--root", bad, "claims"], 1,
       "leaves out graphmoe/c.hpp")
bad = variant(**ROUTERS, **{"include/graphmoe/graphmoe.hpp": UMBRELLA.replace("b.hpp", "core/x.hpp"),
                            "include/graphmoe/b.hpp": ""})
expect("claims: a listed header the umbrella includes", [CHECK, "--root", bad, "claims"], 1,
       "lists graphmoe/core/x.hpp as not included")

# flags: a default a page states against --help's.
for value, status in (("3", 0), ("5", 1)):
    t = variant(**{"bin/prog.sh": HELP.replace("--steps INT  steps", "--steps INT:[1, 9]=3  steps"),
                   "docs/a.md": "<!-- docs-check: flags prog -->\n" + GOOD["docs/a.md"]
                   + f"- `--steps` sets the steps (default {value}).\n"})
    expect(f"flags: a stated default of {value}",
           [CHECK, "--root", t, "flags", f"prog={os.path.join(t, 'bin', 'prog.sh')}"], status,
           "" if status == 0 else "the default is 5, prog --help says 3")

# scripts/program-reference.py: a page written from one --help, checked against another.
programs = [f"{p}={prog}" for p in ("train_lm", "generate", "routing_report", "train_vision",
                                     "finetune_classifier")]
page = os.path.join(good, "programs.md")
args = [a for p in programs for a in ("--program", p)]
expect("program-reference: write", [REFERENCE, "--page", page] + args, 0)
expect("program-reference: the page matches", [REFERENCE, "--page", page, "--check"] + args, 0)
other = variant(**{"bin/prog.sh": HELP.replace("--steps INT", "--epochs INT")})
other_prog = os.path.join(other, "bin", "prog.sh")
other_args = [a for p in programs for a in ("--program", p.split("=")[0] + "=" + other_prog)]
expect("program-reference: a renamed flag", [REFERENCE, "--page", page, "--check"] + other_args, 1,
       "has --epochs, the page does not list it")

for f in failures:
    print("FAILED:", f)
print(f"{len(failures)} failure(s)" if failures else "every check fails on its broken tree")
sys.exit(1 if failures else 0)
