"""The watch's tiered checks, mixed into `Watch` (core.py): what the hooks do inside
module calls, around `loss.backward()` and after an optimizer step, and the replays that
pin a flagged value to its op. The design and its limits: tiers.py.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from ..core import frames as _frames
from ..core import replay as _replay
from ..core.errors import NonFiniteError
from . import safe as _safe
from . import tiers as _tiers
from .checks import (_ALLOWED, _F32, _SUM_DTYPE, _caller, _checkable, _counts, _floating,
                     _grad_enabled, _isfinite, _summary)
from .ops import matches
from .tiers import RootCall, flat_tensors

_get_ident = threading.get_ident
_HOST_READS = True      # False while tests run the device paths on the CPU


class TieredChecks:
    """Methods of `Watch` for the tiers (state in `Watch._t`, a tiers.TierState)."""

    def _check_step(self, optimizer):
        """After an optimizer step run without the per-op check: one sum per parameter
        and per state tensor, a single read; a non-finite one is reported by the
        parameter's name, at the `optimizer.step()` line."""
        tensors = _tiers.step_tensors(optimizer)
        if not _tiers.any_nonfinite_sum([x for x, _, _, _ in tensors]):
            return
        reported = None
        bad = []
        for x, p, what, group in tensors:
            c = _counts(x)
            if sum(c) and self._taint_get(x) is None:
                bad.append((x, p, what, group, c))
        for x, p, what, group, c in bad:
            v = self._judge_step(optimizer, x, p, what, group, c)
            if v is not None and reported is None:
                reported = v
        for x, p, what, group, c in bad:
            self._taint_add(x, c[0] > 0, c[1] + c[2] > 0, reported is not None)
        if reported is not None:
            self._report(reported)

    def _judge_step(self, optimizer, x, p, what, group, counts):
        """The stop rule for a parameter (or its state) that the step left non-finite."""
        nan, posinf, neginf = counts
        kind = "nan" if nan else "inf"
        grad = p.grad
        grad_counts = _counts(grad) if isinstance(grad, Tensor) and _floating(grad) else (0, 0, 0)
        created = not sum(grad_counts)
        unjudged = False
        if not created:
            known = self._taint_get(grad)
            if known is not None:
                return None                 # it flows on from a gradient already judged
            # a gradient no check judged: made by the backward of layers whose gradients
            # are not checked one by one (safe.params_to_check: only an overflow makes
            # one there), or written outside the watch
            unjudged = True
            gkind = "nan" if grad_counts[0] else "inf"
            stop = gkind in self.break_on or "inf-all" in self.break_on
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
        if unjudged:
            text = (f"{whose} became non-finite in {step_name}() ({hyper}) from its "
                    "gradient, which was already non-finite: made in backward by an "
                    "overflow in layers whose gradients are checked only where they "
                    "leave them (`--watch exact` pins the op)")
        else:
            text = (f"{whose} became non-finite in {step_name}() ({hyper}); the op inside "
                    "step() is not pinned (`--watch exact` pins it)")
        frame = _frames.user_frame(_caller(3))
        file, line, function = _frames.location(frame)
        from ..core.records import Violation
        with self._own_ops():
            inputs = [("gradient", _summary(grad) if isinstance(grad, Tensor) else repr(grad))]
            output = _summary(x)
        return Violation(
            kind=kind, op="", torch_op=step_name, module=module, module_type=module_type,
            stage="optimizer", frame=frame, file=file, line=line, function=function,
            nan=nan, posinf=posinf, neginf=neginf, created=created,
            culprit="" if created else "its gradient", output=output, inputs=inputs,
            param=name, step=self._steps, text=text)

    # -- tiers: sentinels inside module calls, replays (see tiers.py) ------------------
    def _own_ops(self):
        """mldebug's own ops (counts, summaries) off the exact mode and unwatched."""
        stack = _tiers.contextlib.ExitStack()
        stack.enter_context(self.suspended())
        stack.enter_context(_tiers.mode_off(self._mode))
        return stack

    def _sentinel(self, output, record):
        """A module's output, checked with one sum per tensor while the exact mode is off."""
        t = self._t
        outs = (output,) if isinstance(output, Tensor) else flat_tensors(output)
        sentinels = []              # by position in outs (an outermost call's are kept)
        code = record[4] if len(record) > 4 else 0
        for out in outs:
            if out is t.last_out:   # a parent returning its child's output
                sentinels.append(t.last_sentinels[-1] if t.last_sentinels else None)
                continue
            sentinels.append(None)
            sum_dtype = _SUM_DTYPE.get(out.dtype, 0)
            if sum_dtype == 0 or not _checkable(out):
                continue
            d = out.detach()        # no autograd node for our own sum
            if out.requires_grad and not code & _safe.NO_GRAD_CHECK and _grad_enabled():
                # the gradient of this output, checked when the real backward runs: a
                # pre-hook on its autograd node (cheaper to register than a tensor hook)
                node = out.grad_fn
                if node is not None:
                    sentinels[-1] = _GradSentinel(self, record, out.output_nr)
                    node.register_prehook(sentinels[-1])
            if code & _safe.NO_FORWARD_CHECK:
                continue            # the next child in its Sequential shows it
            if d.is_cpu and _HOST_READS:
                s = d.sum() if sum_dtype is None else d.sum(dtype=sum_dtype)
                if not _isfinite(s.item()) and t.flag is None:
                    self._sentinel_flag(out, record)
            else:
                t.device_sums.append((d.sum(dtype=_F32), weakref.ref(out), record))
        if outs:
            t.last_out = outs[-1]
            t.last_sentinels = sentinels

    def _sentinel_flag(self, out, record):
        with self._own_ops():
            counts = _counts(out)
        if sum(counts):             # (else: a finite sum that overflowed)
            self._t.flag = (record, counts)

    def _flush_device_sums(self):
        t = self._t
        sums, t.device_sums = t.device_sums, []
        try:
            flags = torch.isfinite(torch.stack([s for s, _, _ in sums]))
            if bool(flags.all()):     # the one sync of the outermost call
                return
            flagged = (~flags).nonzero().flatten().tolist()
        except Exception:             # mixed devices: one read per entry
            flagged = [i for i, e in enumerate(sums) if not _isfinite(float(e[0]))]
        for i in flagged:
            _, ref, record = sums[i]
            out = ref()
            if out is not None and t.flag is None:
                self._sentinel_flag(out, record)

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
            self._taint_outputs(flat_tensors(output), t.fruitless[key])
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
        if t.device_sums:
            with self._own_ops():
                self._flush_device_sums()
        flag, t.flag = t.flag, None
        rng, t.start_rng = t.start_rng, None
        sentinels, t.last_sentinels = t.last_sentinels, []
        t.last_out = None
        if output is None or rng is None:
            return                    # the call raised
        if t.done:
            # a stop was made in this call: what it returns descends from it
            self._taint_outputs(flat_tensors(output), True)
        kwargs = None
        if flag is not None and not t.done:
            record, counts = flag
            key = (id(module), tuple(c > 0 for c in counts))
            if key in t.fruitless:
                self._taint_outputs(flat_tensors(output), t.fruitless[key])
            else:
                kwargs = _tiers.call_kwargs(_caller(1))
                self._replay_forward(module, args, kwargs, rng, output, (module, None),
                                     counts, key)
        if not _grad_enabled():
            return
        outs = flat_tensors(output)
        if not any(o.requires_grad for o in outs):
            return
        if kwargs is None:
            kwargs = _tiers.call_kwargs(_caller(1))
        call = RootCall(module, args, kwargs, rng, _tiers.autocast_state(), outs)
        call.lineage = t.done
        if len(sentinels) == len(outs):
            call.sentinels = sentinels
        t.calls.append(call)
        for pos, o in enumerate(outs):
            if o.requires_grad:
                t.open[id(o)] = (call, pos)
        if len(t.calls) > _tiers.MAX_CALLS:
            self._forget_calls(t.calls[:1])

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

    def _replay(self, module, args, kwargs, rng, autocast, grads=None, record=None) -> str:
        """Run the call again under the exact mode (and its backward from GRADS, the
        gradients of its outputs by position); '' or why it could not run."""
        t = self._t
        t.replaying += 1
        t.read_now += 1
        prev_top = self._top
        reported = len(self.violations)
        try:
            with _tiers.replay_context(rng, autocast, module), \
                    (torch.enable_grad() if grads else _tiers.contextlib.nullcontext()):
                self._top = record if record is not None else (module, None)
                try:
                    out = module.forward(*args, **kwargs)
                finally:
                    self._top = prev_top
                t.replay_lineage = False
                if not grads:   # do the re-run's outputs descend from a reported stop?
                    with self._own_ops():
                        for o in flat_tensors(out):
                            known = self._taint_get(o) if _floating(o) else None
                            if known is not None and known[2]:
                                t.replay_lineage = True
                if grads:
                    flat = flat_tensors(out)
                    pairs = [(flat[pos], g) for pos, g in grads.items()
                             if pos < len(flat) and g is not None and flat[pos].requires_grad]
                    inputs = _tiers.grad_inputs(module, args)
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
            self._pending = []

    def _replay_forward(self, module, args, kwargs, rng, output, record, counts, key):
        t = self._t
        n0, j0 = len(self.violations), self._judged
        reason = ""
        try:
            reason = self._replay(module, args, kwargs, rng, _tiers.autocast_state(),
                                  record=record)
        finally:
            stopped = len(self.violations) > n0
            lineage = stopped or t.replay_lineage
            self._taint_outputs(flat_tensors(output), lineage)
        if stopped:
            t.done = True     # what flows on from it in this call is not a new stop
            return
        if self._judged > j0:
            # judged and not a stop (a constant Inf, an allowed op, a known NaN): the
            # same pattern again needs no replay, only the same judgement of its output
            if len(t.fruitless) < _tiers.MAX_PATTERNS:
                t.fruitless[key] = lineage
            return
        t.done = True
        self._report_unpinned("forward", counts, record=record, reason=reason)

    def _taint_outputs(self, tensors, lineage):
        with self._own_ops():
            for out in tensors:
                if _floating(out) and _checkable(out):
                    c = _counts(out)
                    if sum(c):
                        self._taint_add(out, c[0] > 0, c[1] + c[2] > 0, lineage)

    def _around_backward(self, proceed, tensors, grad_tensors, args, kwargs):
        """`loss.backward()`; then the stops found on autograd's device threads (CUDA
        runs backward there) pause on this thread, at the user's `backward()` line."""
        self._amp.begin([tensors] if isinstance(tensors, Tensor) else list(tensors))
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
        n0 = len(self.violations)
        armed = self._arm_output_sentinels(roots, targets)
        if not armed:
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
        t.device_grad_sums = []
        suspect = None
        t.in_backward += 1
        t.loss_bflag = None
        t.device_loss_sums = []
        try:
            result = proceed(tensors, grad_tensors, *args, **kwargs)
            if not self._skip:
                if armed:
                    self._read_output_grad_sums()
                # (with the mode still off; a loss region that needed the dry run may
                # hold other paths into parameters: then every gradient is checked)
                suspect = self._suspect_grads(calls, checked_only=bool(armed))
        finally:
            t.in_backward -= 1
            for sentinel in armed:
                sentinel.call = None
            if popped:
                _tiers.push(self._mode)
        try:
            if t.loss_bflag is not None and not self._skip:
                stopped = self._report_loss_region(roots, targets)
            after_stop = stopped or any(call.lineage for call in calls)
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
            if not opts.get("retain_graph"):
                self._forget_calls(calls)
        return result

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

    def _read_output_grad_sums(self):
        t = self._t
        sums, t.device_loss_sums = t.device_loss_sums, []
        if sums and t.loss_bflag is None:
            found = _tiers.first_nonfinite_sum([(s, (call, pos)) for s, call, pos in sums])
            if found is not None:
                (call, pos), counts = found
                t.loss_bflag = (call, pos, counts)

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

    def _suspect_grads(self, calls, checked_only=False):
        """After the real backward (exact mode still off): None when every gradient is
        finite, else (bad [(param, counts)], new of those, first bad output gradient).
        CHECKED_ONLY: leave out the gradients that follow from checked ones
        (safe.params_to_check)."""
        t = self._t
        leaves = []
        for call in calls:
            leaves.extend(_tiers.grad_inputs(call.module, call.args, checked_only))
        bflag, t.bflag = t.bflag, None
        if t.device_grad_sums:
            sums, t.device_grad_sums = t.device_grad_sums, []
            if bflag is None:
                bflag = _tiers.first_nonfinite_sum(sums)
        if bflag is None and not _tiers.nonfinite_grads(leaves):
            t.judged_grads.clear()
            return None
        bad = []
        for p in {id(p): p for call in calls
                  for p in _tiers.grad_inputs(call.module, call.args)}.values():
            if p.grad is not None and _floating(p.grad):
                c = _counts(p.grad)
                if sum(c):
                    bad.append((p, c))
        if not bad and bflag is None:
            return None              # a sum that overflowed
        new = [b for b in bad if id(b[0]) not in t.judged_grads]
        t.judged_grads = {id(p) for p, _ in bad}
        if not new and bflag is None:
            return None              # already judged (accumulating into a bad .grad)
        return bad, new, bflag

    def _pin_backward(self, calls, bad, new, bflag):
        """Replay the calls' forward and backward under the exact mode (latest first:
        backward meets them in that order) until one stops."""
        n0, j0 = len(self.violations), self._judged
        reasons = []
        try:
            for call in reversed(calls):
                if call.grads:
                    reason = self._replay(call.module, call.args, call.kwargs,
                                          (call.cpu_rng, call.cuda_rng), call.autocast,
                                          call.grads)
                    if reason:
                        reasons.append(reason)
                    if len(self.violations) > n0:
                        break
        finally:
            stopped = len(self.violations) > n0
            for p, c in bad:
                self._taint_add(p.grad, c[0] > 0, c[1] + c[2] > 0, stopped)
        if stopped or self._judged > j0:
            return
        if not new:
            record, counts = bflag
            self._report_unpinned("backward", counts, record=record, reason="; ".join(
                reasons) or "a re-run of the model's call and its backward made only finite "
                "gradients (the call is not repeatable)")
            return
        p, counts = new[0]
        self._report_unpinned("backward", counts, param=p,
                              reason="; ".join(reasons) or "a re-run of the model's call and "
                              "its backward made only finite gradients (the Inf/NaN comes "
                              "from code outside the model's modules, e.g. a loss term that "
                              "uses the parameter directly, or the call is not repeatable)")

    def _report_unpinned(self, stage, counts, record=None, param=None, reason="",
                         what=None):
        """A sentinel saw a NaN/Inf that the replay could not narrow to one op: still a
        stop, at module (forward) or parameter (backward) level, saying why."""
        nan, posinf, neginf = counts
        kind = "nan" if nan else "inf"
        if kind not in self.break_on and not (kind == "inf" and "inf-all" in self.break_on):
            return
        if stage == "backward" and self._amp.excuses():
            return            # a loss scaler's overflow: GradScaler skips this step
        if stage == "backward":
            reason = self._amp.with_note(reason)
        from ..core.records import Violation
        frame = _frames.user_frame(_caller(1))
        file, line, function = _frames.location(frame)
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
                      output=output, param=name, step=self._steps if self._opt_seen else None, text=text)
        self._report(v)


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
                # no sync here: read with the parameters' gradients
                t.device_grad_sums.append((grad.detach().sum(dtype=_F32), self.record))
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
            t.device_loss_sums.append((grad.detach().sum(dtype=_F32), self.call, self.pos))
        elif t.loss_bflag is None:
            counts = _cpu_nonfinite_counts(grad)
            if counts is not None:
                t.loss_bflag = (self.call, self.pos, counts)


def _cpu_nonfinite_counts(grad):
    """A CPU gradient (floating, checkable): one sum; exact (nan, +inf, -inf) counts when
    it holds a NaN/Inf, else None (also for a finite sum that merely overflowed)."""
    sum_dtype = _SUM_DTYPE[grad.dtype]
    s = grad.sum() if sum_dtype is None else grad.sum(dtype=sum_dtype)
    if _isfinite(s.item()):
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
