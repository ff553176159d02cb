"""What mldebug's hooks need to stay out of a CUDA graph capture.

While a CUDA stream captures (`torch.cuda.graph`, `torch.cuda.make_graphed_callables`, the
trees of `torch.compile(mode="reduce-overhead")`), kernels are recorded, not run: what
they make has no values until a replay; reading a value to the host (a sync) is an error
that invalidates the program's capture; and a captured kernel that writes into memory
allocated before the capture (a recorder's copy block) writes there again at every
replay, long after that memory may belong to someone else. So every hook of mldebug
asks `capturing()` first and, while a capture is underway, returns at once: no op, no
read, no step counted, as while dynamo traces (`core.compile`); the watch only notes,
in Python, what the outermost module calls return, to check it after each replay
(`watch/graph_replays.py`). Each part says once what it does not see (`step_aside`).

The check costs one Python call where CUDA was never initialized, a driver query where
it was.
"""
from __future__ import annotations

import bdb
import functools
import threading
from typing import Callable

import torch

from .errors import MLDebugError
from .frames import warn_at_user_line

_is_initialized = torch.cuda.is_initialized
_SAID: set = set()    # the parts that said they step aside
_SAYING = threading.Lock()
# (the assertions' note: a check reads values to the host, a sync there breaks a capture)
ASSERTIONS_NOTE = ("the assertions are not checked inside it (a check reads values, and "
                   "its tensors have none until a replay)")


# How many captures are open, in any thread: begun through `CUDAGraph.capture_begin`
# (wrapped below, from this module's import: every path to a capture passes there) and not
# yet ended. While it is 0 no stream captures, and a hook knows so without a call or a
# driver query: the hot hooks read `MAYBE[0]` before they ask `step_aside`. (A capture
# begun past `torch.cuda.CUDAGraph`, by another library on torch's stream or by a future
# `torch.accelerator.Graph` for CUDA, is not seen; the tests pretend a capture by setting
# it.)
MAYBE = [0]
_COUNTING = threading.Lock()


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return MAYBE[0] > 0 and _is_initialized() and torch.cuda.is_current_stream_capturing()


def step_aside(part: str, what: str) -> bool:
    """True while this thread captures a CUDA graph; the first time for PART (a name),
    a RuntimeWarning: "mldebug: a CUDA graph is being captured: " + WHAT. Never raises
    (a warning turned into an error would break the capture it is about)."""
    if not MAYBE[0] or not capturing():
        return False
    if part not in _SAID:
        with _SAYING:                      # (autograd's device threads run hooks too)
            if part in _SAID:
                return True
            _SAID.add(part)
        try:
            warn_at_user_line(f"mldebug: a CUDA graph is being captured: {what}")
        except Exception:  # noqa: BLE001 - warnings turned into errors
            pass
    return True


# -- around a capture and its replays -----------------------------------------------------
# A capture in "global" mode (`torch.cuda.graph`'s default, and `capture_begin`'s) makes
# a sync or an allocation on ANY thread an error that breaks the program's capture. So
# what mldebug still has to read from before the capture is read first, on the
# capturing thread (`before_capture`: the recorder's writer is drained, the watch reads
# what it holds): from `torch.cuda.graph.__enter__` before it syncs and switches to its
# capture stream (a stop there leaves the program's streams as they were), and again,
# for a direct `capture_begin()`, from that (by then there is nothing left to read). A
# replay fires no hook: the watch checks what the graph's outermost module calls returned
# once it ran (`after_capture` says which graph they belong to, `before_replay` and
# `after_replay` when it runs). `CUDAGraph`'s own methods are wrapped, so
# `torch.cuda.graph`, `make_graphed_callables`, reduce-overhead's trees and a direct
# `capture_begin()` all pass through them. Installed once, at the first listener, and
# left in place (a wrapper with no listener costs a call; taken out it could leave ours
# buried under a later patch and wrap twice); no listener runs while this thread
# captures.
_LISTENERS: dict = {"before": [], "captured": [], "replaying": [], "replayed": []}
_PATCHED: list = []     # [(class, name, original)] once installed


