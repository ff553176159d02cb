"""Mixed precision's loss scaling, as the watch sees it.

`torch.amp.GradScaler` multiplies the loss by a scale (2^16 by default; Megatron starts
at 2^32, any value is legal) so that float16 gradients do not underflow; when that makes
them overflow, the scaler finds the Inf/NaN, skips `optimizer.step()` and halves the
scale, as often as it takes (from 2^48, some 33 steps in a row). Those non-finite
gradients are the scaler's business, not a bug: in the backward of a loss the scaler
returned, a NaN/Inf in a float16 gradient (or one the re-runs cannot pin) is not a stop
while the scale is above 1, where a smaller scale would give finite gradients.

Judged by the scale, not by a count of skipped steps:
- at a scale <= 1 the gradients are not enlarged at all: a non-finite one is a stop
  (float16 cannot hold the model's own gradients), and says so;
- a gradient that stays non-finite unscaled is a stop at any scale, and says so: the op
  that made it (pinned, as every stop is) is run again on the same inputs in float64 and
  its result divided by the scale; an infinite derivative (sqrt or log at 0, a division
  by 0) is non-finite there too, an overflow of the scale is not. (An op that cannot be
  run again so, one that writes its input in place, is judged by the scale alone.)

The scale is read (one `.item()`) only when a non-finite gradient is judged.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from ..core.structs import tensors_in

# the scaler's own check and unscale (in place on the gradients): its finding, not a stop
SCALER_OPS = ("aten._amp_foreach_non_finite_check_and_unscale_", "aten._amp_update_scale_")
# a stop's evidence when the optimizer stepped on the gradients' overflow that the scaler
# found (`optimizer.step()` where `scaler.step(optimizer)` skips the step): the
# catalogue's `loss_scaler_overflow_stepped` (remedies/hints.py)
STEPPED_ON_OVERFLOW = {"loss_scaler": {"found_inf": True}}
OVERFLOW_MADE_BY = "the loss scale's overflow, which GradScaler found"

try:
    from torch.amp.grad_scaler import GradScaler as _GradScaler
except ImportError:  # older torch: the CUDA one only
    try:
        from torch.cuda.amp import GradScaler as _GradScaler
    except ImportError:
        _GradScaler = None

_ORIG_SCALE = None
_TRACKERS: list = []      # the running watch's tracker (at most one)


def _scale(self, outputs):
    scaled = _ORIG_SCALE(self, outputs)
    if getattr(self, "_enabled", True):   # GradScaler(enabled=False) checks nothing
        for tracker in _TRACKERS:
            tracker.note(scaled, self)
    return scaled


def scale_text(scale: float) -> str:
    """2^48 for a power of two, else the number."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent == int(exponent):
            return f"2^{int(exponent)}"
    return f"{scale:g}"


