"""What a framework callback starts and stops, framework-free: the session's settings,
the graph capture with the assertions, the watch, a recording, and the framework's step
number on every stop. Under `python -m mldebug` the CLI has started the engines already:
then only what is missing is started, and the CLI's are left alone."""
from __future__ import annotations

from typing import Optional

from ..assertions.scan import AlwaysOn
from ..core import session as _session
from ..core.break_on import parse_break_on
from ..graph import active_capture
from ..record import record as _record
from ..record.recorder import active_recorder
from ..watch import active_watch, watch_session


class Wiring:
    """start(model) at the beginning of training, step(n) before each step, close() at
    the end or on an exception (idempotent)."""

    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run: Optional[str] = None,
                 break_on=None, report: Optional[str] = None):
        # a bad break_on is a clear error when the callback is made, not at the first stop
        self.break_on = parse_break_on(break_on) if break_on is not None else None
        self.watch, self.assertions, self.record = watch, assertions, record
        self.every, self.run_dir, self.run, self.report = every, run_dir, run, report
        self._started: list = []       # what this wiring started, to close in reverse
        self._session = None

    def start(self, model, step: Optional[int] = None, recording: bool = True) -> None:
        """Turn on what was asked; `recording=False` leaves the recording for
        `start_recording` (Lightning restores a checkpoint's global step after fit starts)."""
        if self._started:
            return
        session = self._session = _session.current()
        if self.break_on is not None:
            session.break_on = self.break_on
        if self.report:
            session.add_listener(_session.ReportWriter(self.report, session.out))
        session.step = step
        try:
            if active_capture() is None:       # the graph capture; the assertions on it
                self._started.append(AlwaysOn(
                    assertions=self.assertions and "assert" in session.break_on))
            if self.watch and active_watch() is None and session.break_on & {"nan", "inf",
                                                                             "inf-all"}:
                self._started.append(watch_session(session))
            if recording:
                self.start_recording(model, step)
        except BaseException:
            self.close()
            raise

    def start_recording(self, model, step: Optional[int] = None) -> None:
        if self.record and model is not None and active_recorder() is None:
            # its steps count the optimizer's steps from the framework's global step (a
            # resumed run goes on numbering where it was)
            try:
                self._started.append(_record(model, every=self.every, run_dir=self.run_dir,
                                             run=self.run, first_step=step or 0))
            except BaseException:
                self.close()
                raise

    def step(self, number: int) -> None:
        """The framework's step number: on the stops that follow (`step` in the report)."""
        if self._session is not None:
            self._session.step = number

    def close(self) -> None:
        while self._started:
            self._started.pop().close()
