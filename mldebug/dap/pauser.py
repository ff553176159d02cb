"""The DAP pauser: a NaN/Inf/assertion stop becomes a debugpy stop in the user's frame.

`DapPauser(session)` is installed as `session.pauser` in DAP mode. Called by the session
from inside the op (the watch's hook is still on the stack, so every local of the user's
code is alive), it hands debugpy a `NonFiniteError(stop.message)` with a traceback whose
innermost frame is the user's frame, via `debugpy.trigger_exception_handler(...,
as_uncaught=False)`. pydevd then suspends the thread "on an unhandled exception" at that
frame: the client gets `stopped` (reason `exception`), `stackTrace` starts at the user's
line, `exceptionInfo` carries the message, and Continue returns here and the program goes
on. No exception is ever raised into the user's program.

Why not `debugpy.breakpoint()`: it stops at the frame after the call, which is inside
mldebug/torch, and under `justMyCode` such frames are skipped, so nothing stops.
"""
from __future__ import annotations

import sys
import types
from types import FrameType
from typing import Optional

from ..core import errors as _errors
from ..core import frames as _frames
from ..core.quiet import watch_suspended
from .pydevd_api import client_connected, send_event


def _exception_type(reason: str) -> type:
    """The exception class shown in the client's exception widget for a stop REASON."""
    if reason in ("nan", "inf"):
        return _errors.NonFiniteError
    name = {"assertion": "AssertionViolation"}.get(reason, "")
    return getattr(_errors, name, None) or _errors.MLDebugError


def traceback_to(frame: FrameType) -> types.TracebackType:
    """A traceback of the whole live call stack whose innermost entry is FRAME, so the
    client's stack is what a breakpoint at FRAME's current line would show (its
    `justMyCode` hides library frames as usual)."""
    chain = []
    f = frame
    while f is not None:
        chain.append(f)
        f = f.f_back
    tb = None
    for f in chain:   # innermost first: each new entry wraps the previous as tb_next
        tb = types.TracebackType(tb, f, f.f_lasti, f.f_lineno)
    return tb


class DapPauser:
    """`session.pauser` under debugpy: pause(stop, frame) blocks until the client
    continues (or returns at once when no client is attached: the stop is printed)."""

    def __init__(self, session):
        self.session = session
        self.current = None          # the Stop being shown, for the panel
        self.pauses = 0
        # the client hears of every stop (its panel's banner), as the report and the view
        # do: a session listener, also for stops no one pauses for
        session.add_listener(self._tell_client)

    @staticmethod
    def _tell_client(stop) -> None:
        if client_connected():
            send_event("mldebug.stop", {"stop": stop.to_dict()})

    def __call__(self, stop, frame: Optional[FrameType]) -> None:
        if frame is None:
            frame = _frames.caller_user_frame(1) or sys._getframe(1)
        if not client_connected():
            print(f"{stop.tag}mldebug: stop: {stop.message} (no debugger client attached)",
                  file=self.session.out, flush=True)
            return
        exc_type = _exception_type(stop.reason)
        exc = exc_type(stop.message)
        exc.stop = stop
        exc.violation = stop.violation
        tb = traceback_to(frame)
        self.current = stop
        self.pauses += 1
        try:
            with watch_suspended():
                import debugpy
                debugpy.trigger_exception_handler((exc_type, exc, tb), as_uncaught=False)
        except Exception as error:  # noqa: BLE001 - a failed pause must not kill the program
            print(f"{stop.tag}mldebug: stop: {stop.message} (could not pause the debugger: "
                  f"{type(error).__name__}: {error})", file=self.session.out, flush=True)
        finally:
            self.current = None
            exc.__traceback__ = None
            del tb, exc
