"""The re-run: a root call whose check found a NaN/Inf is computed again under the full
watch (the per-op check on every op, module hooks naming every module), which stops at
the op that made the value, in its module, at its line, as the full watch would have
the first time. A bad output re-runs the call; a bad parameter gradient re-runs the call
and its backward (`torch.autograd.grad` from the kept gradients of its outputs, to its
parameters: nothing accumulates into `.grad`). The calls of a backward are re-run latest
first (backward met them in that order) until one stops.

The re-run starts from the call's record (step.RootCall), as the call started:
- the RNG (CPU and CUDA generators: dropout draws the same mask) and autocast;
- the buffers: those of every module the root calls, its own and the layers it uses
  but does not own (BatchNorm's running statistics, spectral_norm's u). The re-run
  updates copies of them; the program's buffers stay as the call left them. A buffer
  that a call writes in place is copied as each call starts (learned from the calls);
- the arguments as they were passed (copied as each call starts once a call of the root
  wrote one in place: a first layer `ReLU(inplace=True)`);
- the module is called, not its `forward`: the root's own hooks run again;
- what the re-run changes in its modules' state is put back afterwards, or never
  touched (`_state_kept`): their attributes (a call counter, a list a forward appends
  to, a `torch.Generator`), tensors a call writes in place (running statistics kept as
  a plain tensor, a momentum encoder's parameters: the re-run writes copies), and
  Python's and numpy's random generators (the re-run draws from those as they are, not
  as the call started);
- DDP: its inner module is the root, and the re-run calls it; DDP's own forward (its
  buffer broadcast, the reducer's preparation) runs outside, never in a re-run, and the
  re-run's backward accumulates into no `.grad`, so no collective runs on one rank alone.
  A root whose forward runs collectives itself (FSDP2 gathers its parameters, a
  SyncBatchNorm) is not re-run: its stop says so;
- compiled code runs eagerly (`set_stance("force_eager")`: its ops are seen one by one);
  what the re-run saves for backward stays its own (checkpointing counts the tensors its
  forward saved); the rest of mldebug is deaf to it (`core.replay`).

When the re-run makes only finite values (a nondeterministic kernel, state changed
outside the call, a call that wrote what it reads), the stop says so and names what the
cheap check saw: the root's output or the parameter whose gradient was not finite, with
the step, the stage and the micro-batch. A pattern whose re-run found the value judged
and no stop (a constant Inf written on purpose) is not re-run again (`_fruitless`).
"""
from __future__ import annotations

import contextlib
import functools
import random
import sys

import torch

from ..core import frames as _frames
from ..core import replay as _replay
from ..core.session import pinning
from ..core.errors import NonFiniteError
from ..core.structs import tensors_in
from .checks import _PLAIN, _STRIDED, _caller, _checkable, _counts, _floating, mode_on
from .roots import _clone_all, _copy_args

MAX_PATTERNS = 256     # patterns whose re-run found no stop, remembered
_set_stance = getattr(torch.compiler, "set_stance", None)     # (torch >= 2.6)
NOT_REPEATED = ("a re-run of the call under the full watch made only finite values (the "
                "call is not repeatable: a nondeterministic kernel, or state it reads "
                "changed since)")


def floating_outputs(output) -> list:
    """The outputs a root's check reads, in order: floating, plain, strided tensors."""
    return [t for t in tensors_in(output) if t.is_floating_point() and type(t) in _PLAIN
            and t.layout is _STRIDED and not t.is_nested and not t.is_meta]


def _pinning(method):
    """A re-run pins a finding: the session knows a stop may be on its way."""
    @functools.wraps(method)
    def pin(self, *args):
        with pinning():
            return method(self, *args)
    return pin


