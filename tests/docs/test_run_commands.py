#!/usr/bin/env python3
"""run_commands.py on small trees with a stand-in train_lm: a page's command that fails as written
fails the run and is named; the small setting rewrites the flags; a router the build lacks runs as
one it has; blocks marked not run, and mpirun lines under --without mpi, are listed, not run; shell
syntax the runner cannot run is refused. A runner that stopped running anything would fail here."""
import os
import stat
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "run_commands.py")
failures = []

# The stand-in train_lm: its --help lists two routers; a run records its arguments (one per line)
# in the scratch repository's args.txt and, like the real one, refuses a command without --train.
TRAIN_LM = """#!/bin/sh
if [ "$1" = --help ]; then
  echo '  --router TEXT:{softmax,xmoe-similarity}=softmax'
  exit 0
fi
printf '%s\\n' "$@" >> args.txt
case " $* " in *" --train "*) exit 0 ;; esac
echo '--train is required' >&2
exit 106
"""


def tree(readme):
    root = tempfile.mkdtemp(prefix="run_commands_")
    files = {"README.md": readme, "build/examples/train_lm": TRAIN_LM,
             "data/wikitext-2/wiki.valid.tokens": " = Title = \n the king said \n" * 5}
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    exe = os.path.join(root, "build/examples/train_lm")
    os.chmod(exe, os.stat(exe).st_mode | stat.S_IXUSR)
    return root


def run(root, *extra):
    args = [sys.executable, RUN, "--root", root, "--build", os.path.join(root, "build"),
            "--data", os.path.join(root, "data"), "--scratch", os.path.join(root, "scratch"),
            *extra, "README.md"]
    out = subprocess.run(args, capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def args_of(root):
    path = os.path.join(root, "scratch", "repo", "args.txt")
    return open(path).read().split("\n") if os.path.exists(path) else []


def expect(what, ok, output):
    if not ok:
        failures.append(f"{what}; output:\n{output}")


GOOD = """# T

<!-- docs-check: not run: the stand-in has no such program -->
```sh
false
```

```sh
build/examples/train_lm --train ../shared/data/wikitext-2/wiki.valid.tokens --router similarity \\
    --layers 4 --steps 600 --out runs/lm   # a comment
mpirun -n 2 build/examples/train_lm --train ../shared/data/wikitext-2/wiki.valid.tokens --dp 2 --batch 8
```
"""
root = tree(GOOD)
status, out = run(root, "--without", "mpi")
expect("a good page: exit 0", status == 0, out)
expect("the marked block is listed, not run", "README.md:4: not run: the stand-in" in out, out)
expect("mpirun under --without mpi is listed, not run", "this build has no MPI" in out, out)
a = args_of(root)
for flag, value in (("--steps", "2"), ("--layers", "1"), ("--router", "xmoe-similarity"),
                    ("--batch", "2"), ("--seq", "16"), ("--out", "runs/lm")):
    expect(f"train_lm ran with {flag} {value}", flag in a and a[a.index(flag) + 1] == value, out)
expect("the comment is not an argument", "#" not in a and "comment" not in a, out)
expect("the stand-in router is said", "--router similarity runs as xmoe-similarity" in out, out)

BAD = GOOD.replace("--train ../shared/data/wikitext-2/wiki.valid.tokens --router", "--router")
root = tree(BAD)
status, out = run(root, "--without", "mpi")
expect("a command that fails as written: exit 1", status == 1, out)
expect("the failure names the page, line and message",
       "FAILED README.md:8:" in out and "exited 106" in out and "--train is required" in out, out)

root = tree("# T\n\n```sh\nbuild/examples/train_lm --train x | head\n```\n")
status, out = run(root)
expect("a pipe is refused", status == 1 and "uses shell syntax" in out, out)

for f in failures:
    print(f"FAILED {f}")
print(f"test_run_commands: {len(failures)} failures")
sys.exit(1 if failures else 0)
