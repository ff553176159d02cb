"""A stop in a run that nobody can answer a prompt for ends the run, in a few lines.

A scheduler's job, a script whose stdin is closed or a pipe: a prompt there would read
end of input at once and end the run with a `bdb.BdbQuit` traceback through every frame
of the framework's loops. `EndingPauser` is the session's pauser there (what a
framework callback with `batch=True` installs, and what a plain `mldebug.watch()` script
gets when stdin is not a terminal): it writes the stop's report line, as `--batch` does,
and raises `StopError`, which names the stop. Uncaught, that error prints the program's
own frames only (the frames of torch, of the framework and of mldebug in between say
nothing a user can act on): `sys.excepthook` renders it, for StopError alone, from the
first one raised on (every other exception goes to the hook that was there before).
"""
from __future__ import annotations

import sys
import traceback

from . import frames as _frames
from .errors import StopError

BATCH_NOTE = ("nobody can answer a prompt here (stdin is not a terminal): the run ends at "
              "its first stop")


def stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):      # closed or replaced by something odd
        return False


def prompt_answerable() -> bool:
    """Whether a prompt can be answered: stdin is a terminal, or an IPython shell runs the
    program (a notebook's kernel reads input through its front end, whatever its stdin)."""
    if stdin_is_terminal():
        return True
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and ipython.get_ipython() is not None
    except Exception:  # noqa: BLE001 - an odd IPython: not known to be one
        return False


class EndingPauser:
    """The session's pauser that ends the run: the report line on the session's stream,
    then `StopError(stop)`. HINT says how to get a prompt instead."""

    def __init__(self, session, hint: str = ""):
        self.session = session
        self.hint = hint

    def __call__(self, stop, frame) -> None:
        line = f"{stop.tag}mldebug: stop: {stop.message}"
        print(line, file=self.session.out, flush=True)
        _install_hook()
        error = StopError(line, stop)
        error.note = BATCH_NOTE + (f"; {self.hint}" if self.hint else "")
        raise error


_previous_hook = None


def _install_hook() -> None:
    global _previous_hook
    if _previous_hook is None and sys.excepthook is not _render_uncaught:
        _previous_hook = sys.excepthook
        sys.excepthook = _render_uncaught


def _render_uncaught(exc_type, exc, tb) -> None:
    if not isinstance(exc, StopError):
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    sys.stderr.write("".join(short_traceback(exc)))
    sys.stderr.flush()


def short_traceback(exc: StopError) -> list:
    """The lines an uncaught StopError prints: the program's frames of its traceback,
    the error, and the note on why the run ended."""
    user = [f for f in traceback.extract_tb(exc.__traceback__)
            if _frames.is_user_file(f.filename)]
    lines = ["Traceback (the program's frames, most recent call last):\n"] if user else []
    lines += traceback.format_list(user)
    lines.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}\n")
    note = getattr(exc, "note", "")
    if note:
        lines.append(f"  ({note})\n")
    return lines
