"""One wrapper around `torch.autograd.backward`, shared by the parts of mldebug that act
around a backward pass (the watch, the assertions runner).

`Tensor.backward` calls `torch.autograd.backward` by attribute, so rebinding the attribute
reaches `loss.backward()`. Each part registers an *around* function
`around(proceed, tensors, grad_tensors, args, kwargs)` that must call
`proceed(tensors, grad_tensors, *args, **kwargs)` once and return its result. With one
shared wrapper, parts can start and stop in any order without unwrapping each other; the
original is put back when the last one leaves.
"""
from __future__ import annotations

import torch

_ORIG = None       # torch.autograd.backward while wrapped
_AROUND: list = []  # registered around functions, outermost first


def _call(index, tensors, grad_tensors, args, kwargs):
    if index >= len(_AROUND):
        return _ORIG(tensors, grad_tensors, *args, **kwargs)
    around = _AROUND[index]

    def proceed(t, g, *a, **k):
        return _call(index + 1, t, g, a, k)

    return around(proceed, tensors, grad_tensors, args, kwargs)


def _wrapped_backward(tensors, grad_tensors=None, *args, **kwargs):
    if not _AROUND:
        return _ORIG(tensors, grad_tensors, *args, **kwargs)
    return _call(0, tensors, grad_tensors, args, kwargs)


def add(around) -> None:
    """Register AROUND (idempotent); wraps torch.autograd.backward on first use."""
    global _ORIG
    if around in _AROUND:
        return
    if _ORIG is None:
        _ORIG = torch.autograd.backward
        torch.autograd.backward = _wrapped_backward
    _AROUND.append(around)


def remove(around) -> None:
    """Unregister AROUND; the original comes back when none is left (unless someone
    else rebound the attribute since: then our wrapper stays, passing straight through)."""
    global _ORIG
    if around in _AROUND:
        _AROUND.remove(around)
    if not _AROUND and _ORIG is not None:
        if torch.autograd.backward is _wrapped_backward:
            torch.autograd.backward = _ORIG
            _ORIG = None


def original():
    """torch.autograd.backward as torch defines it."""
    return _ORIG if _ORIG is not None else torch.autograd.backward
