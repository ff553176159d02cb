"""The optimizer's step, the last part of a healthy training step (step.py has the rest).

    opt.step()       pre-hook: the gradients the step will use join the check (on a
                     device, held; what the read finds of them is kept for the step's own
                     judge), then, on a device, the step's ONE read, before the update:
                     the step's forward, loss region and backward, and the previous
                     update, all checked by it. The step runs without the per-op check.
                     post-hook: the parameters and the optimizer's state the step wrote
                     are checked (on a device, held for the next read: one step late).

A step's closure (LBFGS, Lightning's automatic optimization) runs the forward and the
backward inside the step: it runs with the step's stage lifted, so its ops are forward
and backward, and its calls are roots like any other. A non-finite parameter or state
after the step is judged by `_judge_step` (made by the step from finite
gradients, or carried on from a gradient judged already); one written there on purpose
is a stop that names the line that wrote it (marks.py).
"""
from __future__ import annotations

import threading
from functools import partial
from itertools import chain
from operator import is_, methodcaller
from typing import NamedTuple

from torch import Tensor

from ..core import frames as _frames
from ..core.native import memory_needed
from ..core.records import Violation
from . import checks as _checks
from .amp import OVERFLOW_MADE_BY, STEPPED_ON_OVERFLOW
from .data_origin import _is_parameter
from .checks import (_ALLOWED, _PLAIN, _STRIDED, _caller, _counts, _floating, _is_cpu,
                     _summary, pop_if_top, push)
from .ops import matches
from .step_ledger import cuda_graph_aside, fused_key

_get_ident = threading.get_ident
_values = methodcaller("values")
LIVE_GRAD = object()   # _judge_step: the step's gradient is the parameter's `.grad` now


class GradRead(NamedTuple):
    """What a device's read before the step found of a non-finite gradient."""
    counts: tuple          # (NaN, +Inf, -Inf)
    judged: bool           # its values were judged already (the taint)
    from_stop: bool        # ... and descend from a reported stop
    mark: object           # the Mark of a value written on purpose in it, or None
    overflow: bool         # it holds the loss scaler's overflow (amp.py)


_FINITE_READ = GradRead((0, 0, 0), False, False, None, False)   # (a finite gradient)


class StepTensors:
    """`step_tensors` of one optimizer, with what it was found from: kept from one step
    to the next while the optimizer's groups, parameters and state are the same objects
    (checked with C loops, `same_as`), so that a step asks no tensor of its properties
    again (a few hundred C calls a step on a transformer, what a launch-bound GPU step
    pays in full)."""

    __slots__ = ("entries", "tensors", "by_device", "sizes", "objects")

    def __init__(self, optimizer, entries):
        self.entries = entries
        self.tensors = [x for x, _, _, _ in entries]
        # step_ledger.fused_key -> (tensors, their indices, memory_needed): the ledger's
        # grouping, done once; None for a subclass (a DTensor's local values are looked
        # up at each step: `StepLedger.hold`)
        self.by_device = None
        groups: dict = {}
        for i, x in enumerate(self.tensors):
            if type(x) not in _PLAIN:
                break
            xs, indices = groups.setdefault(fused_key(x), ([], []))
            xs.append(x)
            indices.append(i)
        else:
            self.by_device = {key: (xs, indices, memory_needed(xs))
                              for key, (xs, indices) in groups.items()}
        self.sizes, self.objects = _found_from(optimizer)

    def same_as(self, optimizer) -> bool:
        """Whether OPTIMIZER's groups, parameters and state values are still the objects
        the entries were found from (a parameter added, a state tensor replaced or
        created, `load_state_dict`: not)."""
        sizes, objects = _found_from(optimizer)
        return sizes == self.sizes and all(map(is_, objects, self.objects))


def _found_from(optimizer):
    """What `step_tensors(optimizer)` reads: (the sizes of its lists and dicts, the
    objects in them: param groups, parameter lists, parameters, state keys, state dicts,
    state values), built with C loops. Sizes compare by value, objects by identity (a
    tensor's `==` is elementwise)."""
    groups = list(getattr(optimizer, "param_groups", ()))
    lists = [g.get("params", ()) for g in groups]
    state = getattr(optimizer, "state", {})
    states = list(state.values())
    sizes = [len(groups), len(state), *map(len, lists), *map(len, states)]
    objects = groups + lists + list(chain.from_iterable(lists)) + list(state) + states
    objects.extend(chain.from_iterable(map(_values, states)))
    return sizes, objects


