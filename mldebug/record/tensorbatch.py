"""The recorder's small tensors of one step on a GPU (or another device than the CPU):
at most one copy each, every statistic at the end of the step, for all of them at once.

On a GPU each op is a kernel launch (~10 µs of CPU time), and a step of a small model is
launch-bound. So `add` does ONE op: it copies the tensor as it lies into a block (a
[rows, CHUNK] matrix on the tensor's device, reused from step to step, with its views),
starting on a fresh row. `hold` and `add_many` do less: the copies wait and are made
together, one `_foreach_copy_` (the parameters and gradients at `optimizer.step()`, and
the module tensors the recorder found unchanged until then). The step's end then queues
a fixed handful of ops per block, whatever the number of tensors (`stage`): per-row min
and max with the padding after each tensor set to +inf, then -inf, sum, Σx² and |x| sum
with it set to 0, the samples (one gather), the per-sample norms (two `segment_reduce`),
and each tensor's totals from its rows (`segment_reduce`), all without a read. The
recorder's writer thread then brings them to the host with the step's one transfer and
finishes them (`DeviceStaged.finish`), and only then gives the blocks back. A tensor
whose total is not finite is recomputed exactly from its copy. (The CPU's small tensors
go to `hostbatch.py` instead: numpy, no blocks.)

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

from . import block_graphs

CHUNK = 1024                # columns of a block: a tensor starts on a fresh row
_ROWS0 = 256                # the first block of a dtype: 1 MiB of float32
_LAYOUTS: dict = {}         # (device, tensor rows and sizes, sample size) -> gather/scatter
_LAYOUTS_MAX = 64           # indices (a step's layout repeats from step to step)
_VIEWS_MAX = 4096           # views of one block kept for the next steps
_no_grad = torch.no_grad


class BlockPool:
    """The recorder's blocks, between steps, each with its views (`TensorBatch._place`)."""

    def __init__(self):
        self._free: list = []     # (block, its views)
        self._lock = threading.Lock()
        self.hint: dict = {}      # (device, dtype) -> most rows one step used so far

    def take(self, dtype, rows: int, device=None, want: Optional[int] = None) -> tuple:
        """(block, its views) of at least ROWS rows: WANT rows if new, by default what a
        step used so far."""
        device = torch.device(device or "cpu")
        rows = max(rows, self.hint.get((device, dtype), _ROWS0)) if want is None else want
        with self._lock:
            for j, (b, _) in enumerate(self._free):
                if b.dtype == dtype and b.device == device and b.shape[0] >= rows:
                    return self._free.pop(j)
        return torch.empty(rows, CHUNK, dtype=dtype, device=device), {}

    def give(self, blocks: list) -> None:
        """BLOCKS: (block, its views)."""
        with self._lock:
            for b, views in blocks:    # smaller than a step now needs: let it go
                if b.shape[0] >= self.hint.get((b.device, b.dtype), 0) and len(self._free) < 4:
                    self._free.append((b, views))


