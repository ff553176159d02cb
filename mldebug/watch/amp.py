"""Mixed precision's loss scaling, as the watch sees it.

`torch.amp.GradScaler` multiplies the loss by a large scale (2^16 by default) so that
float16 gradients do not underflow; when that makes them overflow, the scaler finds the
Inf/NaN, skips `optimizer.step()` and halves the scale. Those non-finite gradients are
the scaler's business, not a bug: in the backward of a loss the scaler returned, a
NaN/Inf in a float16 gradient (or one the re-runs cannot pin) is not a stop.

Unless it keeps happening: after MAX_SKIPS such backwards in a row the scale has fallen
65536-fold (to 1 from the default 2^16): the gradients are non-finite at any scale, and
the next one is a stop again, saying so.
"""
from __future__ import annotations

import weakref

import torch

MAX_SKIPS = 16
# the scaler's own check and unscale (in place on the gradients): its finding, not a stop
SCALER_OPS = ("aten._amp_foreach_non_finite_check_and_unscale_", "aten._amp_update_scale_")

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
            tracker.note(scaled)
    return scaled


class LossScaling:
    """The losses GradScaler scaled, whether the backward running now is of one, and
    how many such backwards in a row had non-finite gradients."""

    def __init__(self):
        self._scaled: dict = {}     # id(scaled loss) -> weakref to it
        self.active = False         # a backward of a scaled loss is running
        self.overflowed = False     # ...and a NaN/Inf in it was excused
        self.in_a_row = 0           # scaled backwards in a row that overflowed

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

    def note(self, scaled) -> None:
        items = [scaled] if isinstance(scaled, torch.Tensor) else (
            [x for x in scaled if isinstance(x, torch.Tensor)]
            if isinstance(scaled, (list, tuple)) else [])
        if len(self._scaled) > 64:
            self._scaled = {k: r for k, r in self._scaled.items() if r() is not None}
        for t in items:
            self._scaled[id(t)] = weakref.ref(t)

    def begin(self, roots) -> bool:
        """A backward starts from ROOTS: is it of a scaled loss?"""
        self.active = any((r := self._scaled.get(id(t))) is not None and r() is t
                          for t in roots)
        self.overflowed = False
        return self.active

    def end(self) -> None:
        if self.active:
            self.in_a_row = self.in_a_row + 1 if self.overflowed else 0
        self.active = False

    def excuses(self, dtype=None) -> bool:
        """Whether a non-finite gradient of DTYPE (None: not known, e.g. one the re-run
        could not pin) in this backward is the scaler's overflow, not a stop."""
        if not self.active or self.in_a_row >= MAX_SKIPS:
            return False
        if dtype is not None and dtype is not torch.float16:
            return False
        self.overflowed = True
        return True

    def with_note(self, text: str) -> str:
        """TEXT of a backward stop, with why the scaler's overflows no longer excuse it
        when that is the case."""
        if not (self.active and self.in_a_row >= MAX_SKIPS):
            return text
        why = (f"GradScaler found non-finite gradients in {self.in_a_row} backwards "
               "in a row (its scale fell ~65536-fold): they are non-finite at any "
               "scale, not an overflow of the loss scale")
        return f"{text}; {why}" if text else why
