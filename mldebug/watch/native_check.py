"""The watch's NaN/Inf check of a CPU tensor without a torch op: `finite.c`'s bit test.

On the CPU the cheap check reads each root output, gradient and optimizer result as it is
made. With torch that is three ops and a host read per tensor (`detach`, `sum`, `item`):
about as many extra ops as the plain step has, or more (with MLDEBUG_NATIVE=0,
bench_watch.py's `count_ops`: +35 ops and +12 reads on the benchmark MLP's 45 ops, +676
and +226 on the CNN's 418). The kernel reads the tensor's memory once, in place,
and adds no op and no read to the step; it is exact, where a sum of finite values can
overflow to Inf and must then be counted again.

`nonfinite(t)` -> True / False for a CPU tensor the kernel can read (float64, float32,
float16, bfloat16; its values in one run of memory, in any order of its dimensions; with
memory of its own); None when it cannot (another dtype or layout, no compiler,
MLDEBUG_NATIVE=0): the caller then takes its torch path. The kernel is built on first use (mldebug/core/native.py) and checked
against torch before it is trusted; `reason()` says why it is not used.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from typing import Optional

import torch

from ..core import native as _native

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "finite.c")
_FLAGS = ("-O3", "-fPIC", "-shared")
_SYMBOLS = {torch.float64: "mld_nonfinite_f64", torch.float32: "mld_nonfinite_f32",
            torch.float16: "mld_nonfinite_f16", torch.bfloat16: "mld_nonfinite_bf16"}
_log = logging.getLogger(__name__)
_state: dict = {}       # "fns": dtype -> kernel function ({} when unusable), "reason"


def _functions() -> dict:
    try:
        return _state["fns"]
    except KeyError:
        pass
    fns, why = {}, ""
    if _native.disabled():
        why = "MLDEBUG_NATIVE=0"
    else:
        try:
            lib = _native.load(SOURCE, _FLAGS)
            for dtype, name in _SYMBOLS.items():
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
                fn.restype = ctypes.c_int
                fns[dtype] = fn
            why = _check(fns)
        except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why:
            fns = {}
    _state["fns"], _state["reason"] = fns, why
    if not fns:   # once per process: the watch goes on with its torch path
        _log.warning("the watch's C check is not used (%s): CPU tensors are checked with "
                     "a torch sum each (same stops, more ops)", why)
    return fns


def reason() -> str:
    """Why the kernel is not used ('' when it is)."""
    _functions()
    return _state["reason"]


def nonfinite(t: torch.Tensor) -> Optional[bool]:
    """Whether CPU tensor T holds a NaN or an Inf; None when the kernel cannot read it."""
    fns = _state.get("fns")
    if fns is None:
        fns = _functions()
    fn = fns.get(t.dtype)
    if fn is None:
        return None
    if not t.is_contiguous() and not _dense(t):
        return None
    ptr = _native.readable_address(t)
    if not ptr:
        return None
    return fn(ptr, t.numel()) != 0


def nonfinite_each(tensors) -> list:
    """`nonfinite` of each of TENSORS (True, False or None), in one Python call: the
    watch asks it of a step's parameters, gradients and optimizer state, a few hundred
    tensors, where a call or four each would be most of what it adds to the step.
    (`nonfinite` and `core.native.readable_address` written out in the loop.)"""
    fns = _state.get("fns")
    if fns is None:
        fns = _functions()
    plain = _native._PLAIN
    out = []
    for t in tensors:
        fn = fns.get(t.dtype)
        if fn is None or type(t) not in plain or not t.is_cpu \
                or not t.is_contiguous() and not _dense(t):
            out.append(None)
            continue
        try:
            ptr = t.data_ptr()
        except RuntimeError:          # a wrapper tensor without storage
            out.append(None)
            continue
        if not ptr or t._is_zerotensor() or t.untyped_storage().nbytes() \
                < (t.storage_offset() + t.numel()) * t.element_size():
            out.append(None)
            continue
        out.append(fn(ptr, t.numel()) != 0)
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether T's values fill one run of memory in some order of its dimensions
    (channels-last, a transposed or permuted tensor): its first value is then the lowest
    address and the run is numel() long."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _check(fns: dict) -> str:
    """'' when the kernel agrees with torch.isfinite on every dtype's edge values (the
    largest finite, denormals, signed zeros, NaN, +Inf, -Inf, at the start, inside a
    block and at the end); else what disagrees."""
    for dtype, fn in fns.items():
        info = torch.finfo(dtype)
        finite = torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 2, 1.5],
                              dtype=dtype)
        cases = [finite.repeat(1000)]
        for bad in (float("nan"), float("inf"), float("-inf")):
            for at in (0, 4100, 6999):
                x = finite.repeat(1000)
                x[at] = bad
                cases.append(x)
        for x in cases:
            if (fn(x.data_ptr(), x.numel()) != 0) != (not bool(torch.isfinite(x).all())):
                return f"the built check disagrees with torch on {dtype} (not used)"
    return ""
