"""mldebug's own tensor work is not the program's.

When mldebug computes a summary, a norm, a statistic or an assertion's check, the torch
ops it runs must not be judged by the NaN watch (a NaN in a tensor being looked at
would stop the program again, inside the look), nor captured by the graph or the
assertions' hooks, nor recorded by autograd. `own_work()` does all three; the pieces
are there for the places that need only one (`watch_suspended()`, `QUIET`).

The watch registers itself here when it starts (`watch_started`), so this bottom layer
knows the running watch without importing the engine.
"""
from __future__ import annotations

import contextlib

import torch

# > 0 while mldebug itself runs torch code: the graph capture and the assertions' hooks
# ignore the modules and ops run inside (a list, so readers hold the same cell)
QUIET = [0]

_watch = [None]      # the running watch (mldebug.watch.core.Watch), or None


def watch_started(watch) -> None:
    _watch[0] = watch


def watch_closed(watch) -> None:
    if _watch[0] is watch:
        _watch[0] = None


def watch_suspended():
    """The running watch's `suspended()` context, or a context that does nothing."""
    watch = _watch[0]
    return watch.suspended() if watch is not None else contextlib.nullcontext()


class own_work:
    """Context manager around mldebug's own torch work: the watch looks away, the graph
    and assertion hooks ignore it (QUIET), and, unless KEEP_GRAD, autograd records
    nothing. Cheap enough for the recorder's per-step hooks (slots; grad mode switched
    without building torch's context object)."""

    __slots__ = ("_keep_grad", "_grad", "_suspended")

    def __init__(self, keep_grad: bool = False):
        self._keep_grad = keep_grad

    def __enter__(self):
        QUIET[0] += 1
        if not self._keep_grad:
            self._grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
        watch = _watch[0]
        self._suspended = watch.suspended() if watch is not None else None
        if self._suspended is not None:
            self._suspended.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if self._suspended is not None:
                self._suspended.__exit__(*exc)
        finally:
            if not self._keep_grad:
                torch._C._set_grad_enabled(self._grad)
            QUIET[0] -= 1
        return False
