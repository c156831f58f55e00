#!/usr/bin/env python3
"""Checks that the sanitizer job's test programs include every public non-CUDA header.

    python3 scripts/sanitize-coverage.py BUILD_DIR TARGET...

BUILD_DIR is a configured build with compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS=ON);
TARGET... the executables scripts/sanitize.sh builds. Each of their translation units is run
through the compiler's preprocessor (its own command line, with -M instead of -c -o) to list the
headers it includes, directly or not.

The headers that must be covered: every include/graphmoe/**/*.hpp except those under
include/graphmoe/backend/cuda/ (the CUDA backend: nvcc, Thrust and the CUDA headers) and
graphmoe/dist/mpi.hpp (needs MPI, and LSan reports Open MPI's own allocations; its tests run
under mpiexec in the main suite: scripts/sanitize.sh); the *.cuh files are CUDA by name. test_sanitize_umbrella includes
graphmoe/graphmoe.hpp and through it every header, so it counts only for the headers it exists
for (UMBRELLA_ONLY): the others must be included by a test that runs their code.

Prints which targets include each header; exits 1, naming the headers, when one is covered by
none of the targets (add a test program that uses it to scripts/sanitize.sh's subset).
"""
import concurrent.futures
import json
import os
import pathlib
import shlex
import subprocess
import sys

UMBRELLA = "test_sanitize_umbrella"
# The umbrella include and the two headers no other test program includes (train/datasets.hpp,
# like graphmoe.hpp, only includes other headers).
UMBRELLA_ONLY = {
    "graphmoe/graphmoe.hpp",
    "graphmoe/train/datasets.hpp",
    "graphmoe/routing/registry.hpp",
    "graphmoe/train/progress.hpp",
}

# Public headers the sanitizer job does not build (see the docstring).
NOT_REQUIRED = {"graphmoe/dist/mpi.hpp"}


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    build = pathlib.Path(sys.argv[1]).resolve()
    targets = sys.argv[2:]
    root = pathlib.Path(__file__).resolve().parent.parent
    include = root / "include"
    required = sorted(
        str(p.relative_to(include))
        for p in (include / "graphmoe").rglob("*.hpp")
        if not str(p.relative_to(include)).startswith("graphmoe/backend/cuda/")
        and str(p.relative_to(include)) not in NOT_REQUIRED
    )

    db_path = build / "compile_commands.json"
    if not db_path.exists():
        print(f"sanitize-coverage: no {db_path} (configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)",
              file=sys.stderr)
        return 2
    db = json.loads(db_path.read_text())

    def output_of(entry):
        if "output" in entry:
            return entry["output"]
        args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
        return args[args.index("-o") + 1] if "-o" in args[:-1] else ""

    # The translation units of each target: entries whose object lies in CMakeFiles/<target>.dir/.
    units = []
    for target in targets:
        mine = [e for e in db if f"/CMakeFiles/{target}.dir/" in "/" + output_of(e)]
        if not mine:
            print(f"sanitize-coverage: no translation unit of '{target}' in {db_path}",
                  file=sys.stderr)
            return 2
        units += [(target, e) for e in mine]

    def headers_of(unit):
        target, entry = unit
        args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
        out, skip = [], False
        for a in args:
            if skip:
                skip = False
                continue
            if a in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
                continue
            if a in ("-c", "-MD", "-MMD"):
                continue
            out.append(a)
        out += ["-M", "-MF", "/dev/stdout"]
        res = subprocess.run(out, cwd=entry["directory"], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{target}: {entry['file']}: {res.stderr[-2000:]}")
        found = set()
        for tok in res.stdout.replace("\\\n", " ").split():
            p = pathlib.Path(os.path.normpath(os.path.join(entry["directory"], tok)))
            try:
                rel = str(p.relative_to(include))
            except ValueError:
                continue
            found.add(rel)
        return target, found

    covered = {h: [] for h in required}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for target, found in pool.map(headers_of, units):
            for h in found:
                if h not in covered:
                    continue
                if target == UMBRELLA and h not in UMBRELLA_ONLY:
                    continue
                if target not in covered[h]:
                    covered[h].append(target)

    missing = [h for h in required if not covered[h]]
    for h in required:
        print(f"  {h:45s} {', '.join(sorted(covered[h])) or 'NONE'}")
    print(f"sanitize-coverage: {len(required) - len(missing)} of {len(required)} public non-CUDA "
          f"headers included by {len(targets)} targets")
    if missing:
        print("sanitize-coverage: FAILED: no test program of the sanitizer subset includes "
              + ", ".join(missing) + " (add one to scripts/sanitize.sh)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
