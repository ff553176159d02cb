"""A healthy training step, in the order it runs: what the watch does at each point.

    model(x)         a root's pre-hook (roots.py): a RootCall (the arguments as passed,
                     the RNG, autocast, the buffers as the call starts); the per-op check
                     goes off the stack. Every module below runs on torch's fast call
                     path: nothing of mldebug's.
                     its post-hook: the per-op check back on; the outputs checked; a
                     pre-hook on each output's autograd node keeps its gradient.
    loss = f(out)    the per-op check (dispatch.py): every op outside the roots.
    loss.backward()  the loss region (the autograd nodes from the loss down to the roots'
                     outputs) runs op by op under the per-op check first, when it can
                     make a NaN/Inf from finite values (the "dry run"); the real backward
                     runs without the mode. Then the outputs' gradients and the roots'
                     parameter gradients are checked.
    opt.step()       (update.py) pre-hook: on a device, the step's ONE read (before the
                     update); the step runs without the mode. post-hook: the parameters
                     and the optimizer's state are checked (on a device, at the next read).

A check on the CPU is the C bit test (native_check.py: no op, no read), at once; on a
device its tensors are held by the ledger (step_ledger.py) and read once, at the step
(at a call's end when no step comes: no optimizer seen, no gradient, a loss scaler, a
fifth waiting call). What a check finds goes to its judge: a root's bad output or a bad
parameter gradient re-runs the call (rerun.py); a bad output gradient with an unchecked
loss region is that region's overflow; a bad parameter or state after the step is the
step's (update.py `_judge_step`).

What it cannot see: a NaN/Inf made inside a root and absorbed before its output and its
gradients (an Inf that `tanh` saturates in a forward whose backward stays finite, an
infinite derivative that a ReLU's backward masks). The full watch sees them (`exact`,
and the first step, while the roots are learned).
"""
from __future__ import annotations

import threading
import weakref
from functools import partial

import torch
import torch.distributed
from torch import Tensor

from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core import replay as _replay
from ..core.errors import NonFiniteError
from ..core.structs import tensors_in
from . import checks as _checks
from .checks import (_PLAIN, _STRIDED, _caller, _counts, _in_transform, _is_cpu,
                     _isfinite, host_nonfinite, pop_if_top, push)
from .checks import host_bad as host_bad_of
from .roots import (RootCall, _Backward, _KeepGrad, _clone_all, _copy_args,
                    _versions, autocast_state, rng_state)
from .step_ledger import cuda_graph_aside

_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
try:
    from torch.autograd.graph import GradientEdge as _GradientEdge
except ImportError:  # torch < 2.2
    _GradientEdge = None

MAX_CALLS = 4          # root calls with a gradient waiting for their backward (each keeps
                       # its arguments): one more is read at once
MAX_LOSS_NODES = 64    # a bigger loss region gets the dry run

# Backward nodes that make finite gradients from finite gradients and finite saved
# values (short of a float overflow): a loss region made only of these needs no dry run.
# Not here, on purpose: Log, Sqrt, Rsqrt, Pow below 1, Reciprocal, Exp, Atan2, Norm, BCE (its
# derivative divides by x(1-x)), and a division by a tensor that needs a gradient.
SAFE_BACKWARD = frozenset("""
    NllLossBackward0 NllLoss2DBackward0 LogSoftmaxBackward0 SoftmaxBackward0
    MseLossBackward0 L1LossBackward0 SmoothL1LossBackward0 HuberLossBackward0
    BinaryCrossEntropyWithLogitsBackward0 SoftMarginLossBackward0
    MeanBackward0 MeanBackward1 SumBackward0 SumBackward1 AddBackward0 AddBackward1
    SubBackward0 SubBackward1 RsubBackward0 RsubBackward1 NegBackward0 MulBackward0
    MulBackward1 DivBackward1 ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0
    TBackward0 TransposeBackward0 TransposeBackward1 PermuteBackward0 SelectBackward0
    SliceBackward0 SqueezeBackward0 SqueezeBackward1 SqueezeBackward2 SqueezeBackward3
    SqueezeBackward4 UnsqueezeBackward0 ExpandBackward0 CloneBackward0 ToCopyBackward0
    IndexBackward0 GatherBackward0 CatBackward0 StackBackward0 SplitBackward0
    SplitWithSizesBackward0 UnbindBackward0 WhereBackward0 MaskedFillBackward0
    AbsBackward0 ClampBackward1 ClampMinBackward0 ClampMaxBackward0 ReluBackward0
    ThresholdBackward0 SigmoidBackward0 TanhBackward0 LogSigmoidBackward0
    SoftplusBackward0 MaxBackward0 MaxBackward1 MinBackward0 MinBackward1 AmaxBackward0
    AminBackward0 FlattenBackward0 DetachBackward0 AliasBackward0
    torch::autograd::AccumulateGrad
""".split())


