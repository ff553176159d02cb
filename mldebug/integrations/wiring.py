"""What a framework callback starts and stops, framework-free: the session's settings,
the graph capture with the assertions, the watch, a recording, and the framework's step
number on every stop. Under `python -m mldebug` the CLI has started the engines already:
then only what is missing is started, and the CLI's are left alone.

Where no front end was set up (a script the framework launched), `batch` says what a stop
does: True writes its report line and ends the fit with one `StopError` naming it
(core/batch_end.py); False opens mldebug's prompt, also on a stdin that is not a terminal
(commands piped in); None, the default, is True when stdin is not a terminal (a
scheduler's job) unless a DAP client (VS Code) is attached or an IPython kernel runs it."""
from __future__ import annotations

import bdb
import sys
import threading
from typing import Optional

from ..assertions.scan import AlwaysOn
from ..core import session as _session
from ..core.batch_end import EndingPauser, prompt_answerable, short_traceback
from ..core.errors import StopError, UsageError
from ..core.break_on import parse_break_on
from ..graph import active_capture
from ..record import record as _record
from ..record.recorder import active_recorder
from ..watch import Watch, active_watch, read_before_exception, watch_session

BATCH_HINT = "batch=False on the callback opens mldebug's prompt on stdin instead"


class Wiring:
    """start(model) at the beginning of training, step(n) before each step, close() at
    the end or on an exception (idempotent)."""

    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run: Optional[str] = None,
                 break_on=None, report: Optional[str] = None, batch: Optional[bool] = None):
        # a bad break_on is a clear error when the callback is made, not at the first stop
        self.break_on = parse_break_on(break_on) if break_on is not None else None
        if batch not in (None, True, False):
            raise UsageError(f"batch must be None, True or False, batch={batch!r}")
        self.batch = batch
        self._pauser = None            # the session's pauser this wiring set
        self.watch, self.assertions, self.record = watch, assertions, record
        self.every, self.run_dir, self.run, self.report = every, run_dir, run, report
        self._started: list = []       # what this wiring started, to close in reverse
        self._session = None
        self._uncaught = None          # its sys.excepthook (read_before_uncaught)

    def start(self, model, step: Optional[int] = None, recording: bool = True,
              to=None) -> None:
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
        self._set_pauser(session)
        try:
            if active_capture() is None:       # the graph capture; the assertions on it
                self._started.append(AlwaysOn(
                    assertions=self.assertions and "assert" in session.break_on))
            if self.watch and active_watch() is None and session.break_on & {"nan", "inf",
                                                                             "inf-all"}:
                self._started.append(watch_session(session))
            if recording:
                self.start_recording(model, step, to=to)
        except BaseException:
            self.close()
            raise

    def start_recording(self, model, step: Optional[int] = None, to=None) -> None:
        """The recording, with a live copy into TO (`record(to=)`: the trainer's logger)."""
        if self.record and model is not None and active_recorder() is None:
            # its steps count the optimizer's steps from the framework's global step (a
            # resumed run goes on numbering where it was)
            try:
                self._started.append(_record(model, every=self.every, run_dir=self.run_dir,
                                             run=self.run, first_step=step or 0, to=to))
            except BaseException:
                self.close()
                raise

    def step(self, number: int) -> None:
        """The framework's step number: on the stops that follow (`step` in the report)."""
        if self._session is not None:
            self._session.step = number

    def _set_pauser(self, session) -> None:
        """What a stop does where no front end was set up (see the module's docstring)."""
        if session.pauser is not None or session.batch:
            return                          # the CLI's, a notebook's, pytest's, DAP's
        from ..dap import DapPauser, debugger_active
        batch = self.batch
        if batch is None:
            batch = not prompt_answerable() and not debugger_active()
        if batch:
            self._pauser = EndingPauser(session, hint=BATCH_HINT)
        elif self.batch is False:           # the prompt, whatever stdin is
            if debugger_active():
                self._pauser = DapPauser(session)
            else:
                from ..debugger import get_debugger
                self._pauser = get_debugger(session).pause_at
        if self._pauser is not None:
            session.pauser = self._pauser

    def read_before(self, exc: BaseException) -> None:
        """Before the fit ends with EXC: what the watch still holds, judged first (its
        stop names EXC: watch/before_exception.py)."""
        for engine in self._started:
            if isinstance(engine, Watch):
                read_before_exception(exc, engine)

    def read_before_uncaught(self) -> None:
        """For a framework with no exception callback (Hugging Face's Trainer): an
        exception that leaves the program uncaught first has what the watch still holds
        judged (`read_before`: on a device a NaN read late is reported before the error
        it led to, as on the CPU), then what was started is closed. Through
        `sys.excepthook`, while this wiring is started, and only when it trains on the
        main thread (the hook runs for the main thread's errors: one raised there while
        training runs on another thread must not end the training's watch)."""
        if self._started and self._uncaught is None \
                and threading.current_thread() is threading.main_thread():
            self._uncaught = _BeforeUncaught(self, sys.excepthook)
            sys.excepthook = self._uncaught

    def close(self, after_error: bool = False) -> None:
        """Close what was started. AFTER_ERROR: the fit ends with an exception (a stop's
        StopError among them): what the watch still holds is not judged then (a stop
        there would hide the error the fit ends with)."""
        while self._started:
            engine = self._started.pop()
            if after_error and isinstance(engine, Watch):
                engine.close(_flush=False)
            else:
                engine.close()
        hook, self._uncaught = self._uncaught, None
        if hook is not None:
            hook.wiring = None
            if sys.excepthook is hook:
                sys.excepthook = hook.previous
        session, pauser, self._pauser = self._session, self._pauser, None
        if pauser is not None and session is not None and session.pauser is pauser:
            session.pauser = None


class _BeforeUncaught:
    """`sys.excepthook` while a wiring runs (`Wiring.read_before_uncaught`): the watch's
    read first, then the hook that was there. A stop that ends the run (StopError,
    without a terminal) is reported in place of the exception, whose place it names
    (`then: ...`), in the program's frames (core/batch_end.py); `q` at its prompt, or at
    an earlier stop's, ends the run with nothing more printed."""

    def __init__(self, wiring, previous):
        self.wiring, self.previous = wiring, previous

    def __call__(self, kind, exc, tb) -> None:
        wiring, self.wiring = self.wiring, None
        if sys.excepthook is self:
            sys.excepthook = self.previous
        if wiring is None:
            self.previous(kind, exc, tb)
            return
        shown = None          # a stop that ended the run, printed in the exception's place
        try:
            if isinstance(exc, bdb.BdbQuit):
                return        # `q` at an earlier stop's prompt: the user ended the run
            if isinstance(exc, Exception):
                wiring.read_before(exc)
        except bdb.BdbQuit:
            return            # `q` at the prompt of the read's stop
        except StopError as stop:
            shown = "".join(short_traceback(stop))
        except BaseException as raised:  # noqa: BLE001 - action='raise': in its place
            kind, exc, tb = type(raised), raised, raised.__traceback__
        finally:
            wiring.close(after_error=True)
        if shown is not None:
            sys.stderr.write(shown)
            sys.stderr.flush()
            return
        # (the hook that was there: never sys.excepthook, which may be a hook installed
        # since, calling this one in turn)
        self.previous(kind, exc, tb)
