"""What mldebug's hooks need to stay out of a CUDA graph capture.

While a CUDA stream captures (`torch.cuda.graph`, `torch.cuda.make_graphed_callables`, the
trees of `torch.compile(mode="reduce-overhead")`), kernels are recorded, not run: what
they make has no values until a replay; reading a value to the host (a sync) is an error
that invalidates the program's capture; and a captured kernel that writes into memory
allocated before the capture (a recorder's copy block) writes there again at every
replay, long after that memory may belong to someone else. So every hook of mldebug
asks `capturing()` first and, while a capture is underway, returns at once: no op, no
read, nothing of its own changed, as while dynamo traces (`core.compile`). Each part
says once what it does not see (`step_aside`).

The check costs one Python call where CUDA was never initialized, a driver query where
it was.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

_is_initialized = torch.cuda.is_initialized
_SAID: set = set()    # the parts that said they step aside
# (the assertions' note: a check reads values to the host, a sync there breaks a capture)
ASSERTIONS_NOTE = ("the assertions are not checked inside it (a check reads values, and "
                   "its tensors have none until a replay)")


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return _is_initialized() and torch.cuda.is_current_stream_capturing()


def step_aside(part: str, what: str) -> bool:
    """True while this thread captures a CUDA graph; the first time for PART (a name),
    a RuntimeWarning: "mldebug: a CUDA graph is being captured: " + WHAT. Never raises
    (a warning turned into an error would break the capture it is about)."""
    if not capturing():
        return False
    if part not in _SAID:
        _SAID.add(part)
        try:
            warnings.warn(f"mldebug: a CUDA graph is being captured: {what}", RuntimeWarning,
                          stacklevel=3)
        except Exception:  # noqa: BLE001 - warnings turned into errors
            pass
    return True


# -- before a capture begins -------------------------------------------------------------
# `torch.cuda.graph` captures in "global" mode by default: while it does, a sync or an
# allocation on ANY thread is an error that breaks the program's capture. A thread of
# mldebug that may still be reading a step to the host (the recorder's writer) is
# drained first: `torch.cuda.graph.__enter__` runs the functions given to
# `before_capture`, on the capturing thread, before the capture begins.
_BEFORE: list = []
_PATCHED: list = []     # [(torch.cuda.graph, its __enter__)] while installed


class _Handle:
    """What `before_capture` returns: `remove()` takes the function back (as a hook's
    handle does; the last one out puts `torch.cuda.graph` back as it was)."""

    def __init__(self, fn):
        self.fn = fn

    def remove(self) -> None:
        if self.fn in _BEFORE:
            _BEFORE.remove(self.fn)
        if not _BEFORE:
            _uninstall()


def before_capture(fn: Callable[[], None]) -> _Handle:
    """Run FN before every CUDA graph capture begins (its errors are swallowed: it never
    stands in the program's way)."""
    _install()
    _BEFORE.append(fn)
    return _Handle(fn)


def _install() -> None:
    if _PATCHED:
        return
    try:
        from torch.cuda.graphs import graph
    except Exception:  # noqa: BLE001 - a torch without CUDA graphs: nothing is captured
        return
    original = graph.__enter__

    @functools.wraps(original)
    def __enter__(self):
        for fn in list(_BEFORE):
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass
        return original(self)

    graph.__enter__ = __enter__
    _PATCHED.append((graph, original))


def _uninstall() -> None:
    while _PATCHED:
        cls, original = _PATCHED.pop()
        cls.__enter__ = original