class Rerun:
    """Methods of `Watch` (core.py): the re-run path (state in `Watch`)."""

    @_pinning
    def _rerun_forward(self, call, counts):
        """CALL's output is not finite: re-run it (forward) under the full watch."""
        key = (id(call.info), counts[0] > 0, counts[1] + counts[2] > 0)
        outs = call.outputs()
        if key in self._fruitless:
            lineage, mark = self._fruitless[key]
            self._taint_outputs(outs, lineage, mark)
            call.stopped = call.stopped or lineage
            return
        n0, j0 = len(self.violations), self._judged
        reason = ""
        try:
            reason = self._replay(call)
        finally:
            stopped = len(self.violations) > n0
            lineage = stopped or self._rerun_lineage
            mark = None if lineage else self._rerun_mark
            self._taint_outputs(outs, lineage, mark)
        if stopped or lineage:
            call.stopped = True     # what flows on from it is not a new stop
            return
        if self._judged > j0:
            # judged, and not a stop (a constant Inf, an allowed op, a known NaN): the
            # same pattern again needs no re-run, only the same judgement of its output
            if len(self._fruitless) < MAX_PATTERNS:
                self._fruitless[key] = (lineage, mark)
            return
        call.stopped = True
        record = self._root_record(call)
        path, kind = self._names.path(record)
        self._report_unpinned("forward", counts, record=record,
                              what=f"the output of {path or kind or 'a module'}",
                              reason=reason or call.unfaithful or NOT_REPEATED,
                              where=call.site, micro=self._micro_of(call.micro))

    @_pinning
    def _rerun_backward(self, bw, bad, new):
        """A parameter gradient of backward BW is not finite (BAD: (param, grad, counts),
        NEW those not judged before): re-run its calls and their backward, latest first."""
        from .step import _grads_local   # (distributed state, asked only here)
        n0, j0 = len(self.violations), self._judged
        reasons = []
        self._flowed_mark = None
        try:
            for call in reversed(bw.calls):
                if not call.grads:
                    continue
                reason = self._replay(call, backward=True)
                if reason:
                    reasons.append(reason)
                elif call.unfaithful:
                    reasons.append(call.unfaithful)
                if len(self.violations) > n0:
                    break
        finally:
            stopped = len(self.violations) > n0
            # (a value written on purpose that flowed into them: the step's check says so)
            flowed = None if stopped else self._flowed_mark
            for _, g, c in bad:
                self._taint_add(g, c[0] > 0, c[1] + c[2] > 0, stopped, mark=flowed)
                if not stopped and self._amp.overflowed:
                    self._amp.hold_overflow(g)      # (the scaler's: it skips this step)
        if stopped or self._judged > j0:
            return
        p, _, counts = new[0]
        if not _grads_local():
            reasons.append("gradients are averaged over the ranks after backward (DDP): "
                           "this rank's own backward made only finite ones")
        self._report_unpinned(
            "backward", counts, param=p, micro=self._micro_of(bw.micro), reason="; ".join(reasons) or (
                "a re-run of the model's call and its backward made only finite gradients "
                "(the Inf/NaN comes from code outside the model's calls, e.g. a loss term "
                "that uses the parameter directly, or the call is not repeatable)"))
        if len(self.violations) > n0:
            for _, g, c in bad:    # what the step makes of them descends from this stop
                self._taint_add(g, c[0] > 0, c[1] + c[2] > 0, True)

    def _root_record(self, call):
        """The module record a stop in CALL's root names (from DDP when it wraps it)."""
        info = call.info
        outer = (info.wrapper, None) if info.wrapper is not None else None
        return (info.module, outer)

    def _replay(self, call, backward=False) -> str:
        """Run CALL again under the full watch (and its backward, from the kept gradients
        of its outputs); '' or why it could not run."""
        info = call.info
        module = info.module
        if module is None:
            return "the module is gone"
        if info.collective:
            return (f"not re-run: {info.collective}, and a re-run on one rank alone would "
                    "wait for the others (`--watch exact` pins the op)")
        reported = len(self.violations)
        started = _frames.user_location(_caller(1))[:2]
        outer = (info.wrapper, None) if info.wrapper is not None else None
        previous = self._rerun
        self._rerun = (started, call.site, self._micro_of(call.micro))
        try:
            with self._full_watch(outer), _state_kept(info.modules, info.written), \
                    _as_the_call_started(call) as (args, kwargs):
                out = module(*args, **kwargs)
                self._top = outer
                if backward:
                    self._replay_backward(call, module, args, kwargs, out)
                else:
                    self._rerun_lineage, self._rerun_mark = False, None
                    with self._own_ops():   # do its outputs descend from a stop?
                        for o in floating_outputs(out):
                            known = self._taint_get(o)
                            if known is not None and known[2]:
                                self._rerun_lineage = True
                            elif known is not None and self._rerun_mark is None:
                                # (or from a constant written on purpose: marks.py)
                                self._rerun_mark = self._mark_get(o)
            return ""
        except Exception as exc:  # noqa: BLE001 - the original call succeeded: never fail it
            if isinstance(exc, NonFiniteError) or len(self.violations) > reported:
                raise     # from the stop itself: `q` at the prompt (BdbQuit), action='raise'
            return f"re-running it raised {type(exc).__name__}: {exc}"
        finally:
            self._rerun = previous
            self._pending = []

    def _replay_backward(self, call, module, args, kwargs, out):
        flat = floating_outputs(out)
        pairs = [(flat[pos], g) for pos, g in call.grads.items()
                 if pos < len(flat) and g is not None and flat[pos].requires_grad]
        inputs = [p for p in call.info.params if p.requires_grad]
        seen = {id(p) for p in inputs}
        for t in tensors_in((args, kwargs)):
            if t.requires_grad and t.is_leaf and id(t) not in seen:
                seen.add(id(t))
                inputs.append(t)
        if pairs and inputs:
            torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                allow_unused=True)

    @contextlib.contextmanager
    def _full_watch(self, top):
        """The per-op check on every op and the module hooks on, for a re-run."""
        installed = not self._module_handles
        if installed:
            self._install_module_hooks()
        self._rerunning += 1
        self._read_now += 1
        previous, self._top = self._top, top
        try:
            with mode_on(self._mode):
                yield
        finally:
            self._top = previous
            self._rerunning -= 1
            self._read_now -= 1
            if installed:
                self._remove_module_hooks()

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


