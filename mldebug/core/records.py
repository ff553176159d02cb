"""The records of mldebug: what an engine found (`Violation`) and the pause it turns
into (`Stop`), the one record every front end reads: the terminal prints it, the JSON
report writes it, the browser view and VS Code show it, `why` explains it.

The bottom layer: imports nothing of mldebug but `core.frames`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Optional

from . import frames as _frames

REASONS = ("nan", "inf", "assertion", "exception", "breakpoint", "interrupt", "peer_stop")
STAGES = ("forward", "backward", "optimizer", "other")


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
    # came in with the data: {"variable", "rows", "dataset_indices"} (watch/data_origin.py)
    data: Optional[dict] = None
    # judged at a read after the op ran (a device's window: its frame may be gone)
    read_later: bool = False
    # not counted: its values were gone by the read and could not be computed again; the
    # counts above then say only NaN or Inf (what a norm tells), and `gone` says why
    gone: str = ""
    # gradient accumulation: which backward of the step (1, 2, ...) the stop is in
    micro_batch: Optional[int] = None
    # a non-finite constant the program wrote on purpose (file:line is that write) has
    # reached what it must not: e.g. 'the model call Net at train.py:31', 'the loss'
    reached: str = ""
    # ... not written but made by an op where no gradient flows through it: 'torch.log
    # of 0' (the -Inf of log(0): a log-space mask); without `reached`, what made the value
    # that came in through `culprit` (the loss scale's overflow); '' otherwise
    made_by: str = ""
    # what the value led to before it was read: 'ValueError: ... at policy.py:9', the
    # exception that ended the program there (watch/before_exception.py)
    then: str = ""
    # the cause in words and its usual fix ('<cause>; fix at file:line: <remedy>'), from
    # the catalogue of causes (remedies/hints.py); `cause` names the rule, '' when none
    hint: str = ""
    cause: str = ""
    # what the hint read that the fields above do not hold (remedies/evidence.py)
    evidence: Optional[dict] = None

    @property
    def count(self) -> int:
        """NaN + Inf values in the bad output; 0 when they were not counted (`gone`)."""
        return 0 if self.gone else self.nan + self.posinf + self.neginf

    def headline(self, hint: bool = True) -> str:
        """One line: what, where, how it came about (and, with HINT, the likely cause in
        words and its fix)."""
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
            if self.gone:       # (a norm: NaN or Inf, not how many, nor the sign)
                what = "NaN" if self.nan else "Inf"
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
        elif self.module_type and not self.param:   # the outermost module itself
            where.append(f"in {self.module_type}")
        if self.param:
            where.append(f"updating parameter {self.param}")
        if self.file:
            where.append(f"at {os.path.basename(self.file)}:{self.line}")
        stage = self.stage
        if self.step is not None:
            stage += f", step {self.step}"
        if self.micro_batch is not None:
            stage += f", micro-batch {self.micro_batch}"
        cause = ""
        if self.kind != "assertion":
            made = "this op made it" if self.op else "made there"
            cause = f"; {made} from {self.made_from()}" if self.created else (
                f"; it came in through {self.culprit or 'an input'}, made "
                + (f"by {self.made_by}" if self.made_by else "outside the watched ops"))
            if self.reached:
                cause = (f"; made there by {self.made_by}, it reaches {self.reached}"
                         if self.made_by else
                         f"; written there on purpose, it reaches {self.reached}")
            if self.data:
                cause += f"; in the data: {data_text(self.data)}"
        if self.gone:
            cause += f"; not counted: {self.gone}"
        if self.then:
            cause += f"; then: {self.then}"
        if self.hint and hint:
            cause += f"; hint: {self.hint}"
        return f"{what} {' '.join(where)} [{stage}]{cause}".replace("  ", " ")

    def made_from(self) -> str:
        """'finite inputs', or the Inf of the input it made a NaN from ('the -Inf in
        input 0 (self)': inf - inf, 0 * inf, a softmax of an all -inf row)."""
        if not self.culprit:
            return "finite inputs"
        held = next((s for name, s in self.inputs if name == self.culprit), None)
        signs = [sign for sign, n in (("+Inf", getattr(held, "posinf", 0)),
                                      ("-Inf", getattr(held, "neginf", 0))) if n]
        return f"the {' and '.join(signs) or 'Inf'} in {self.culprit}"


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
    data: Optional[dict] = None    # the sample it came in with: variable, rows, dataset_indices
    reached: str = ""              # a constant written on purpose (file:line) reached this
    then: str = ""                 # the exception this NaN/Inf led to before it was read
    hint: str = ""                 # the likely cause and its usual fix, '' when none known
    cause: str = ""                # the name of the catalogue's rule behind `hint`
    evidence: Optional[dict] = None   # what the hint read (masked rows, the divisor's zeros)
    # the op's inputs as `why` shows them: [{"name", "text", "summary"}]
    inputs: Optional[list] = None
    # the rank of a multi-process job that stopped (all None for a single process)
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    host: Optional[str] = None
    # another rank's stop behind this one ({"rank", "file", "line", "message"}): the
    # first stop of the job for a peer_stop, the rank a NaN came in from otherwise
    peer: Optional[dict] = None
    micro_batch: Optional[int] = None  # gradient accumulation: the step's backward it is in
    # the engine's finding behind a NaN/Inf/assertion stop (`why`, the graph's marking,
    # the panels read it from here); not part of the report
    violation: Optional[Violation] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in _REPORTED}

    @property
    def tag(self) -> str:
        """'[rank 1] ' in a multi-process job, else '': the start of every line that
        tells of this stop."""
        return f"[rank {self.rank}] " if self.rank is not None else ""

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)

    @classmethod
    def from_violation(cls, v: Violation) -> "Stop":
        """The stop for an engine's finding: the fields both records have are copied
        by name (one list, the dataclass's), the rest derived here."""
        reason = "assertion" if v.kind == "assertion" else v.kind
        pause_file, pause_line, _ = _frames.location(v.frame)
        same_place = (pause_file, pause_line) == (v.file, v.line)
        shared = {name: getattr(v, name) for name in _SHARED_WITH_VIOLATION}
        message = v.headline()
        if v.read_later and pause_file and not same_place and not v.then:
            at = v.frame.f_code.co_name if v.frame is not None else ""
            message += ("; found at the program's end" if at == _frames.END_OF_PROGRAM else
                        "; found at the test's end" if at == _frames.END_OF_TEST else
                        f"; found at the read at {os.path.basename(pause_file)}:{pause_line}")
        return cls(
            reason=reason, message=message, count=v.count,
            created=None if reason == "assertion" else v.created,
            output=v.output.to_dict() if hasattr(v.output, "to_dict") else None,
            inputs=[_input_dict(name, s) for name, s in v.inputs] if v.inputs else None,
            pause_file="" if same_place else pause_file,
            pause_line=0 if same_place else pause_line,
            violation=v, **shared)

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