def step_tensors(optimizer) -> list:
    """[(tensor, param, 'value' or state key, param group)] an optimizer step writes: its
    floating parameters and their floating state tensors (not a 0-d step counter)."""
    out = []
    # (by id: a tensor's __hash__ is a Python call, once per parameter and step)
    state = {id(p): st for p, st in getattr(optimizer, "state", {}).items()}
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            if not isinstance(p, Tensor) or not p.is_floating_point() \
                    or p.layout is not _STRIDED or p.is_meta:
                continue
            out.append((p, p, "value", group))
            for key, value in (state.get(id(p)) or {}).items():
                if isinstance(value, Tensor) and value.is_floating_point() \
                        and value.layout is _STRIDED and not value.is_meta \
                        and not (key == "step" and not value.dim()):
                    out.append((value, p, key, group))
    return out



class OptimizerStep:
    """Methods of `Watch` (core.py) for `optimizer.step()` (state in `Watch`)."""

    def _holds_state(self, t) -> bool:
        """Whether T is a parameter or the running optimizer's state (not a temporary of
        its step)."""
        if _is_parameter(t):
            return True
        try:
            ptr = t.untyped_storage().data_ptr()
            state = getattr(self._optimizer, "state", None) or {}
            held = [x for values in state.values() for x in values.values()]
            held += [p for group in getattr(self._optimizer, "param_groups", ())
                     for p in group.get("params", ())]    # (written through `p.data`)
            return any(isinstance(x, Tensor) and x.untyped_storage().data_ptr() == ptr
                       for x in held)
        except Exception:  # noqa: BLE001 - unreadable: judged as state (a stop as before)
            return True

    def _optimizer_pre(self, optimizer, args, kwargs):
        if self._skip or _get_ident() != self._owner:
            return None
        if cuda_graph_aside():
            self._captured_step()    # (its replays are steps: graph_replays.py)
            return None
        if self._stash:
            self._deliver_stash()
        if self._win:
            self._flush_window()
        self._opt_seen = True
        if not self.exact:
            self._hold_step_grads(optimizer)
        if self._ledger:
            self._read_ledger()  # the training step's read: before the parameters change
        self._calls = []         # parameters change: earlier calls cannot be re-run
        self._accumulating = self._accumulating or self._micro > 1
        self._micro = 0
        self._opt_depth += 1
        self._optimizer = optimizer
        if (not self.exact and self._opt_depth == 1 and not self._rerunning
                and len(args or ()) <= 1 and not (kwargs or {}).get("closure")):
            # (args holds the optimizer itself; anything more is a closure, which runs
            # the model inside: the step keeps the per-op check then)
            self._opt_popped = pop_if_top(self._mode)
        return self._closure_outside_step(args, kwargs)

    def _closure_outside_step(self, args, kwargs):
        """`optimizer.step(closure)` (LBFGS, Lightning's automatic optimization) runs the
        forward and backward inside the step: the closure runs with the step's stage
        lifted, so its ops are forward and backward, and only the update is optimizer.
        Returns the step's (args, kwargs) with the closure wrapped, or None."""
        kwargs = kwargs or {}
        closure = kwargs.get("closure")
        positional = closure is None and len(args or ()) > 1 and callable(args[1])
        if positional:
            closure = args[1]          # (args[0] is the optimizer itself)
        if closure is None or not callable(closure):
            return None
        watch = self

        def closure_outside_the_step(*a, **k):
            depth, watch._opt_depth = watch._opt_depth, 0
            try:
                result = closure(*a, **k)
                if watch._ledger and not watch._skip:
                    watch._read_ledger()   # the forward and backward it ran: before the update
                return result
            finally:
                watch._opt_depth = depth

        if positional:
            return (args[0], closure_outside_the_step, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_outside_the_step}

    def _optimizer_post(self, optimizer, args, kwargs):
        if self._skip or _get_ident() != self._owner or cuda_graph_aside():
            return None
        if self._win:
            self._flush_window()
        popped, self._opt_popped = self._opt_popped, False
        try:
            if popped:
                self._check_step(optimizer)       # (with the mode still off: cheaper)
        finally:
            if popped:
                push(self._mode)
            self._opt_depth = max(0, self._opt_depth - 1)
            self._steps += 1
        if self._learning and not self._opt_depth and not self._rerunning:
            self._end_learning()        # (the first step: the roots are known)
        return None

    def _hold_step_grads(self, optimizer):
        """Before the step, on a device: the gradients it will use join the read (those
        of the roots' parameters are held already), and what it finds of them is kept
        for the step's own check, read after the update."""
        grads, params = [], []
        for group in getattr(optimizer, "param_groups", ()):
            for p in group.get("params", ()):
                g = getattr(p, "grad", None)
                if g is not None and g.is_floating_point() and g.layout is _STRIDED \
                        and not g.is_meta and not (g.is_cpu and _checks.HOST_READS):
                    grads.append(g)
                    params.append(p)
        self._step_grads = {}
        if grads:
            self._check(grads, partial(self._judge_step_grads, params, grads), alive=True,
                        defer=True)

    def _judge_step_grads(self, params, grads, bad):
        """A judge: a GradRead of each non-finite gradient."""
        verdicts = {}
        for i in bad:
            with self._own_ops():
                c = _counts(grads[i])
            if sum(c):
                known = self._taint_get(grads[i])
                verdicts[id(params[i])] = GradRead(
                    c, known is not None, bool(known and known[2]),
                    self._mark_get(grads[i]) if known else None,
                    self._amp.holds_overflow(grads[i]))
        self._step_grads = verdicts

    def _check_step(self, optimizer):
        """After a step run without the per-op check: its parameters and state tensors,
        now on the CPU, at the next read on a device (in training: the next step's); a
        non-finite one is reported by the parameter's name at the `optimizer.step()` line."""
        known = self._known_step_tensors(optimizer)
        entries, tensors = known.entries, known.tensors
        if not entries:
            return
        frame = _frames.user_frame(_caller(1))
        where = _frames.location(frame) if frame is not None else None
        later = not (_checks.HOST_READS and all(map(_is_cpu, tensors))) \
            and self._can_defer()
        # (judged later, the gradients may be gone: what the read before the step found
        # of them stands in)
        if self._check(tensors, partial(self._judge_held_step, optimizer, entries,
                                        self._steps, where,
                                        self._step_grads if later else None),
                       alive=True, defer=later, grouped=known.by_device) and later:
            self._ledger.sources.append(tensors)  # (an op that writes them reads first)

    def _known_step_tensors(self, optimizer) -> StepTensors:
        """`step_tensors(optimizer)`, kept between steps while nothing changed."""
        try:
            known = self._step_tensors.get(optimizer)
        except TypeError:                 # (an optimizer that cannot be a dict's key)
            return StepTensors(optimizer, step_tensors(optimizer))
        if known is None or not known.same_as(optimizer):
            known = self._step_tensors[optimizer] = StepTensors(optimizer,
                                                                step_tensors(optimizer))
        return known

    def _judge_held_step(self, optimizer, entries, step, where, grads, bad):
        """A judge: the step left these non-finite; read now, or at a later read (then
        GRADS, what the read before the step found of its gradients, stands in)."""
        steps, self._steps = self._steps, step
        try:
            with self._own_ops():   # (as after the step itself: the mode off)
                self._judge_step_tensors(optimizer, [entries[i] for i in bad], where=where,
                                         grads=grads)
        finally:
            self._steps = steps

    def _judge_step_tensors(self, optimizer, tensors, where=None, grads=None):
        """The stop rule for the step's tensors that may be non-finite. GRADS: what the
        read before the step found of its gradients (None: they are the `.grad`s now)."""
        reported = None
        bad = []
        for x, p, what, group in tensors:
            c = _counts(x)
            if not sum(c):
                continue
            before = self._taint_of_storage(x)
            if before is None and what != "value":
                # a state written out of place (a new tensor each step) that the step
                # before left non-finite too: carried on (no taint follows it there)
                last = self._bad_state.get((id(p), what))
                if last is not None and last[0] == self._steps - 1:
                    before = (c[0] > 0, c[1] + c[2] > 0, last[1])
            if before is not None:
                self._bad_state[(id(p), what)] = (self._steps, before[2])
                # non-finite before the step already, and judged then: the step carried
                # it on (an Inf in Adam's exp_avg_sq stays Inf), no new stop every step;
                # judged again as it is now (the next op that writes it in place sees it)
                mark = self._mark_at(x.untyped_storage().data_ptr()) if not before[2] \
                    else None
                if mark is not None and not mark.stopped and reported is None \
                        and ("nan" if c[0] else "inf") in self.break_on:
                    # (written there on purpose, and no stop made of it: marks.py)
                    name = self._names.param(p, optimizer)
                    reported = self._mark_violation(
                        mark, f"the parameter {name}" if what == "value" else
                        f"the optimizer state {what!r} of {name}", x, c, "optimizer",
                        param=name, frame=_frames.user_frame(_caller(1)))
                self._taint_add(x, c[0] > 0, c[1] + c[2] > 0, before[2])
                continue
            bad.append((x, p, what, group, c))
        lineage = []
        for x, p, what, group, c in bad:
            if grads is None:
                grad = LIVE_GRAD
                known = self._taint_get(p.grad) if isinstance(p.grad, Tensor) else None
                lineage.append(bool(known and known[2]))
            else:
                grad = grads.get(id(p))
                lineage.append(grad is not None and grad.judged and grad.from_stop)
            v = self._judge_step(optimizer, x, p, what, group, c, grad=grad, where=where)
            if v is not None and reported is None:
                reported = v
        for (x, p, what, group, c), from_stop in zip(bad, lineage):
            # (from a gradient that descends from a reported stop: so does the step's)
            self._taint_add(x, c[0] > 0, c[1] + c[2] > 0, reported is not None or from_stop)
            self._bad_state[(id(p), what)] = (self._steps, reported is not None or from_stop)
        if reported is not None:
            self._report(reported)

    # -- the verdict ------------------------------------------------------------------
    def _judge_step(self, optimizer, x, p, what, group, counts, grad=LIVE_GRAD, where=None):
        """The stop rule for a parameter (or its state) that the step left non-finite.
        GRAD: LIVE_GRAD while the step's gradient is `p.grad`; read later (a device's
        step read), what the read before the step found of it (a GradRead, or None:
        finite). WHERE: (file, line, function) of the step
        when it is not the frame's."""
        nan, posinf, neginf = counts
        kind = "nan" if nan else "inf"
        if grad is LIVE_GRAD:
            grad = p.grad
            grad_counts = _counts(grad) if isinstance(grad, Tensor) and _floating(grad) \
                else (0, 0, 0)
            judged = bool(sum(grad_counts)) and self._taint_get(grad) is not None
            mark = self._mark_get(grad) if judged else None
            overflow = judged and self._amp.holds_overflow(grad)
        else:
            read = grad if grad is not None else _FINITE_READ
            grad_counts, judged, mark, overflow = read.counts, read.judged, read.mark, \
                read.overflow
            grad = ("non-finite" if sum(grad_counts) else "finite") + \
                " when read before the step"
        created = not sum(grad_counts)
        unjudged = False
        if not created:
            if judged and mark is not None and not mark.stopped \
                    and self._opt_stop_step != self._steps \
                    and ("nan" if counts[0] else "inf") in self.break_on:
                # a gradient written on purpose (`p.grad[m] = nan`): into the parameter
                name = self._names.param(p, optimizer)
                self._opt_stop_step = self._steps
                return self._mark_violation(
                    mark, f"the parameter {name} in {type(optimizer).__name__}.step", x,
                    counts, "optimizer", param=name, frame=_frames.user_frame(_caller(3)))
            if judged and not overflow:
                return None                 # it flows on from a gradient already judged
            # a gradient no check judged (written outside the watched backward: by hand,
            # a hook, a collective after it), or the loss scaler's overflow, stepped on
            unjudged = True
            gkind = "nan" if grad_counts[0] else "inf"
            stop = gkind in self.break_on
        else:
            stop = kind in self.break_on
        if not stop or self._opt_stop_step == self._steps:
            return None
        name = self._names.param(p, optimizer)
        module, module_type = self._names.owner(name)
        patterns = tuple(_ALLOWED) + self.allow
        step_name = f"{type(optimizer).__name__}.step"
        if patterns and (matches(patterns, (step_name,)) or (module and matches(patterns, (module,)))):
            return None
        self._opt_stop_step = self._steps
        hyper = ", ".join(f"{k}={group[k]!r}" for k in ("lr", "momentum", "weight_decay", "eps")
                          if k in group and not isinstance(group[k], Tensor))
        whose = "the parameter" if what == "value" else f"its optimizer state {what!r}"
        if overflow:
            text = (f"{whose} became non-finite in {step_name}() from its gradient, which "
                    "holds the overflow GradScaler found: `scaler.step(optimizer)` skips "
                    "such a step, `optimizer.step()` does not")
        elif unjudged:
            text = (f"{whose} became non-finite in {step_name}() ({hyper}) from its "
                    "gradient, which was already non-finite: made in backward by an "
                    "overflow in layers whose gradients are checked only where they "
                    "leave them (`--watch exact` pins the op)")
        else:
            text = (f"{whose} became non-finite in {step_name}() ({hyper}); the op inside "
                    "step() is not pinned (`--watch exact` pins it)")
        frame = _frames.user_frame(_caller(3))
        file, line, function = where or _frames.location(frame)
        with self._own_ops():
            inputs = [("gradient", _summary(grad) if isinstance(grad, Tensor) else
                       grad if isinstance(grad, str) else repr(grad))]
            output = _summary(x)
        v = Violation(
            kind=kind, op="", torch_op=step_name, module=module, module_type=module_type,
            stage="optimizer", frame=frame, file=file, line=line, function=function,
            nan=nan, posinf=posinf, neginf=neginf, created=created,
            culprit="" if created else "its gradient", output=output, inputs=inputs,
            param=name, step=self._steps, text=text)
        if overflow:
            v.evidence, v.made_by = dict(STEPPED_ON_OVERFLOW), OVERFLOW_MADE_BY
        return v