def _identity(t):
    return t


def _own_saved_tensors():
    """What the re-run saves for backward stays its own: identity saved-tensor hooks on
    top of the stack hide it from the program's (torch.utils.checkpoint counts the
    tensors its forward saves, and fails the recomputation when a re-run added some)."""
    try:
        return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
    except Exception:  # noqa: BLE001 - hooks disabled here (functorch): nothing to hide
        return contextlib.nullcontext()


# a module's own bookkeeping (parameters, buffers, children, hooks): not the program's
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)
_CONTAINERS = (list, dict, set)


@contextlib.contextmanager
def _state_kept(modules, written):
    """What a re-run changes in its modules' state beyond their buffers
    (`_as_the_call_started`) is put back as it was before it, or never touched: their
    attributes (a call counter `self.calls += 1`, the contents of a list, dict, set or
    numpy array one holds: `self.seen.append(x)`), the state of a `torch.Generator` one
    holds, Python's and numpy's random generators; a tensor attribute (running
    statistics kept as a plain tensor) and a parameter a call writes in place (WRITTEN,
    learned: a momentum encoder's) are swapped for copies, which the re-run writes. State
    outside the modules (a global, an argument that is not a tensor) is not kept."""
    saved, generators, swapped = [], [], []
    with torch.no_grad():
        for m in modules:
            attributes = m.__dict__
            before = dict(attributes)
            contents = []
            for k, v in before.items():
                if k in _MODULE_INTERNALS:
                    continue
                kind = type(v)
                if kind in _CONTAINERS or kind.__name__ == "ndarray":
                    contents.append((v, list(v) if kind is list else v.copy()))
                elif kind is torch.Generator:
                    generators.append((v, v.get_state()))
                elif kind in _PLAIN and not v.requires_grad:
                    attributes[k] = v.clone()     # (BEFORE binds the program's back)
            saved.append((attributes, before, contents))
        for m, name in written:
            p = m._parameters.get(name)
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(p.detach().clone(), p.requires_grad)
                swapped.append((m, name, p))
    py_random = random.getstate()
    np_random = sys.modules.get("numpy")
    np_random = np_random.random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p
        for attributes, before, contents in saved:
            for key in [k for k in attributes if k not in before]:
                del attributes[key]
            attributes.update(before)
            for value, content in contents:
                if type(value) is list:
                    value[:] = content
                elif type(value).__name__ == "ndarray":
                    value[...] = content
                else:
                    value.clear()
                    value.update(content)
        for generator, state in generators:
            generator.set_state(state)
        random.setstate(py_random)
        if np_random is not None:
            sys.modules["numpy"].random.set_state(np_random)


@contextlib.contextmanager
def _as_the_call_started(call):
    """The RNG, autocast, grad mode, buffers and arguments as CALL started; everything as
    it was afterwards. The buffers are swapped for copies of their values at the call's
    start (writing values back would bump their version counters, and a backward that
    saved them would fail); the re-run updates the copies."""
    info = call.info
    cpu_now = torch.get_rng_state()
    cuda_now = None
    swapped = []
    try:
        with torch.no_grad():
            starts = []
            for i, (m, name) in enumerate(info.buffers):
                start = call.copies.get(i)
                if start is None:
                    start = call.buffers[i] if i < len(call.buffers) else m._buffers.get(name)
                if start is not None:
                    swapped.append((m, name, m._buffers.get(name)))
                    starts.append(start)
            for (m, name, _), copy in zip(swapped, _clone_all(starts) if starts else ()):
                m._buffers[name] = copy
        torch.set_rng_state(call.cpu_rng)
        if call.cuda_rng is not None:
            cuda_now = torch.cuda.get_rng_state_all()
            torch.cuda.set_rng_state_all(call.cuda_rng)
        if call.arg_copies is not None:
            args, kwargs = _copy_args(*call.arg_copies)
        else:
            args, kwargs = call.args, call.kwargs
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replay.replaying())
            stack.enter_context(_own_saved_tensors())
            if _set_stance is not None:
                # a compiled model (or a compiled part of it) re-runs eagerly: its ops one
                # by one under the per-op check, which compiled code hides from it
                stack.enter_context(_set_stance("force_eager"))
            on = dict(call.autocast)
            for device in ("cpu", "cuda"):
                if device in on:
                    stack.enter_context(torch.autocast(device, dtype=on[device]))
                elif _autocast_on(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            stack.enter_context(torch.set_grad_enabled(call.grad))
            yield args, kwargs
    finally:
        for m, name, b in swapped:
            m._buffers[name] = b
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state_all(cuda_now)


def _autocast_on(device) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except Exception:  # noqa: BLE001 - older torch
        return False
