"""The recorder's small CPU tensors of one step when the C kernel is not there
(`native.py`: no compiler, or MLDEBUG_NATIVE=0): one copy when seen, every statistic at
the end of the step, for all of them at once, in numpy.

A CPU tensor of a few thousand values costs more in per-op overhead than in arithmetic,
and torch's CPU reductions pay more of it (~5-8 µs an op, and a wake-up of the OpenMP
team that the training step is using too) than numpy's (~1 µs, one thread). So `add`
copies the tensor into a flat buffer of its accumulation type, right after the one
before it (no padding), and `reduce` takes every tensor's stats with a fixed handful of
numpy passes over the buffer, whatever the number of tensors: `reduceat` at the tensors'
offsets for Σx, |x| sum, min and max; Σx² from the squares, cut at each sample's offset
for the tensors whose per-sample norms are wanted (their norms come out of the same
pass); one gather for every histogram sample. A tensor whose sum is not finite is
counted again exactly from its copy (NaN/Inf inside, or an overflow: rare).

Accuracy: numpy sums a segment pairwise in its type (float32, or float64 for float64)
and totals over samples in float64, as exact as torch's own `sum` of the tensor.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .tensorbatch import nonfinite_row, per_sample_norms, put_rows, sample_index

_FIRST = 1 << 18               # the first buffer of a dtype: 1 MiB of float32
_LAYOUTS: dict = {}            # (sample size, tensors' sizes and sample counts) -> _Layout
_LAYOUTS_MAX = 64              # (a step's layout repeats from step to step)
_NP = {torch.float32: np.float32, torch.float64: np.float64}


class HostPool:
    """The CPU buffers between steps: the largest one of each dtype is kept."""

    def __init__(self):
        self._free: dict = {}      # dtype -> numpy buffer
        self.hint: dict = {}       # dtype -> most values one step used so far
        self.native_hint: dict = {}   # nativebatch's buffers: name -> most values a step used

    def take(self, dtype, n: int) -> np.ndarray:
        """A buffer of at least N values (the kept one if large enough; a new one at least
        as large as the most a step used so far)."""
        buf = self._free.pop(dtype, None)
        if buf is not None and len(buf) >= n:
            return buf
        return np.empty(max(n, self.hint.get(dtype, _FIRST)), _NP[dtype])

    def give(self, dtype, buf: np.ndarray, used: int) -> None:
        self.hint[dtype] = max(self.hint.get(dtype, 0), used)
        kept = self._free.get(dtype)
        if kept is None or len(kept) < len(buf):
            self._free[dtype] = buf


class HostBatch:
    """Copies of a step's small CPU tensors; `reduce` fills their stats rows."""

    def __init__(self, pool: HostPool):
        self.pool = pool
        self.buffers: list = []   # [dtype, numpy buffer, torch view of it, values used, segs]
        self.open: dict = {}      # dtype -> index in buffers being filled

    def __bool__(self):
        return bool(self.buffers)

    def add(self, row: int, flat: torch.Tensor, dtype, shape=None,
            batch_dim: Optional[int] = None) -> None:
        """Copy FLAT (1-D, CPU) now, as DTYPE (float32 or float64); with SHAPE and
        BATCH_DIM its per-sample norms too."""
        n = flat.numel()
        b = self.open.get(dtype)
        if b is None or self.buffers[b][3] + n > len(self.buffers[b][1]):
            used = sum(x[3] for x in self.buffers if x[0] == dtype)
            buf = self.pool.take(dtype, max(n, self.pool.hint.get(dtype, 0) - used))
            self.buffers.append([dtype, buf, torch.from_numpy(buf), 0, []])
            b = self.open[dtype] = len(self.buffers) - 1
        entry = self.buffers[b]
        o = entry[3]
        if flat.dtype != dtype or not _numpy_copy(entry[1], o, flat):
            entry[2].narrow(0, o, n).copy_(flat)    # torch converts bfloat16, half, ints
        entry[3] = o + n
        entry[4].append((row, n, shape if batch_dim is not None else None, batch_dim))

    def reduce(self, stats: np.ndarray, samples: dict, norms: dict, size: int) -> None:
        """Fill STATS rows (the `stats.ROW` columns), SAMPLES {row: float64 array of SIZE
        values at the fixed positions} and NORMS {row: float32 per-sample norms}; then
        hand the buffers back to the pool."""
        try:
            for _, buf, view, used, segs in self.buffers:
                _reduce_buffer(buf[:used], view, segs, stats, samples, norms, size)
        finally:
            for dtype, buf, _, used, _ in self.buffers:
                self.pool.give(dtype, buf, sum(x[3] for x in self.buffers if x[0] == dtype))
            self.buffers, self.open = [], {}


