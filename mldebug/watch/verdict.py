"""The stop rule: a non-finite value the checks found becomes a `Violation`, or not.

Mixed into `Watch` (core.py). `_slow` counts an op's outputs exactly and `_judge`
applies the rule to one of them (made here or came in; see the package docstring);
`_report_unpinned`, for a root's output or a gradient whose re-run could not pin the op.
With update.py's `_judge_step` (a parameter, or its optimizer state, that the unchecked
optimizer step left non-finite) these build every `Violation` the watch reports;
`_report` hands one to the callback (or raises), from the owner thread.
The taint (taint.py) records which non-finite storages were judged already, so that
values that merely flow on from them are not new stops. A NaN/Inf made inside one of
torch's own backward formulas is judged once the formula has returned: some mask their
own 0/0 (`_judge_when_formula_ends`).
"""
from __future__ import annotations

import os
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from ..core import frames as _frames
from ..core.errors import NonFiniteError
from ..core.records import Violation
from ..core.session import current
from ..remedies import hints as _hints
from . import data_origin as _data_origin
from .amp import OVERFLOW_MADE_BY, SCALER_OPS, STEPPED_ON_OVERFLOW, stays_unscaled
from .checks import (_ALLOWED, METADATA_KEY, _caller, _counts, _floating, _isfinite,
                     _summary, push, torch_formula,
                     user_code_in_backward)
from .context import module_record
from .marks import Mark
from .ops import CONSTANT_WRITERS, WORKSPACE_OUTPUTS, argument_name, matches

_current_node = torch._C._current_autograd_node
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_get_ident = threading.get_ident


class Input(NamedTuple):
    """One input of an op, as `_judge` reads it (the defaults: one with no NaN/Inf)."""
    label: str             # 'input 0 (self)', 'input 1 (other) = -inf'
    value: object          # the tensor or number (None: freed before a device's read)
    has_nan: bool = False
    has_inf: bool = False
    known: bool = True     # its NaN/Inf was judged already (or it holds none)
    lineage: bool = False  # ... and descends from a reported stop
    mark: object = None    # the Mark of a value written on purpose, or flowing from one
    written: bool = False  # the very constant written (a scalar argument, a literal)


