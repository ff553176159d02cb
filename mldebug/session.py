"""The record of a pause (`Stop`), the watch's finding (`Violation`), and the session
that turns findings into stops for whichever front end is active.

Every front end (terminal, JSON report, browser view, VS Code) shows the same `Stop`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Optional

from . import frames as _frames

REASONS = ("nan", "inf", "assertion", "exception", "breakpoint", "interrupt")
STAGES = ("forward", "backward", "optimizer", "other")
BREAK_ON_CHOICES = ("nan", "inf", "inf-all", "assert", "exception", "none")
DEFAULT_BREAK_ON = frozenset({"nan", "inf", "assert", "exception"})


@dataclass
class Violation:
    """What the numerics watch found: the first non-finite output of an op.

    Filled by the engine (`watch`, `assertions`); no front-end knowledge in here.
    """

    kind: str                      # 'nan' or 'inf' (NaN wins when both are present)
    op: str = ""                   # aten overload, e.g. 'aten.log.default'
    torch_op: str = ""             # the torch-level call, e.g. 'torch.log' ('' if unknown)
    module: str = ""               # dotted path from the outermost module, e.g. 'encoder.0'
    module_type: str = ""          # e.g. 'Linear'
    stage: str = "other"           # forward / backward / optimizer / other
    frame: Optional[FrameType] = None   # live user frame to pause in (None if gone)
    file: str = ""                 # user location of the op (forward op's line for backward)
    line: int = 0
    function: str = ""
    nan: int = 0                   # counts in the bad output
    posinf: int = 0
    neginf: int = 0
    created: bool = True           # inputs were finite: this op made the NaN/Inf
    culprit: str = ""              # the non-finite input when not created, e.g. 'input 0'
    output: Any = None             # TensorSummary of the bad output
    inputs: list = field(default_factory=list)   # [(name, TensorSummary or repr str)]
    param: str = ""                # optimizer stage: the parameter's name in the model
    node: str = ""                 # backward: the autograd node, e.g. 'SqrtBackward0'
    step: Optional[int] = None     # training step if known
    assertion: str = ""            # assertion name for assertion violations
    text: str = ""                 # assertion message / hint

    @property
    def count(self) -> int:
        return self.nan + self.posinf + self.neginf

    def headline(self) -> str:
        """One line: what, where, how it came about."""
        if self.kind == "assertion":
            what = f"assertion {self.assertion} failed"
            if self.text:
                what += f": {self.text}"
        else:
            parts = []
            if self.nan:
                parts.append(f"{self.nan} NaN")
            if self.posinf:
                parts.append(f"{self.posinf} +Inf")
            if self.neginf:
                parts.append(f"{self.neginf} -Inf")
            what = " and ".join(parts) if parts else ("NaN" if self.kind == "nan" else "Inf")
        where = []
        if self.op:
            op = self.op
            if self.torch_op:
                op += f" ({self.torch_op})"
            where.append(f"from {op}")
        elif self.torch_op:          # not pinned to an aten op: the call it was made in
            where.append(f"in {self.torch_op}()")
        if self.node:
            where.append(f"in {self.node}")
        if self.module:
            mod = self.module
            if self.module_type:
                mod += f" ({self.module_type})"
            where.append(f"in module {mod}")
        if self.param:
            where.append(f"updating parameter {self.param}")
        if self.file:
            where.append(f"at {os.path.basename(self.file)}:{self.line}")
        stage = self.stage
        if self.step is not None:
            stage += f", step {self.step}"
        cause = ""
        if self.kind != "assertion":
            made = "this op made it" if self.op else "made there"
            cause = f"; {made} from finite inputs" if self.created else (
                f"; it came in through {self.culprit or 'an input'}, made outside the watched ops")
        return f"{what} {' '.join(where)} [{stage}]{cause}".replace("  ", " ")


@dataclass
class Stop:
    """One pause of the program, the same record for every front end.

    Keys of `to_dict()` are a contract of the `--report` JSON lines.
    """

    reason: str                    # one of REASONS
    message: str                   # the one-line human report
    file: str = ""                 # absolute path of the user frame (culprit's line)
    line: int = 0
    function: str = ""
    stage: str = "other"
    op: str = ""
    module: str = ""
    assertion: str = ""
    step: Optional[int] = None
    torch_op: str = ""
    module_type: str = ""
    count: int = 0
    created: Optional[bool] = None
    culprit: str = ""
    param: str = ""
    node: str = ""
    output: Optional[dict] = None  # summary of the bad output, as a dict
    exception: str = ""            # 'ValueError: ...' for exception stops
    pause_file: str = ""           # where the debugger paused, when it differs from file:line
    pause_line: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)

    @classmethod
    def from_violation(cls, v: Violation) -> "Stop":
        reason = "assertion" if v.kind == "assertion" else v.kind
        pause_file, pause_line, _ = _frames.location(v.frame)
        output = None
        if v.output is not None and hasattr(v.output, "to_dict"):
            output = v.output.to_dict()
        same_place = (pause_file, pause_line) == (v.file, v.line)
        return cls(
            reason=reason, message=v.headline(), file=v.file, line=v.line,
            function=v.function, stage=v.stage, op=v.op, module=v.module,
            assertion=v.assertion, step=v.step, torch_op=v.torch_op,
            module_type=v.module_type, count=v.count,
            created=None if reason == "assertion" else v.created,
            culprit=v.culprit, param=v.param, node=v.node, output=output,
            pause_file="" if same_place else pause_file,
            pause_line=0 if same_place else pause_line,
        )

    @classmethod
    def from_exception(cls, exc: BaseException, frame: Optional[FrameType]) -> "Stop":
        file, line, function = _frames.location(frame)
        try:
            detail = str(exc)
        except Exception as err:  # noqa: BLE001 - a user's __str__ that raises
            detail = f"<str() failed: {type(err).__name__}: {err}>"
        text = f"{type(exc).__name__}: {detail}".rstrip(": ")
        where = f" at {os.path.basename(file)}:{line} in {function}" if file else ""
        return cls(reason="exception", message=f"uncaught {text}{where}", file=file,
                   line=line, function=function, exception=text)

    @classmethod
    def from_breakpoint(cls, frame: Optional[FrameType]) -> "Stop":
        file, line, function = _frames.location(frame)
        return cls(reason="breakpoint",
                   message=f"breakpoint at {os.path.basename(file)}:{line} in {function}",
                   file=file, line=line, function=function)


    @classmethod
    def from_interrupt(cls, frame: Optional[FrameType], step: Optional[int] = None) -> "Stop":
        """Ctrl-C paused the program at FRAME (mldebug/interrupt.py)."""
        file, line, function = _frames.location(frame)
        where = f" at {os.path.basename(file)}:{line} in {function}" if file else ""
        when = f" [step {step}]" if step is not None else ""
        return cls(reason="interrupt", message=f"interrupted (Ctrl-C){where}{when}",
                   file=file, line=line, function=function, step=step)


def parse_break_on(text: str | list | tuple | set) -> frozenset:
    """`'nan,inf'` → {'nan', 'inf'}; 'none' → empty. Raises ValueError naming a bad word."""
    words = text.split(",") if isinstance(text, str) else list(text)
    words = [w.strip().lower() for w in words if w.strip()]
    bad = [w for w in words if w not in BREAK_ON_CHOICES]
    if bad:
        raise ValueError(f"unknown break-on kind {bad[0]!r}; choose from {', '.join(BREAK_ON_CHOICES)}")
    if "none" in words:
        if len(words) > 1:
            raise ValueError("'none' cannot be combined with other break-on kinds")
        return frozenset()
    result = set(words)
    if "inf-all" in result:
        result.add("inf")
    return frozenset(result)


class BatchStop(BaseException):
    """Ends the program after the first real stop in --batch mode (exit status 3).

    A BaseException so that a user's `except Exception` does not swallow it.
    """


class Session:
    """State shared by the engine and the front ends: what to break on, where to report,
    which front end pauses, and the stops so far."""

    def __init__(self, break_on=DEFAULT_BREAK_ON, batch: bool = False,
                 report_path: str | None = None, out=None):
        self.break_on = frozenset(break_on)
        self.batch = batch
        self.report_path = os.path.abspath(report_path) if report_path else None
        self.out = out or sys.stderr
        self.stops: list[Stop] = []
        self.last_violation: Optional[Violation] = None
        self.batch_stopped = False
        self.input_ended = False   # the prompt read end of input from a pipe (exit 3)
        self.step: Optional[int] = None
        self.allow: tuple = ()  # the watch's exemptions (--allow), kept for `watch on`
        self.exact_watch = False  # --watch exact: the per-op check everywhere
        # pause(stop, frame) -> None, blocks until the user continues; set by a front end
        self.pauser: Optional[Callable[[Stop, Optional[FrameType]], None]] = None
        self._lock = threading.RLock()

    # -- recording -------------------------------------------------------------------
    def record(self, stop: Stop) -> None:
        with self._lock:
            self.stops.append(stop)
            if self.report_path:
                try:
                    with open(self.report_path, "a", encoding="utf-8") as fh:
                        fh.write(stop.to_json() + "\n")
                except OSError as exc:  # never take the user's program down for a report
                    print(f"mldebug: warning: cannot write the report {self.report_path}: "
                          f"{exc.strerror or exc}", file=self.out, flush=True)

    def wants(self, reason: str) -> bool:
        key = {"assertion": "assert"}.get(reason, reason)
        return key in self.break_on

    # -- stopping --------------------------------------------------------------------
    def stop(self, stop: Stop, frame: Optional[FrameType]) -> None:
        """Record a stop and pause the active front end (or end the run in batch mode)."""
        self.record(stop)
        if self.batch:
            print(f"mldebug: stop: {stop.message}", file=self.out, flush=True)
            if stop.reason != "breakpoint":
                self.batch_stopped = True
                raise BatchStop(stop.message)
            return
        if self.pauser is None:
            self._install_default_pauser()
        self.pauser(stop, frame)

    def _install_default_pauser(self) -> None:
        """No front end was set up (`with mldebug.watch():` in a plain script or a plain
        debugpy session): pause in the client debugpy serves, else at mldebug's prompt."""
        from . import dap

        if dap.debugger_active():
            from .dap.pauser import DapPauser

            self.pauser = DapPauser(self)
        else:
            from .debugger import get_debugger

            get_debugger(self)  # sets self.pauser

    def on_violation(self, violation: Violation) -> None:
        """Called by the watch (inside the op) when it found a violation worth a stop."""
        self.last_violation = violation
        if violation.step is None:
            violation.step = self.step
        self.stop(Stop.from_violation(violation), violation.frame)


_current: Optional[Session] = None


def current() -> Session:
    """The process's session, created with defaults when none was configured."""
    global _current
    if _current is None:
        _current = Session()
    return _current


def install(session: Session) -> Session:
    global _current
    _current = session
    return session