def data_text(data: dict) -> str:
    """'x row 7 (dataset index 77)': the sample a non-finite value came in with."""
    what = data.get("variable") or "the batch"
    rows, indices = data.get("rows"), data.get("dataset_indices")
    if rows:
        what += f" {'row' if len(rows) == 1 else 'rows'} {_few(rows)}"
    if indices:
        label = "dataset index" if len(indices) == 1 else "dataset indices"
        what += f" ({label} {_few(indices)})"
    return what


def _few(values, most: int = 5) -> str:
    shown = ", ".join(str(v) for v in values[:most])
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _input_dict(name: str, summary) -> dict:
    """One input of the op for the report: its label, its one-line summary (or repr) and
    the summary as an object (null for a number)."""
    return {"name": name, "text": str(summary),
            "summary": summary.to_dict() if hasattr(summary, "to_dict") else None}


def _plain(value):
    # the report's dicts are copies: a listener that edits one changes no other
    return copy.deepcopy(value) if isinstance(value, (dict, list)) else value


# the keys of `Stop.to_dict()`: a contract of the --report JSON lines (add, don't rename)
_REPORTED = tuple(f for f in dataclasses.fields(Stop) if f.name != "violation")
# fields a Stop takes from its Violation as they are
_SHARED_WITH_VIOLATION = tuple(
    f.name for f in dataclasses.fields(Stop)
    if f.name in {g.name for g in dataclasses.fields(Violation)}
    and f.name not in ("output", "created", "inputs"))   # derived in from_violation


class BatchStop(BaseException):
    """Ends the program after the first real stop in --batch mode (exit status 3).

    A BaseException so that a user's `except Exception` does not swallow it.
    """
