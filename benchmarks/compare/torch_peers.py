"""The PyTorch installations the comparison scripts (lm_torch.py, moe_layer_torch.py) measure
against, and the machine-load bookkeeping they share.

A peer is a Python interpreter whose `import torch` works; each torch side runs as a child process
of that interpreter, so one driver compares graphmoe with several torches. Found by default, in
this order (duplicates, i.e. the same torch/__init__.py, dropped):

  /usr/bin/python3                         Debian's python3-torch (1.13)
  $GRAPHMOE_TORCH_VENV/bin/python          default ~/.cache/graphmoe/venv-torch, the current PyPI
                                           torch that scripts/install-torch-current.sh installs
  the python running the script

An interpreter that is missing or whose torch does not import is reported and skipped. Modes:
"eager", and "compiled" (the model or layer through torch.compile, default backend inductor,
which on the CPU needs a C++ compiler) where torch has torch.compile.
"""
import json
import os
import subprocess
import sys
import time

# the machine-load helpers of the GEMM report (/proc/stat and the children's CPU time)
from gemm_report import children_cpu_seconds, cpu_jiffies, other_load, wait_until_idle

DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "graphmoe", "venv-torch")


def default_pythons():
    venv = os.environ.get("GRAPHMOE_TORCH_VENV") or DEFAULT_VENV
    return ["/usr/bin/python3", os.path.join(venv, "bin", "python"), sys.executable]


class Peer:
    def __init__(self, python, version, torch_file):
        self.python, self.version, self.torch_file = python, version, torch_file
        # "2.15.0+cu132" -> "2.15.0": the local part names the wheel's CUDA, not the CPU code
        self.label = "torch-" + version.split("+")[0]
        self.has_compile = int(version.split(".")[0]) >= 2

    def modes(self, compile_too):
        return ["eager", "compiled"] if compile_too and self.has_compile else ["eager"]


def find_peers(pythons, explicit):
    """Peers among pythons; prints each one found or skipped (with why) to stderr."""
    peers, seen = [], set()
    for py in pythons:
        if not (os.path.isfile(py) and os.access(py, os.X_OK)):
            if explicit:
                print(f"torch peer {py}: skipped (no such interpreter)", file=sys.stderr)
            continue
        code = "import json, torch; print(json.dumps([torch.__version__, torch.__file__]))"
        try:
            res = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"torch peer {py}: skipped ({e})", file=sys.stderr)
            continue
        if res.returncode != 0:
            lines = res.stderr.strip().splitlines()
            print(f"torch peer {py}: skipped, torch does not import "
                  f"({lines[-1] if lines else 'exit ' + str(res.returncode)})", file=sys.stderr)
            continue
        version, torch_file = json.loads(res.stdout.strip().splitlines()[-1])
        if os.path.realpath(torch_file) in seen:
            continue
        seen.add(os.path.realpath(torch_file))
        print(f"torch peer {py}: torch {version}", file=sys.stderr)
        peer = Peer(py, version, torch_file)
        if any(q.label == peer.label for q in peers):  # the same version twice: name the python
            peer.label += f"@{py}"
        peers.append(peer)
    return peers


def add_peer_arguments(ap):
    ap.add_argument("--python", action="append", metavar="PY",
                    help="Python whose torch to compare with; repeatable (default: /usr/bin/python3, "
                         "$GRAPHMOE_TORCH_VENV/bin/python or ~/.cache/graphmoe/venv-torch/bin/python, "
                         "and this script's python, each where its torch imports)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile runs (only eager)")


def peers_from_args(args):
    peers = find_peers(args.python or default_pythons(), explicit=bool(args.python))
    if not peers:
        sys.exit("no Python with an importable torch: install Debian's python3-torch "
                 "(/usr/bin/python3) or run scripts/install-torch-current.sh, or pass --python")
    return peers


def child_env(env, mode):
    """The child's environment: compiled runs compile in the child's own process, so that the
    CPU time of Inductor's compile workers is counted as the child's, not as other load."""
    return dict(env, TORCHINDUCTOR_COMPILE_THREADS="1") if mode == "compiled" else env


def compile_or_reason(torch, fn):
    """torch.compile(fn), or (None, reason) where this torch has none."""
    if not hasattr(torch, "compile"):
        return None, f"torch {torch.__version__} has no torch.compile"
    return torch.compile(fn), None


def child_result(out):
    """The JSON object a torch child prints on its last stdout line."""
    return json.loads(out.strip().splitlines()[-1])


def error_reason(e):
    """One line naming an exception from a torch child (torch.compile's can span pages)."""
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0][:300] if first else ''}".rstrip(": ")


# ----------------------------------------------------------------------------- summary

def report_left_out(unavailable, failed):
    """Prints the torches left out of the comparison: compiled mode unavailable (label -> reason),
    or an eager run that failed (label -> error)."""
    for label, reason in unavailable.items():
        print(f"{label} compiled: unavailable ({reason})")
    for label, reason in failed.items():
        print(f"{label}: failed, not compared ({reason})")


def first_compared(peers, ratios, failed):
    """The label of the first torch found whose eager runs succeeded (in ratios): the peer of the
    single-torch summary line. Exits naming every failure when none did."""
    eager = [p.label for p in peers if p.label in ratios]
    if not eager:
        sys.exit("no torch run succeeded: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    return eager[0]


# ----------------------------------------------------------------------------- machine load

def add_load_arguments(ap):
    ap.add_argument("--max-other-load", type=float, default=0.05,
                    help="rerun a side when other processes used more than this share of CPUs")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--idle-timeout", type=float, default=300.0,
                    help="seconds to wait for a quiet moment before a rerun")
    ap.add_argument("--wait-idle", action="store_true",
                    help="wait for a quiet 2-second window before every run")


def run_measured(cmd, env, args, label):
    """Runs cmd; reruns it while other processes took more than args.max_other_load of the CPUs.
    Returns (stdout, other load fraction or None)."""
    load = None
    for attempt in range(args.retries + 1):
        if attempt > 0 or args.wait_idle:
            wait_until_idle(args.max_other_load, args.idle_timeout)
        j0, c0, t0 = cpu_jiffies(), children_cpu_seconds(), time.time()
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
        j1, c1, t1 = cpu_jiffies(), children_cpu_seconds(), time.time()
        load = other_load(j0, j1, c1 - c0, t1 - t0)
        if load is None:
            return out, None
        if load <= args.max_other_load:
            break
        print(f"  {label}: other processes used {100 * load:.0f}% of the CPUs, "
              f"{'rerunning' if attempt < args.retries else 'kept (no retries left)'}",
              file=sys.stderr)
    return out, load


def fmt_load(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def coretype_line():
    """OPENBLAS_CORETYPE as the sides see it, beside scripts/openblas-coretype.sh's advice."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                          "openblas-coretype.sh")
    try:
        advice = subprocess.run(["bash", script], capture_output=True, text=True,
                                timeout=60).stdout.strip() or "(unset: OpenBLAS's own choice)"
    except (OSError, subprocess.TimeoutExpired):
        advice = "(unknown)"
    return (f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; "
            f"scripts/openblas-coretype.sh advises {advice}")
