"""The watch's primitives, shared by the per-op check (dispatch.py, verdict.py,
device_window.py), the healthy step (step.py) and the re-run (rerun.py): which tensors
are checked, in what dtype they are summed, exact counts, a host check, and the per-op
check's mode put on and taken off the dispatch stack."""
from __future__ import annotations

import math
import operator
import sys

import torch
from torch import Tensor

from ..core.frames import is_user_file as _is_user_file
from ..core.structs import tensors_in
from ..summaries import nonfinite_counts, summary
from .native_check import nonfinite as _native_nonfinite
from .native_check import nonfinite_each as _native_nonfinite_each

_F32 = torch.float32
_LOW = frozenset(d for d in (torch.float16, torch.bfloat16,
                             getattr(torch, "float8_e4m3fn", None),
                             getattr(torch, "float8_e5m2", None)) if d is not None)
_isfinite = math.isfinite
_is_cpu = operator.attrgetter("is_cpu")     # (in map(): no Python call per tensor)
_grad_enabled = torch.is_grad_enabled
# inside torch.func's vmap / grad / jacrev a module's tensors are functorch's wrappers
# (no memory to read, no `.item()`): the watch's module hooks step aside there, and the
# per-op check sees the ops on the tensors underneath
_in_transform = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_BackwardCFunction = torch.autograd.function.BackwardCFunction
# floating dtype -> dtype to sum in (None: its own; float32 for the low-precision ones,
# whose sum would overflow); missing: not checked (integer, bool, complex)
_SUM_DTYPE = {d: (_F32 if d.itemsize < 4 else None) for d in vars(torch).values()
              if isinstance(d, torch.dtype) and d.is_floating_point}
_getframe = sys._getframe
_ALLOWED: list = []        # patterns of mldebug.allow(), shared by every watch
METADATA_KEY = "mldebug"   # grad_fn.metadata key holding the forward op's provenance


def _counts(t) -> tuple[int, int, int]:
    """Exact (nan, posinf, neginf) of a floating tensor."""
    try:
        return tuple(int(c) for c in nonfinite_counts(t))
    except Exception:
        pass
    with torch.no_grad():
        return (int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()),
                int(torch.isneginf(t).sum()))


def _summary(x):
    try:
        return summary(x)
    except Exception:
        try:
            return f"tensor{list(x.shape)} {x.dtype}"
        except Exception:
            return repr(x)


def _caller(depth):
    """sys._getframe(depth + 1), or None where the stack is shallower (autograd's device
    threads run __torch_dispatch__ with no Python frame above it)."""
    try:
        return _getframe(depth + 1)
    except ValueError:
        return None


_STRIDED = torch.strided
_PLAIN = frozenset(t for t in (Tensor, torch.nn.Parameter,
                               getattr(torch.nn.parameter, "Buffer", None)) if t is not None)


def _checkable(t) -> bool:
    """A plain strided tensor (or parameter: optimizers update those in place) with data:
    FakeTensors (torch.export, FakeTensorMode) and
    other subclasses, meta, nested and mkldnn tensors have no values a sum could read, or
    no sum kernel; the watch must not change what they do."""
    return (type(t) in _PLAIN and t.layout is _STRIDED and not t.is_nested
            and not t.is_meta)


def _floating(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


# False while tests run the device paths on the CPU (core.simulate_device): CPU tensors
# are then held and read as a device's. (dispatch.py keeps its own copy for its hot path.)
HOST_READS = True
_OWN_SUM = (torch.float32, torch.float64)    # summed in their own dtype (no copy)


def version_of(t):
    """T's version counter (bumped by each in-place write), or None: an inference tensor
    has none."""
    try:
        return t._version
    except Exception:  # noqa: BLE001
        return None


def torch_formula(node) -> bool:
    """Whether NODE (the autograd node running, or None) is one of torch's own backward
    formulas, not a backward the program wrote (an autograd.Function's)."""
    return node is not None and not isinstance(node, _BackwardCFunction)


_ENGINE_CODE = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None),
                       "__code__", None)


