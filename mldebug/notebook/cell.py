"""What `%mldebug on` and `%%mldebug` do around a cell: the engines the session
describes (the graph capture with the assertions, the NaN/Inf watch) started before the
cell and closed after it, the pause of a stop inside the cell, and the post-mortem of an
uncaught exception.

Between cells nothing of mldebug is installed: `%mldebug on` starts the engines when a
cell starts (IPython's pre_run_cell event) and closes them when it ends (post_run_cell),
whatever way it ended, so an error, a stop or a KeyboardInterrupt leaves no hook, mode
or patch behind and the next cell starts afresh.

A stop in a cell: where the front end lets the kernel read input (JupyterLab, VS Code
notebooks, the IPython terminal), mldebug's prompt opens through the input box; where it
does not (nbclient, papermill: `allow_stdin` off), the cell ends with `StopInCell`, whose
message is the stop's line. Either way the session keeps the Stop: `mldebug.last_stop()`.
"""
from __future__ import annotations

import bdb
import sys
import traceback
import warnings
from typing import Optional

from .. import debugger as _debugger
from ..assertions.scan import AlwaysOn
from ..core import frames as _frames
from ..core import session as _session
from ..core.records import BatchStop, Stop
from ..watch import active_watch, read_before_exception, watch_session

NO_INPUT_NOTE = ("this front end lets the kernel read no input (allow_stdin is off), so "
                 "the cell ends here; mldebug.last_stop() has the stop, and a front end "
                 "with an input box (JupyterLab, VS Code) opens mldebug's prompt instead")


class StopInCell(BatchStop):
    """A stop ended the cell: no input box to open the prompt in, or `q` at the prompt.

    A BaseException, as the CLI's BatchStop is, so that a training loop's
    `except Exception` does not swallow it and run on past the NaN."""

    def __init__(self, stop: Stop, note: str = NO_INPUT_NOTE):
        super().__init__(f"{stop.tag}mldebug: stop: {stop.message}")
        self.stop = stop
        self.note = note

    def _render_traceback_(self) -> list:
        """IPython's traceback of this error: the cell's own frames (the user's code),
        not the watch's and torch's below them, then the stop and what happens now."""
        user = [f for f in traceback.extract_tb(self.__traceback__)
                if _frames.is_user_file(f.filename)]
        lines = ["Traceback (the cell's frames):\n"] if user else []
        lines += traceback.format_list(user)
        lines.append(f"{type(self).__name__}: {self}\n")
        lines.append(f"  ({self.note})\n")
        return [line.rstrip("\n") for chunk in lines for line in chunk.splitlines()]


