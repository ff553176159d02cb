"""While `torch.jit.trace` runs the program's module or function, mldebug looks away.

The tracer records every torch op that runs while it traces, mldebug's too: the watch's
device read and the assertions' checks entered the traced graph (which then differed
between the tracer's runs: `TracingCheckError`; a segfault inside `trace_module` once
a scripted module existed), and their host reads warned (`TracerWarning`). Each part of
mldebug that hooks the program registers here (`add(owner)`); while one is registered,
`torch.jit.trace` and `torch.jit.trace_module` run under `quiet.own_work` and
`quiet.watch_off` (the watch suspended and its dispatch mode off the stack: the trace
checker's ops do not pass through a mode; the graph capture and the assertions' hooks
quiet; autograd as it is). What the traced module computes when the program calls it
afterwards is watched as any call.
"""
from __future__ import annotations

import functools

import torch

from .quiet import own_work, watch_off

_NAMES = ("trace", "trace_module")
_ORIG: dict = {}          # name -> torch.jit's function while wrapped
_OWNERS: list = []


def _quiet(fn):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with own_work(keep_grad=True), watch_off():
            return fn(*args, **kwargs)
    traced.__mldebug_wrapped__ = fn
    return traced


def add(owner) -> None:
    """OWNER hooks the program: wrap torch.jit's tracing functions (once)."""
    if owner in _OWNERS:
        return
    _OWNERS.append(owner)
    if not _ORIG:
        for name in _NAMES:
            fn = getattr(torch.jit, name, None)
            if fn is not None:
                _ORIG[name] = fn
                setattr(torch.jit, name, _quiet(fn))


def remove(owner) -> None:
    """OWNER stopped; the originals come back when none is left (a function rebound
    since by someone else stays as it is)."""
    if owner in _OWNERS:
        _OWNERS.remove(owner)
    if _OWNERS or not _ORIG:
        return
    for name, fn in list(_ORIG.items()):
        if getattr(getattr(torch.jit, name, None), "__mldebug_wrapped__", None) is fn:
            setattr(torch.jit, name, fn)
    _ORIG.clear()
