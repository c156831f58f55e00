#!/usr/bin/env python3
"""tools/check_includes.py on small header trees: it passes a layered tree and fails, naming the
offending include, on each kind of violation."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "tools", "check_includes.py")


def run(tree):
    with tempfile.TemporaryDirectory() as root:
        for rel, text in tree.items():
            path = os.path.join(root, "graphmoe", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        p = subprocess.run([sys.executable, SCRIPT, root], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr


def inc(*targets):
    return "".join(f'#include "graphmoe/{t}"\n' for t in targets)


CLEAN = {
    "config.hpp": "",
    "core/tensor.hpp": inc("config.hpp"),
    "backend/cpu/gemm.hpp": inc("core/tensor.hpp"),
    "backend/cuda/gemm.cuh": inc("core/tensor.hpp"),
    "ops/gemm.hpp": inc("backend/cpu/gemm.hpp", "core/tensor.hpp"),
    "layers/linear.hpp": inc("ops/gemm.hpp"),
    "graphmoe.hpp": inc("layers/linear.hpp", "backend/cpu/gemm.hpp"),
    "cuda.cuh": inc("backend/cuda/gemm.cuh", "layers/linear.hpp"),
}

failures = []


def expect(name, tree, code, *needles):
    rc, out = run(tree)
    if rc != code or any(n not in out for n in needles):
        failures.append(f"{name}: exit {rc} (expected {code}), output:\n{out}")


expect("clean tree", CLEAN, 0, "no upward include")
expect("upward include", {**CLEAN, "core/tensor.hpp": inc("layers/linear.hpp")}, 1,
       "core/tensor.hpp:1: includes graphmoe/layers/linear.hpp: upward include")
expect("backend includes another backend",
       {**CLEAN, "backend/cuda/gemm.cuh": inc("backend/cpu/gemm.hpp")}, 1,
       "backend/cuda/gemm.cuh:1: includes graphmoe/backend/cpu/gemm.hpp", "another backend")
expect("layer includes a backend", {**CLEAN, "layers/linear.hpp": inc("backend/cpu/gemm.hpp")}, 1,
       "layers/linear.hpp:1: includes graphmoe/backend/cpu/gemm.hpp", "include the op from ops/")
expect("ops includes the CUDA backend", {**CLEAN, "ops/gemm.hpp": inc("backend/cuda/gemm.cuh")}, 1,
       "ops/gemm.hpp:1: includes graphmoe/backend/cuda/gemm.cuh")
expect("folder cycle", {**CLEAN, "ops/gemm.hpp": inc("layers/linear.hpp")}, 1,
       "folder cycle layers <-> ops")
expect("unknown folder", {**CLEAN, "extras/x.hpp": ""}, 1, "folder 'extras' has no rank")
expect("a CUDA header reaching Eigen",
       {**CLEAN, "core/eigen.hpp": "#include <Eigen/Core>\n",
        "backend/cuda/gemm.cuh": inc("core/eigen.hpp")}, 1,
       "backend/cuda/gemm.cuh: reaches Eigen through core/eigen.hpp")
expect("missing header", {**CLEAN, "layers/linear.hpp": inc("ops/nothing.hpp")}, 1,
       "no such header")
# a backend calls its own system: an op-layer function called without a backend tag first is an
# upward call; tagged calls, member calls, other namespaces' functions, declarations, comments
# and strings are not
OPS = {"ops/gemm.hpp": inc("backend/cpu/gemm.hpp", "core/tensor.hpp") +
       "namespace graphmoe {\ntemplate <class T, Backend B>\nvoid gemm(Trans ta, const Tensor<T, B>& a) {\n"
       "  gemm(B{}, ta, a);\n}\nnamespace detail {\ninline void helper(int) {}\n}  // namespace detail\n}\n"}
TAGGED = ("template <class T>\nvoid gemm(cpu, Trans ta, const Tensor<T, cpu>& a) {}\n"
          "template <class T>\nvoid experts(const Tensor<T, cpu>& a) {\n"
          "  gemm(cpu{}, Trans::N, a);  // gemm(a) in a comment\n"
          "  pool.gemm(Trans::N, a);\n  detail::gemm(a);\n  helper(3);\n"
          "  const char* s = \"gemm(a)\";\n}\n")
expect("a backend calling its own system", {**CLEAN, **OPS, "backend/cpu/gemm.hpp": inc("core/tensor.hpp") + TAGGED}, 0,
       "no untagged call from a backend into the op layer (1 op functions)")
expect("a backend calling up into the op layer",
       {**CLEAN, **OPS, "backend/cpu/gemm.hpp": inc("core/tensor.hpp") + TAGGED +
        "template <class T>\nvoid more(const Tensor<T, cpu>& a) {\n  if (true) gemm(Trans::T, a);\n"
        "  graphmoe::gemm(Trans::N, a);\n}\n"}, 1,
       "backend/cpu/gemm.hpp:14: calls gemm(Trans::T, ...) without a backend tag",
       "backend/cpu/gemm.hpp:15: calls graphmoe::gemm(Trans::N, ...) without a backend tag")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("test_check_includes: 11 cases passed")
