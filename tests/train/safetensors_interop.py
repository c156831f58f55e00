#!/usr/bin/env python3
"""Interop check between graphmoe's safetensors I/O and the real `safetensors` library.

    safetensors_interop.py check FILE   load FILE (written by graphmoe) with safetensors.numpy and
                                        safe_open; compare names, dtypes, shapes, values, metadata
    safetensors_interop.py write FILE   write the same tensors and metadata with
                                        safetensors.numpy.save_file, for graphmoe to load

Both sides build the expected content from the same rule (kept in sync with
tests/train/test_checkpoint.cpp, `interop_value`): element i (row-major) of a tensor is
    float dtypes   i * 0.5 - 1
    I32            i * 7 - 20
    I64            i * 2**33 - 5
    U8             (i * 37) % 256
BF16 is left out: numpy has no bfloat16, so safetensors.numpy cannot read or write it.
Exit status 0 when everything matches, 1 with a message on stderr otherwise.
"""
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

# name -> (safetensors dtype, numpy dtype, shape)
SPEC = {
    "model.f32": ("F32", np.float32, (2, 3)),
    "model.f64": ("F64", np.float64, (4,)),
    "model.f16": ("F16", np.float16, (3, 1, 2)),
    "model.i32": ("I32", np.int32, (3, 2)),
    "model.i64": ("I64", np.int64, (2, 2)),
    "model.u8": ("U8", np.uint8, (9,)),
    "scalar": ("F32", np.float32, ()),
    "empty": ("F64", np.float64, (0, 3)),
}
METADATA = {"format": "graphmoe", "step": "42", "unicode": "gr\u00fc\u00dfe \u2713"}


def expected(st_dtype, np_dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.int64)
    if st_dtype in ("F32", "F64", "F16"):
        v = i.astype(np.float64) * 0.5 - 1
    elif st_dtype == "I32":
        v = i * 7 - 20
    elif st_dtype == "I64":
        v = i * (1 << 33) - 5
    elif st_dtype == "U8":
        v = (i * 37) % 256
    else:
        raise ValueError(st_dtype)
    return v.astype(np_dtype).reshape(shape)


def fail(msg):
    print("safetensors_interop: " + msg, file=sys.stderr)
    sys.exit(1)


def check(path):
    tensors = load_file(path)
    if set(tensors) != set(SPEC):
        fail(f"{path}: tensor names {sorted(tensors)} != expected {sorted(SPEC)}")
    for name, (st_dtype, np_dtype, shape) in SPEC.items():
        a = tensors[name]
        if a.dtype != np.dtype(np_dtype):
            fail(f"{path}: {name} has dtype {a.dtype}, expected {np.dtype(np_dtype)}")
        if a.shape != shape:
            fail(f"{path}: {name} has shape {a.shape}, expected {shape}")
        want = expected(st_dtype, np_dtype, shape)
        if a.tobytes() != want.tobytes():
            fail(f"{path}: {name} values {a.ravel()[:8]} != expected {want.ravel()[:8]}")
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
        if meta != METADATA:
            fail(f"{path}: metadata {meta} != expected {METADATA}")
        if set(f.keys()) != set(SPEC):
            fail(f"{path}: safe_open keys {sorted(f.keys())} != expected {sorted(SPEC)}")
        a = f.get_tensor("model.f32")
        if a.tobytes() != expected("F32", np.float32, (2, 3)).tobytes():
            fail(f"{path}: safe_open model.f32 values differ")
    print(f"safetensors_interop: {path}: {len(SPEC)} tensors and metadata match")


def write(path):
    tensors = {name: expected(st, nd, shape) for name, (st, nd, shape) in SPEC.items()}
    save_file(tensors, path, metadata=METADATA)
    print(f"safetensors_interop: wrote {path}")


def main(argv):
    if len(argv) != 3 or argv[1] not in ("check", "write"):
        fail("usage: safetensors_interop.py check|write FILE")
    (check if argv[1] == "check" else write)(argv[2])


if __name__ == "__main__":
    main(sys.argv)
