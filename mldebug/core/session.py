"""The session: the mailbox the engines post their findings to.

An engine (watch, assertions, graph scan) calls `session.on_violation(violation)`; the
session turns it into the one `Stop` record, tells its stop listeners (the --report
writer, the browser view's hub, ...), ends a --batch run, or asks the front end that
filled the pause slot to pause. The session never imports a front end: the front end
that starts fills `session.pauser` (the CLI's prompt, the DAP pauser), and where none
did (a plain `with mldebug.watch():` script) the factory registered by the package
(`Session.default_pauser`, set in mldebug/__init__.py) picks one.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import FrameType
from typing import Callable, Optional

from . import user_files
from .break_on import DEFAULT_BREAK_ON
from .ranks import expand_rank, this_rank
from .records import BatchStop, Stop, Violation

Pauser = Callable[[Stop, Optional[FrameType]], None]
StopListener = Callable[[Stop], None]


class ReportWriter:
    """A stop listener: appends every stop to PATH as one JSON line (--report).

    `{rank}` in PATH is the rank of a multi-process job (0 for one process). Each line
    is one write() to a file opened for appending, so lines of several ranks sharing a
    file never interleave."""

    def __init__(self, path: str, out=None):
        self.path = os.path.abspath(expand_rank(path))
        self.out = out or sys.stderr

    def __call__(self, stop: Stop) -> None:
        try:
            user_files.append_line(self.path, stop.to_json() + "\n")
        except OSError as exc:  # never take the user's program down for a report
            print(f"mldebug: warning: cannot write the report {self.path}: "
                  f"{exc.strerror or exc}", file=self.out, flush=True)


class Session:
    """State shared by the engines and the front ends: what to break on, who pauses,
    who listens, and the stops so far."""

    # session -> pauser, for a session no front end set up; registered by mldebug's
    # package face so that this layer imports no front end
    default_pauser: Optional[Callable[["Session"], Pauser]] = None

    def __init__(self, break_on=DEFAULT_BREAK_ON, batch: bool = False,
                 report_path: str | None = None, out=None):
        self.break_on = frozenset(break_on)
        self.batch = batch
        self.out = out or sys.stderr
        self.stops: list[Stop] = []
        self.batch_stopped = False
        self.input_ended = False   # the prompt read end of input from a pipe (exit 3)
        self.step: Optional[int] = None
        self.allow: tuple = ()  # the watch's exemptions (--allow), kept for `watch on`
        self.exact_watch = False  # --watch exact: the per-op check everywhere
        # pause(stop, frame) -> None, blocks until the user continues; set by a front end
        self.pauser: Optional[Pauser] = None
        self.listeners: list[StopListener] = []
        # f(stop) right before the front end pauses for STOP, and f(stop, ended) when that
        # pause is over: the user continued (ended False) or ended the program from it
        # (quit, a second Ctrl-C: ended True). The other ranks of a job wait meanwhile.
        self.pause_listeners: list[StopListener] = []
        self.resume_listeners: list[Callable[[Stop, bool], None]] = []
        self.report_path = None
        if report_path:
            writer = ReportWriter(report_path, self.out)
            self.report_path = writer.path
            self.listeners.append(writer)
        self._lock = threading.RLock()

    # -- the record of stops ---------------------------------------------------------
    @property
    def last_violation(self) -> Optional[Violation]:
        """The engine's finding behind the latest NaN/Inf/assertion stop."""
        for stop in reversed(self.stops):
            if stop.violation is not None:
                return stop.violation
        return None

    def record(self, stop: Stop) -> None:
        """Keep STOP and tell every listener; a listener that fails is skipped."""
        if stop.rank is None:
            info = this_rank()
            if info is not None:
                stop.rank, stop.local_rank = info.rank, info.local_rank
                stop.world_size, stop.host = info.world_size, info.host
        with self._lock:
            self.stops.append(stop)
            for listener in list(self.listeners):
                try:
                    listener(stop)
                except Exception as exc:  # noqa: BLE001 - a listener never ends the program
                    print(f"mldebug: warning: a stop listener failed: "
                          f"{type(exc).__name__}: {exc}", file=self.out, flush=True)

    def add_listener(self, listener: StopListener) -> StopListener:
        self.listeners.append(listener)
        return listener

    def remove_listener(self, listener: StopListener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def wants(self, reason: str) -> bool:
        key = {"assertion": "assert"}.get(reason, reason)
        return key in self.break_on

    # -- stopping --------------------------------------------------------------------
    def stop(self, stop: Stop, frame: Optional[FrameType]) -> None:
        """Record a stop and pause the active front end (or end the run in batch mode)."""
        self.record(stop)
        if self.batch:
            print(f"{stop.tag}mldebug: stop: {stop.message}", file=self.out, flush=True)
            if stop.reason != "breakpoint":
                self.batch_stopped = True
                raise BatchStop(stop.message)
            return
        if self.pauser is None and Session.default_pauser is not None:
            self.pauser = Session.default_pauser(self)
        if self.pauser is None:
            print(f"{stop.tag}mldebug: stop: {stop.message} (no front end to pause in)",
                  file=self.out, flush=True)
            return
        for listener in list(self.pause_listeners):
            listener(stop)
        try:
            self.pauser(stop, frame)
        except BaseException:
            self._resumed(stop, ended=True)
            raise
        self._resumed(stop, ended=False)

    def pause_after_end(self, stop: Stop, pause: Callable[[], None]) -> None:
        """A pause that stop() does not make: the post-mortem prompt of a program that
        has ended. The pause listeners hear of it as of any pause (the other ranks of a
        job hold, one prompt at a time on a terminal), the resume listeners of its end,
        always as ending the program."""
        for listener in list(self.pause_listeners):
            listener(stop)
        try:
            pause()
        finally:
            self._resumed(stop, ended=True)

    def _resumed(self, stop: Stop, ended: bool) -> None:
        for listener in list(self.resume_listeners):
            try:
                listener(stop, ended)
            except Exception as exc:  # noqa: BLE001 - a listener never ends the program
                print(f"mldebug: warning: a resume listener failed: "
                      f"{type(exc).__name__}: {exc}", file=self.out, flush=True)

    def on_violation(self, violation: Violation) -> None:
        """Called by an engine (inside the op) when it found a violation worth a stop."""
        if violation.step is None:
            violation.step = self.step
        self.stop(Stop.from_violation(violation), violation.frame)


# -- a stop on its way ------------------------------------------------------------------
_pinning = 0                     # engines at work between a finding and its stop
_pinned = threading.Condition()


@contextlib.contextmanager
def pinning():
    """Around an engine's work between a cheap check that found a NaN/Inf and the stop
    it may report (the re-run that pins the op): another rank's stop heard meanwhile
    waits for this one (`wait_pinned`) rather than ending this rank with a `peer_stop`
    that would hide what it found (a NaN that reached it through a collective)."""
    global _pinning
    with _pinned:
        _pinning += 1
    try:
        yield
    finally:
        with _pinned:
            _pinning -= 1
            _pinned.notify_all()


def wait_pinned(timeout: float) -> None:
    """Return once no engine is pinning a finding (or after TIMEOUT seconds)."""
    with _pinned:
        _pinned.wait_for(lambda: _pinning == 0, timeout)


_current: Optional[Session] = None


def current() -> Session:
    """The process's session, created with defaults when none was configured."""
    global _current
    if _current is None:
        _current = Session()
    return _current


def current_if_any() -> Optional[Session]:
    """The process's session when one exists (a panel asking must not create one)."""
    return _current


def install(session: Session) -> Session:
    global _current
    _current = session
    return session
