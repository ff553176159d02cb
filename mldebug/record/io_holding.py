"""Which module tensors a recorded step on a device may hold rather than copy when seen
(methods of `Recorder`).

On a GPU every copy is a launch. A module's inputs, outputs and output gradients are
copied when seen on the first recorded steps, which also find out which of them the
program changes in place before the step ends: by their version counters, and by a twin
copied at the step's end whose statistics and histogram must equal the first copy's
(a write the version counter misses: `x.data`, a custom kernel). From then on those it
leaves alone are held (`StepBatch.hold`) and copied together, in one op, at
`optimizer.step()`; the others are still copied when seen. A held tensor that starts
changing later is left out of that step, said once, and copied when seen from then on.
"""
from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
import torch

from ..core.frames import warn_at_user_line
from . import stats as _stats


class IoHolding:
    """Methods of `Recorder`: holding module tensors on a device, and learning which."""

    def _add_io(self, t: torch.Tensor, keys, batch_dim: Optional[int] = None) -> int:
        """Row of module input, output or output gradient T (series KEYS). On a device its
        copy waits for the step's end, one op for all (`StepBatch.hold`), once a recorded
        step has shown that the program leaves it as it was recorded until then (it does
        not after a BatchNorm followed by ReLU(inplace=True), with `out += identity`, in
        a hook or a kernel writing in place): until then, and for those it changes, a
        copy when seen."""
        if not _stats.defers(t):
            return self._batch.add(t, self.sample, batch_dim)
        if self._copy_now.isdisjoint(keys) and self._unchanged.issuperset(keys) \
                and _stats.holds_well(t):
            return self._batch.hold(t, self.sample, batch_dim, deferrable=True)
        row = self._batch.add(t, self.sample, batch_dim)
        if self._copy_now.isdisjoint(keys):
            # kept alive to the step's end, within the blocks' budget, to see whether it
            # changes (a gradient is let go as soon as autograd has used it); beyond the
            # budget a weak reference: one gone by then is learned on a later step
            self._copied_numel += t.numel()
            keep = t if self._copied_numel <= _stats.DEVICE_BUDGET else weakref.ref(t)
            self._copied.append((keep, t._version, row))
        return row

    def _twins_of(self, batch, copied: list) -> tuple:
        """At a recorded step's end, before it is staged: of the io tensors copied when
        seen (COPIED, as `_add_io` kept them), the rows of those whose version moved, and
        for those still at their version a twin row copied now: ({changed rows},
        [(row, twin row)]). The twins' statistics are compared with the rows' when the
        step is written (`_judge_twins`): a write that bypasses the version counter
        (`x.data`, a custom kernel writing in place) is caught there."""
        changed, twins = set(), []
        for keep, version, row in copied:
            t = keep() if isinstance(keep, weakref.ref) else keep
            if t is None:
                continue
            if t._version != version:
                changed.add(row)
            else:
                twins.append((row, batch.hold(t, self.sample)))
        return changed, twins

    def _judge_twins(self, out: dict, entries: list, twins: list) -> None:
        """Once the step's statistics are back (writer thread): a series whose tensor's
        statistics and histogram at the step's end equal those when it was recorded is
        held from now on; one whose differ is copied when seen."""
        stats, hist = out["stats"], out["hist"]
        same, changed = set(), set()
        for row, twin in twins:
            equal = np.array_equal(stats[row], stats[twin], equal_nan=True) \
                and np.array_equal(hist[row], hist[twin])
            (same if equal else changed).add(row)
        with self._lock:
            self._copy_now.update(_keys_of(entries, changed))
            self._unchanged.update(_keys_of(entries, same) - self._copy_now)

    def _learn_copies(self, entries: list, lost: set, changed: set) -> list:
        """At a recorded step's end: the series whose tensors changed in place after they
        were recorded (CHANGED rows: copied when seen from now on); ENTRIES without the
        rows held and then changed (LOST: not recorded on this step, said once)."""
        changed = changed | lost
        if not changed:
            return entries
        self._copy_now.update(_keys_of(entries, changed))
        self._unchanged.difference_update(self._copy_now)
        if not lost:
            return entries
        gone = sorted(_keys_of(entries, lost))
        self._say(f"mldebug.record: {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''} "
                  f"changed in place (or could not be read) after it was recorded on step "
                  f"{self.step_index}: not recorded on that step; from now on copied when "
                  "seen")
        return [e for e in entries if e[3] not in lost]

    @staticmethod
    def _say(message: str) -> None:
        """A RuntimeWarning that never raises into the program (under `-W error` too)."""
        try:
            warn_at_user_line(message)
        except Exception:  # noqa: BLE001 - warnings turned into errors
            pass


def _keys_of(entries: list, rows: set) -> set:
    """The series keys of ENTRIES (key, meta, call, row) whose row is in ROWS: a row is
    shared by every entry that saw the same tensor at the same version."""
    return {e[0] for e in entries if e[3] in rows}
