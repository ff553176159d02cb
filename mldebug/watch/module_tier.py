"""The module tier: inside an outermost module call the exact mode is off, and each
module's output is checked by a sentinel (one sum) in the global forward hook; a flagged
call is replayed under the exact mode, which stops at the op that made the value. The
output sentinels also arm the gradient sentinels of backward_tier.py, and the outermost
calls are remembered there for a backward replay. The design and its limits: tiers.py.

Mixed into `Watch` (core.py), called from its module hooks.
"""
from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import Tensor

from ..core import frames as _frames
from ..core.errors import NonFiniteError
from . import safe as _safe
from . import tiers as _tiers
from .backward_tier import _GradSentinel
from .checks import (_SUM_DTYPE, _caller, _checkable, _counts, _floating,
                     _grad_enabled, _isfinite)
from .tiers import RootCall, flat_tensors
from .native_check import nonfinite as _native_nonfinite
from .step_ledger import counts_of

_HOST_READS = True      # False while tests run the device paths on the CPU
# in place of a gradient sentinel: the output's gradient is checked in its module's
# parameter gradients after backward (safe.params_show_grad; a parent returning the
# output passes it on, an outermost call puts a sentinel of its own there)
_BY_PARAMS = "checked in its module's parameter gradients"


class ModuleTier:
    """Methods of `Watch` for module calls (state in `Watch._t`, a tiers.TierState)."""

    def _sentinel(self, output, record):
        """A module's output, checked with one sum per tensor while the exact mode is off."""
        t = self._t
        outs = (output,) if isinstance(output, Tensor) else flat_tensors(output)
        sentinels = []              # by position in outs (an outermost call's are kept)
        code = record[4] if len(record) > 4 else 0
        for out in outs:
            if out is t.last_out:   # a parent returning its child's output
                shared = t.last_sentinels[-1] if t.last_sentinels else None
                if shared is _BY_PARAMS and record[1] is None:
                    # an outermost call's output gradient is kept for a replay: its own
                    shared = self._grad_sentinel(out, record)
                sentinels.append(shared)
                continue
            sentinels.append(None)
            sum_dtype = _SUM_DTYPE.get(out.dtype, 0)
            if sum_dtype == 0 or not _checkable(out):
                continue
            if out.requires_grad and not code & _safe.NO_GRAD_CHECK and _grad_enabled():
                # (none where its module's parameter gradients show it: checked after
                # backward)
                sentinels[-1] = _BY_PARAMS if code & _safe.PARAMS_SHOW_GRAD \
                    else self._grad_sentinel(out, record)
            if code & _safe.NO_FORWARD_CHECK:
                continue            # the next child in its Sequential shows it
            if out.is_cpu and _HOST_READS:
                bad = _native_nonfinite(out)       # no op, no read; None: not readable
                if bad is None:
                    d = out.detach()               # no autograd node for our own sum
                    s = d.sum() if sum_dtype is None else d.sum(dtype=sum_dtype)
                    bad = not _isfinite(s.item())
                if bad and t.flag is None:
                    self._sentinel_flag(out, record)
            elif out.numel():                      # (an empty tensor holds nothing)
                # no op here: held by the ledger, checked with the rest of the window
                t.device_outputs.append((self._ledger.hold((out,))[0],
                                         weakref.ref(out), record))
        if outs:
            t.last_out = outs[-1]
            t.last_sentinels = sentinels

    def _grad_sentinel(self, out, record):
        """The gradient of OUT (needs one), checked when the real backward runs: a
        pre-hook on its autograd node (cheaper to register than a tensor hook)."""
        node = out.grad_fn
        if node is None:
            return None
        sentinel = _GradSentinel(self, record, out.output_nr)
        node.register_prehook(sentinel)
        return sentinel

    def _sentinel_flag(self, out, record):
        with self._own_ops():
            counts = _counts(out)
        if sum(counts):             # (else: a finite sum that overflowed)
            self._t.flag = (record, counts)

    def _flag_outputs(self, entries, values):
        """A judge of the ledger: flag the first of ENTRIES [(slot, weakref(output),
        record)] whose output is not finite (exact counts while it is alive)."""
        t = self._t
        for slot, ref, record in entries:
            if t.flag is not None:
                return
            value = values.get(slot, 0.0)
            if _isfinite(value):
                continue
            out = ref()
            if out is not None:
                self._sentinel_flag(out, record)
            else:
                t.flag = (record, counts_of(value))

    def _flagged_call(self, module, args, output, record):
        """A sentinel flagged this call's output (or a call inside it deferred to it).
        If its inputs were already non-finite, the value was made before it, by its
        caller's own code: defer to the caller. Else replay this call under the exact
        mode, which stops at the op that made the value."""
        t = self._t
        counts = t.flag[1]
        key = (id(module), tuple(c > 0 for c in counts))
        if key in t.fruitless:
            t.flag = None             # replayed before: judged, not a stop
            self._taint_outputs(flat_tensors(output), t.fruitless[key],
                                t.fruitless_marks.get(key))
            return
        kwargs = _tiers.call_kwargs(_caller(1))
        parent = record[1]
        no_rng = len(record) > 2 and record[2] is None      # (see Watch._module_pre)
        if parent is not None and (no_rng or _tiers.any_nonfinite((args, kwargs))):
            t.flag = (parent, counts)
            return
        t.flag = None
        rng = record[2] if len(record) > 2 and record[2] is not None else t.start_rng
        _tiers.push(self._mode)       # the replay runs under the exact mode
        try:
            self._replay_forward(module, args, kwargs, rng, output, record, counts, key)
        finally:
            _tiers.pop_if_top(self._mode)

    def _root_end(self, module, args, output):
        """The outermost call returned (exact mode back on): replay it if a device
        sentinel flagged it; remember it for a backward replay if its output needs a
        gradient."""
        t = self._t
        entries, t.device_outputs = t.device_outputs, []
        # a training forward waits for its step's read (a call that raised, one without
        # a gradient, or a 5th call before a step: read now)
        defer = bool(entries) and output is not None and t.start_rng is not None \
            and self._ledger.calls < _tiers.MAX_CALLS and self._can_defer() \
            and _grad_enabled() and any(o.requires_grad for o in flat_tensors(output))
        if entries and not defer:
            self._read_or_defer(partial(self._flag_outputs, entries), defer=False)
            if self._nan_marks:   # (what its arguments hold is judged now: marks.py)
                self._check_call_marks(module, args)
        flag, t.flag = t.flag, None
        rng, t.start_rng = t.start_rng, None
        sentinels, t.last_sentinels = t.last_sentinels, []
        shown, t.shown = t.shown, {}
        t.last_out = None
        if output is None or rng is None:
            return                    # the call raised
        if t.done:
            # a stop was made in this call: what it returns descends from it
            self._taint_outputs(flat_tensors(output), True)
        kwargs = None
        if flag is not None and not t.done:
            kwargs = _tiers.call_kwargs(_caller(1))
            self._judge_flagged_root(module, args, kwargs, rng, flat_tensors(output),
                                     flag[1], flagged=flag[0])
        if not _grad_enabled():
            return
        outs = flat_tensors(output)
        if not any(o.requires_grad for o in outs):
            return
        if kwargs is None:
            kwargs = _tiers.call_kwargs(_caller(1))
        call = RootCall(module, args, kwargs, rng, _tiers.autocast_state(), outs,
                        site=_frames.location(_frames.user_frame(_caller(1))))
        call.lineage = t.done
        if len(sentinels) == len(outs):
            call.sentinels = sentinels
        call.shown = list(shown.values())
        t.calls.append(call)
        for pos, o in enumerate(outs):
            if o.requires_grad:
                t.open[id(o)] = (call, pos)
        if len(t.calls) > _tiers.MAX_CALLS:
            self._forget_calls(t.calls[:1])
        if defer:
            # judged at the training step's read (step_ledger.py), re-run from `call`
            self._ledger.calls += 1
            self._ledger.sources.append(call)
            self._read_or_defer(partial(self._judge_deferred_call, call, entries,
                                        [weakref.ref(o) for o in outs]))

    def _judge_deferred_call(self, call, entries, out_refs, values):
        """A judge of the ledger: an outermost call read after it returned (at the
        training step's read), done as `_root_end` does it, from what `call` kept."""
        t = self._t
        flag, done = t.flag, t.done
        t.flag, t.done = None, False
        try:
            if self._nan_marks:   # (what its arguments hold is judged now: marks.py)
                self._check_call_marks(call.module, call.args, call.kwargs,
                                       getattr(call, "site", None))
            self._flag_outputs(entries, values)
            if t.flag is None:
                return
            (flagged, counts), t.flag = t.flag, None
            outs = [o for o in (r() for r in out_refs) if o is not None]
            self._judge_flagged_root(call.module, call.args, call.kwargs,
                                     (call.cpu_rng, call.cuda_rng), outs, counts,
                                     autocast=call.autocast, flagged=flagged, site=call.site)
            call.lineage = call.lineage or t.done
        finally:
            t.flag, t.done = flag, done

    def _judge_flagged_root(self, module, args, kwargs, rng, outs, counts, autocast=None,
                            flagged=None, site=None):
        """An outermost call whose output a sentinel flagged: judged as its pattern was
        before (a replay that found no stop), else re-run under the exact mode. FLAGGED:
        the record of the call whose output the sentinel flagged (read after the call,
        on a device), named if the re-run does not pin the op."""
        t = self._t
        key = (id(module), tuple(c > 0 for c in counts))
        if key in t.fruitless:
            self._taint_outputs(outs, t.fruitless[key], t.fruitless_marks.get(key))
            return
        self._replay_forward(module, args, kwargs, rng, outs, (module, None), counts, key,
                             autocast=autocast, unpinned=flagged, site=site)

    def _forget_calls(self, calls=None):
        t = self._t
        if calls is None:
            t.calls = []
            t.open.clear()
            return
        gone = {id(c) for c in calls}
        t.calls = [c for c in t.calls if id(c) not in gone]
        for key in [k for k, (c, _) in t.open.items() if id(c) in gone]:
            del t.open[key]

    def _mark_used(self, args):
        """An op outside modules reads an outermost call's output: the loss region's
        gradient flows into it (the dry run of `_around_backward` computes it). Its
        autograd edge is kept (the tensor object itself is often a temporary)."""
        found = self._open
        for a in args:
            if isinstance(a, Tensor):
                hit = found.get(id(a))
                if hit is not None and hit[0].outs[hit[1]]() is a:
                    hit[0].use(hit[1], a)
            elif type(a) is list or type(a) is tuple:
                for x in a:
                    hit = found.get(id(x)) if isinstance(x, Tensor) else None
                    if hit is not None and hit[0].outs[hit[1]]() is x:
                        hit[0].use(hit[1], x)

    def _replay(self, module, args, kwargs, rng, autocast, grads=None, record=None,
                shown=(), site=None) -> str:
        """Run the call again under the exact mode (and its backward from GRADS, the
        gradients of its outputs by position, to its parameters, its leaf arguments and
        those of SHOWN, RootCall.shown); '' or why it could not run. SITE: the user's
        line of the call (RootCall.site), which a stop made in library code directly
        under it names (TierState.replay_site)."""
        t = self._t
        t.replaying += 1
        t.read_now += 1
        prev_top = self._top
        prev_site = t.replay_site
        if site is not None and site[0]:
            started = _frames.location(_frames.user_frame(_caller(1)))
            t.replay_site = (started[:2], site)
        reported = len(self.violations)
        try:
            with _tiers.replay_context(rng, autocast, module), \
                    (torch.enable_grad() if grads else _tiers.contextlib.nullcontext()):
                self._top = record if record is not None else (module, None)
                try:
                    out = module.forward(*args, **kwargs)
                finally:
                    self._top = prev_top
                t.replay_lineage, t.replay_mark = False, None
                if not grads:   # do the re-run's outputs descend from a reported stop?
                    with self._own_ops():
                        for o in flat_tensors(out):
                            known = self._taint_get(o) if _floating(o) else None
                            if known is not None and known[2]:
                                t.replay_lineage = True
                            elif known is not None and t.replay_mark is None:
                                # (or from a constant written on purpose: marks.py)
                                t.replay_mark = self._mark_get(o)
                if grads:
                    flat = flat_tensors(out)
                    pairs = [(flat[pos], g) for pos, g in grads.items()
                             if pos < len(flat) and g is not None and flat[pos].requires_grad]
                    inputs = _tiers.grad_inputs(module, args, shown=shown)
                    if pairs and inputs:
                        torch.autograd.grad([o for o, _ in pairs], inputs,
                                            [g for _, g in pairs], allow_unused=True)
            return ""
        except Exception as exc:  # noqa: BLE001 - the original call succeeded: never fail it
            if isinstance(exc, NonFiniteError) or len(self.violations) > reported:
                raise     # from the stop itself: `q` at the prompt (BdbQuit), action='raise'
            return f"re-running it raised {type(exc).__name__}: {exc}"
        finally:
            self._top = prev_top
            t.replaying -= 1
            t.read_now -= 1
            t.replay_site = prev_site
            self._pending = []

    def _replay_forward(self, module, args, kwargs, rng, output, record, counts, key,
                        autocast=None, unpinned=None, site=None):
        t = self._t
        n0, j0 = len(self.violations), self._judged
        reason = ""
        if autocast is None:
            autocast = _tiers.autocast_state()
        try:
            reason = self._replay(module, args, kwargs, rng, autocast, record=record,
                                  site=site)
        finally:
            stopped = len(self.violations) > n0
            lineage = stopped or t.replay_lineage
            mark = None if lineage else t.replay_mark
            self._taint_outputs(flat_tensors(output), lineage, mark)
        if stopped:
            t.done = True     # what flows on from it in this call is not a new stop
            return
        if self._judged > j0:
            # judged and not a stop (a constant Inf, an allowed op, a known NaN): the
            # same pattern again needs no replay, only the same judgement of its output
            if len(t.fruitless) < _tiers.MAX_PATTERNS:
                t.fruitless[key] = lineage
                t.fruitless_marks[key] = mark
            return
        t.done = True
        self._report_unpinned("forward", counts, record=unpinned or record, reason=reason)

    def _taint_outputs(self, tensors, lineage, mark=None):
        """TENSORS (a call's outputs) judged: descending from a stop (LINEAGE) or, MARK,
        from a constant written on purpose (marks.py)."""
        with self._own_ops():
            for out in tensors:
                if _floating(out) and _checkable(out):
                    c = _counts(out)
                    if sum(c):
                        self._taint_add(out, c[0] > 0, c[1] + c[2] > 0, lineage,
                                        mark=None if mark is None else mark.flowing())
