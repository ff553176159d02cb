"""Tensor statistics for the recorder: computed on the tensor's device, batched per step.

A recorded tensor costs a handful of reductions when it is seen (the values may change
in place later): `sum`, `abs().sum()`, Σx², `aminmax`, and a gather of a fixed random
sample for its histogram. The results stay 0-d tensors on the device. At the end of the
step `StepBatch.finish()` stacks them all (one op), brings stats, samples and per-sample
norms to the host with ONE transfer, and bins every histogram there at once (numpy).

CPU: reading a scalar costs nothing, so the non-finite counts (and stats of the finite
values) are computed only for the tensors whose sum is not finite. Other devices never
read back before the step ends: the counts are always computed there and the stats come
from `nan_to_num(x, 0, 0, 0)` (exact over the finite values; min/max then include the
zeros put in place of NaN/Inf).

Rows (columns of `ROW`): number of finite values, sum, abs_sum, sum of squares, min, max,
nan, +inf, -inf, all over the FINITE values. Accumulation is in float32 for float32 and narrower types
(float64 for float64): a tensor whose squares overflow float32 (|x| > ~1e19) has an
infinite std while its abs-max stays exact.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

ROW = ("numel", "sum", "abs_sum", "sumsq", "min", "max", "nan", "posinf", "neginf")
_NROW = len(ROW)
_ACC = {torch.float64: torch.float64}
SMALL = 1 << 12                # CPU tensors up to this many elements: reduced in one batch
BIG = 1 << 18                  # CPU tensors above this: fewer passes over memory
_IDX_CACHE: dict = {}          # (numel, sample, device) -> sorted random indices
_IDX_CACHE_MAX = 512
_GEN: dict = {}                # device -> private torch.Generator (never the global RNG)


def _sample_index(n: int, size: int, device) -> torch.Tensor:
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


def flat_of(t: torch.Tensor) -> torch.Tensor:
    """A 1-D detached view (a copy only for non-contiguous tensors)."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def sample_of(flat: torch.Tensor, size: int) -> torch.Tensor:
    """A copy of SIZE elements at fixed random positions (every element if fewer)."""
    n = flat.numel()
    if n <= size:
        return flat.clone()
    return flat.index_select(0, _sample_index(n, size, flat.device))


def per_sample_norms(t: torch.Tensor, batch_dim: int = 0) -> Optional[torch.Tensor]:
    """‖t[i]‖₂ for each sample i along BATCH_DIM (float32), None for 0-d tensors."""
    if t.dim() == 0:
        return None
    x = t.detach()
    if batch_dim:
        x = x.movedim(batch_dim, 0)
    x = x.reshape(x.shape[0], -1)
    return torch.linalg.vector_norm(x.float() if x.dtype not in (torch.float32, torch.float64)
                                    else x, dim=1).float()


def _nonfinite_row(x: torch.Tensor) -> list:
    """CPU, the sum is not finite: exact counts and stats of the finite values."""
    nan = int(torch.isnan(x).sum())
    pinf = int((x == math.inf).sum())
    ninf = int((x == -math.inf).sum())
    fin = x[torch.isfinite(x)]
    n = fin.numel()
    if n:
        lo, hi = torch.aminmax(fin)
        body = [fin.sum(), fin.abs().sum(), torch.dot(fin, fin), lo, hi]
    else:
        body = [0.0, 0.0, 0.0, math.nan, math.nan]
    return [n, *body, nan, pinf, ninf]


