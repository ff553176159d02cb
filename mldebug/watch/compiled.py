"""Compiled functions: the watch checks what they return, at the call.

A compiled *module* is checked at its boundary by the module hooks (torch runs those
eagerly around the compiled forward) and a NaN inside is pinned by re-running the call.
A compiled *function* (`step = torch.compile(train_step)`) has no module boundary, and
inside it the watch's dispatch mode sees nothing (it ignores compile internals, so that
the function is compiled as without mldebug). So the function `torch.compile` returns is
wrapped while a watch may run: after each call, one finiteness check over the floating
tensors it returned (one host read per call); a NaN/Inf there stops at the user's line
that called it. It is not pinned to an op: re-running a function may repeat its side
effects (an optimizer step inside it), so the stop says how to pin it instead.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable, Optional

import torch

from ..core.compile import compiling as _compiling
from .step_ledger import cuda_graph_aside
from ..core import frames as _frames
from ..core.records import Violation
from ..core.structs import tensors_in
from .checks import _caller, _counts, _summary

_patched: list = []          # [(class, original __call__)] while installed


def install(active_watch: Callable[[], Optional[object]]) -> None:
    """Wrap what torch.compile returns for a plain function (idempotent). ACTIVE_WATCH()
    gives the running watch or None; a function compiled while none runs still passes
    through the wrapper at the cost of one call."""
    if _patched:
        return
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except Exception:  # noqa: BLE001 - a torch without dynamo: nothing is compiled
        return
    original = _TorchDynamoContext.__call__

    @functools.wraps(original)
    def __call__(self, fn, *args, **kwargs):
        compiled = original(self, fn, *args, **kwargs)
        if compiled is fn or not _user_function(fn) or not callable(compiled):
            return compiled
        return _checked(compiled, fn, active_watch)

    _TorchDynamoContext.__call__ = __call__
    _patched.append((_TorchDynamoContext, original))


def uninstall() -> None:
    """torch.compile as it was (functions compiled meanwhile keep their wrapper, which
    passes through while no watch runs)."""
    while _patched:
        cls, original = _patched.pop()
        cls.__call__ = original


def _user_function(fn) -> bool:
    """A function, lambda or method of the program (Lightning compiles a module's
    `training_step`): not a module, nor a module's `forward` (checked by its hooks), not
    torch's own code (`model.compile()` compiles `Module._call_impl`)."""
    if inspect.ismethod(fn):
        if isinstance(fn.__self__, torch.nn.Module) and fn.__name__ == "forward":
            return False
        fn = fn.__func__
    return inspect.isfunction(fn) and not (getattr(fn, "__module__", "") or "").startswith("torch")


def _checked(compiled, fn, active_watch):
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        watch = active_watch()
        if watch is None or _compiling():
            return compiled(*args, **kwargs)
        # the few ops of compiled code that reach the per-op check (extern kernels:
        # `mm.out` into a buffer that a fused kernel then writes in place, unseen) are not
        # held for a later read: by then the buffer holds what they did not make. Its
        # outputs are checked here, at its return
        watch._in_compiled += 1
        watch._compiled_seen = True
        try:
            out = compiled(*args, **kwargs)
        finally:
            watch._in_compiled -= 1
        if watch is active_watch():
            watch._compiled_returned(fn, args, kwargs, out)
        return out

    return call


class CompiledBoundary:
    """Methods of `Watch`: the check of what a compiled function returned."""

    def _compiled_returned(self, fn, args, kwargs, out) -> None:
        if self._skip or threading.get_ident() != self._owner or cuda_graph_aside():
            return     # (called inside the program's CUDA graph capture: no read there)
        # floating outputs, as the per-op check (integer, bool and complex ones never are)
        outs = [t for t in tensors_in(out) if t.is_floating_point()]
        if not outs:
            return
        with self._own_ops():
            if bool(torch.stack([torch.isfinite(t).all() for t in outs]).all()):
                return
            per_output = [(t, _counts(t)) for t in outs]
            bad, _ = next((t, c) for t, c in per_output if sum(c))
            counts = [sum(c[i] for _, c in per_output) for i in range(3)]
            ins = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]
            came_in = any(not bool(torch.isfinite(t).all()) for t in ins)
            output = _summary(bad)
        kind = "nan" if counts[0] else "inf"
        if kind not in self.break_on:
            return
        name = getattr(fn, "__name__", "") or "function"
        frame = _frames.user_frame(_caller(1))
        file, line, function = _frames.location(frame)
        if came_in:
            text = f"an input of the compiled function {name} was not finite already"
        else:
            text = (f"made inside the compiled function {name}, where the watch does not "
                    "look op by op; run with TORCH_COMPILE_DISABLE=1 and mldebug pins the op "
                    "and its line")
        self._report(Violation(
            kind=kind, torch_op=name, stage=self._stage(None), frame=frame, file=file,
            line=line, function=function, nan=counts[0], posinf=counts[1], neginf=counts[2],
            created=not came_in, culprit="" if not came_in else f"an input of {name}()",
            output=output, step=self._steps if self._opt_seen else None, text=text))
