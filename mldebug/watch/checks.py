"""The watch's primitives, shared by the per-op check (dispatch.py, verdict.py,
device_window.py) and the tiers (module_tier.py, backward_tier.py): which tensors are
checked, in what dtype they are summed, exact counts."""
from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

from ..summaries import nonfinite_counts, summary

_F32 = torch.float32
_LOW = frozenset(d for d in (torch.float16, torch.bfloat16,
                             getattr(torch, "float8_e4m3fn", None),
                             getattr(torch, "float8_e5m2", None)) if d is not None)
_isfinite = math.isfinite
_grad_enabled = torch.is_grad_enabled
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
