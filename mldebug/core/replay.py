"""Whether the watch is re-running a module call to pin the op behind a NaN/Inf.

The watch checks module outputs cheaply and, when one is non-finite, runs the outermost
module call again under its full watch (see watch/rerun.py). The other parts of
mldebug that listen to module calls (graph capture, assertions, recording) must not see
that second run: they test `active()` first (the hooks that run for every module call
and gradient read `_depth` itself: one call fewer each).
"""
from __future__ import annotations

_depth = 0


def active() -> bool:
    return _depth > 0


class replaying:
    """Context manager: module-call listeners ignore what runs inside."""

    def __enter__(self):
        global _depth
        _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth
        _depth -= 1
        return False
