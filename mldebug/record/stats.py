"""Tensor statistics for the recorder, batched per step.

Rows (columns of `ROW`): number of finite values, sum, abs_sum, sum of squares, min, max,
nan, +inf, -inf, all over the FINITE values. Accumulation is in float32 for float32 and
narrower types (float64 for float64): a tensor whose squares overflow float32
(|x| > ~1e19) has an infinite std while its abs-max stays exact. Each recorded tensor also
gives a fixed random sample for its histogram (and per-sample L2 norms for gradients).

CPU tensors: read once when seen (the values may change in place later) by the C kernel
(`nativebatch.py`, `fused.c`): row, summary, histogram and norms in one pass and one
call. Without the kernel (no compiler, MLDEBUG_NATIVE=0), tensors up to BATCH values are
copied when seen (one op) and reduced all together in numpy when the step is staged
(`hostbatch.py`: for them per-op overhead, not arithmetic, is the cost); larger ones are
reduced when seen by torch, with few passes. Reading a CPU scalar costs nothing, so the
non-finite counts (and stats of the finite values) are computed only for tensors whose
sum is not finite.

Other devices (CUDA): tensors up to DEVICE_BATCH values are batched likewise, in blocks
(`tensorbatch.py`; a kernel launch costs ~10 us of CPU time: one copy instead of ~10
reductions); their reductions are queued when the step is staged, or when DEVICE_BUDGET
values of a dtype fill the blocks (the block is then filled again: bounded memory for
any step), and read with the step's transfer. Larger ones are reduced when seen; the
results stay 0-d tensors on the device and are never read back before the step ends: the
counts are always computed and the stats come from `nan_to_num(x, 0, 0, 0)` (exact over
the finite values; min/max then include the zeros put in place of NaN/Inf).
`StepBatch.stage()` stacks them (one op per device), and `finish_staged()` brings stats,
samples and norms to the host with ONE transfer and bins every histogram there at once
(numpy).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ..core.device_path import simulated_by_env
from . import native
from .hostbatch import HostBatch, HostPool
from .nativebatch import NativeBatch
from .rows import SUMMARY, bin_rows, describe_rows, sample_of  # noqa: F401 - also stats' names
from .tensorbatch import CHUNK, BlockPool, TensorBatch, nonfinite_row, per_sample_norms

ROW = ("numel", "sum", "abs_sum", "sumsq", "min", "max", "nan", "posinf", "neginf")
_NROW = len(ROW)
_ACC = {torch.float64: torch.float64}
BATCH = 1 << 15                # CPU tensors up to this many elements: copied, reduced later
DEVICE_BATCH = 1 << 22         # the same on other devices (a copy costs little there),
DEVICE_BUDGET = 1 << 25        # in blocks of at most this many values of a dtype (128 MiB
                               # of float32), reduced and refilled when full
_HOST = [not simulated_by_env()]
                               # False: CPU tensors take the device path (simulate_device,
                               # core/device_path.py)


def simulate_device(on: bool) -> None:
    """Tests and benchmarks: treat CPU tensors as a device's (blocks, queued reductions,
    one transfer at the end of the step), so that a machine without a GPU runs and
    counts the device path."""
    _HOST[0] = not on


def _on_host(dev: torch.device) -> bool:
    return dev.type == "cpu" and _HOST[0]


def flat_of(t: torch.Tensor) -> torch.Tensor:
    """A 1-D detached view (a copy only for non-contiguous tensors)."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def _cpu_row(x: torch.Tensor, norms: Optional[torch.Tensor]) -> list:
    """A large CPU tensor now, as host numbers: sum, Σx², aminmax (one pass), |x| sum, on
    the threads the step uses (memory-bound: numpy's one thread measured up to 2x slower
    here, though faster than torch on the small tensors of `hostbatch`). A tensor of one
    sign (a ReLU's output) has |x| sum = ±sum: its abs pass (a temporary written and read
    again, 1.5 of the ~4.5 passes) is skipped."""
    s = x.sum().item()
    if not math.isfinite(s):
        return nonfinite_row(x)
    if norms is not None:       # Σx² from the per-sample norms: one pass less
        ss = float(norms.double().square().sum())
    else:
        ss = torch.dot(x, x).item()
    lo, hi = (v.item() for v in torch.aminmax(x))
    absum = s if lo >= 0 else -s if hi <= 0 else x.abs().sum().item()
    return [x.numel(), s, absum, ss, lo, hi, 0, 0, 0]


