"""mldebug's own tensor work is not the program's.

When mldebug computes a summary, a norm, a statistic or an assertion's check, the torch
ops it runs must not be judged by the NaN watch (a NaN in a tensor being looked at
would stop the program again, inside the look), nor captured by the graph or the
assertions' hooks, nor recorded by autograd. `own_work()` does all three; the pieces
are there for the places that need only one (`watch_suspended()`, `QUIET`).

`own_call` marks mldebug's public entry points that compute for the user (`summary`,
`describe`, the HTML repr, `trace`, `log_tensor`, `inspect`, ...): while one runs, the
watch looks away, so nothing it computes stops the program, is remembered as judged, or
joins what the watch holds for its next read. The program's own values are left as they
were: a NaN that `summary(x)` looked at still stops the program where the program itself
first uses it, as it would have without the look. It costs the watch nothing (its hot
path reads the flag it reads anyway), and only the thread the watch watches looks away:
a view's or a panel's thread computing a summary while the program runs blinds nothing.

The watch registers itself here when it starts (`watch_started`), so this bottom layer
knows the running watch without importing the engine.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

# > 0 while mldebug itself runs torch code: the graph capture and the assertions' hooks
# ignore the modules and ops run inside (a list, so readers hold the same cell)
QUIET = [0]

_watch = [None]      # the running watch (mldebug.watch.core.Watch), or None
_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id


def watch_started(watch) -> None:
    _watch[0] = watch


def watch_closed(watch) -> None:
    if _watch[0] is watch:
        _watch[0] = None


def watch_suspended():
    """The running watch's `suspended()` context, or a context that does nothing."""
    watch = _watch[0]
    return watch.suspended() if watch is not None else contextlib.nullcontext()


def _watch_on_this_thread():
    """The running watch when it watches this thread (the one it was started on, or one
    of autograd's device threads running a backward, where its mode is carried), else
    None."""
    watch = _watch[0]
    if watch is not None and (getattr(watch, "_owner", None) == _get_ident()
                              or _graph_task_id() != -1):
        return watch
    return None


def looking_away():
    """Context manager: the watch looks away on this thread (what `own_call` does, for
    an entry point that reads its caller's frame)."""
    watch = _watch_on_this_thread()
    return watch.suspended() if watch is not None else contextlib.nullcontext()


def watch_off():
    """Context manager: the watch looks away on this thread and its dispatch mode is off
    the stack (TorchScript's trace checker runs ops a mode cannot pass on)."""
    watch = _watch_on_this_thread()
    return watch._own_ops() if watch is not None else contextlib.nullcontext()


def own_call(fn):
    """Decorator of an entry point of mldebug's own computations: the watch looks away
    while it runs (on the watch's thread; elsewhere the watch sees nothing anyway)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        watch = _watch_on_this_thread() if _watch[0] is not None else None
        if watch is None:
            return fn(*args, **kwargs)
        with watch.suspended():
            return fn(*args, **kwargs)

    return call


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
        watch = _watch_on_this_thread()
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