class _Handle:
    """What `before_capture` and the others return: `remove()` takes the function back
    (as a hook's handle does)."""

    def __init__(self, event: str, fn):
        self.event, self.fn = event, fn

    def remove(self) -> None:
        listeners = _LISTENERS[self.event]
        if self.fn in listeners:
            listeners.remove(self.fn)


def before_capture(fn: Callable[[], None]) -> _Handle:
    """FN() before every CUDA graph capture begins."""
    return _listen("before", fn)


def after_capture(fn: Callable[[object], None]) -> _Handle:
    """FN(cuda_graph) after a capture ended (`capture_end` returned)."""
    return _listen("captured", fn)


def before_replay(fn: Callable[[object], None]) -> _Handle:
    """FN(cuda_graph) before each `CUDAGraph.replay()`."""
    return _listen("replaying", fn)


def after_replay(fn: Callable[[object], None]) -> _Handle:
    """FN(cuda_graph) after each `CUDAGraph.replay()`."""
    return _listen("replayed", fn)


def _listen(event: str, fn) -> _Handle:
    _install()
    _LISTENERS[event].append(fn)
    return _Handle(event, fn)


def _tell(event: str, *args) -> None:
    """The listeners of EVENT, unless this thread captures (a replay inside another
    capture: nothing of ours may run there). Their errors are swallowed (they never
    stand in the program's way), but for what a stop means to raise: the watch's
    `action='raise'`, `q` at its prompt, `--batch`'s end."""
    listeners = _LISTENERS[event]
    if not listeners or capturing():
        return
    for fn in list(listeners):
        try:
            fn(*args)
        except (MLDebugError, bdb.BdbQuit):
            raise
        except Exception:  # noqa: BLE001
            pass


def _install() -> None:
    if _PATCHED:
        return
    try:
        from torch.cuda.graphs import CUDAGraph, graph
    except Exception:  # noqa: BLE001 - a torch without CUDA graphs: nothing is captured
        return

    def wrap(cls, name, before, after):
        original = getattr(cls, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            if before:
                _tell(before, *([self] if before == "replaying" else []))
            if name == "capture_begin":
                _count(+1)
                try:
                    out = original(self, *args, **kwargs)
                except BaseException:
                    _count(-1)
                    raise
            elif name == "capture_end":
                # (counted as closed only once it returned: one that raised may not have
                # ended it, torch's stream check; one invalidated stays counted, and the
                # hooks then ask the driver, as they did before the count)
                out = original(self, *args, **kwargs)
                _count(-1)
            else:
                out = original(self, *args, **kwargs)
            if after:
                _tell(after, self)
            return out
        setattr(cls, name, wrapper)
        _PATCHED.append((cls, name, original))

    wrap(graph, "__enter__", "before", None)
    wrap(CUDAGraph, "capture_begin", "before", None)
    wrap(CUDAGraph, "capture_end", None, "captured")
    wrap(CUDAGraph, "replay", "replaying", "replayed")


def _count(change: int) -> None:
    with _COUNTING:
        MAYBE[0] = max(0, MAYBE[0] + change)


def unwrapped(name: str):
    """`CUDAGraph.<NAME>` as torch defines it, past mldebug's wrapper: for mldebug's own
    graphs (`record/block_graphs.py`), which no listener of the program's must see (the
    recorder would drain its writer before each of them, the watch read its ledger)."""
    for cls, wrapped_name, original in _PATCHED:
        if cls.__name__ == "CUDAGraph" and wrapped_name == name:
            return original
    from torch.cuda.graphs import CUDAGraph
    return getattr(CUDAGraph, name)


_install()    # (at import: a capture begun before a hook exists is counted in MAYBE too)
