"""The watch's read before an exception is reported.

On a device the watch judges what it holds at its next read (a training step's, a model
call's end). A NaN can turn into an exception before that read: `Categorical(probs=p)`'s
check of a NaN row raises ValueError, `torch.multinomial` raises "probability tensor
contains either inf, nan or element < 0", an `assert torch.isfinite(...)` fails. On the
CPU the NaN's own stop comes first, at the line that made it; reported as it happens on
a device, the exception would come first and the NaN second, or never.

So every place that reports an exception (the CLI's uncaught exception and post-mortem,
`pytest --mldebug`'s failure, a notebook cell's error, the framework callbacks, a
`with mldebug.watch():` block) first calls `read_before_exception(exc)`: what the watch
holds is judged, and a stop found is the first stop, at its origin, paused in the
innermost user frame of the exception's traceback (its locals are there), its message
naming the exception as what it led to (`then: ValueError: ... at policy.py:9`). The
exception itself is reported after, if the user continues.
"""
from __future__ import annotations

import os
from ..core import frames as _frames

MAX_TEXT = 120      # characters of the exception's message in the stop's `then`


def led_to(exc: BaseException, frame) -> str:
    """'ValueError: Expected parameter probs ... at policy.py:9': the first line of EXC's
    message, cut short, and where it was raised."""
    try:
        lines = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001 - a user's __str__ that raises
        lines = []
    detail = lines[0] if lines else ""
    if len(detail) > MAX_TEXT:
        detail = detail[:MAX_TEXT - 3].rstrip() + "..."
    text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    if frame is not None:
        text += f" at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return text


def read_before_exception(exc: BaseException, watch) -> bool:
    """Judge what WATCH holds before EXC is reported; returns whether that made a stop.
    The stop pauses (or ends a --batch run, or raises under action='raise') as any
    other: callers let what it raises go up in place of EXC. (`mldebug.watch.
    read_before_exception(exc)` asks the active watch.)"""
    if watch is None or not watch.pending or isinstance(exc, (KeyboardInterrupt,
                                                              SystemExit)):
        return False
    frame = _frames.innermost_user_frame(exc.__traceback__)
    before = len(watch.violations)
    watch._late = (frame, led_to(exc, frame))
    try:
        watch.flush()
    finally:
        watch._late = None
    return len(watch.violations) > before