class LossScaling:
    """The losses GradScaler scaled (and by which scaler), whether the backward running
    now is of one, and why a non-finite gradient in it is not the scale's doing."""

    def __init__(self):
        self._scaled: dict = {}     # id(scaled loss) -> (weakref to it, weakref to its scaler)
        self.active = False         # a backward of a scaled loss is running
        self._scaler = None         # weakref to the scaler of that loss
        self.refused = ""           # why the last gradient judged is not excused
        self.overflowed = False     # this backward made an Inf the scaler's overflow excused
        # the gradients holding the scaler's overflow, and what was made of them since:
        # address -> weak reference to the storage (dead once `zero_grad()` lets go)
        self._overflow: dict = {}

    def start(self) -> None:
        global _ORIG_SCALE
        if _GradScaler is None:
            return
        if _ORIG_SCALE is None:
            _ORIG_SCALE = _GradScaler.scale
            _GradScaler.scale = _scale
        _TRACKERS.append(self)

    def stop(self) -> None:
        global _ORIG_SCALE
        if self in _TRACKERS:
            _TRACKERS.remove(self)
        if not _TRACKERS and _ORIG_SCALE is not None:
            if _GradScaler.scale is _scale:
                _GradScaler.scale = _ORIG_SCALE
                _ORIG_SCALE = None
        self._scaled.clear()
        self._overflow.clear()

    def note(self, scaled, scaler=None) -> None:
        items = [scaled] if isinstance(scaled, torch.Tensor) else (
            [x for x in scaled if isinstance(x, torch.Tensor)]
            if isinstance(scaled, (list, tuple)) else [])
        if len(self._scaled) > 64:
            self._scaled = {k: r for k, r in self._scaled.items() if r[0]() is not None}
        owner = weakref.ref(scaler) if scaler is not None else None
        for t in items:
            self._scaled[id(t)] = (weakref.ref(t), owner)

    def begin(self, roots) -> bool:
        """A backward starts from ROOTS: is it of a scaled loss?"""
        self.active, self._scaler, self.refused = False, None, ""
        self.overflowed = False
        for r in roots:
            found = self._scaled.get(id(r))
            if found is not None and found[0]() is r:
                self.active, self._scaler = True, found[1]
                break
        return self.active

    def end(self) -> None:
        self.active, self._scaler = False, None

    def hold_overflow(self, t) -> None:
        """T holds the scaler's overflow (or what was made of it): the step it is in is
        skipped by `scaler.step()`, which found it."""
        try:
            storage = t.untyped_storage()
        except Exception:  # noqa: BLE001 - no storage: nothing to know it by
            return
        if len(self._overflow) > 256:
            self._overflow = {k: r for k, r in self._overflow.items() if r() is not None}
        self._overflow[storage.data_ptr()] = weakref.ref(storage)

    def holds_overflow(self, t) -> bool:
        """Whether tensor T's memory holds the scaler's overflow (`hold_overflow`)."""
        if not self._overflow or not isinstance(t, Tensor):
            return False
        try:
            storage = t.untyped_storage()
        except Exception:  # noqa: BLE001
            return False
        ref = self._overflow.get(storage.data_ptr())
        return ref is not None and ref() is storage

    def scale(self):
        """The scale of this backward's loss (a read), or None when it is not known."""
        scaler = self._scaler() if self._scaler is not None else None
        if scaler is None:
            return None
        try:
            return float(scaler.get_scale())
        except Exception:  # noqa: BLE001 - a scaler of another make: not known
            return None

    def excuses(self, dtype=None, unscaled=None) -> bool:
        """Whether a non-finite gradient of DTYPE (None: not known, e.g. one the re-run
        could not pin) in this backward is the scaler's overflow, not a stop. UNSCALED:
        called with the scale, says whether the op that made it gives a non-finite value
        without the scale too (None: judged by the scale alone)."""
        self.refused = ""
        if not self.active:
            return False
        if dtype is not None and dtype is not torch.float16:
            return False
        scale = self.scale()
        if scale is None:
            return True
        if scale <= 1:
            self.refused = (f"GradScaler's scale is {scale:g}: the gradient is "
                            "non-finite at any scale, not an overflow of the loss scale")
            return False
        if unscaled is not None and unscaled(scale):
            self.refused = (f"it stays non-finite unscaled (the op run again in float64, "
                            f"divided by GradScaler's scale {scale_text(scale)}): not an "
                            "overflow of the loss scale")
            return False
        return True

    def with_note(self, text: str) -> str:
        """TEXT of a backward stop, with why the scaler's overflows do not excuse it
        when that is the case."""
        if not (self.active and self.refused):
            return text
        return f"{text}; {self.refused}" if text else self.refused


def stays_unscaled(func, args, kwargs, scale: float) -> bool:
    """Whether FUNC (an op that made a NaN/Inf from finite inputs), run again on ARGS in
    float64 with its result divided by SCALE, still gives a NaN/Inf. False when it cannot
    be run so (an input gone, no float64 kernel): the scale alone judges then."""
    def wide(x):
        if isinstance(x, Tensor):
            return x.detach().double() if x.is_floating_point() else x
        if isinstance(x, torch.dtype):
            return torch.float64 if x.is_floating_point else x
        if isinstance(x, (list, tuple)):
            return type(x)(wide(v) for v in x)
        return x

    devices = {t.device.type for t in tensors_in((args, kwargs))}
    try:
        with torch.no_grad(), _no_autocast(devices):
            out = func(*wide(tuple(args)), **{k: wide(v) for k, v in (kwargs or {}).items()})
        outs = [o for o in tensors_in(out) if o.is_floating_point()]
        return any(not bool(torch.isfinite(o / scale).all()) for o in outs)
    except Exception:  # noqa: BLE001 - not run again: the scale judges
        return False


class _no_autocast:
    """Autocast off on DEVICES (a re-run of a call keeps its autocast on: the float64 run
    must not be cast back to float16)."""

    def __init__(self, devices):
        self._contexts = [torch.autocast(d, enabled=False) for d in devices
                          if d in ("cpu", "cuda")]

    def __enter__(self):
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)
