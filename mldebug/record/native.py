"""`fused.c`, the recorder's one-pass statistics of a CPU tensor, built on first use.

The kernel is compiled with the machine's C compiler into mldebug's cache folder once per
source and machine type (~0.3 s; mldebug/core/native.py), loaded with ctypes and
checked against numpy before it is used. Without a compiler, when the build or the check
fails, or with `MLDEBUG_NATIVE=0`, `kernel()` is None and the recorder takes its torch and
numpy path instead (same statistics, slower: see benchmarks/README.md); `reason()` says
why.

The library holds no state and calls nothing back: the call releases the GIL (ctypes
does) and only reads the tensor and writes the caller's arrays.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from typing import Optional

import numpy as np
import torch

from ..core import native as _native
from .rows import bin_rows, describe_rows

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused.c")
# -ffp-contract=off: no fused multiply-adds, so the histogram's range and bins round as
# numpy's do (`stats._histograms`), bin for bin
_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared")
_STATE: dict = {}      # "kernel": Kernel or None, "reason": why None
_log = logging.getLogger(__name__)
OUT_WIDTH = 21         # fused.c: row (9), summary (10), histogram range (2); then counts


class Kernel:
    """The loaded library: `by_dtype[dtype](x, n, chunk, norms, idx, nidx, bins, clip,
    out)` for float32 and float64 tensors, every pointer an int address (0 for none):
    OUT gets OUT_WIDTH + bins + 2 slots of 8 bytes (see `fused.c`); returns 1 when the
    tensor's sum is not finite (only its row and norms are written: it is to be counted
    again), else 0."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double,
                ctypes.c_void_p]
        self.by_dtype = {}
        for dtype, name in ((torch.float32, "mld_row_f32"), (torch.float64, "mld_row_f64")):
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self.by_dtype[dtype] = fn


def kernel() -> Optional[Kernel]:
    """The kernel, built and checked once per process; None where it cannot be."""
    try:
        return _STATE["kernel"]
    except KeyError:
        pass
    k, why = None, ""
    if _native.disabled():
        why = "MLDEBUG_NATIVE=0"
    else:
        try:
            lib = _native.load(SOURCE, _FLAGS)
            k = Kernel(lib)
            why = _check(k)
            if why:
                k = None
        except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    _STATE["kernel"], _STATE["reason"] = k, why
    if k is None:   # once per process: the recording goes on, only slower
        _log.warning("the recorder's C kernel is not used (%s): CPU statistics take the "
                     "torch path (same figures, slower)", why)
    return k


def reason() -> str:
    """Why `kernel()` is None ('' when it is not)."""
    kernel()
    return _STATE["reason"]


def _check(k: Kernel) -> str:
    """'' when the kernel agrees with numpy (`stats.describe_rows`, `stats.bin_rows`) on a
    small tensor of each dtype: row, summary, norms and histogram; else what disagrees."""
    rng = np.random.default_rng(0)
    for dtype, np_dtype in ((torch.float32, np.float32), (torch.float64, np.float64)):
        a = (rng.standard_normal(1000) * 3).astype(np_dtype)     # 10 samples of 100
        idx = np.array([0, 7, 500, 999], np.int64)
        out, norms = np.zeros(OUT_WIDTH + 7), np.zeros(10, np.float32)
        bad = k.by_dtype[dtype](a.ctypes.data, a.size, 100, norms.ctypes.data,
                                idx.ctypes.data, 4, 5, -1.0, out.ctypes.data)
        d = a.astype(np.float64)
        row = np.array([d.size, d.sum(), np.abs(d).sum(), (d * d).sum(), d.min(), d.max(),
                        0, 0, 0])
        lo, hi = d.min(keepdims=True), d.max(keepdims=True)
        ok = (bad == 0 and np.allclose(out[:9], row, rtol=1e-5, atol=1e-6)
              and np.array_equal(out[9:19], describe_rows(out[None, :9])[0])
              and np.array_equal(out[19:21], [lo[0], hi[0]])
              and np.array_equal(out[21:].view(np.int64), bin_rows(d[idx], np.array([4]),
                                                                   lo, hi, 5)[0])
              and np.allclose(norms, np.sqrt((d.reshape(10, 100) ** 2).sum(1)), rtol=1e-5))
        if not ok:
            return f"the built kernel disagrees with numpy on {dtype} (not used)"
    return ""
