"""The backward tier: `loss.backward()` runs the loss region under the exact mode (a dry
run, skipped when its nodes are all safe.SAFE_BACKWARD), the model's backward without
it, then one check of the gradients (`_GradSentinel` on the model outputs' nodes, one
sum per parameter gradient); a bad one replays the model call and its backward under
the exact mode (`_pin_backward`). The design and its limits: tiers.py.

Mixed into `Watch` (core.py), called around backward by autograd_patch.
"""
from __future__ import annotations

import threading
from functools import partial

import torch
from torch import Tensor

from ..core import replay as _replay
from ..core.errors import NonFiniteError
from . import safe as _safe
from . import tiers as _tiers
from .checks import _SUM_DTYPE, _checkable, _counts, _floating, _isfinite
from .native_check import nonfinite as _native_nonfinite
from .step_ledger import cuda_graph_aside, counts_of, first_bad, first_bad_entry

_get_ident = threading.get_ident
_HOST_READS = True      # False while tests run the device paths on the CPU


class BackwardTier:
    """Methods of `Watch` for backward (state in `Watch._t`, a tiers.TierState)."""

    def _around_backward(self, proceed, tensors, grad_tensors, args, kwargs):
        """`loss.backward()`; then the stops found on autograd's device threads (CUDA
        runs backward there) pause on this thread, at the user's `backward()` line."""
        if cuda_graph_aside():   # a backward captured into a CUDA graph: not looked into
            return proceed(tensors, grad_tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if self._marks and not self._skip and _get_ident() == self._owner \
                and not self._t.replaying:
            self._check_loss_marks(roots)   # a NaN/Inf written on purpose: not in a loss
        self._amp.begin(roots)
        try:
            result = self._tiered_backward(proceed, tensors, grad_tensors, args, kwargs)
        finally:
            self._amp.end()
        if self._stash and _get_ident() == self._owner:
            self._deliver_stash()
        return result

    def _tiered_backward(self, proceed, tensors, grad_tensors, args, kwargs):
        """The loss region exactly (dry run), the model's backward without the mode,
        then one check of the gradients; a bad one is replayed."""
        t = self._t
        if (self._skip or self.exact or _get_ident() != self._owner or t.in_backward
                or t.replaying or not t.calls):
            return proceed(tensors, grad_tensors, *args, **kwargs)
        opts = dict(zip(("retain_graph", "create_graph", "grad_variables", "inputs"), args))
        opts.update(kwargs)
        if opts.get("create_graph") or opts.get("inputs") is not None \
                or opts.get("grad_variables") is not None:
            return proceed(tensors, grad_tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        root_ids = {id(r) for r in roots}
        targets = []     # (call, position, tensor or autograd edge of that output)
        for call in t.calls:
            for pos, ref in enumerate(call.outs):
                o = ref() if ref is not None else None
                if o is not None and id(o) in root_ids:
                    targets.append((call, pos, o))
                elif pos in call.used:
                    targets.append((call, pos, call.used[pos]))
        if not targets:
            return proceed(tensors, grad_tensors, *args, **kwargs)   # exact all through
        if t.judged_grads:
            self._forget_reset_grads()
        if self._ledger.backwards:
            # one backward's judge waits for the step's read at a time (it keeps its
            # gradients): a second backward before the step (gradient accumulation)
            # reads the first one's now
            self._read_ledger()
        n0 = len(self.violations)
        armed = self._arm_output_sentinels(roots, targets)
        if not armed:
            if self._ledger or self._win:
                self._read_ledger()   # the dry run judges now: what came before, first
                self._check_loss_marks(roots)    # (a constant written in the loss: marks.py)
            t.read_now += 1
            try:
                with _replay.replaying():
                    grads = torch.autograd.grad(roots, [o for _, _, o in targets],
                                                grad_tensors, retain_graph=True,
                                                allow_unused=True)
            except Exception as exc:  # noqa: BLE001 - the real call raises what it raises
                if isinstance(exc, NonFiniteError) or len(self.violations) > n0:
                    raise     # from a stop in the dry run: `q` at its prompt, action='raise'
                return proceed(tensors, grad_tensors, *args, **kwargs)
            finally:
                t.read_now -= 1
            if self._stash:   # a stop made on autograd's device thread: pause here, now
                self._deliver_stash()
            for (call, pos, _), g in zip(targets, grads):
                if g is not None:
                    call.grads[pos] = g
        stopped = len(self.violations) > n0
        calls = []
        for call, _, _ in targets:
            if call not in calls:
                calls.append(call)
        popped = _tiers.pop_if_top(self._mode)
        t.bflag = None
        t.device_grad_slots = []
        t.in_backward += 1
        t.loss_bflag = None
        t.device_loss_slots = []
        checks = None
        try:
            result = proceed(tensors, grad_tensors, *args, **kwargs)
            if not self._skip:
                # (with the mode still off; a loss region that needed the dry run may
                # hold other paths into parameters: then every gradient is checked)
                checks = self._gradient_checks(calls, checked_only=bool(armed))
        finally:
            t.in_backward -= 1
            for sentinel in armed:
                sentinel.call = None
            if popped:
                _tiers.push(self._mode)
        if not opts.get("retain_graph"):
            self._forget_calls(calls)     # (a judge keeps what it needs of them)
        if checks is None:
            return result
        judge = partial(self._judge_backward, checks, roots, targets, calls, stopped)
        if checks.device:
            self._ledger.backwards += 1
            self._ledger.sources.extend(calls)   # (its re-run computes from them)
            self._read_or_defer(judge, always=True)
        else:
            judge(None)
        return result

    def _forget_reset_grads(self):
        """Before a backward: a parameter whose non-finite gradient was judged is no
        longer judged once its gradient was reset (`zero_grad()`: None, or zeros), so a
        NaN/Inf this backward makes there again is new, not one accumulated into the old
        (the output gradient of a layer in RootCall.shown has no check of its own to
        say so). A read each only for gradients kept since as zeros: rare."""
        t = self._t
        kept = {}
        with self._own_ops():
            for key, p in t.judged_grads.items():
                g = p.grad
                if g is not None and _tiers.any_nonfinite_sum([g]):
                    kept[key] = p
        t.judged_grads = kept

    def _gradient_checks(self, calls, checked_only):
        """Right after the real backward: the gradients on the CPU checked now, those on
        a device held by the ledger for the judge of this backward."""
        t = self._t
        leaves = []
        for call in calls:
            leaves.extend(_tiers.grad_inputs(call.module, call.args, checked_only,
                                             call.shown))
        checks = _GradientChecks()
        checks.loss_bflag, t.loss_bflag = t.loss_bflag, None
        checks.bflag, t.bflag = t.bflag, None
        checks.loss_slots, t.device_loss_slots = t.device_loss_slots, []
        checks.grad_slots, t.device_grad_slots = t.device_grad_slots, []
        host, device = _tiers.split_by_device(_tiers.floating_grads(leaves))
        checks.host_bad = _tiers.any_nonfinite_sum(host) if host else False
        checks.leaf_slots = self._ledger.hold(device, alive=True) if device else ()
        checks.device = bool(checks.loss_slots or checks.grad_slots or device)
        return checks

    def _judge_backward(self, checks, roots, targets, calls, stopped, values):
        """A judge of the ledger (always run): the gradients' verdict, a replay of the
        model's backward for a bad one (`_pin_backward`)."""
        t = self._t
        if values is not None and self._marks:
            self._check_loss_marks(roots, site=("", 0, ""))   # (the loss, judged by now)
        loss_bflag, bflag = checks.loss_bflag, checks.bflag
        found = first_bad_entry(values, checks.loss_slots) if loss_bflag is None else None
        if found is not None:
            (_, call, pos), value = found
            loss_bflag = (call, pos, counts_of(value))
        found = first_bad_entry(values, checks.grad_slots) if bflag is None else None
        if found is not None:
            (_, record), value = found
            bflag = (record, counts_of(value))
        if bflag is None and not checks.host_bad \
                and first_bad(values, checks.leaf_slots) is None:
            t.judged_grads.clear()       # every gradient finite
            if loss_bflag is None:
                return
            suspect = None
        else:
            with self._own_ops():
                suspect = self._suspect_grads(calls, bflag)
        t.loss_bflag = loss_bflag
        try:
            after_stop = stopped or any(call.lineage for call in calls)
            if t.loss_bflag is not None and not self._skip and not after_stop \
                    and not self._outputs_judged(calls):
                # (judged at the step's read, after the forward: a model output judged
                # non-finite since made the loss's gradient so, not an overflow there)
                after_stop = self._report_loss_region(roots, targets)
            if (after_stop or t.loss_bflag is not None) and suspect is not None:
                # the forward or the loss's backward made them (a stop there, or the
                # unchecked region's overflow): the bad gradients descend from that (the
                # optimizer must not call them a new one), no replay of the model's
                # backward (whose forward would make that stop again)
                for p, c in suspect[0]:
                    self._taint_add(p.grad, c[0] > 0, c[1] + c[2] > 0, after_stop)
            elif suspect is not None and not self._skip:
                self._pin_backward(calls, *suspect)
        finally:
            t.loss_bflag = None

    def _arm_output_sentinels(self, roots, targets) -> list:
        """When the loss region (the autograd graph from the loss down to the model's
        outputs) is made only of nodes whose backward cannot make a NaN/Inf from finite
        values (safe.SAFE_BACKWARD), the dry run is skipped: the pre-hooks on the model
        outputs' nodes then keep each output's gradient for a replay and check it.
        [] when the dry run is needed: also while a non-finite value judged before is
        alive (the loss region may then be non-finite already: its backward is judged
        op by op)."""
        if not self._no_live_taint():
            return []
        armed = []
        for call, pos, _ in targets:
            sentinel = call.sentinels[pos] if pos < len(call.sentinels) else None
            if sentinel is None:
                return []          # an output without a pre-hook: no gradient to keep
            armed.append((sentinel, call, pos))
        if not _safe.loss_region_safe(roots, boundary_of(targets)):
            return []
        for sentinel, call, pos in armed:
            sentinel.call, sentinel.pos = call, pos
        return [sentinel for sentinel, _, _ in armed]

    def _report_loss_region(self, roots, targets) -> bool:
        """A model output's gradient came out of the unchecked loss region non-finite
        (an overflow): a stop at `loss.backward()` that names the region's nodes."""
        call, pos, counts = self._t.loss_bflag
        n0 = len(self.violations)
        nodes = _safe.loss_region_nodes(roots, boundary_of(targets))
        module, module_type = self._names.path((call.module, None))
        self._report_unpinned(
            "backward", counts, record=(call.module, None),
            what=f"the gradient of output {pos} of {module or module_type}",
            reason=f"the loss's backward ({', '.join(nodes) or 'no node'}) made it from "
                   "finite values (an overflow); it runs op by op only with "
                   "`--watch exact`, which pins the op")
        return len(self.violations) > n0

    def _outputs_judged(self, calls) -> bool:
        """Whether an output of CALLS still alive holds a NaN/Inf judged already."""
        for call in calls:
            for ref in call.outs:
                o = ref() if ref is not None else None
                if o is not None and self._taint_get(o) is not None:
                    return True
        return False

    def _suspect_grads(self, calls, bflag):
        """Some gradient may be non-finite (BFLAG: the first bad output gradient, or
        None): None when no parameter gradient is (a finite sum that overflowed), else
        (bad [(param, counts)], new of those, BFLAG)."""
        t = self._t
        bad = []
        for p in {id(p): p for call in calls
                  for p in _tiers.grad_inputs(call.module, call.args, shown=call.shown)
                  }.values():
            if p.grad is not None and _floating(p.grad):
                c = _counts(p.grad)
                if sum(c):
                    bad.append((p, c))
        if not bad and bflag is None:
            return None              # a sum that overflowed
        new = [b for b in bad if id(b[0]) not in t.judged_grads]
        t.judged_grads = {id(p): p for p, _ in bad}
        if not new and bflag is None:
            return None              # already judged (accumulating into a bad .grad)
        return bad, new, bflag

    def _pin_backward(self, calls, bad, new, bflag):
        """Replay the calls' forward and backward under the exact mode (latest first:
        backward meets them in that order) until one stops."""
        n0, j0 = len(self.violations), self._judged
        reasons = []
        self._flowed_mark = None
        try:
            for call in reversed(calls):
                if call.grads:
                    reason = self._replay(call.module, call.args, call.kwargs,
                                          (call.cpu_rng, call.cuda_rng), call.autocast,
                                          call.grads, shown=call.shown, site=call.site)
                    if reason:
                        reasons.append(reason)
                    if len(self.violations) > n0:
                        break
        finally:
            stopped = len(self.violations) > n0
            # (a value written on purpose that flowed into them: the step's check says so)
            flowed = None if stopped else self._flowed_mark
            for p, c in bad:
                self._taint_add(p.grad, c[0] > 0, c[1] + c[2] > 0, stopped, mark=flowed)
        if stopped or self._judged > j0:
            return
        if not new:
            record, counts = bflag
            self._report_unpinned("backward", counts, record=record, reason="; ".join(
                reasons) or "a re-run of the model's call and its backward made only finite "
                "gradients (the call is not repeatable)")
        else:
            p, counts = new[0]
            self._report_unpinned("backward", counts, param=p, reason="; ".join(reasons) or
                                  "a re-run of the model's call and its backward made only "
                                  "finite gradients (the Inf/NaN comes from code outside the "
                                  "model's modules, e.g. a loss term that uses the parameter "
                                  "directly, or the call is not repeatable)")
        if len(self.violations) > n0:
            for p, c in bad:    # what the step makes of them descends from this stop
                self._taint_add(p.grad, c[0] > 0, c[1] + c[2] > 0, True)


class _GradientChecks:
    """What the checks right after a backward found (on the CPU) or hold (on a device)."""

    __slots__ = ("loss_bflag", "bflag", "loss_slots", "grad_slots", "host_bad",
                 "leaf_slots", "device")


class _GradSentinel:
    """Pre-hook on the autograd node of a module output: the output's gradient, checked
    with one sum during the real backward (where the exact mode is off); the first bad
    one flags the backward."""

    __slots__ = ("w", "record", "index", "call", "pos")

    def __init__(self, watch, record, index):
        self.w = watch
        self.record = record
        self.index = index
        self.call = None    # armed by a backward that skips the dry run: (RootCall,
        self.pos = None     # position) whose gradient this is, kept for a replay

    def __call__(self, grad_outputs):
        t = self.w._t
        if not t.in_backward or self.index >= len(grad_outputs):
            return None
        grad = grad_outputs[self.index]
        if self.call is not None:
            if isinstance(grad, Tensor):
                self._keep(t, grad)     # (its own check: what it finds is the loss's)
            return None
        if t.bflag is not None:
            return None
        if isinstance(grad, Tensor) \
                and _SUM_DTYPE.get(grad.dtype, 0) != 0 and _checkable(grad):
            if not (grad.is_cpu and _HOST_READS):
                # no op here: held by the ledger, read with the parameters' gradients
                if grad.numel():
                    t.device_grad_slots.append((self.w._ledger.hold((grad,))[0],
                                                self.record))
                return None
            counts = _cpu_nonfinite_counts(grad)
            if counts is not None:
                t.bflag = (self.record, counts)
        return None

    def _keep(self, t, grad):
        """A model output's gradient, straight from the unchecked loss region."""
        self.call.grads[self.pos] = grad
        if _SUM_DTYPE.get(grad.dtype, 0) == 0 or not _checkable(grad):
            return
        if not (grad.is_cpu and _HOST_READS):
            if grad.numel():           # (kept by the call: held without a bound)
                t.device_loss_slots.append((self.w._ledger.hold((grad,), alive=True)[0],
                                            self.call, self.pos))
        elif t.loss_bflag is None:
            counts = _cpu_nonfinite_counts(grad)
            if counts is not None:
                t.loss_bflag = (self.call, self.pos, counts)


def _cpu_nonfinite_counts(grad):
    """A CPU gradient (floating, checkable): one sum; exact (nan, +inf, -inf) counts when
    it holds a NaN/Inf, else None (also for a finite sum that merely overflowed)."""
    bad = _native_nonfinite(grad)                  # no op, no read; None: not readable
    if bad is None:
        sum_dtype = _SUM_DTYPE[grad.dtype]
        s = grad.sum() if sum_dtype is None else grad.sum(dtype=sum_dtype)
        bad = not _isfinite(s.item())
    if not bad:
        return None
    counts = _counts(grad)
    return counts if sum(counts) else None


def boundary_of(targets) -> dict:
    """id(node) -> node of the autograd nodes of the model outputs that backward meets
    (a tensor's grad_fn, or the node of a kept gradient edge)."""
    nodes = {}
    for _, _, o in targets:
        node = o.grad_fn if isinstance(o, Tensor) else getattr(o, "node", None)
        if node is not None:
            nodes[id(node)] = node
    return nodes
