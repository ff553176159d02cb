"""The taint: which non-finite storages the stop rule judged already (and whether they
descend from a reported stop), so that values that merely flow on from them are not new
stops. Keyed by the memory's address, with a weak reference to its storage (a later
tensor at the same address is not taken for it) and the version counter when judged
(a later write is that op's own to judge).

Mixed into `Watch` (core.py); verdict.py writes it, the checks read it.
"""
from __future__ import annotations

import weakref

from .checks import version_of


class Taint:
    """Methods of `Watch`: the record of non-finite values judged (state in `Watch`)."""

    def _taint_add(self, t, has_nan, has_inf, lineage, mark=None):
        """Remember `t`'s non-finite values as judged; MARK: they were written on purpose
        or flow from such a write (marks.py)."""
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            ref = weakref.ref(storage)   # storage objects are preserved: dies with the memory
        except Exception:
            return
        if len(self._taint) > 4096:
            self._prune_taint()
        version = version_of(t)
        self._taint[ptr] = (ref, version, has_nan, has_inf, lineage)
        if mark is not None and not lineage:
            self._marks[ptr] = (ref, version, mark)
            if has_nan:
                self._nan_marks[ptr] = ref
        elif self._marks:
            self._forget_mark(ptr)

    def _taint_at(self, address, storage=None):
        """The taint record (storage ref, version, has_nan, has_inf, lineage) of the memory
        at ADDRESS while the storage it was taken of lives (STORAGE: that very storage,
        when the caller knows it; a later tensor can reuse the address), else None."""
        rec = self._taint.get(address)
        if rec is None:
            return None
        held = rec[0]()
        if held is None or (storage is not None and held is not storage):
            return None
        return rec

    def _prune_taint(self) -> None:
        """Drop the records of non-finite tensors whose memory is gone."""
        self._taint = {k: r for k, r in self._taint.items() if r[0]() is not None}
        if self._marks:
            self._marks = {k: r for k, r in self._marks.items() if r[0]() is not None}
            self._nan_marks = {k: r for k, r in self._nan_marks.items() if r() is not None}

    def _taint_of_storage(self, t):
        """(has_nan, has_inf, lineage) judged of `t`'s memory at any earlier version."""
        if not self._taint:
            return None
        try:
            rec = self._taint_at(t.untyped_storage().data_ptr())
        except Exception:
            return None
        return rec[2:] if rec is not None else None

    def _no_live_taint(self) -> bool:
        """Whether no non-finite tensor judged so far is still alive (dead ones dropped)."""
        if self._taint:
            self._prune_taint()
        return not self._taint

    def _taint_get(self, t):
        """(has_nan, has_inf, lineage) if `t`'s current non-finite values were already
        judged; lineage: they descend from a reported stop."""
        if not self._taint:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return None
        rec = self._taint_at(ptr)
        if rec is None:
            return None     # not judged, or freed: a new tensor at its address
        _, version, has_nan, has_inf, lineage = rec
        now = version_of(t)
        if version is not None and now is not None and now - version not in (0, 1):
            return None  # written by a later op: that op's own check judged it
        return has_nan, has_inf, lineage

    def _forget_taint(self, t) -> None:
        """`t`'s values were judged non-finite and are finite now (their maker masked
        them): no record of them is kept."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no storage: nothing was recorded
            return
        self._taint.pop(ptr, None)
        if self._marks:
            self._forget_mark(ptr)