def _loss_region(roots, boundary):
    """(safe, names) of the autograd nodes from ROOTS down to (not into) the BOUNDARY
    nodes (by id): safe when each is in SAFE_BACKWARD (or a division or a power that
    cannot blow up there), within MAX_LOSS_NODES; names of those visited, for a report."""
    stack = [r.grad_fn for r in roots]
    seen: dict = {}      # id -> node (kept: a dropped node's address may be reused)
    names = []
    safe = True
    while stack:
        node = stack.pop()
        if node is None or id(node) in boundary or id(node) in seen:
            continue
        seen[id(node)] = node
        if len(seen) > MAX_LOSS_NODES:
            return False, names
        name = node.name()
        names.append(name)
        if name == "DivBackward0":
            # x / y: safe when only x needs a gradient (a y near 0 would blow up dy)
            edges = node.next_functions
            if len(edges) > 1 and edges[1][0] is not None:
                safe = False
        elif name == "PowBackward0":
            # x ** k: k * x ** (k - 1) is finite for k >= 1 (k = 0.5 is a sqrt)
            exponent = getattr(node, "_saved_exponent", None)
            if not isinstance(exponent, (int, float)) or not exponent >= 1:
                safe = False
        elif name not in SAFE_BACKWARD:
            safe = False
        for fn, _ in node.next_functions:
            stack.append(fn)
    return safe, names


