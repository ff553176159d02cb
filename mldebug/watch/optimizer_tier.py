"""The optimizer tier: `optimizer.step()` runs without the per-op check; its parameters
and their state are checked after it (on the CPU at once; on a device with the ledger's
read, which in training is the next step's), and a non-finite one is reported by the
parameter's name at the `optimizer.step()` line. Before the step, the device ledger is
read (step_ledger.py): the training step's one read, while a re-run still computes what
the step computed.

Mixed into `Watch` (core.py), called from its global optimizer hooks.
"""
from __future__ import annotations

import operator
import threading
from functools import partial

from torch import Tensor

from ..core import frames as _frames
from . import tiers as _tiers
from .checks import _caller, _counts
from .step_ledger import cuda_graph_aside, first_bad
from .verdict import LIVE_GRAD as _LIVE

_get_ident = threading.get_ident
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


class OptimizerTier:
    """Methods of `Watch` for the optimizer step (state in `Watch._t` and the Watch)."""

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
        self._forget_calls()     # parameters change: earlier calls cannot be replayed
        self._opt_depth += 1
        self._optimizer = optimizer
        t = self._t
        if (not self.exact and self._opt_depth == 1 and not t.replaying
                and len(args or ()) <= 1 and not (kwargs or {}).get("closure")):
            # (args holds the optimizer itself; anything more is a closure)
            # the step without the per-op check; parameters and state checked after it
            # (a step with a closure runs the model inside: it keeps the exact check)
            t.opt_popped = _tiers.pop_if_top(self._mode)
        return self._closure_outside_step(args, kwargs)

    def _closure_outside_step(self, args, kwargs):
        """`optimizer.step(closure)` (LBFGS, Lightning's automatic optimization) runs the
        forward and backward inside the step: the closure runs with the step's stage
        lifted, so its ops are forward and backward, and only the update is optimizer.
        Returns the step's (args, kwargs) with the closure wrapped, or None (no closure)."""
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
        t = self._t
        popped, t.opt_popped = t.opt_popped, False
        try:
            if popped:
                self._check_step(optimizer)       # (with the mode still off: cheaper)
        finally:
            if popped:
                _tiers.push(self._mode)
            self._opt_depth = max(0, self._opt_depth - 1)
            self._steps += 1
        return None

    def _check_step(self, optimizer):
        """After an optimizer step run without the per-op check: its parameters and state
        tensors, on the CPU now (one read), on a device held by the ledger and read with
        the next window (in training: the next step's read); a non-finite one is reported
        by the parameter's name, at the `optimizer.step()` line."""
        host, device = _tiers.split_by_device(_tiers.step_tensors(optimizer), _first)
        if host and _tiers.any_nonfinite_sum([x for x, _, _, _ in host]):
            self._judge_step_tensors(optimizer, host)
        if device:
            slots = self._ledger.hold([x for x, _, _, _ in device], alive=True)
            frame = _frames.user_frame(_caller(1))
            where = _frames.location(frame) if frame is not None else None
            # read later, its gradients may be gone by then: what the read before the
            # step found of them stands in (`_hold_step_grads`)
            defer = self._can_defer()
            if defer:     # (an op that writes them before the read reads first)
                self._ledger.sources.append([x for x, _, _, _ in device])
            self._read_or_defer(partial(self._judge_held_step, optimizer, device, slots,
                                        self._steps, where,
                                        self._step_grads if defer else None), defer=defer)

    def _judge_held_step(self, optimizer, entries, slots, step, where, grads, values):
        """A judge of the ledger: the step's device tensors, read now or at a later
        window (then GRADS, what the read before the step found of its gradients, stands
        in for them); the stop names the step and its line either way."""
        bad = [e for e, slot in zip(entries, slots) if first_bad(values, (slot,)) is not None]
        if not bad:
            return
        steps = self._steps
        self._steps = step
        try:
            with self._own_ops():   # (as after the step itself: the mode off)
                self._judge_step_tensors(optimizer, bad, where=where, grads=grads)
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
            if before is not None:
                # non-finite before the step already, and judged then: the step carried
                # it on (an Inf in Adam's exp_avg_sq stays Inf), no new stop every step;
                # judged again as it is now (the next op that writes it in place sees it)
                mark = self._mark_at(x.untyped_storage().data_ptr()) if not before[2] \
                    else None
                if mark is not None and not mark.stopped and reported is None:
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
                grad = _LIVE
                known = self._taint_get(p.grad) if isinstance(p.grad, Tensor) else None
                lineage.append(bool(known and known[2]))
            else:
                grad = grads.get(id(p))
                lineage.append(bool(grad and grad[1] and grad[2]))
            v = self._judge_step(optimizer, x, p, what, group, c, grad=grad, where=where)
            if v is not None and reported is None:
                reported = v
        for (x, p, what, group, c), from_stop in zip(bad, lineage):
            # (from a gradient that descends from a reported stop: so does the step's)
            self._taint_add(x, c[0] > 0, c[1] + c[2] > 0, reported is not None or from_stop)
        if reported is not None:
            self._report(reported)

    def _hold_step_grads(self, optimizer):
        """Before the step: the gradients it will use, on a device, join the read, and
        what it finds of them is kept for the step's own check (read later, when the
        gradients may be gone)."""
        _, pairs = _tiers.split_by_device(_tiers.step_grads(optimizer), _second)
        if not pairs:
            return
        slots = self._ledger.hold([g for _, g in pairs], alive=True)
        self._step_grads = {}
        self._ledger.then(partial(self._judge_step_grads, pairs, slots))

    def _judge_step_grads(self, pairs, slots, values):
        """A judge of the ledger: (counts, judged, from a stop) of each non-finite
        gradient."""
        verdicts = {}
        for (p, g), slot in zip(pairs, slots):
            if first_bad(values, (slot,)) is not None:
                with self._own_ops():
                    c = _counts(g)
                if sum(c):
                    known = self._taint_get(g)
                    verdicts[id(p)] = (c, known is not None, bool(known and known[2]),
                                       self._mark_get(g) if known is not None else None)
        self._step_grads = verdicts
