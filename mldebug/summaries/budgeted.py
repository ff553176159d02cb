"""Summaries on a time budget, for front ends that must answer now (a debugger's
Variables view, a browser panel): a summary that would take longer than the UI can wait
(a 10⁸-element tensor, a large tensor with NaN) is computed on a worker thread that
pydevd neither traces nor suspends, and given as its header
(`tensor[10000, 10000] f32 n=100000000 (381Mb) stats: computing…`) until it is ready;
then every `on_late` callback runs (the DAP front end asks its client to look again).

Public names
    is_tensor(x) -> bool            torch tensor or numpy array (never imports either)
    summary_within(x, budget) -> (TensorSummary, ready: bool)
    header(x) -> TensorSummary      only what costs nothing (shape, dtype, size)
    on_late: list of callables      run when a summary someone gave up on is ready
"""
from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from typing import Any, Optional

from ..core.quiet import watch_suspended
from ..core.threads import hide_from_debugger
from .compute import summary
from .slicing import is_tensor  # noqa: F401 - part of this module's face
from .tensor_summary import TensorSummary, short_dtype

on_late: list = []     # callables run (on the worker) when a late summary is ready


def _late_ready() -> None:
    for callback in list(on_late):
        try:
            callback()
        except Exception:  # noqa: BLE001 - a front end's callback never stops the worker
            pass


VALUE_BUDGET_S = 0.05        # longest a single value waits for its summary
WINDOW_S = 0.5               # ... and all values together within this window
WINDOW_BUDGET_S = 0.12
INLINE_NUMEL = 1 << 16       # summaries this small are computed on the spot
CACHE_SIZE = 64
PENDING_NOTE = "stats: computing…"


def _torch():
    return sys.modules.get("torch")


# -- cache -------------------------------------------------------------------------------
def _key(x):
    """Identity plus what changes when the data does: the version counter of a tensor, a
    fingerprint of a few elements of an array (numpy has no version counter)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        try:
            version = x._version
        except Exception:  # noqa: BLE001 - inference tensors have none
            version = None
        try:
            ptr = x.data_ptr()
        except Exception:  # noqa: BLE001 - sparse, meta, fake
            ptr = None
        return (id(x), version, ptr, tuple(x.shape), x.dtype, x.requires_grad,
                x.grad is not None and x.grad._version if x.is_leaf else None)
    try:  # 17 elements spread over the array, read in place (no copy of the whole)
        size = int(x.size)
        finger = x.flat[[i * (size - 1) // 16 for i in range(17)]].tobytes() if size else b""
    except Exception:  # noqa: BLE001
        finger = None
    return (id(x), x.__array_interface__["data"][0] if hasattr(x, "__array_interface__") else None,
            x.shape, str(x.dtype), finger)


class _Job:
    __slots__ = ("key", "ref", "value", "done", "result", "late")

    def __init__(self, key, value):
        self.key = key
        self.value = value            # strong ref until computed
        self.done = threading.Event()
        self.result = None
        self.late = False             # someone gave up waiting: tell the client when ready


_lock = threading.Lock()
_cache: "dict[Any, tuple]" = {}          # key -> (weakref or None, TensorSummary)
_jobs: "dict[Any, _Job]" = {}
_queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
_worker: Optional[threading.Thread] = None
_window = [0.0, 0.0]                     # [start, spent]
_closing = threading.Event()


def _cached(key, x):
    entry = _cache.get(key)
    if entry is None:
        return None
    ref, result = entry
    if ref is not None and ref() is not x:
        return None
    return result


def _store(key, x, result):
    try:
        ref = weakref.ref(x)
    except TypeError:
        ref = None
    with _lock:
        if len(_cache) >= CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = (ref, result)


def _summarize(x, quiet: bool = True):
    """summary(x); QUIET (on the paused thread) with the watch suspended. The worker
    thread never suspends it: the watch's mode is per thread and the worker has none,
    while suspending would blind the watch for the program, which may be running."""
    if not quiet:
        return summary(x)
    with watch_suspended():
        return summary(x)


def _ensure_worker() -> None:
    global _worker
    if _worker is not None and _worker.is_alive():
        return

    _worker = hide_from_debugger(threading.Thread(target=_work, name="mldebug-summaries",
                                                  daemon=True))
    _worker.start()
    atexit.register(_drain)


def _drain() -> None:
    """At exit: drop waiting jobs and let the running one finish. A daemon thread still
    inside a torch kernel when the interpreter tears down aborts the process."""
    _closing.set()
    while True:
        try:
            _queue.get_nowait().done.set()
        except queue.Empty:
            break
    _queue.put(None)
    if _worker is not None:
        _worker.join(timeout=60)


def _work() -> None:
    while True:
        job = _queue.get()
        if job is None or _closing.is_set():
            return
        try:
            result = _summarize(job.value, quiet=False)
            _store(job.key, job.value, result)
            job.result = result
        except Exception:  # noqa: BLE001 - summary never raises; belt and braces
            job.result = None
        finally:
            job.value = None
            with _lock:
                _jobs.pop(job.key, None)
            job.done.set()
        if job.late:
            _late_ready()


def _allowance(budget: float) -> float:
    now = time.monotonic()
    if now - _window[0] > WINDOW_S:
        _window[0], _window[1] = now, 0.0
    return max(0.0, min(budget, WINDOW_BUDGET_S - _window[1]))


def summary_within(x, budget: float = VALUE_BUDGET_S):
    """(summary, True) when ready within BUDGET seconds, else (header-only summary, False)
    while the full one is computed in the background."""
    key = _key(x)
    result = _cached(key, x)
    if result is not None:
        return result, True
    numel = _numel(x)
    if numel is not None and numel <= INLINE_NUMEL:
        result = _summarize(x)
        _store(key, x, result)
        return result, True
    with _lock:
        job = _jobs.get(key)
        if job is None:
            job = _jobs[key] = _Job(key, x)
            _queue.put(job)
    _ensure_worker()
    allowed = _allowance(budget)
    started = time.monotonic()
    job.done.wait(allowed)
    _window[1] += time.monotonic() - started
    if job.done.is_set() and job.result is not None:
        return job.result, True
    job.late = True
    return header(x), False


def _numel(x) -> Optional[int]:
    try:
        return int(x.numel()) if hasattr(x, "numel") else int(x.size)
    except Exception:  # noqa: BLE001
        return None


def header(x):
    """A TensorSummary with only what costs nothing: kind, shape, dtype, device, size."""
    torch = _torch()
    try:
        if torch is not None and isinstance(x, torch.Tensor):
            return TensorSummary(kind="tensor", shape=tuple(x.shape), dtype=short_dtype(x.dtype),
                                 device=str(x.device), requires_grad=x.requires_grad,
                                 grad_fn=type(x.grad_fn).__name__ if x.grad_fn is not None else None,
                                 numel=x.numel(), nbytes=x.numel() * x.element_size(),
                                 note=PENDING_NOTE)
        return TensorSummary(kind="ndarray", shape=tuple(x.shape), dtype=short_dtype(x.dtype),
                             numel=int(x.size), nbytes=int(x.nbytes), note=PENDING_NOTE)
    except Exception as exc:  # noqa: BLE001
        return TensorSummary(kind=type(x).__name__, note=f"unavailable: {exc}")