def _grads_local() -> bool:
    """Whether a parameter's gradient after backward is what this process's backward
    made: not across ranks (DDP averages them, FSDP keeps a shard)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1)


def _nonfinite_grad(p) -> bool:
    """Whether P's gradient (floating, strided) holds a NaN/Inf: one exact reduction and
    one read (after a stop only: `_forget_reset_grads`)."""
    g = p.grad
    return g is not None and g.is_floating_point() and g.layout is _STRIDED \
        and not g.is_meta and not bool(torch.isfinite(g).all())


# -- the step, as it runs ----------------------------------------------------------------
class HealthyStep:
    """Methods of `Watch` (core.py) for the healthy step: the roots' hooks, backward,
    the optimizer's hooks, and the checks they make (state in `Watch`)."""

    # -- model(x) --------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        """A root's own pre-hook (and the global one's, for an outermost call)."""
        if self._inside:
            self._inside += 1
            return None
        if self._skip or _get_ident() != self._owner or self._rerunning \
                or self._in_backward or self._opt_depth or _graph_task_id() != -1 \
                or _in_transform():
            return None   # (a re-run's own call; a checkpoint recomputing inside backward;
                          # torch.func's wrappers: checked op by op, checks._in_transform)
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            self._captured_call_begins()
            return None
        info = self._roots.get(id(module))
        if info is None or info.ref() is not module or info.start:
            return None       # (not a root: its ops are checked op by op)
        if self._stash:
            self._deliver_stash()
        if self._win:
            self._window_to_ledger()   # (the ops before the call are judged first)
        call = RootCall(info, args, kwargs)
        call.micro = self._micro + 1
        call.cpu_rng, call.cuda_rng = rng_state()
        call.autocast = autocast_state()
        call.grad = _grad_enabled()
        call.site = _frames.user_location(_caller(2))
        if self._nan_marks:
            # a NaN written on purpose must not reach a model call (marks.py)
            self._check_call_marks(module, args, kwargs, call.site)
        if self._constant_unread:
            # (one written on a device is known at the read: looked for then)
            self._ledger.then(partial(self._call_marks_at_read, call), always=True)
        self._inside = 1
        self._root_popped = pop_if_top(self._mode)
        self._before_call(call, info)
        self._call = call
        return None

    def _before_call(self, call, info):
        """As the call starts (the mode off): the buffers and, where a call of this root
        writes them in place, copies of them and of its arguments."""
        buffers = call.buffers
        versions = call.versions
        try:
            for m, name in info.buffers:
                b = m._buffers.get(name)
                buffers.append(b)
                versions.append(b._version if b is not None else None)
        except RuntimeError:              # an inference tensor: no version counter
            call.unfaithful = "a buffer of the call has no version counter"
        if info.copied:
            found = [(i, buffers[i]) for i in info.copied if buffers[i] is not None]
            call.copies = dict(zip([i for i, _ in found], _clone_all([b for _, b in found])))
        if info.copies_args:
            call.arg_copies = _copy_args(call.args, call.kwargs)
        else:
            call.arg_versions = _versions(call.args, call.kwargs)

    def _root_post(self, module, args, kwargs, output):
        """A root's own post-hook (and the global one's): the call returned (or raised)."""
        if not self._inside:
            if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
                # a call captured into a CUDA graph (its pre-hook stepped aside): checked
                # after each replay
                self._captured_call_ends(module, output)
            return None
        self._inside -= 1
        if self._inside:
            return None
        call, self._call = self._call, None
        if self._root_popped:
            push(self._mode)
            self._root_popped = False
        if call is None:
            return None
        self._after_call(call, call.info)
        if output is not None:
            self._check_outputs(call, output)
        return None

    def _after_call(self, call, info):
        """What the call wrote in place that a re-run needs as it was: learned for the
        next calls (copied as they start); this one says so if it is re-run."""
        now = _versions(call.args, call.kwargs)
        if call.arg_versions is not None and now != call.arg_versions:
            info.copies_args = True
            call.unfaithful = "the call wrote its argument in place"
        for i, (m, name) in enumerate(info.buffers):
            b = m._buffers.get(name)
            if b is None or i >= len(call.buffers) or b is not call.buffers[i] \
                    or i in call.copies:
                continue                 # (rebound: the old object is as it was)
            try:
                if b._version != call.versions[i]:
                    info.copied.append(i)
                    call.unfaithful = call.unfaithful or (
                        f"the call wrote its buffer {name!r} in place")
            except RuntimeError:
                continue

    def _check_outputs(self, call, output):
        """The call's floating outputs: checked now (CPU) or at the step's read (a
        device); those that need a gradient keep it, for its backward."""
        outs = []       # (rerun.floating_outputs, inline: a call less each root call)
        for t in tensors_in(output):
            if t.is_floating_point() and type(t) in _PLAIN and t.layout is _STRIDED \
                    and not t.is_nested and not t.is_meta:
                outs.append(t)
        call.outs = [weakref.ref(t) for t in outs]
        train = _grad_enabled()
        if train:
            nodes = call.nodes
            for pos, t in enumerate(outs):
                node = t.grad_fn
                if node is not None:
                    node.register_prehook(_KeepGrad(call, pos, t.output_nr))
                    nodes.append((node, t.output_nr, pos))
            train = bool(nodes)
        if train:
            self._calls.append(call)
            if len(self._calls) > MAX_CALLS:     # (no backward came: forget the oldest)
                self._calls.pop(0).nodes = []
        defer = train and self._ledger.calls < MAX_CALLS and self._can_defer()
        if self._check(outs, partial(self._judge_outputs, call), defer=defer) and defer:
            self._ledger.calls += 1
            self._ledger.sources.append(call)   # (written in place: read first)

    def _call_marks_at_read(self, call, values):
        """A judge of the ledger: CALL's arguments, once the read judged what the program
        wrote before it (a device's constant written on purpose: marks.py)."""
        module = call.info.module
        if self._nan_marks and module is not None and not call.stopped:
            self._check_call_marks(module, call.args, call.kwargs, call.site, call.micro - 1)

    def _judge_outputs(self, call, bad):
        """A root's output is not finite: re-run the call under the full watch."""
        outs = call.outputs()
        with self._own_ops():
            counts = next((c for c in (_counts(o) for o in outs) if sum(c)), None)
        if counts is None:
            counts = (1, 0, 0)          # (gone: its norm said so)
        self._rerun_forward(call, counts)

    # -- loss.backward() ---------------------------------------------------------------
    def _around_backward(self, proceed, tensors, grad_tensors, args, kwargs):
        """`loss.backward()` (autograd_patch): checked; then the stops found on
        autograd's device threads (CUDA runs backward there) pause on this thread."""
        if cuda_graph_aside():   # a backward captured into a CUDA graph: not looked into
            return proceed(tensors, grad_tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if (self._marks or self._constant_unread) and not self._skip \
                and _get_ident() == self._owner and not self._rerunning:
            self._loss_marks(roots)
        self._amp.begin(roots)
        try:
            result = self._checked_backward(proceed, roots, tensors, grad_tensors, args,
                                            kwargs)
        finally:
            self._amp.end()
        if self._stash and _get_ident() == self._owner:
            self._deliver_stash()
        return result

    def _loss_marks(self, roots):
        """A NaN/Inf written on purpose must not be in a loss (marks.py): looked for now,
        and, for one written on a device that no read judged yet, at the read."""
        site = _frames.user_location(_caller(2))
        if self._marks:
            self._check_loss_marks(roots, site)
        if self._constant_unread:
            if self._win:
                self._window_to_ledger()
            self._ledger.then(partial(self._loss_marks_at_read, roots, site, self._micro),
                              always=True)

    def _loss_marks_at_read(self, roots, site, backwards, values):
        """A judge of the ledger: the loss, once the read judged what was written
        (BACKWARDS: the step's backwards before this one)."""
        if self._marks:
            self._check_loss_marks(roots, site, backwards)

    def _checked_backward(self, proceed, roots, tensors, grad_tensors, args, kwargs):
        calls = self._calls
        mine = not (self._skip or self._in_backward or self._rerunning) \
            and _get_ident() == self._owner
        if mine and (self.exact or not calls):
            # (op by op: exact, or the roots being learned; its stops name the
            # micro-batch, and the step's read learns there is accumulation)
            self._micro += 1
        if not mine or self.exact or not calls:
            return proceed(tensors, grad_tensors, *args, **kwargs)   # (op by op)
        opts = dict(zip(("retain_graph", "create_graph", "grad_variables", "inputs"), args))
        opts.update(kwargs)
        if opts.get("create_graph") or opts.get("inputs") is not None \
                or opts.get("grad_variables") is not None:
            return proceed(tensors, grad_tensors, *args, **kwargs)
        if self._ledger.backwards:
            # gradient accumulation: the previous micro-batch's backward is read first
            # (it holds its gradients, which this one adds to)
            self._read_ledger()
        if self._judged_grads:
            self._forget_reset_grads()
        if self._win:
            self._window_to_ledger()
        self._micro += 1
        bw = _Backward()
        bw.calls, bw.micro = calls, self._micro
        boundary = {}
        for call in calls:
            for node, _, _ in call.nodes:
                boundary[id(node)] = node
        safe, bw.nodes = _loss_region(roots, boundary)
        n0 = len(self.violations)
        # (after a stop in one of its calls what the region computes descends from it,
        # with values made inside the call that no check saw: no dry run, no new stop)
        bw.dry = (not safe or not self._no_live_taint()) \
            and not any(call.stopped for call in calls)
        if bw.dry and not self._dry_run(roots, grad_tensors, calls, n0):
            return proceed(tensors, grad_tensors, *args, **kwargs)
        bw.stopped = len(self.violations) > n0
        popped = pop_if_top(self._mode)
        self._in_backward += 1
        try:
            result = proceed(tensors, grad_tensors, *args, **kwargs)
        finally:
            self._in_backward -= 1
            if popped:
                push(self._mode)
        if not opts.get("retain_graph"):
            self._calls = []
            for call in calls:
                call.nodes = []
        if self._skip:
            return result
        self._check_gradients(bw)
        return result

    def _dry_run(self, roots, grad_tensors, calls, n0) -> bool:
        """The loss region's backward op by op, under the per-op check: the gradients of
        the roots' outputs, kept for a re-run (the real backward then computes them
        again, without the mode). False when it could not run."""
        if self._ledger or self._win:
            self._read_ledger()        # (what came before is judged first)
        targets, where = [], []
        for call in calls:
            for node, nr, pos in call.nodes:
                targets.append(_GradientEdge(node, nr) if _GradientEdge else node)
                where.append((call, pos))
        self._read_now += 1
        try:
            with _replay.replaying():
                grads = torch.autograd.grad(roots, targets, grad_tensors, retain_graph=True,
                                            allow_unused=True)
        except Exception as exc:  # noqa: BLE001 - the real call raises what it raises
            if isinstance(exc, NonFiniteError) or len(self.violations) > n0:
                raise      # from a stop in the dry run: `q` at its prompt, action='raise'
            return False
        finally:
            self._read_now -= 1
        if self._stash:   # a stop made on autograd's device thread: pause here, now
            self._deliver_stash()
        for (call, pos), g in zip(where, grads):
            if g is not None:
                call.grads[pos] = g
        return True

    def _check_gradients(self, bw):
        """After the real backward: the outputs' gradients it kept and the parameter
        gradients of its calls."""
        checked, kept = [], []
        for call in bw.calls:
            for pos, g in call.grads.items():
                if isinstance(g, Tensor) and g.is_floating_point():
                    checked.append(g)
                    kept.append((call, pos))
        params, seen = [], set()
        many = len(bw.calls) > 1
        for call in bw.calls:
            for p in call.info.params:
                if many:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                g = p.grad
                if g is not None and g.is_floating_point() and g.layout is _STRIDED \
                        and not g.is_meta:
                    checked.append(g)
                    params.append(p)
        bw.checked, bw.kept, bw.params = checked, kept, params
        defer = self._can_defer()
        if self._check(checked, partial(self._judge_backward, bw), alive=True, defer=defer) \
                and defer:
            self._ledger.backwards += 1
            self._ledger.sources.extend(bw.calls)   # (its re-run computes from them)

    def _forget_reset_grads(self):
        """Before a backward: a parameter whose non-finite gradient was judged is judged
        afresh once its gradient was reset (`zero_grad()`): what this backward makes
        there is new, not accumulated into the old."""
        with self._own_ops():
            self._judged_grads = {k: p for k, p in self._judged_grads.items()
                                  if _nonfinite_grad(p)}

    def _judge_backward(self, bw, bad):
        """A judge: a gradient of this backward is not finite. An output's gradient: the
        loss region made it (checked op by op when it could; else only an overflow
        could). A parameter's: the calls and their backward are re-run."""
        n = len(bw.kept)
        kept_bad = [bw.kept[i] for i in bad if i < n]
        params_bad = [(bw.params[i - n], bw.checked[i]) for i in bad if i >= n]
        after_stop = bw.stopped or any(call.stopped for call in bw.calls)
        if kept_bad and not after_stop and not bw.dry and not self._outputs_judged(bw.calls):
            after_stop = self._report_loss_region(bw, *kept_bad[0])
        if not params_bad:
            return
        with self._own_ops():
            bad_grads = [(p, g, _counts(g)) for p, g in params_bad]
        bad_grads = [b for b in bad_grads if sum(b[2])]
        if after_stop or kept_bad:
            # the forward or the loss's backward made them (a stop there, or the loss
            # region's overflow): what descends from it, not a new stop
            for _, g, c in bad_grads:
                self._taint_add(g, c[0] > 0, c[1] + c[2] > 0, after_stop)
            # (and so what the next micro-batch's backward adds to them, until zero_grad)
            self._judged_grads.update({id(p): p for p, _, _ in bad_grads})
            return
        new = [b for b in bad_grads if id(b[0]) not in self._judged_grads]
        self._judged_grads.update({id(p): p for p, _, _ in bad_grads})
        if new:
            self._rerun_backward(bw, bad_grads, new)

    def _outputs_judged(self, calls) -> bool:
        """Whether an output of CALLS still alive holds a NaN/Inf judged already."""
        for call in calls:
            for o in call.outputs():
                if self._taint_get(o) is not None:
                    return True
        return False

    def _report_loss_region(self, bw, call, pos) -> bool:
        """A root output's gradient came out of the unchecked loss region non-finite (an
        overflow): a stop at `loss.backward()` that names the region's nodes."""
        n0 = len(self.violations)
        g = call.grads.get(pos)
        with self._own_ops():
            counts = _counts(g) if isinstance(g, Tensor) else (1, 0, 0)
        module = call.info.module
        path, kind = self._names.path((module, None))
        self._report_unpinned(
            "backward", counts, record=(module, None),
            what=f"the gradient of output {pos} of {path or kind}",
            reason=f"the loss's backward ({', '.join(bw.nodes) or 'no node'}) made it from "
                   "finite values (an overflow); it runs op by op only with "
                   "`--watch exact`, which pins the op", micro=self._micro_of(call.micro))
        return len(self.violations) > n0

    def _micro_by_op(self, stage, backwards=None):
        """The micro-batch of a stop made at the op (per-op check, `--watch exact`, a
        re-run) or at a root call (a NaN written on purpose reaching it): in a re-run its
        call's; else the forward of the next backward, or the backward running.
        BACKWARDS: the step's backwards when the op ran (default: now)."""
        if self._rerun is not None:
            return self._rerun[2]
        if stage == "optimizer":
            return None
        if backwards is None:
            backwards = self._micro
        return self._micro_of(backwards + 1 if stage == "forward" else backwards)

    def _micro_of(self, micro):
        """The micro-batch a stop names (1, 2, ...: which forward and backward since the
        last optimizer step), or None where there is no gradient accumulation to speak
        of: the first backward of a step when no step had more, and before any optimizer
        step (backwards without an optimizer: tests, a hand-written update) as the step
        is."""
        return micro if micro and self._opt_seen and (micro > 1 or self._accumulating) \
            else None

    # -- the checks ----------------------------------------------------------------------
    def _check(self, tensors, judge, alive=False, defer=False, grouped=None) -> bool:
        """JUDGE(bad), BAD the indices in TENSORS of those that hold a NaN/Inf: on the CPU
        now (the C bit test: no op, no read), on a device at the ledger's read: now, or
        with the training step's when DEFER. ALIVE: they live on anyway (parameters,
        gradients, state), else temporaries the ledger holds within its bound. GROUPED:
        TENSORS (alive) grouped already (`StepLedger.hold_grouped`), or None.
        Whether the ledger holds some of them now."""
        host_bad, on_device = [], []
        if _checks.HOST_READS:
            if all(map(_is_cpu, tensors)):
                host_bad = host_bad_of(tensors)
            else:
                for i, x in enumerate(tensors):
                    if not x.is_cpu:
                        on_device.append(i)
                    elif host_nonfinite(x):
                        host_bad.append(i)
        else:
            on_device = list(range(len(tensors)))
        if on_device:
            if len(on_device) == len(tensors):
                slots = self._ledger.hold(tensors, alive) if grouped is None else \
                    self._ledger.hold_grouped(grouped, len(tensors))
            else:
                slots = self._ledger.hold([tensors[i] for i in on_device], alive)
            self._ledger.then(partial(_bad_ones, judge, host_bad, on_device, slots))
            if not defer:
                self._read_ledger()
                return False
            return True
        if host_bad:
            judge(host_bad)
        return False

    def _can_defer(self) -> bool:
        """Whether a check may wait for the training step's read: once an optimizer step
        was seen (one will come, before the parameters change), not in a re-run or a
        dry run (they read op by op), not under a loss scaler (it skips steps)."""
        return (self._opt_seen and not self.exact and not self._read_now
                and not self._rerunning and not self._amp.active and not self._skip)


def _bad_ones(judge, host_bad, indices, slots, values):
    """A ledger's judge for `_check`: JUDGE(bad) when a held tensor is not finite."""
    bad = [i for i, slot in zip(indices, slots) if not _isfinite(values.get(slot, 0.0))]
    if bad or host_bad:
        judge(sorted(host_bad + bad))