class StepBatch:
    """The rows, samples and per-sample norms of one step, finished with one transfer."""

    def __init__(self, bins: int, clip: Optional[float], sample: int = 0):
        self.sample_size = sample
        self.bins = bins
        self.clip = clip
        self.rows: list = []        # per row: list of _NROW numbers or 0-d tensors
        self.samples: list = []     # per row: sample tensor (or None)
        self.norms: list = []       # (row index, per-sample norm tensor)
        self.small: list = []       # (row index, CPU copy): reduced later, all at once

    def __len__(self):
        return len(self.rows)

    def add(self, t: torch.Tensor, sample: int, batch_dim: Optional[int] = None) -> int:
        """Stats and sample of T now (nothing read back on other devices than the CPU),
        and with BATCH_DIM its per-sample L2 norms; returns its row index."""
        norms = None
        if batch_dim is not None and t.dim() > 0:
            norms = per_sample_norms(t, batch_dim)
        flat = flat_of(t)
        acc = _ACC.get(flat.dtype, torch.float32)
        x = flat if flat.dtype == acc else flat.to(acc)
        n = x.numel()
        if n == 0:
            self.rows.append([0, 0.0, 0.0, 0.0, math.nan, math.nan, 0, 0, 0])
            self.samples.append(None)
            self.add_norms(len(self.rows) - 1, norms)
            return len(self.rows) - 1
        if x.device.type == "cpu" and n <= SMALL:
            # a copy now (one op), the reductions of every small tensor of the step later,
            # together, on the writer thread: per-op overhead dominates small tensors
            self.rows.append(None)
            self.samples.append(None)
            self.small.append((len(self.rows) - 1, x.clone()))
            self.add_norms(len(self.rows) - 1, norms)
            return len(self.rows) - 1
        if x.device.type == "cpu":
            # reading a CPU scalar is free: host floats now, nothing left to stack later
            s = x.sum().item()
            if math.isfinite(s):
                if norms is not None:     # Σx² from the per-sample norms: one pass less
                    ss = float(norms.double().square().sum())
                elif n > BIG:             # out of cache: torch's threaded kernels
                    ss = torch.dot(x, x).item()
                else:
                    a = x.numpy()
                    ss = float(np.dot(a, a))
                if n > BIG:               # one pass for both
                    lo, hi = (v.item() for v in torch.aminmax(x))
                else:
                    lo, hi = x.amin().item(), x.amax().item()
                row = [n, s, x.abs().sum().item(), ss, lo, hi, 0, 0, 0]
            else:
                row = [v.item() if isinstance(v, torch.Tensor) else v
                       for v in _nonfinite_row(x)]
        else:
            nan = torch.isnan(x).sum()
            pinf = (x == math.inf).sum()
            ninf = (x == -math.inf).sum()
            y = torch.nan_to_num(x, 0.0, 0.0, 0.0)
            lo, hi = torch.aminmax(y)
            row = [n - (nan + pinf + ninf), y.sum(), y.abs().sum(),
                   torch.linalg.vector_norm(y).square(), lo, hi, nan, pinf, ninf]
        self.rows.append(row)
        self.samples.append(sample_of(x, sample) if sample else None)
        self.add_norms(len(self.rows) - 1, norms)
        return len(self.rows) - 1

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
        staged = []
        for dev, index in by_device.items():
            cells, where = [], []
            for i in index:
                row = self.rows[i]
                if dev.type == "cpu":      # host numbers already
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
                "event": None,
                "cells": torch.stack(cells) if cells else None,
                "where": np.array(where, np.int64).reshape(-1, 2),
                "samples": torch.cat([v for _, v in samp]) if samp else None,
                "sample_rows": [(i, v.numel()) for i, v in samp],
                "norms": torch.cat([v for _, v in nrm]) if nrm else None,
                "norm_rows": [(r, v.numel()) for r, v in nrm]})
            if dev.type == "cuda":   # the writer thread waits for the main thread's stream
                staged[-1]["event"] = torch.cuda.Event()
                staged[-1]["event"].record(torch.cuda.current_stream(dev))
        small = None
        if self.small:
            small = ([i for i, _ in self.small], [c.numel() for _, c in self.small],
                     torch.cat([c for _, c in self.small]))
        self.rows, self.samples, self.norms, self.small = [], [], [], []
        return k, fixed, staged, small

    def finish(self) -> dict:
        return self.finish_staged(self.stage())

    def finish_staged(self, staged: tuple) -> dict:
        """Host numpy arrays: the `describe_rows` columns [K], hist [K, bins] int64, lo,
        hi [K], below, above, sample_n [K] int64, norms {row: float32 array}. One host
        transfer per device."""
        k, stats, parts_by_device, small = staged
        stats = stats.copy()
        host_samples: list = [None] * k
        norms: dict = {}
        if small is not None:
            self._small_stats(stats, host_samples, *small)
        for d in parts_by_device:
            parts = [p for p in (d["cells"], d["samples"], d["norms"]) if p is not None]
            if not parts:
                continue
            if parts[0].device.type == "cpu":
                host = np.concatenate([p.numpy().astype(np.float64).reshape(-1) for p in parts])
            else:
                if d.get("event") is not None:
                    d["event"].synchronize()
                host = torch.cat([p.double().reshape(-1) for p in parts]).cpu().numpy()
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
        out = describe_rows(stats)
        out.update(self._histograms(stats, out, host_samples))
        out["norms"] = norms
        return out

    def _small_stats(self, stats, host_samples, rows, lengths, cat) -> None:
        """Stats and samples of every small CPU tensor of the step, segment by segment,
        with a few numpy passes over their concatenation."""
        a = cat.numpy().astype(np.float64)
        lengths = np.asarray(lengths, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        rows = np.asarray(rows, np.int64)
        bad = ~np.isfinite(a)
        if bad.any():
            seg = np.repeat(np.arange(len(rows)), lengths)
            nan = np.bincount(seg[np.isnan(a)], minlength=len(rows))
            pinf = np.bincount(seg[a == np.inf], minlength=len(rows))
            ninf = np.bincount(seg[a == -np.inf], minlength=len(rows))
            z = np.where(bad, 0.0, a)
            lo = np.minimum.reduceat(np.where(bad, np.inf, a), starts)
            hi = np.maximum.reduceat(np.where(bad, -np.inf, a), starts)
            finite = lengths - nan - pinf - ninf
            lo = np.where(finite > 0, lo, np.nan)
            hi = np.where(finite > 0, hi, np.nan)
        else:
            z = a
            nan = pinf = ninf = np.zeros(len(rows))
            lo = np.minimum.reduceat(a, starts)
            hi = np.maximum.reduceat(a, starts)
            finite = lengths
        stats[rows] = np.stack([finite, np.add.reduceat(z, starts),
                                np.add.reduceat(np.abs(z), starts),
                                np.add.reduceat(z * z, starts), lo, hi, nan, pinf, ninf], 1)
        size = self.sample_size
        if size:
            for r, s0, n in zip(rows, starts, lengths):
                seg = a[s0:s0 + n]
                host_samples[r] = seg if n <= size else seg[_sample_index(int(n), size, "cpu").numpy()]

    def _histograms(self, stats: np.ndarray, desc: dict, samples: list) -> dict:
        """Bin every sample at once: range = [min, max] of the finite values, clipped to
        mean ± clip·std; sample values outside it are counted as below / above."""
        k, bins = len(samples), self.bins
        lo = np.nan_to_num(desc["min"].astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        hi = np.nan_to_num(desc["max"].astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if self.clip is not None:
            mean = np.nan_to_num(desc["mean"].astype(np.float64))
            half = self.clip * np.nan_to_num(desc["std"].astype(np.float64), posinf=np.inf)
            with np.errstate(invalid="ignore"):
                lo = np.maximum(lo, mean - half)
                hi = np.minimum(hi, mean + half)
        hi = np.maximum(hi, lo)
        lengths = np.array([0 if s is None else len(s) for s in samples], np.int64)
        if not lengths.sum():
            z = np.zeros(k, np.int64)
            return {"hist": np.zeros((k, bins), np.int64), "lo": lo, "hi": hi, "below": z,
                    "above": z, "sample_n": lengths}
        x = np.concatenate([s for s in samples if s is not None])
        row = np.repeat(np.arange(k), lengths)
        width = hi - lo
        scale = np.where(width > 0, bins / np.where(width > 0, width, 1.0), 0.0)
        with np.errstate(invalid="ignore"):
            t = (x - lo[row]) * scale[row]
            ok = np.isfinite(t)
            # class 0: below the range, 1..bins: the bins (hi itself in the last), bins+1: above
            b = np.floor(np.where(ok, t, 0.0))
            b = np.where(t == bins, bins - 1, b)
            b = np.clip(b, -1, bins).astype(np.int64) + 1 + row * (bins + 2)
        counts = np.bincount(b[ok], minlength=k * (bins + 2)).reshape(k, bins + 2)
        return {"hist": counts[:, 1:-1], "lo": lo, "hi": hi, "below": counts[:, 0],
                "above": counts[:, -1], "sample_n": lengths}


_CPU = torch.device("cpu")
SUMMARY = ("numel", "mean", "abs_mean", "std", "abs_max", "min", "max", "nan", "posinf",
           "neginf")


def describe_rows(stats: np.ndarray) -> dict:
    """Vectorized summaries of host rows: {numel, mean, abs_mean, std, abs_max, min, max,
    nan, posinf, neginf} as arrays (NaN where undefined: no finite value, std of one)."""
    n, s, a, ss, lo, hi, nan, pinf, ninf = (stats[:, j] for j in range(_NROW))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        has = n > 0
        safe = np.where(has, n, 1.0)
        mean = np.where(has, s / safe, np.nan)
        var = (ss - s * (s / safe)) / np.where(n > 1, n - 1, 1.0)
        std = np.where(n > 1, np.sqrt(np.maximum(var, 0.0)), np.nan)
        std = np.where(np.isinf(ss) & (n > 1), np.inf, std)
        return {"numel": (n + nan + pinf + ninf).astype(np.int64), "mean": mean,
                "abs_mean": np.where(has, a / safe, np.nan), "std": std,
                "abs_max": np.where(has, np.maximum(np.abs(lo), np.abs(hi)), np.nan),
                "min": np.where(has, lo, np.nan), "max": np.where(has, hi, np.nan),
                "nan": nan.astype(np.int64), "posinf": pinf.astype(np.int64),
                "neginf": ninf.astype(np.int64)}