def user_code_in_backward(frame):
    """The frame of the program's code that runs an op during backward (a tensor hook, a
    backward it wrote, a post-accumulate-grad hook), found above FRAME (the op's caller)
    before the autograd engine's entry; None when the op is the engine's own (a node's
    formula: its forward op's provenance says where)."""
    while frame is not None:
        code = frame.f_code
        if code is _ENGINE_CODE:
            return None
        if _is_user_file(code.co_filename):
            return frame
        frame = frame.f_back
    return None


def host_nonfinite(x) -> bool:
    """Whether CPU tensor X (floating) holds a NaN/Inf: the C bit test (no op, no read),
    else one sum and one read."""
    bad = _native_nonfinite(x)
    if bad is None:
        d = x.detach()
        s = d.sum() if d.dtype in _OWN_SUM else d.sum(dtype=_F32)
        bad = not _isfinite(s.item())
    return bad


def host_bad(tensors) -> list:
    """The indices of the CPU TENSORS (floating) that hold a NaN/Inf: `host_nonfinite`
    of each, the C bit test of all of them in one call."""
    bad = []
    for i, found in enumerate(_native_nonfinite_each(tensors)):
        if found or found is None and host_nonfinite(tensors[i]):
            bad.append(i)
    return bad


# -- the per-op check's mode on the dispatch stack -----------------------------------
_pop_mode = torch._C._pop_torch_dispatch_stack
_push_mode = torch._C._push_on_torch_dispatch_stack
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at


def mode_on_top(mode) -> bool:
    n = _stack_len()
    return bool(n) and _stack_at(n - 1) is mode


def pop_if_top(mode) -> bool:
    """Take MODE off the dispatch stack when it is on top; whether it was. (Runs at
    every root call, backward and step: mode_on_top's test written out, no call.)"""
    if mode is not None:
        n = _stack_len()
        if n and _stack_at(n - 1) is mode:
            _pop_mode(None)
            return True
    return False


push = _push_mode    # (put back what pop_if_top took off: torch's own call, no wrapper)


class mode_on:
    """The per-op mode on top of the stack for a block (a re-run needs it), also from
    where it is off: inside a root call, backward, the optimizer step."""

    __slots__ = ("mode", "pushed")

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.pushed = self.mode is not None and not mode_on_top(self.mode)
        if self.pushed:
            _push_mode(self.mode)

    def __exit__(self, *exc):
        if self.pushed:
            pop_if_top(self.mode)


def gradient_flows(out, args, kwargs, running) -> bool:
    """Whether a gradient flows through the op's output OUT. RUNNING: the op runs now,
    below autograd (its output gets `requires_grad` once it returns): a gradient flows
    when grad mode is on and an input requires one. Judged later (a device window), the
    output has it, or its stand-in (device_window._stand_in) what was known then."""
    if out.requires_grad:
        return True
    if running and _in_reentrant_checkpoint():
        return True     # (its forward runs under no_grad; backward runs it again with grad)
    if not running or not _grad_enabled():
        return False
    return any_requires_grad(args, kwargs)


def any_requires_grad(args, kwargs) -> bool:
    """Whether a tensor among an op's ARGS and KWARGS requires grad (below autograd its
    output has no `requires_grad` yet)."""
    return any(t.requires_grad for t in tensors_in((args, kwargs)))


def _checkpoint_forward_code():
    try:
        from torch.utils.checkpoint import CheckpointFunction
        return CheckpointFunction.forward.__code__
    except Exception:  # noqa: BLE001 - a torch without it
        return None


_CHECKPOINT_FORWARD = _checkpoint_forward_code()


def _in_reentrant_checkpoint() -> bool:
    """Whether the running op is in the forward of a reentrant checkpoint
    (`checkpoint(..., use_reentrant=True)`), read off the stack."""
    frame = _getframe(1)
    while frame is not None:
        if frame.f_code is _CHECKPOINT_FORWARD:
            return True
        frame = frame.f_back
    return False
