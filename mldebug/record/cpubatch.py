"""The recorder's CPU tensors of one step: one copy when seen, every statistic at the end
of the step, for all of them at once.

On the CPU a tensor of a few thousand values costs more in per-op overhead (~4 µs an op:
five reductions, a sample gather, a read-back each) than in arithmetic. So `add` does ONE
op: it copies the tensor into a block (a [rows, CHUNK] matrix reused from step to step,
so no page faults), starting on a fresh row. `reduce` then runs a fixed handful of ops per
block, whatever the number of tensors: the padding after each tensor zeroed (one
scatter), per-row sum, Σx² (2-norm), min, max, |x| sum (`abs_` in place: the copy is
ours) and the samples (one gather) in torch; per-tensor totals in float64 with
`reduceat` over each tensor's rows. The min/max of a tensor's last, partly filled row are
taken again without its padding. A tensor whose total is not finite is recomputed
exactly from its copy.

Accuracy: a row is summed by torch in the accumulation type (float32, or float64 for
float64) over at most CHUNK values and rows are added in float64, so totals are at least
as exact as torch's own `sum` of the whole tensor.
"""
from __future__ import annotations

import math
import threading
from typing import Optional

import numpy as np
import torch

CHUNK = 1024                # columns of a block: a tensor starts on a fresh row
_ROWS0 = 256                # the first block of a dtype: 1 MiB of float32
_LAYOUTS: dict = {}         # (tensor rows and sizes, sample size) -> gather/scatter
_LAYOUTS_MAX = 64           # indices (a step's layout repeats from step to step)


class BlockPool:
    """The recorder's blocks, between steps."""

    def __init__(self):
        self._free: list = []
        self._lock = threading.Lock()
        self.hint: dict = {}      # dtype -> most rows one step used so far

    def take(self, dtype, rows: int) -> torch.Tensor:
        """A block of at least ROWS rows, and at least what a step used so far."""
        rows = max(rows, self.hint.get(dtype, _ROWS0))
        with self._lock:
            for j, b in enumerate(self._free):
                if b.dtype == dtype and b.shape[0] >= rows:
                    return self._free.pop(j)
        return torch.empty(rows, CHUNK, dtype=dtype)

    def give(self, blocks: list) -> None:
        with self._lock:
            for b in blocks:    # smaller than a step now needs: let it go
                if b.shape[0] >= self.hint.get(b.dtype, 0) and len(self._free) < 4:
                    self._free.append(b)


