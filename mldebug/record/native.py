"""`fused.c`, the recorder's one-pass statistics of a CPU tensor, built on first use.

The kernel is compiled with the machine's C compiler (`$CC`, else `cc`, `gcc` or
`clang`) into a cache folder (`$MLDEBUG_CACHE_DIR`, else `$XDG_CACHE_HOME/mldebug` or
`~/.cache/mldebug`), once per source and machine type (~0.3 s), loaded with ctypes and
checked against numpy before it is used. Without a compiler, when the build or the check
fails, or with `MLDEBUG_NATIVE=0`, `kernel()` is None and the recorder takes its torch and
numpy path instead (same statistics, slower: see benchmarks/README.md); `reason()` says
why.

The library holds no state and calls nothing back: the call releases the GIL (ctypes
does) and only reads the tensor and writes the caller's arrays.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Optional

import numpy as np
import torch

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
    if os.environ.get("MLDEBUG_NATIVE", "1").strip().lower() in ("0", "off", "no", "false"):
        why = "MLDEBUG_NATIVE=0"
    else:
        try:
            path = _library()
            try:
                lib = ctypes.CDLL(path)
            except OSError:        # a cached library this machine cannot load: build it
                lib = ctypes.CDLL(_library(rebuild=True))
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


def _compiler() -> list:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise OSError("no C compiler (cc, gcc or clang; or set CC)")


def _private(d: str) -> bool:
    """Whether D is (now) a folder of this user's that no one else may write to: a library
    found there is loaded into this process, so another user must not be able to put one
    there (a shared /tmp)."""
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022 and os.access(d, os.W_OK)
            and (not hasattr(os, "getuid") or st.st_uid == os.getuid()))


def _cache_dir() -> str:
    """$MLDEBUG_CACHE_DIR, else $XDG_CACHE_HOME/mldebug or ~/.cache/mldebug, else
    /tmp/mldebug-UID: the first that is private (`_private`); else a new private folder
    for this process only (the kernel is then built again by the next one)."""
    d = os.environ.get("MLDEBUG_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        d = os.path.join(base, "mldebug")
    user = os.getuid() if hasattr(os, "getuid") else 0
    for where in (d, os.path.join(tempfile.gettempdir(), f"mldebug-{user}")):
        if _private(where):
            return where
    return tempfile.mkdtemp(prefix="mldebug-")


def _library(rebuild: bool = False) -> str:
    """The built library's path, built now when missing or REBUILD (written under a
    temporary name and renamed: processes that build at once never see half a file). The
    cache key is the source, the flags and the machine type: a library built once serves
    every later process, with or without a compiler."""
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(),
                                     platform.machine().encode(), sys.platform.encode()]))
    path = os.path.join(_cache_dir(), f"fused-{key.hexdigest()[:16]}.so")
    if os.path.exists(path) and not rebuild:
        return path
    cc = _compiler()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        error = ""
        # target_clones needs GCC on x86-64 with ifunc support (glibc): else the baseline
        for extra in ([], ["-DMLD_NO_CLONES"]):
            run = subprocess.run(cc + list(_FLAGS) + extra + ["-o", tmp, SOURCE],
                                 capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                os.replace(tmp, path)
                return path
            lines = run.stderr.strip().splitlines()
            error = lines[-1] if lines else f"exit status {run.returncode}"
        raise OSError(f"{cc[0]} could not build {os.path.basename(SOURCE)}: {error}")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