class TensorBatch:
    """Copies of a step's tensors of one device; `stage` queues their reductions.

    On a device the blocks of one dtype hold at most ROLL_ROWS rows in all: when they are
    full, the open block's reductions are queued at once (`DeviceStaged.add_block`,
    rolled) and the block is filled again from its first row. The stream runs the
    reductions before the copies that follow, so memory stays bounded whatever the size
    of the step, at one copy launch per tensor."""

    def __init__(self, pool: BlockPool, device=None, size: int = 0, roll_rows: int = 0):
        self.pool = pool
        self.device = torch.device(device or "cpu")
        self.size = size          # sample size (what a rolled block gathers)
        self.roll_rows = roll_rows
        self.blocks: list = []    # [block, dtype, rows used, block.view(-1), its views]
        self.open: dict = {}      # dtype -> index in blocks being filled
        self.segs: list = []      # (stats row, block index, first row, numel, shape, batch_dim)
        self.numel = 0            # values copied so far
        self.rows: dict = {}      # dtype -> rows allocated this step
        self.rolled: Optional[DeviceStaged] = None
        self._pending: list = []  # (block view, tensor, its version, row): copies to make
        self.lost: set = set()    # rows held and changed before their copy (`hold`)

    def __bool__(self):
        return bool(self.segs) or self.rolled is not None

    def add(self, row: int, t: torch.Tensor, dtype, shape=None,
            batch_dim: Optional[int] = None) -> None:
        """Copy T (on this batch's device, any shape and strides) now, as DTYPE: one op;
        with BATCH_DIM its per-sample norms too."""
        dst = self._place(row, t.numel(), dtype, t.shape, shape, batch_dim)
        with _no_grad():
            dst.copy_(t)

    def add_many(self, items) -> None:
        """ITEMS: (row, tensor, dtype), copied as `add` does, with what `hold` kept, in one
        `_foreach_copy_` per pair of dtypes (and contiguity): a step's parameters and
        gradients in one launch, not one each."""
        for row, t, dtype in items:
            self.hold(row, t, dtype)
        self._copy_pending()

    def hold(self, row: int, t: torch.Tensor, dtype, shape=None,
             batch_dim: Optional[int] = None) -> None:
        """As `add`, but the copy waits, with those of the other tensors held, for one
        `_foreach_copy_`: with the parameters' before the optimizer changes anything
        (`add_many`), at the step's end (`stage`), or when its block is full (`_roll`:
        so what is held is bounded as the blocks are). T is kept alive until then; if
        it has changed in place by then (its version moved) or its memory was let go,
        it is not copied and its row is in `lost`."""
        dst = self._place(row, t.numel(), dtype, t.shape, shape, batch_dim)
        self._pending.append((dst, t, t._version, row))

    def _copy_pending(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        groups: dict = {}
        for dst, t, version, row in pending:
            if t._version != version or not t.untyped_storage().nbytes():
                self.lost.add(row)
                continue
            # (a GPU's multi-tensor copy takes its fast path only when all its sources
            # lie as their contiguous destinations: the others in a group of their own)
            key = (dst.dtype, t.dtype, t.is_contiguous())
            dsts, srcs, rows = groups.setdefault(key, ([], [], []))
            dsts.append(dst)
            srcs.append(t)
            rows.append(row)
        with _no_grad():
            for dsts, srcs, rows in groups.values():
                try:
                    torch._foreach_copy_(dsts, srcs)
                except RuntimeError:
                    self._copy_one_by_one(dsts, srcs, rows)

    def _copy_one_by_one(self, dsts: list, srcs: list, rows: list) -> None:
        """A held tensor that cannot be read (a CUDA graph's output overwritten by a later
        replay raises on access): the others copied, its row lost."""
        for dst, t, row in zip(dsts, srcs, rows):
            try:
                dst.copy_(t)
            except RuntimeError:
                self.lost.add(row)

    def _place(self, row: int, n: int, dtype, view_shape, shape=None,
               batch_dim: Optional[int] = None) -> torch.Tensor:
        """The block rows of the next N values of DTYPE, as a view of VIEW_SHAPE: a
        view made once per block, position and shape (a step's layout repeats from step
        to step, so no view op is left in a step)."""
        k = -(-n // CHUNK)
        b = self.open.get(dtype)
        if b is None or self.blocks[b][2] + k > self.blocks[b][0].shape[0]:
            b = self.open[dtype] = self._block_for(dtype, k)
        blk = self.blocks[b]
        r0 = blk[2]
        blk[2] = r0 + k
        self.segs.append((row, b, r0, n, shape, batch_dim))
        self.numel += n
        views = blk[4]
        dst = views.get((r0, view_shape))
        if dst is None:
            if len(views) >= _VIEWS_MAX:
                views.clear()
            dst = views[(r0, view_shape)] = blk[3].narrow(0, r0 * CHUNK, n).view(view_shape)
        return dst

    def _block_for(self, dtype, k: int) -> int:
        """The block the next K rows of DTYPE go to: a new one, unless this step's blocks
        of DTYPE already hold ROLL_ROWS rows (device only): then the largest of them that
        fits, its reductions queued first and its rows reused."""
        have = self.rows.get(dtype, 0)
        if self.roll_rows and have + k > self.roll_rows:
            fit = [j for j, x in enumerate(self.blocks) if x[1] == dtype and x[0].shape[0] >= k]
            if fit:
                b = max(fit, key=lambda j: self.blocks[j][0].shape[0])
                self._roll(b)
                return b
        want = None if not self.roll_rows else min(      # (None: the pool's hint)
            max(k, self.pool.hint.get((self.device, dtype), _ROWS0)),
            max(k, self.roll_rows - have))
        blk, views = self.pool.take(dtype, k, self.device, want)
        self.rows[dtype] = have + blk.shape[0]
        self.blocks.append([blk, dtype, 0, blk.view(-1), views])
        return len(self.blocks) - 1

    def _roll(self, b: int) -> None:
        """Queue block B's reductions now (its values are overwritten after them)."""
        self._copy_pending()
        segs = [s for s in self.segs if s[1] == b]
        blk = self.blocks[b]
        if segs:
            if self.rolled is None:
                self.rolled = DeviceStaged(self)
            self.rolled.add_block(blk[0][:blk[2]], segs, self.size, rolled=True)
            self.segs = [s for s in self.segs if s[1] != b]
        blk[2] = 0

    def _note_use(self) -> None:
        used: dict = {}
        for _, dtype, rows, *_ in self.blocks:   # how much a step takes
            used[dtype] = used.get(dtype, 0) + rows
        for dtype, rows in used.items():
            key = (self.device, dtype)
            self.pool.hint[key] = max(self.pool.hint.get(key, 0), rows,
                                      self.rows.get(dtype, 0) if self.rolled else 0)

    def _per_block(self):
        for b, (blk, _, rows, *_) in enumerate(self.blocks):
            segs = [s for s in self.segs if s[1] == b]
            if segs:
                yield blk[:rows], segs

    def stage(self, size: int) -> "DeviceStaged":
        """Another device: queue every reduction (no read); the result's `tensors` go to
        the host with the step's one transfer, then its `finish` fills the rows."""
        self._note_use()
        self._copy_pending()
        staged = self.rolled if self.rolled is not None else DeviceStaged(self)
        try:
            for v, segs in self._per_block():
                staged.add_block(v, segs, size)
        except BaseException:
            self._give_back()
            raise
        return staged

    def _give_back(self) -> None:
        self.pool.give([(blk[0], blk[4]) for blk in self.blocks])
        self.blocks, self.segs, self.open, self.rows, self.rolled = [], [], {}, {}, None


def put_rows(stats: np.ndarray, rows: np.ndarray, n: np.ndarray, s, absum, sumsq, lo, hi,
             counts=None) -> None:
    """Each tensor's totals (host arrays, one value a tensor) -> its STATS row
    (`stats.ROW`): ROWS the tensors' stats rows, N their sizes; COUNTS [3, tensors]: NaN,
    +Inf, -Inf, not among the finite values. (The device blocks' and `hostbatch`'s.)"""
    out = np.zeros((len(rows), stats.shape[1]))
    out[:, 0] = n
    out[:, 1], out[:, 2], out[:, 3], out[:, 4], out[:, 5] = s, absum, sumsq, lo, hi
    if counts is not None:
        out[:, 6:] = counts.T
        out[:, 0] -= counts.sum(0)
    stats[rows] = out


def _recounted(flat: torch.Tensor, segs: list, totals: np.ndarray) -> dict:
    """{stats row: exact row} of the tensors whose total is not finite, from their copy
    in block FLAT (NaN/Inf inside, or an overflow: rare)."""
    return {segs[j][0]: nonfinite_row(flat.narrow(0, segs[j][2] * CHUNK, segs[j][3]))
            for j in np.flatnonzero(~np.isfinite(totals))}


def _sample_norms(flat: torch.Tensor, segs: list, lay: "_Layout") -> tuple:
    """The per-sample L2 norms of the tensors in block FLAT copied with a batch dimension:
    ([tensors], [[(stats row, samples), ...] for each tensor]). Those batched along
    their first dimension (each sample's values one after another) all at once, a fixed
    handful of ops: the squares summed in pieces of at most CHUNK values (float32, as a
    row of the block), the pieces then per sample in float64. Others one by one."""
    parts, rows = [], []
    if lay.norm_rows:
        sq = flat.narrow(0, lay.norm_begin, lay.norm_end - lay.norm_begin).square()
        pieces = torch.segment_reduce(sq, "sum", lengths=lay.norm_lengths, unsafe=True)
        per_sample = torch.segment_reduce(pieces.index_select(0, lay.norm_pick).double(),
                                          "sum", lengths=lay.norm_counts, unsafe=True)
        parts.append(per_sample.sqrt_())
        rows.append(lay.norm_rows)
    for s in lay.norm_other:
        x = per_sample_norms(flat.narrow(0, s[2] * CHUNK, s[3]).view(s[4]), s[5])
        parts.append(x)
        rows.append([(s[0], x.numel())])
    return parts, rows


def _row_extremes(v: torch.Tensor, pad: torch.Tensor) -> tuple:
    """(min, max) of each row of block V, the padding (flat positions PAD) left out:
    +inf for the min, -inf for the max, then 0 for the sums that follow (and kept 0)."""
    flat = v.view(-1)
    if len(pad):
        flat.index_fill_(0, pad, math.inf)
        lo = v.amin(1)
        flat.index_fill_(0, pad, -math.inf)
        hi = v.amax(1)
        flat.index_fill_(0, pad, 0.0)
    else:
        lo, hi = v.amin(1), v.amax(1)
    return lo, hi


def _split_samples(segs, picked, size, samples) -> None:
    o = 0
    for s in segs:
        m = min(s[3], size)
        samples[s[0]] = picked[o:o + m]
        o += m


class DeviceStaged:
    """A device batch whose reductions are queued: `tensors` (to bring to the host in
    one transfer, in this order; there they make arrays of `sizes`), then `finish` with
    those host arrays."""

    def __init__(self, batch: TensorBatch):
        self.batch = batch
        self.tensors: list = []
        self.sizes: list = []     # the host arrays `tensors` make, in order
        # (view, segs, sample size, _Layout, norm rows, rolled, first array, graph on trial)
        self.blocks: list = []

    def add_block(self, v, segs, size, rolled: bool = False) -> None:
        """Queue block view V's reductions (`_reductions`; on a GPU, once the same block
        and layout come back, one CUDA graph: `block_graphs`). ROLLED: V is filled again
        after them, so there is no copy to recount a non-finite tensor from later."""
        lay = _layout(segs, size, v.device)
        reduce = lambda: _reductions(v, segs, size, lay, rolled)  # noqa: E731
        if rolled:          # (its reductions zero what they count: not run twice)
            tensors, norm_rows = reduce()
            sizes, trial = [t.numel() for t in tensors], None
        else:
            tensors, sizes, norm_rows, trial = block_graphs.GRAPHS.reduce(v, lay.key, reduce,
                                                                          keep=lay)
        self.blocks.append((v, segs, size, lay, norm_rows, rolled, len(self.sizes), trial))
        self.tensors += tensors
        self.sizes += sizes

    def finish(self, host: list, stats: np.ndarray, samples: dict, norms: dict) -> None:
        """HOST: float64 numpy arrays of `sizes` (flat, same order). On the writer thread,
        after the transfer; gives the blocks back."""
        try:
            for v, segs, size, lay, norm_rows, rolled, k, trial in self.blocks:
                k0 = k
                if size:
                    _split_samples(segs, host[k], size, samples)
                    k += 1
                for rows in norm_rows:      # (stats row, samples) of each part
                    o = 0
                    for row, m in rows:
                        norms[row] = host[k][o:o + m].astype(np.float32)
                        o += m
                    k += 1
                # [Σx, Σx², Σ|x|, (NaN, +Inf, -Inf)] and [min, -max] per tensor
                totals = host[k].reshape(len(segs), -1).T
                least = host[k + 1].reshape(len(segs), 2).T
                k += 2
                if trial is not None:       # the graph's arrays follow: the same?
                    block_graphs.GRAPHS.judge(trial, host[k0:k], host[k:2 * k - k0])
                s, sumsq, absum = totals[:3]
                put_rows(stats, lay.rows, lay.n, s, absum, sumsq, least[0], -least[1],
                         totals[3:6] if rolled else None)
                if not rolled:     # (a refilled block's copy is gone: counted before)
                    for row, values in _recounted(v.view(-1), segs, s).items():
                        stats[row] = values
        finally:
            self.batch._give_back()


def _reductions(v, segs, size, lay: "_Layout", rolled: bool) -> tuple:
    """The ops that reduce block view V (no read): ([tensors], norm rows). The samples
    (one gather), the per-sample norms, then per row min and max with the padding after
    each tensor set to +inf, then -inf, and the sums with it set to 0, added up per
    tensor in float64 (what goes to the host is a few numbers a tensor, not a row).
    ROLLED: NaN/+Inf/-Inf are counted per row now and set to 0 (min/max of such a row
    then count those zeros)."""
    flat = v.view(-1)
    tensors = [flat.index_select(0, lay.gather)] if size else []
    parts, norm_rows = _sample_norms(flat, segs, lay)
    tensors += parts
    counts = []
    if rolled:
        if len(lay.pad):     # (what the block held before: not counted)
            flat.index_fill_(0, lay.pad, 0.0)
        counts = [torch.isnan(v).sum(1), (v == math.inf).sum(1), (v == -math.inf).sum(1)]
        v.nan_to_num_(0.0, 0.0, 0.0)
    lo, hi = _row_extremes(v, lay.pad)
    # per row [Σx, Σx², Σ|x|, (NaN, +Inf, -Inf)], then min and -max
    per_row = torch.stack([v.sum(1), torch.linalg.vecdot(v, v),
                           torch.linalg.vector_norm(v, 1, dim=1),
                           *[c.to(v.dtype) for c in counts], lo, hi.neg()], 1).double()
    c = per_row.shape[1] - 2
    tensors.append(torch.segment_reduce(per_row[:, :c], "sum", lengths=lay.row_counts,
                                        unsafe=True))
    tensors.append(torch.segment_reduce(per_row[:, c:], "min", lengths=lay.row_counts,
                                        unsafe=True))
    return tensors, norm_rows


class _Layout:
    """Where a block's tensors lie (cached per layout): on the block's device the flat
    positions of every sample (`gather`) and of the padding after each tensor (`pad`),
    and how many rows each tensor takes (`row_counts`); on the host each tensor's first block row
    (`r0`), stats row (`rows`) and size (`n`); and the pieces of the per-sample norms
    (`_sample_norms`, `_norm_pieces`)."""

    __slots__ = ("gather", "pad", "r0", "rows", "n", "row_counts", "norm_begin", "norm_end",
                 "norm_lengths", "norm_pick", "norm_counts", "norm_rows", "norm_other", "key")

    def __init__(self, segs: list, size: int, device, key=None):
        self.key = key            # (its cache key: a block graph's too)
        gather = [torch.arange(n) + r0 * CHUNK if n <= size
                  else sample_index(n, size, "cpu") + r0 * CHUNK for _, _, r0, n, *_ in segs]
        pad = [torch.arange(r0 * CHUNK + n, (r0 + -(-n // CHUNK)) * CHUNK)
               for _, _, r0, n, *_ in segs if n % CHUNK]
        self.gather = _to_device(torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long),
                                 device)
        self.pad = _to_device(torch.cat(pad) if pad else torch.zeros(0, dtype=torch.long), device)
        self.rows = np.array([s[0] for s in segs], np.int64)
        self.r0 = np.array([s[2] for s in segs], np.int64)
        self.n = np.array([s[3] for s in segs], np.int64)
        self.row_counts = _to_device(torch.tensor([-(-s[3] // CHUNK) for s in segs],
                                                  dtype=torch.long), device)
        _norm_pieces(self, segs, device)


def _norm_pieces(lay: _Layout, segs: list, device) -> None:
    """Where `_sample_norms` cuts: from the first to the last value of the tensors
    batched along their first dimension (`norm_begin`, `norm_end`), the lengths of the
    pieces (each sample's values in pieces of at most CHUNK, and what lies between two
    such tensors as one piece), which pieces are samples' (`norm_pick`) and how many
    make each sample (`norm_counts`); the other tensors with a batch dimension
    (`norm_other`)."""
    lengths, pick, counts = [], [], []
    lay.norm_rows, lay.norm_other = [], []
    lay.norm_begin = lay.norm_end = 0
    for s in sorted(segs, key=lambda s: s[2]):
        row, _, r0, n, shape, bd = s
        if bd is None or not shape:
            continue
        if bd % len(shape) or not shape[0]:
            lay.norm_other.append(s)
            continue
        start = r0 * CHUNK
        if not lay.norm_rows:
            lay.norm_begin = lay.norm_end = start
        if start > lay.norm_end:          # the tensors in between: one piece, not read
            lengths.append(start - lay.norm_end)
        inner = n // shape[0]
        full, rest = divmod(inner, CHUNK)
        one = [CHUNK] * full + ([rest] if rest else [])   # a sample's pieces
        pick.append(np.arange(len(lengths), len(lengths) + len(one) * shape[0]))
        lengths += one * shape[0]
        counts += [len(one)] * shape[0]
        lay.norm_rows.append((row, shape[0]))
        lay.norm_end = start + n
    as_long = lambda x: _to_device(torch.as_tensor(np.asarray(x, np.int64)), device)  # noqa: E731
    lay.norm_lengths, lay.norm_counts = as_long(lengths), as_long(counts)
    lay.norm_pick = as_long(np.concatenate(pick) if pick else [])


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """Host indices X on DEVICE without a sync: to a GPU from pinned memory, not waited for
    (torch keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _layout(segs: list, size: int, device) -> _Layout:
    key = (device, size, tuple([(s[0], s[2], s[3], s[4], s[5]) for s in segs]))
    got = _LAYOUTS.get(key)
    if got is None:
        got = _Layout(segs, size, device, key)    # (once per layout: copies to the device)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = got
    return got


def nonfinite_row(x: torch.Tensor) -> list:
    """[finite count, sum, |x| sum, Σx², min, max of the finite values, nan, +inf, -inf]."""
    a = x.cpu().double().numpy()
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


def sample_index(n: int, size: int, device) -> torch.Tensor:
    """SIZE sorted random positions among N: a function of N and SIZE only (a private
    generator seeded by them, never the global RNG), so every step, every path and
    every run picks the same ones (two runs' histograms compare sample for sample)."""
    key = (n, size, device)
    idx = _IDX_CACHE.get(key)
    if idx is None:
        gen = torch.Generator().manual_seed((0x5EED * 1_000_003 + n) * 1_000_003 + size)
        idx = _to_device(torch.randint(n, (size,), generator=gen).sort().values, device)
        if len(_IDX_CACHE) >= _IDX_CACHE_MAX:
            _IDX_CACHE.clear()
        _IDX_CACHE[key] = idx
    return idx