class CpuBatch:
    """Copies of a step's CPU tensors; `reduce` fills their stats rows."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list = []    # [block, dtype, rows used, block.view(-1)]
        self.open: dict = {}      # dtype -> index in blocks being filled
        self.segs: list = []      # (stats row, block index, first row, numel, shape, batch_dim)

    def __bool__(self):
        return bool(self.segs)

    def add(self, row: int, flat: torch.Tensor, dtype, shape=None,
            batch_dim: Optional[int] = None) -> None:
        """Copy FLAT (1-D, CPU) now, as DTYPE; with BATCH_DIM its per-sample norms too."""
        n = flat.numel()
        k = -(-n // CHUNK)
        b = self.open.get(dtype)
        if b is None or self.blocks[b][2] + k > self.blocks[b][0].shape[0]:
            b = self.open[dtype] = len(self.blocks)
            blk = self.pool.take(dtype, k)
            self.blocks.append([blk, dtype, 0, blk.view(-1)])
        blk = self.blocks[b]
        r0 = blk[2]
        blk[3].narrow(0, r0 * CHUNK, n).copy_(flat)
        blk[2] = r0 + k
        self.segs.append((row, b, r0, n, shape, batch_dim))

    def reduce(self, stats: np.ndarray, samples: dict, norms: dict, size: int) -> None:
        """Fill STATS rows (the `stats.ROW` columns), SAMPLES {row: float64 array of SIZE
        values at the fixed positions} and NORMS {row: float32 per-sample norms}; then
        hand the blocks back to the pool."""
        used: dict = {}
        for _, dtype, rows, _ in self.blocks:   # how much a step takes
            used[dtype] = used.get(dtype, 0) + rows
        for dtype, rows in used.items():
            self.pool.hint[dtype] = max(self.pool.hint.get(dtype, 0), rows)
        try:
            for b, (blk, _, rows, _) in enumerate(self.blocks):
                segs = [s for s in self.segs if s[1] == b]
                if segs:
                    _reduce_block(blk[:rows], segs, stats, samples, norms, size)
        finally:
            self.pool.give([blk[0] for blk in self.blocks])
            self.blocks, self.segs, self.open = [], [], {}


def _reduce_block(v, segs, stats, samples, norms, size) -> None:
    flat = v.view(-1)
    rows = np.array([s[0] for s in segs], np.int64)
    n = np.array([s[3] for s in segs], np.int64)
    r0 = np.array([s[2] for s in segs], np.int64)
    gather, pad, last, valid = _layout(segs, size)
    flat.index_fill_(0, pad, 0.0)        # sums and |x| sums count the padding as 0
    per_row = torch.stack([v.sum(1), torch.linalg.vector_norm(v, dim=1), v.amin(1),
                           v.amax(1)]).double().numpy()
    tails = v.index_select(0, last).double().numpy() if len(valid) else None
    picked = flat.index_select(0, gather).double().numpy() if size else None
    for s in segs:
        if s[5] is not None and len(s[4]):
            seg = flat.narrow(0, s[2] * CHUNK, s[3]).view(s[4])
            norms[s[0]] = per_sample_norms(seg, s[5]).numpy().copy()
    sums, sq, lo, hi = per_row
    sq *= sq
    if tails is not None:   # min and max of the last rows without their padding
        lo[last.numpy()] = np.where(valid, tails, np.inf).min(1)
        hi[last.numpy()] = np.where(valid, tails, -np.inf).max(1)
    total = np.add.reduceat(sums, r0)
    # NaN/Inf inside (or an overflow): exact counts and stats of the finite values
    exact = {j: _nonfinite_row(flat.narrow(0, r0[j] * CHUNK, n[j]))
             for j in np.flatnonzero(~np.isfinite(total))}
    absum = v.abs_().sum(1).double().numpy()      # last: it overwrites the copy
    with np.errstate(invalid="ignore"):
        stats[rows] = np.stack([n, total, np.add.reduceat(absum, r0),
                                np.add.reduceat(sq, r0), np.minimum.reduceat(lo, r0),
                                np.maximum.reduceat(hi, r0), *np.zeros((3, len(n)))], 1)
    for j, row in exact.items():
        stats[rows[j]] = row
    if picked is not None:
        o = 0
        for s in segs:
            m = min(s[3], size)
            samples[s[0]] = picked[o:o + m]
            o += m


def _layout(segs: list, size: int) -> tuple:
    """For a block's tensors (cached per layout): the flat positions of every sample, of
    the padding, the partly filled last rows and their [rows, CHUNK] mask of values."""
    key = (tuple((s[2], s[3]) for s in segs), size)
    got = _LAYOUTS.get(key)
    if got is None:
        gather = [torch.arange(n) + r0 * CHUNK if n <= size
                  else sample_index(n, size, "cpu") + r0 * CHUNK for r0, n in key[0]]
        ends = [(r0 * CHUNK + n, n % CHUNK) for r0, n in key[0] if n % CHUNK]
        pad = [torch.arange(e, e + CHUNK - t) for e, t in ends]
        got = (torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long),
               torch.cat(pad) if pad else torch.zeros(0, dtype=torch.long),
               torch.tensor([e // CHUNK for e, _ in ends], dtype=torch.long),
               np.arange(CHUNK) < np.array([t for _, t in ends], np.int64)[:, None])
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = got
    return got


def _nonfinite_row(x: torch.Tensor) -> list:
    """[finite count, sum, |x| sum, Σx², min, max of the finite values, nan, +inf, -inf]."""
    a = x.double().numpy()
    fin = a[np.isfinite(a)]
    body = ([fin.sum(), np.abs(fin).sum(), np.dot(fin, fin), fin.min(), fin.max()]
            if len(fin) else [0.0, 0.0, 0.0, math.nan, math.nan])
    return [len(fin), *body, int(np.isnan(a).sum()), int((a == np.inf).sum()),
            int((a == -np.inf).sum())]


def per_sample_norms(t: torch.Tensor, batch_dim: int = 0) -> Optional[torch.Tensor]:
    """‖t[i]‖₂ for each sample i along BATCH_DIM (float32), None for 0-d tensors."""
    if t.dim() == 0:
        return None
    x = t.detach()
    if batch_dim:
        x = x.movedim(batch_dim, 0)
    if x.shape[0] == 0:         # no samples (reshape(0, -1) would be ambiguous)
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    x = x.reshape(x.shape[0], -1)
    return torch.linalg.vector_norm(x.float() if x.dtype not in (torch.float32, torch.float64)
                                    else x, dim=1).float()


_IDX_CACHE: dict = {}          # (numel, sample, device) -> sorted random indices
_IDX_CACHE_MAX = 512
_GEN: dict = {}                # device -> private torch.Generator (never the global RNG)


def sample_index(n: int, size: int, device) -> torch.Tensor:
    """SIZE sorted random positions among N, the same for every step (a private RNG)."""
    key = (n, size, device)
    idx = _IDX_CACHE.get(key)
    if idx is None:
        gen = _GEN.get("cpu")
        if gen is None:
            gen = _GEN["cpu"] = torch.Generator().manual_seed(0x5EED)
        idx = torch.randint(n, (size,), generator=gen).sort().values.to(device)
        if len(_IDX_CACHE) >= _IDX_CACHE_MAX:
            _IDX_CACHE.clear()
        _IDX_CACHE[key] = idx
    return idx