def stdin_available(shell) -> bool:
    """Whether the kernel may read input for this cell: the execute request's
    allow_stdin under a Jupyter kernel, a terminal otherwise (the IPython terminal)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        return bool(getattr(kernel, "_allow_stdin", False))
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


class CellPauser:
    """The session's pauser in a notebook: mldebug's prompt through the input box, or
    StopInCell where there is none."""

    def __init__(self, shell, session: _session.Session):
        self.shell = shell
        self.session = session

    def __call__(self, stop: Stop, frame) -> None:
        if not stdin_available(self.shell):
            raise StopInCell(stop)
        debugger = _debugger.get_debugger(self.session)
        try:
            debugger.pause_at(stop, frame)
        except bdb.BdbQuit:
            raise StopInCell(stop, note="`q` at mldebug's prompt ended the cell") from None


class Engines:
    """The graph capture with the assertions and the NaN/Inf watch a session describes
    (as the CLI starts them: AlwaysOn, watch_session), for one cell; close() closes them
    and any watch the prompt started meanwhile (`watch on`)."""

    def __init__(self, session: _session.Session, watch_mode: str = "on"):
        self._started: list = []
        self._before = active_watch()
        session.exact_watch = watch_mode == "exact"
        try:
            # the graph capture first: its module hooks run before the watch's (cli.py)
            self._started.append(AlwaysOn(assertions="assert" in session.break_on))
            if watch_mode != "off" and session.break_on & {"nan", "inf", "inf-all"}:
                self._started.append(watch_session(session))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        started = self._started
        watch = active_watch()
        if watch is not None and watch is not self._before and watch not in started:
            started.append(watch)         # started at the prompt: the newest, closed first
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            while started:
                try:
                    started.pop().close()
                except (BatchStop, bdb.BdbQuit):
                    pass     # a stop in what was pending: told already


def record_exception(session: _session.Session, exc: BaseException) -> Optional[Stop]:
    """EXC, uncaught in a cell, as SESSION's stop (once: %%mldebug records it, then
    IPython's post-mortem sees it), unless it is a stop's own end, a quit or a Ctrl-C."""
    tb = exc.__traceback__
    if isinstance(exc, (BatchStop, bdb.BdbQuit, KeyboardInterrupt)) or tb is None:
        return None
    recorded = getattr(exc, "_mldebug_stop", None)
    if recorded is not None:
        return recorded
    stop = Stop.from_exception(exc, _frames.innermost_user_frame(tb))
    session.record(stop)
    try:
        exc._mldebug_stop = stop
    except AttributeError:        # an exception type with __slots__
        pass
    return stop


class PostMortem:
    """What IPython's traceback handler calls for `%pdb`-style post-mortem and `%debug`
    while `%mldebug on` holds (its `debugger_cls`): the exception becomes the session's
    stop and, where input can be read, mldebug's prompt opens at the user's innermost
    frame; IPython calls reset(), sets botframe and calls interaction(None, tb)."""

    botframe = None

    def __init__(self, shell, session: _session.Session):
        self.shell = shell
        self.session = session

    def reset(self) -> None:
        pass

    def interaction(self, frame, tb) -> None:
        exc = getattr(sys, "last_value", None)
        stop = record_exception(self.session, exc) if exc is not None else None
        if stop is None:
            return
        tb = exc.__traceback__
        if not stdin_available(self.shell):
            print(f"{stop.tag}mldebug: stop: {stop.message} (post-mortem needs an input "
                  "box: allow_stdin is off)", file=sys.stderr, flush=True)
            return
        debugger = _debugger.get_debugger(self.session)
        debugger.message(f"{stop.tag}mldebug: {stop.message}")
        debugger.message("  (post-mortem: `where`, `up`, `inspect NAME`, `why`, `q` to leave)")
        debugger._current_stop = stop
        try:
            debugger.post_mortem_at(tb)
        except bdb.BdbQuit:
            pass


def read_before(exc: BaseException) -> None:
    """Before EXC, uncaught in a watched cell, is shown: a NaN/Inf the watch still holds
    (read late, on a device) is the cell's first stop, naming EXC as what it led to
    (watch/before_exception.py). It pauses where there is an input box, else raises
    StopInCell, which the caller shows in EXC's place."""
    if isinstance(exc, Exception) and not isinstance(exc, BatchStop):
        read_before_exception(exc)


class ShowStopFirst:
    """IPython's `showtraceback` while `%mldebug on` holds: `read_before` first; a
    StopInCell it raises is the cell's error instead of the exception (its message names
    the exception). Installed on the shell instance, removed by `remove()`."""

    def __init__(self, shell):
        self.shell = shell

    def install(self) -> None:
        if self.shell.__dict__.get("showtraceback") is not self:
            self.shell.showtraceback = self

    def remove(self) -> None:
        if self.shell.__dict__.get("showtraceback") is self:
            del self.shell.showtraceback

    def __call__(self, exc_tuple=None, *args, **kwargs):
        show = type(self.shell).showtraceback.__get__(self.shell)
        value = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
        try:
            read_before(value)
        except StopInCell as stop:
            return show((StopInCell, stop, stop.__traceback__), *args, **kwargs)
        except bdb.BdbQuit:
            pass
        return show(exc_tuple, *args, **kwargs)


def untrace() -> None:
    """Stepping at the prompt (`n`, `s`) left mldebug's tracer on: the cell is over,
    and the kernel's own code is nothing to step through."""
    if isinstance(getattr(sys.gettrace(), "__self__", None), _debugger.MLCommands):
        sys.settrace(None)