class StepBatch:
    """The rows, samples and per-sample norms of one step, finished with one transfer."""

    def __init__(self, bins: int, clip: Optional[float], sample: int = 0,
                 pool: Optional[BlockPool] = None, host_pool: Optional[HostPool] = None):
        self.sample_size = sample
        self.bins = bins
        self.clip = clip
        self.rows: list = []        # per row: list of _NROW numbers or 0-d tensors, or
                                    # None (in self.cpu)
        self.samples: list = []     # per row: sample tensor (or None)
        self.norms: list = []       # (row index, per-sample norm tensor)
        self.pool = pool if pool is not None else BlockPool()
        self.host_pool = host_pool if host_pool is not None else HostPool()
        self.cpu = HostBatch(self.host_pool)
        self.native = self._native_batch()
        self.on_device: dict = {}   # device -> TensorBatch
        self.lost: set = set()      # after `stage`: rows `hold` could not copy
        self.twins: list = []       # (row, twin row): the recorder's check (`_twins_of`)

    def _native_batch(self) -> Optional[NativeBatch]:
        k = native.kernel()
        return (NativeBatch(k, self.sample_size, self.bins, self.clip, self.host_pool.native_hint)
                if k else None)

    def __len__(self):
        return len(self.rows)

    def add(self, t: torch.Tensor, sample: int, batch_dim: Optional[int] = None) -> int:
        """Stats and sample of T now, or a copy to reduce later (nothing read back on
        other devices than the CPU), and with BATCH_DIM its per-sample L2 norms; returns
        its row index."""
        i = len(self.rows)
        batch_dim = _batch_dim_of(t, batch_dim)
        nb = self.native
        # the kernel reads the memory itself: plain strided CPU tensors (a parameter too)
        # only; a subclass, a fake tensor under tracing, a sparse or MKL-DNN tensor or a
        # negative view takes torch's path (and a strided view is made contiguous first)
        if nb is not None and t.is_cpu and _HOST[0] and type(t) in _PLAIN \
                and t.layout is _STRIDED \
                and not t.is_neg() and t.numel() \
                and nb.add(i, t if t.is_contiguous() else t.contiguous(),
                           t.shape if batch_dim is not None else None, batch_dim):
            return self._blank_row()
        acc = _acc_of(t)
        n = t.numel()
        dev = t.device
        shape = t.shape if batch_dim is not None else None
        if _batched_on_device(t, n):    # one op: a copy as it lies, into the step's block
            return self._block_row(t, batch_dim, held=False)
        flat = flat_of(t)
        if _on_host(dev) and 0 < n <= BATCH:
            self.cpu.add(i, flat, acc, shape, batch_dim)
            return self._blank_row()
        norms = None
        if batch_dim is not None and t.dim() > 0:
            norms = per_sample_norms(t, batch_dim)
        x = flat if flat.dtype == acc else flat.to(acc)
        if n == 0:
            row = [0, 0.0, 0.0, 0.0, math.nan, math.nan, 0, 0, 0]
        elif _on_host(x.device):
            row = _cpu_row(x, norms)
        else:
            nan = torch.isnan(x).sum()
            pinf = (x == math.inf).sum()
            ninf = (x == -math.inf).sum()
            y = torch.nan_to_num(x, 0.0, 0.0, 0.0)
            lo, hi = torch.aminmax(y)
            row = [n - (nan + pinf + ninf), y.sum(), y.abs().sum(),
                   torch.linalg.vector_norm(y).square(), lo, hi, nan, pinf, ninf]
        self.rows.append(row)
        self.samples.append(sample_of(x, sample) if sample and n else None)
        self.add_norms(i, norms)
        return i

    def hold(self, t: torch.Tensor, sample: int, batch_dim: Optional[int] = None,
             deferrable: bool = False) -> int:
        """As `add`; on a device the copy waits for the step's end, one op for all the
        tensors held (`TensorBatch.hold`): for tensors the caller expects unchanged until
        then. One changed in place meanwhile is not recorded: its row is in `lost` after
        `stage`. DEFERRABLE: the caller has found `defers(t)` already (the recorder's
        hooks run this for every tensor of a step: each call counts on a GPU)."""
        if not (deferrable or defers(t)):
            return self.add(t, sample, batch_dim)
        if batch_dim is not None:
            batch_dim = _batch_dim_of(t, batch_dim)
        return self._block_row(t, batch_dim, held=True)

    def _blank_row(self) -> int:
        """A new row whose numbers come from a batch (the kernel, the host or a device
        batch fills it when the step is staged)."""
        self.rows.append(None)
        self.samples.append(None)
        return len(self.rows) - 1

    def _block_row(self, t: torch.Tensor, batch_dim: Optional[int], held: bool) -> int:
        """T's row in its device's blocks: copied now (`TensorBatch.add`), or HELD
        (`TensorBatch.hold`); a plain tensor as it lies, another kind flattened first."""
        self.rows.append(None)      # (`_blank_row`, inline: it runs for every tensor)
        self.samples.append(None)
        i = len(self.rows) - 1
        batch = self.on_device.get(t.device)
        if batch is None:
            batch = self._device_batch(t.device)
        (batch.hold if held else batch.add)(     # (what is held is plain: `defers`)
            i, t if held or _copied_as_is(t) else flat_of(t), _ACC.get(t.dtype, _F32),
            t.shape if batch_dim is not None else None, batch_dim)
        return i

    def add_many(self, ts: list, sample: int) -> list:
        """The rows of TS (no batch dimension), as `add` would give them; those batched on
        a device are copied together (`TensorBatch.add_many`: one op, not one each)."""
        rows, together = [], {}
        for t in ts:
            if defers(t):
                rows.append(self._blank_row())
                together.setdefault(t.device, []).append((rows[-1], t,
                                                          _ACC.get(t.dtype, _F32)))
            else:
                rows.append(self.add(t, sample))
        for dev in together:
            self._device_batch(dev)
        for dev, batch in self.on_device.items():   # (what `hold` kept is copied too,
            batch.add_many(together.get(dev, []))   # before the optimizer changes it)
        return rows

    def _device_batch(self, dev) -> TensorBatch:
        batch = self.on_device.get(dev)
        if batch is None:
            batch = self.on_device[dev] = TensorBatch(self.pool, dev, self.sample_size,
                                                      DEVICE_BUDGET // CHUNK)
        return batch

    def add_norms(self, row: int, norms: Optional[torch.Tensor]) -> None:
        if norms is not None:
            self.norms.append((row, norms))

    def stage(self) -> tuple:
        """Everything of the step in three tensors per device (no host transfer yet):
        what `finish_staged` turns into host arrays, possibly on another thread."""
        k = len(self.rows)
        fixed = np.zeros((k, _NROW))
        by_device: dict = {}
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            dev = next((v.device for v in row if isinstance(v, torch.Tensor)), _CPU)
            by_device.setdefault(dev, []).append(i)
        norms_by_device: dict = {}
        for r, v in self.norms:
            norms_by_device.setdefault(v.device, []).append((r, v))
        for dev in norms_by_device:
            by_device.setdefault(dev, [])
        # the device batches' reductions, queued before each device's event
        batches = {dev: b.stage(self.sample_size) for dev, b in self.on_device.items() if b}
        self.lost = set().union(*(b.lost for b in self.on_device.values()))
        for dev in batches:
            by_device.setdefault(dev, [])
        staged = []
        for dev, index in by_device.items():
            cells, where = [], []
            for i in index:
                row = self.rows[i]
                if not isinstance(row[1], torch.Tensor):      # host numbers already
                    fixed[i] = row
                    continue
                for j, v in enumerate(row):
                    if isinstance(v, torch.Tensor):
                        cells.append(v)
                        where.append((i, j))
                    else:
                        fixed[i, j] = v
            samp = [(i, self.samples[i]) for i in index if self.samples[i] is not None]
            nrm = norms_by_device.get(dev, [])
            # type promotion does the dtype work; one tensor each
            staged.append({
                "device": dev,
                "event": None,
                "cells": torch.stack(cells) if cells else None,
                "where": np.array(where, np.int64).reshape(-1, 2),
                "samples": torch.cat([v for _, v in samp]) if samp else None,
                "sample_rows": [(i, v.numel()) for i, v in samp],
                "norms": torch.cat([v for _, v in nrm]) if nrm else None,
                "norm_rows": [(r, v.numel()) for r, v in nrm],
                "batch": batches.get(dev)})
            if dev.type == "cuda":   # the writer thread waits for the main thread's stream
                staged[-1]["event"] = torch.cuda.Event()
                staged[-1]["event"].record(torch.cuda.current_stream(dev))
        cpu = ({}, {}, None)   # the CPU's samples and norms; the kernel's rows (`fill`)
        if self.cpu:
            # here, not on the writer thread: numpy there would hold the GIL that the next
            # step's Python needs (measured slower on a small machine), and the buffers go
            # back to the pool for the next step at once
            self.cpu.reduce(fixed, cpu[0], cpu[1], self.sample_size)
        if self.native:
            cpu = cpu[:2] + (self.native.fill(fixed, *cpu[:2]),)
        self.rows, self.samples, self.norms = [], [], []
        self.cpu = HostBatch(self.host_pool)
        self.native = self._native_batch()
        self.on_device = {}
        return k, fixed, staged, cpu

    def finish(self) -> dict:
        return self.finish_staged(self.stage())

    @staticmethod
    def on_host(staged: tuple) -> bool:
        """Whether a staged step holds nothing on another device than the CPU (nothing to
        wait for: `finish_staged` is host work only). A simulated device's step is not:
        it is finished on the writer thread, as a GPU's is."""
        return _HOST[0] and all(d["device"].type == "cpu" for d in staged[2])

    def finish_staged(self, staged: tuple) -> dict:
        """Host numpy arrays: stats [K, 10] (`describe_rows`), hist [K, bins] int64, lo,
        hi [K], below, above, sample_n [K] int64, norms {row: float32 array}. One host
        transfer per device."""
        k, stats, parts_by_device, cpu = staged
        stats = stats.copy()
        host_samples: list = [None] * k
        for i, v in cpu[0].items():
            host_samples[i] = v
        norms = dict(cpu[1])
        for d in parts_by_device:
            parts = [p for p in (d["cells"], d["samples"], d["norms"]) if p is not None]
            batch = d.get("batch")
            extra = batch.tensors if batch is not None else []
            if not parts and not extra:
                continue
            if not extra and parts[0].device.type == "cpu":
                host = np.concatenate([p.numpy().astype(np.float64).reshape(-1) for p in parts])
            else:
                if d.get("event") is not None:
                    d["event"].synchronize()
                host = torch.cat([_flat64(p) for p in parts + extra]).cpu().numpy()
            if extra:      # the device batch's part of the transfer, at its end
                o = host.size - sum(batch.sizes)
                arrays = []
                for n in batch.sizes:     # (a block graph's one output makes several)
                    arrays.append(host[o:o + n])
                    o += n
                got: dict = {}
                batch.finish(arrays, stats, got, norms)
                for i, v in got.items():
                    host_samples[i] = v
            o = 0
            if d["cells"] is not None:
                n = d["cells"].numel()
                stats[d["where"][:, 0], d["where"][:, 1]] = host[:n]
                o = n
            for i, n in d["sample_rows"]:
                host_samples[i] = host[o:o + n]
                o += n
            for r, n in d["norm_rows"]:
                norms[r] = host[o:o + n].astype(np.float32)
                o += n
        native_rows = cpu[2]      # (rows, their summaries, their histograms) or None
        if native_rows is not None and len(native_rows[0]) == k:   # every row, in order
            desc = native_rows[1]
        else:
            desc = describe_rows(stats)
        out = self._histograms(desc, host_samples,
                               None if native_rows is None else native_rows[2])
        out["norms"] = norms
        return out

    def _histograms(self, desc: np.ndarray, samples: list, binned: Optional[tuple] = None) -> dict:
        """DESC: `describe_rows`. Bin every sample at once: range = [min, max] of the finite
        values, clipped to mean ± clip·std; sample values outside it are counted as below
        / above. BINNED: rows the kernel binned already (`NativeBatch.fill`). Returns
        {stats: DESC, hist, lo, hi, below, above, sample_n}."""
        k, bins = len(samples), self.bins
        if binned is not None and len(binned[0]) == k:      # every row (in order): done
            _, counts, lo, hi, lengths = binned
            return {"stats": desc, "hist": counts[:, 1:-1], "lo": lo, "hi": hi,
                    "below": counts[:, 0], "above": counts[:, -1], "sample_n": lengths}
        lo, hi = _finite_or_0(desc[:, 5]), _finite_or_0(desc[:, 6])
        if self.clip is not None:
            mean = desc[:, 1]
            mean = np.where(np.isnan(mean), 0.0, mean)
            std = desc[:, 3]
            half = self.clip * np.where(np.isnan(std), 0.0, std)
            with np.errstate(invalid="ignore"):
                lo = np.maximum(lo, mean - half)
                hi = np.minimum(hi, mean + half)
        hi = np.maximum(hi, lo)
        lengths = np.array([0 if s is None else len(s) for s in samples], np.int64)
        if lengths.sum():
            x = np.concatenate([s for s in samples if s is not None]).astype(np.float64,
                                                                              copy=False)
            counts = bin_rows(x, lengths, lo, hi, bins)
        else:
            counts = np.zeros((k, bins + 2), np.int64)
        if binned is not None:
            rows, got, got_lo, got_hi, got_n = binned
            counts[rows], lo[rows], hi[rows], lengths[rows] = got, got_lo, got_hi, got_n
        return {"stats": desc, "hist": counts[:, 1:-1], "lo": lo, "hi": hi,
                "below": counts[:, 0], "above": counts[:, -1], "sample_n": lengths}


def _batched_on_device(t: torch.Tensor, n: int) -> bool:
    """Whether T goes to its device's blocks (`tensorbatch`)."""
    return 0 < n <= DEVICE_BATCH and not _on_host(t.device)


def _batch_dim_of(t: torch.Tensor, batch_dim: Optional[int]) -> Optional[int]:
    """BATCH_DIM if T has that dimension, else None (a 0-d or narrower tensor: no norms)."""
    return batch_dim if batch_dim is not None and -t.dim() <= batch_dim < t.dim() else None


def _acc_of(t: torch.Tensor) -> torch.dtype:
    """The type T's statistics accumulate in: float64 for float64, else float32."""
    return _ACC.get(t.dtype, torch.float32)


def defers(t: torch.Tensor) -> bool:
    """Whether T's copy can wait (`StepBatch.hold`): a plain tensor on a device, batched
    there (`_batched_on_device` and `_copied_as_is` in one expression: it runs for every
    tensor a step records)."""
    return type(t) in _PLAIN and t.layout is _STRIDED and 0 < t.numel() <= DEVICE_BATCH \
        and not (t.is_cpu and _HOST[0])


def holds_well(t: torch.Tensor) -> bool:
    """Whether holding T until the step's end costs no more memory than its copy would
    and its copy may wait: not a small view of a larger storage (which it would keep
    alive), and on a GPU made on the default stream (a copy made later on another stream
    would not wait for it)."""
    if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size():
        return False
    return t.device.type != "cuda" or \
        torch.cuda.current_stream(t.device) == torch.cuda.default_stream(t.device)


def _copied_as_is(t: torch.Tensor) -> bool:
    """Whether T is copied into a block as it lies (any strides, one op): plain strided
    tensors; another kind (a subclass) is flattened first."""
    return type(t) in _PLAIN and t.layout is _STRIDED


def _flat64(x: torch.Tensor) -> torch.Tensor:
    """X as 1-D float64, without an op where it is so already (on a GPU every op counts)."""
    if x.dtype is not torch.float64:
        x = x.double()
    return x if x.dim() == 1 else x.reshape(-1)


def _finite_or_0(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, 0.0)


_CPU = torch.device("cpu")
_F32 = torch.float32
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