def _numpy_copy(buf: np.ndarray, o: int, flat: torch.Tensor) -> bool:
    """FLAT into BUF at O by numpy (~1.5 µs less than torch's narrow + copy_); False
    when numpy cannot see the tensor."""
    try:
        buf[o:o + flat.numel()] = flat.numpy()
        return True
    except (TypeError, RuntimeError):
        return False


def _reduce_buffer(v: np.ndarray, view: torch.Tensor, segs: list, stats: np.ndarray,
                   samples: dict, norms: dict, size: int) -> None:
    lay = _layout(segs, size)
    starts = lay.starts
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.add.reduceat(v, starts).astype(np.float64)
        lo = np.minimum.reduceat(v, starts)
        hi = np.maximum.reduceat(v, starts)
        tmp = np.square(v)
        pieces = np.add.reduceat(tmp, lay.pieces)      # per sample where norms are wanted
        sumsq = np.add.reduceat(pieces.astype(np.float64), lay.first_piece)
        absum = np.add.reduceat(np.abs(v, out=tmp), starts).astype(np.float64)
    rows = np.fromiter((x[0] for x in segs), np.int64, len(segs))
    put_rows(stats, rows, lay.n, s, absum, sumsq, lo, hi)
    for j in np.flatnonzero(~np.isfinite(s)):
        stats[rows[j]] = nonfinite_row(view.narrow(0, int(starts[j]), int(lay.n[j])))
    for j, p0, count in lay.norm_pieces:
        norms[segs[j][0]] = np.sqrt(pieces[p0:p0 + count]).astype(np.float32)
    for j in lay.norm_other:       # samples not contiguous (a batch dimension inside)
        row, n, shape, batch_dim = segs[j]
        x = view.narrow(0, int(starts[j]), n).view(shape)
        norms[row] = per_sample_norms(x, batch_dim).numpy().copy()
    if size:
        picked = v[lay.gather].astype(np.float64)
        for j, (a, b) in enumerate(lay.sample_span):
            samples[segs[j][0]] = picked[a:b]


class _Layout:
    """Where a buffer's tensors lie (cached per layout): each tensor's offset (`starts`)
    and size (`n`); the pieces Σx² is summed over (a whole tensor, or each of its samples
    where its per-sample norms are wanted) and each tensor's first piece; the histogram
    samples' positions (`gather`) and each tensor's share of them (`sample_span`)."""

    __slots__ = ("starts", "n", "pieces", "first_piece", "norm_pieces", "norm_other",
                 "gather", "sample_span")

    def __init__(self, segs: list, size: int):
        n = np.array([s[1] for s in segs], np.int64)
        self.n = n
        self.starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
        pieces, first, self.norm_pieces, self.norm_other = [], [], [], []
        for j, (_, m, shape, batch_dim) in enumerate(segs):
            first.append(len(pieces))
            o = int(self.starts[j])
            if shape is None or len(shape) == 0:
                pieces.append(o)
            elif math.prod(shape[:batch_dim % len(shape)]) == 1:   # samples in a row
                count = shape[batch_dim]
                self.norm_pieces.append((j, len(pieces), count))
                pieces.extend(range(o, o + m, m // count))
            else:
                self.norm_other.append(j)
                pieces.append(o)
        self.pieces = np.array(pieces, np.int64)
        self.first_piece = np.array(first, np.int64)
        gather, spans, g = [], [], 0
        if size:
            for o, m in zip(self.starts.tolist(), n.tolist()):
                idx = (np.arange(m) if m <= size else sample_index(m, size, "cpu").numpy()) + o
                gather.append(idx)
                spans.append((g, g + len(idx)))
                g += len(idx)
        self.gather = np.concatenate(gather) if gather else np.zeros(0, np.int64)
        self.sample_span = spans


def _layout(segs: list, size: int) -> _Layout:
    key = (size, tuple((s[1], s[2], s[3]) for s in segs))
    got = _LAYOUTS.get(key)
    if got is None:
        got = _Layout(segs, size)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = got
    return got