class Verdict:
    """Methods of `Watch`: the stop rule and the report (state in `Watch`)."""

    # -- an op's outputs failed their check ------------------------------------------
    def _stage(self, node):
        if node is not None:
            return "backward"
        return "optimizer" if self._opt_depth else "forward"

    def _slow(self, func, info, args, kwargs, outs, entry, note="", freed=None, dtype=None,
              formula=None):
        """An output's check failed: count exactly, apply the rule, report a stop.

        `entry` is a device-window entry (stage, node name, provenance, module record,
        location) when the op ran earlier; None when it is running now. `freed`: an
        input is gone, and what it is taken to have held (has NaN, has Inf, descends
        from a stop). `dtype`: that of the output, when it is gone (judged by its sum).
        `formula`: judged later inside one of torch's backward formulas, whether what the
        formula returned was finite (None: not known). `note`: OUTS is a stand-in for
        values gone by a device's read (device_window.py), and why they are gone.
        """
        if self._recomputing and self._stop_step == self._steps:
            # a checkpoint recomputes a forward of this step that made a stop: what it
            # makes again was a stop then, or flowed from one; mark it so (its backward
            # is no new stop), and stop nothing here
            self._taint_outputs([t for t, _ in self._flatten_outputs(outs)], True)
            return
        if entry is None:
            node = _current_node()
            stage = self._stage(node)
            node_name = node.name() if node is not None else ""
            node_prov = node.metadata.get(METADATA_KEY) if node is not None else None
            if node_prov is not None and user_code_in_backward(_caller(1)) is not None:
                node_prov = None    # (a hook's op, not the node's formula: its own line)
            record = self._top
            if record is None and stage == "forward":
                record = module_record(_caller(1))   # (a module outside the roots)
            frame = _frames.user_frame(_caller(1))
            here = backwards = None
        else:
            stage, node_name, node_prov, record, here, backwards = entry
            frame = _frames.user_frame(_caller(1)) if _get_ident() == self._owner else None
        bad = []
        for index, item in enumerate(self._flatten_outputs(outs)):
            t, list_index = item
            if not _floating(t) or index and info.short in WORKSPACE_OUTPUTS:
                continue
            counts = _counts(t)
            if sum(counts):
                bad.append((t, list_index, counts))
        reported = made = None
        for t, list_index, counts in bad:
            v = self._judge(info, args, kwargs, t, list_index, counts, stage, node_name,
                            node_prov, record, frame, here, freed, dtype, backwards)
            if v is not None and note:
                # judged by a stand-in for values that are gone: what it is, not its counts
                v.gone, v.output = note, None
            if v is not None and entry is not None:
                v.read_later = True
            if v is not None and reported is None:
                reported, made = v, t
        if reported is None:
            return
        if entry is None and reported.created and torch_formula(node):
            self._judge_when_formula_ends(node, made, reported)
            return
        if formula and reported.created:
            self._forget_taint(made)   # (the formula's own: what it returned is finite)
            return
        self._report(reported)

    def _judge_when_formula_ends(self, node, t, v) -> None:
        """A NaN/Inf made inside one of torch's backward formulas (NODE's), from finite
        values: a formula may mask it itself before it returns (the norm's derivative at
        0 is `(grad / norm).masked_fill_(norm == 0, 0)`, F.normalize's of an all-zero
        row; logcumsumexp's, xlogy's and cumprod's discard theirs with `where`), so it is
        a stop only if it is still there, and in what the formula returns, when it has
        returned: judged at the next op of another node (the per-op check), or when
        backward ends. A formula the program wrote (an autograd.Function) is judged at
        once, paused in its code."""
        if not self._in_formula:
            _queue_callback(self._judge_formulas)
        if all(n is not node for n, _, _ in self._in_formula):
            returned = self._formula_returned

            def formula_returned(grad_inputs, _grad_outputs):   # (what it returns)
                handle.remove()
                with self._own_ops():
                    returned[id(node)] = not any(
                        sum(_counts(g)) for g in grad_inputs if isinstance(g, Tensor))

            handle = node.register_hook(formula_returned)
        self._in_formula.append((node, t, v))

    def _judge_formulas(self) -> None:
        """The formulas returned: each value judged inside one that is still not finite,
        and that reaches what the formula returns, is a stop; one the formula masked or
        left out of what it returns was the formula's own (forgotten)."""
        pending, self._in_formula = self._in_formula, []
        returned, self._formula_returned = self._formula_returned, {}
        for node, t, v in pending:
            with self._own_ops():
                masked = returned.get(id(node)) or not sum(_counts(t))
            if masked:
                self._forget_taint(t)
            elif not self._skip:
                self._report(v)

    @staticmethod
    def _flatten_outputs(outs):
        """[(tensor, index within its list or None)]"""
        flat = []
        for item in outs:
            if isinstance(item, Tensor):
                flat.append((item, None))
            elif isinstance(item, (list, tuple)):
                flat.extend((t, i) for i, t in enumerate(item) if isinstance(t, Tensor))
        return flat

    def _inputs(self, info, args, kwargs, list_index):
        """[(label, value, key)] of the op's arguments; for foreach ops only element
        `list_index` of each list argument."""
        items = []

        def one(label_of, key, value):
            if isinstance(value, (list, tuple)) and value and any(
                    isinstance(x, Tensor) for x in value):
                if list_index is not None and list_index < len(value):
                    items.append((label_of(key, list_index), value[list_index], key))
                else:
                    for i, x in enumerate(value):
                        items.append((label_of(key, i), x, key))
            elif isinstance(value, (Tensor, float, int)) and not isinstance(value, bool):
                items.append((label_of(key, None), value, key))

        for pos, value in enumerate(args):
            one(lambda k, i: argument_name(info, k, i), pos, value)
        for name, value in (kwargs or {}).items():
            one(lambda k, i: argument_name(info, k, i), name, value)
        return items

    def _judge(self, info, args, kwargs, bad, list_index, counts, stage, node_name, node_prov,
               record, frame, here, freed=None, dtype=None, backwards=None):
        """Apply the stop rule to one non-finite output; return a Violation or None.
        BACKWARDS: the step's backwards when the op ran (judged later: a device window)."""
        nan, posinf, neginf = counts
        out_nan = nan > 0
        self._judged += 1
        mutated_keys = {key for key, _ in info.mutated}
        rows = []              # an Input each
        written = None         # the Mark of this op's non-finite scalar argument
        for label, value, key in self._inputs(info, args, kwargs, list_index):
            if isinstance(value, Tensor):
                if not value.is_floating_point() or value.is_complex():
                    rows.append(Input(label, value))
                    continue
                if key in mutated_keys:
                    # the op wrote this input (the output itself, or another argument it
                    # updates in place: a fused optimizer's exp_avgs): its values now are
                    # not what the op read. Its state before is known only through the
                    # taint of an earlier judged op (finite otherwise)
                    prior = self._taint_get(value)
                    has_nan, has_inf, lineage = prior if prior else (False, False, False)
                    mark = self._mark_get(value) if prior else None
                    if mark is not None and mark.stopped:
                        lineage, mark = True, None     # (a stop was made of it)
                    rows.append(Input(label, value, has_nan, has_inf, True, lineage, mark))
                    continue
                c = _counts(value)
                has_nan, has_inf = c[0] > 0, c[1] + c[2] > 0
                known, lineage, mark = True, False, None
                if has_nan or has_inf:
                    prior = self._taint_get(value)
                    known = prior is not None and (prior[0] or not has_nan)
                    lineage = bool(prior and prior[2])
                    mark = self._mark_get(value) if known else None
                    if mark is not None and mark.stopped:
                        lineage, mark = True, None     # (a stop was made of it)
                rows.append(Input(label, value, has_nan, has_inf, known, lineage, mark,
                                  mark is not None and mark.written))
            elif isinstance(value, float) and not _isfinite(value) \
                    and info.short not in CONSTANT_WRITERS:
                rows.append(Input(f"{label} = {value}", value, value != value,
                                  value == value, False, False, None, False))
            elif isinstance(value, float) and not _isfinite(value):
                # a constant the program writes (fill, masked_fill, full): known
                if written is None:
                    written = Mark(*self._op_location(stage, node_prov, here, frame))
                rows.append(Input(f"{label} = {value}", value, value != value,
                                  value == value, True, False, written, True))
            else:
                rows.append(Input(label, value))
        if freed is not None:
            stopped = freed[3] is not None and freed[3].stopped
            mark = None if stopped else freed[3]
            rows.append(Input("an input freed before the window was read", None, *freed[:2],
                              True, freed[2] or stopped, mark,
                              mark is not None and mark.written))

        any_nan = any(r.has_nan for r in rows)
        nonfinite = [r for r in rows if r.has_nan or r.has_inf]
        lineage = any(r.lineage for r in nonfinite)   # descends from a reported stop
        culprit = ""
        culprit_value = None       # the input it came in through, when not made here
        made = ""                  # what made it here on purpose (marks.py)
        text = ""
        stop = False
        if out_nan:
            kind = "nan"
            if not any_nan:
                # a NaN made here: from finite inputs, or from Infs (inf - inf, 0 * inf,
                # softmax of an all -inf row). A consequence only when those Infs
                # descend from a stop already reported.
                created = True
                stop = "nan" in self.break_on and not lineage
                if nonfinite:
                    culprit = nonfinite[0].label
                    text = f"{culprit} holds Inf (e.g. a fully masked row)"
                    maker = nonfinite[0].mark
                    if maker is not None and maker.origin.made_by:
                        # (an Inf an op made, judged a value: ops.LOG_AT_ZERO, an optimizer's
                        # temporary)
                        culprit = (f"{culprit}, made by {maker.origin.made_by} at "
                                   f"{maker.where()}")
                        text = f"{culprit} (-Inf)"
                if stop and "inf-all" not in self.break_on:
                    made = self._nan_made_on_purpose(info, args, kwargs, bad, nonfinite,
                                                     stage, record, here is None)
            else:
                unknown = [r for r in rows if r.has_nan and not r.known]
                created = False
                if unknown:
                    stop = "nan" in self.break_on
                    culprit, culprit_value = unknown[0].label, unknown[0].value
        else:
            kind = "inf"
            if not nonfinite:
                created = True
                stop = "inf" in self.break_on
                if stop and "inf-all" not in self.break_on:
                    made = self._inf_made_on_purpose(info, args, kwargs, bad, posinf, stage,
                                                     record, here is None)
                if stop and not made and info.short == "_ctc_loss" and (
                        kwargs.get("zero_infinity") if kwargs else
                        len(args) > 5 and args[5] is True):
                    # an alignment that cannot be made: CTCLoss(zero_infinity=True) zeroes
                    # that sample's infinite loss and its gradient, as asked
                    stop = False
            else:
                created = False
                # (with inf-all a constant written is a stop where it is written)
                unknown = [r for r in nonfinite if not r.known or r.written]
                if unknown and "inf-all" in self.break_on:
                    stop = True
                    culprit, culprit_value = unknown[0].label, unknown[0].value
        if made:        # made on purpose: judged as a constant written (marks.py)
            stop, created = False, False
            written = Mark(*self._op_location(stage, node_prov, here, frame), made_by=made,
                           op=(info.name, info.torch_op))
        if stop and stage == "optimizer" and self._opt_stop_step == self._steps:
            stop = False   # one stop per optimizer step: the other parameters follow
        # (a NaN made in backward from Infs not judged a stop: from the overflow that
        # made them, in whatever dtype the op runs: LayerNorm's backward in float32)
        stepped = False    # the optimizer's step ran on the scaler's overflow
        overflowed = stage == "backward" and bool(nonfinite) and not lineage \
            and self._amp.overflowed
        if stop and (info.name.startswith(SCALER_OPS) or (
                stage == "backward" and self._amp.excuses(
                    None if overflowed else dtype or bad.dtype,
                    self._unscaled_check(info, args, kwargs, created and not nonfinite)))):
            stop = False   # a loss scaler's overflow: GradScaler skips this step
            self._amp.overflowed = self._amp.overflowed or stage == "backward"
            self._amp.hold_overflow(bad)
        elif nonfinite and self._amp.holds_overflow(nonfinite[0].value):
            # made of the scaler's overflow before its step (`clip_grad_norm_` after
            # `unscale_`: inf * 0): skipped with it. In an optimizer's step it is a
            # stop: `scaler.step()` would not have run the step
            if stage == "optimizer":
                stepped = stop = kind in self.break_on \
                    and self._opt_stop_step != self._steps
                culprit = nonfinite[0].label
            elif stop and created and stage == "forward" \
                    and all(self._amp.holds_overflow(r.value) for r in nonfinite):
                stop = False
            if not stop:
                self._amp.hold_overflow(bad)
        if stop and stage == "backward":
            text = self._amp.with_note(text)
        # a value written on purpose flows on: no stop, unless it reaches a gradient, a
        # parameter or the optimizer's state (marks.py)
        mark = written if made else None if created or stop or lineage else next(
            (r.mark for r in nonfinite if r.mark is not None), written)
        reached = ""
        if mark is not None and not made:
            # (an Inf may flow through backward's own steps, exp(-inf - lse) in logsumexp's:
            # what reaches a parameter's gradient is seen at the optimizer's step)
            if stage == "backward" and out_nan and not (
                    self._amp.overflowed and self._amp.excuses()):
                reached = "a gradient"   # (under a loss scaler: its overflow, while it can)
            elif stage == "optimizer":
                reached = "the optimizer's step"
            elif stage == "forward" and _data_origin._is_parameter(bad):
                reached = "a parameter"
            stop = bool(reached) and kind in self.break_on \
                and not (stage == "optimizer" and self._opt_stop_step == self._steps)
        if mark is not None and not stop:
            self._flowed_mark = mark       # (a re-run's gradients carry it: rerun.py)
        # everything judged here is known from now on: propagation is not a new stop
        self._taint_add(bad, out_nan, posinf + neginf > 0, stop or lineage,
                        mark=None if mark is None else mark.flowing())
        for r in nonfinite:
            if not r.known and isinstance(r.value, Tensor):
                self._taint_add(r.value, r.has_nan, r.has_inf, False)
        if not stop:
            return None

        # where
        torch_op = info.torch_op
        param = ""
        if stage == "backward" and node_prov is not None:
            record, file, line, function, fwd_torch_op = node_prov
            file = os.path.abspath(file) if file and not file.startswith("<") else file
            torch_op = fwd_torch_op or torch_op
        elif here is not None:
            file, line, function = here
            file = os.path.abspath(file) if file and not file.startswith("<") else file
        else:
            file, line, function = _frames.location(frame)
        module, module_type = self._names.path(record) if stage != "optimizer" else ("", "")
        if stage == "optimizer":
            param = self._names.param(bad, self._optimizer)
            module, module_type = self._names.owner(param)
        patterns = tuple(_ALLOWED) + self.allow
        if patterns and (matches(patterns, (info.name, info.short, info.name.rsplit(".", 1)[0]))
                         or (module and matches(patterns, (module,)))):
            return None
        if stage == "optimizer":
            self._opt_stop_step = self._steps
        if reached:
            return self._mark_violation(
                mark, reached, bad, counts, stage, module, module_type, param, frame=frame,
                op=info.name, torch_op=torch_op, node=node_name,
                inputs=[(label, _summary(value) if isinstance(value, Tensor) else repr(value))
                        for label, value, *_ in rows])
        v = Violation(
            kind=kind, op=info.name, torch_op=torch_op, module=module,
            module_type=module_type, stage=stage, frame=frame, file=file, line=line,
            function=function, nan=nan, posinf=posinf, neginf=neginf, created=created,
            culprit=culprit, output=_summary(bad),
            inputs=[(label, _summary(value) if isinstance(value, Tensor) else repr(value))
                    for label, value, *_ in rows],
            param=param, node=node_name,
            step=self._steps if self._opt_seen else None, text=text,
            micro_batch=self._micro_by_op(stage, backwards),
        )
        with self._own_ops():       # (read once, at the stop: what the hints need)
            v.evidence = _hints.gather(info, args, kwargs, rows, bad, stage, here is None)
        if stepped:
            v.evidence = {**(v.evidence or {}), **STEPPED_ON_OVERFLOW}
            v.made_by = OVERFLOW_MADE_BY
        if stage == "forward" and culprit_value is not None:
            _data_origin.name_the_data(v, culprit_value)
        return v

    @staticmethod
    def _op_location(stage, node_prov, here, frame):
        """(file, line, function) of the op being judged, as its stop would name it."""
        if stage == "backward" and node_prov is not None:
            return node_prov[1], node_prov[2], node_prov[3]
        if here is not None:
            return here
        return _frames.location(frame)

    def _unscaled_check(self, info, args, kwargs, from_finite):
        """For GradScaler's verdict (amp.py): whether the op that made this non-finite
        gradient from finite inputs makes one without the scale too; None where that is
        not the question (an input already non-finite: an overflow before it) or cannot
        be asked (an op that writes its input)."""
        if not from_finite or info.mutated:
            return None

        def unscaled(scale):
            with self._own_ops():
                return stays_unscaled(info.func, args, kwargs, scale)
        return unscaled

    # -- the cheap check's verdict -----------------------------------------------------
    def _report_unpinned(self, stage, counts, record=None, param=None, reason="",
                         what=None, where=None, micro=None):
        """A cheap check saw a NaN/Inf that the re-run could not narrow to one op: still a
        stop, naming the root's output (forward) or the parameter (backward), saying why.
        WHERE: (file, line, function) of the call, when not the frame's; MICRO: its
        micro-batch."""
        nan, posinf, neginf = counts
        kind = "nan" if nan else "inf"
        if kind not in self.break_on:
            return
        if stage == "backward" and self._amp.excuses():
            return            # a loss scaler's overflow: GradScaler skips this step
        if stage == "backward":
            reason = self._amp.with_note(reason)
        frame = _frames.user_frame(_caller(1))
        file, line, function = where if where and where[0] else _frames.location(frame)
        name = ""
        if param is not None:
            name = self._names.param(param)
            module, module_type = self._names.owner(name)
            what = f"the gradient of {name or 'a parameter'}"
        else:
            module, module_type = self._names.path(record)
            what = what or f"the output of {module or module_type or 'a module'}"
        patterns = tuple(_ALLOWED) + self.allow
        if patterns and module and matches(patterns, (module,)):
            return
        text = f"{what} is not finite; the op that made it was not pinned"
        if reason:
            text += f": {reason}"
        with self._own_ops():
            output = _summary(param.grad) if param is not None else None
        v = Violation(kind=kind, op="", torch_op="", module=module, module_type=module_type,
                      stage=stage, frame=frame, file=file, line=line, function=function,
                      nan=nan, posinf=posinf, neginf=neginf, created=True, culprit="",
                      output=output, param=name, step=self._steps if self._opt_seen else None,
                      text=text, micro_batch=micro)
        self._report(v)

    # -- reporting -------------------------------------------------------------------
    def _report(self, v) -> None:
        site = self._rerun
        if site is not None and site[1] and v.line == site[0][1] and \
                _frames.same_file(v.file, site[0][0]):
            # made in library code right under a re-run call: at the call's own line
            if site[1][:2] != site[0]:
                v.read_later = True     # (re-run at a later read: a device's step)
            v.file, v.line, v.function = site[1]
        _hints.explain(v, self)     # the cause in words, when the catalogue knows it
        if self._late is not None:
            # read before an exception is reported (before_exception.py): the program
            # has left the line; pause where the exception was raised, and name it
            if self._late[0] is not None:
                v.frame = self._late[0]
            v.then, v.read_later = self._late[1], True
        self.violations.append(v)
        self._stop_step = self._steps
        if self.action == "raise":
            self._after_escape(v, exception_type=NonFiniteError)
            raise NonFiniteError(f"mldebug: {v.headline()}", v)
        if _get_ident() != self._owner:
            # autograd's device threads: pause on the user's thread at its next event
            self._stash.append(v)
            return
        callback = self.on_violation
        if callback is None:
            callback = current().on_violation
        self._suspend += 1
        self._update_skip()
        try:
            callback(v)
        except BaseException as exc:
            self._after_escape(v, exception_type=type(exc))
            raise
        finally:
            self._suspend -= 1
            self._update_skip()

    def _after_escape(self, v, exception_type):
        """An exception leaves the op: the optimizer's post hook will not run, and for
        non-Exception errors (BatchStop) nor will the modules' always-call hooks."""
        if v.stage == "optimizer":
            self._opt_depth = 0
        if not issubclass(exception_type, Exception) and not self._rerunning:
            self._top = self._call = None
            self._inside = 0
            if self._root_popped:      # the root call's post hook will not run
                push(self._mode)
                self._root_popped = False
        self._pending = []

    def _deliver_stash(self):
        if _get_ident() != self._owner or self._skip:
            return
        stash, self._stash = self._stash, []
        frame = _frames.user_frame(_caller(1))
        for v in stash:
            if v.frame is None:
                v.frame = frame
            self.violations.remove(v)
            self._report(v)
