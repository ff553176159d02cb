"""The recorder's CPU tensors of one step through the one-pass kernel (`fused.c`).

Each float32 / float64 tensor (bfloat16 and half converted first) is reduced when it is
seen, in one call that reads it once: its stats row, its summary, its histogram (binned
from the fixed random sample as `stats._histograms` bins it) and, for a gradient whose
samples lie one after another, its per-sample norms go straight into this step's
arrays. Nothing is copied, and the end of the step only hands the arrays over.

A tensor whose sum is not finite is counted again exactly (`nonfinite_row`), and its
sample is binned with the others at the end of the step (its range needs the finite
values' stats); one whose samples are interleaved (a batch dimension inside) gets its
norms from torch.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ..core.native import readable_address
from .native import OUT_WIDTH, Kernel
from .rows import describe_rows, sample_of
from .tensorbatch import nonfinite_row, per_sample_norms, sample_index

# the kernel's row (native.OUT_WIDTH slots, then the counts): stats.ROW, the summary
# (store.STAT_COLUMNS), the histogram's lo and hi
_NROW = 9
_SUMMARY = slice(_NROW, OUT_WIDTH - 2)
_LO, _HI = OUT_WIDTH - 2, OUT_WIDTH - 1
_NATIVE = (torch.float32, torch.float64)


class _Arena:
    """Blocks of WIDTH slots of 8 bytes in large buffers, one per row of a step; a full
    buffer is left to the rows already in it and a new one started."""

    def __init__(self, width: int, first: int):
        self.width = width
        self.bufs = [np.empty((max(first, 16), width))]
        self.addr = self.bufs[0].ctypes.data
        self.n = 0            # rows in the last buffer

    def take(self) -> int:
        """The address of the next row's block."""
        buf = self.bufs[-1]
        if self.n == len(buf):
            buf = np.empty((2 * len(buf), self.width))
            self.bufs.append(buf)
            self.addr = buf.ctypes.data
            self.n = 0
        self.n += 1
        return self.addr + (self.n - 1) * self.width * 8

    def rows(self) -> np.ndarray:
        """Every block taken, [rows, width] float64 (a copy only after a spill)."""
        last = self.bufs[-1][:self.n]
        return last if len(self.bufs) == 1 else np.concatenate(self.bufs[:-1] + [last])


class NativeBatch:
    """One step's CPU rows reduced by the kernel; `fill` hands them to the step's arrays.
    SIZE: histogram sample size (0: none), BINS and CLIP (None: no clipping) as the
    recorder's. HINT: {name: count} of the largest step so far, so that a step like it
    allocates each buffer once."""

    def __init__(self, k: Kernel, size: int, bins: int, clip: Optional[float], hint: dict):
        self.fns = k.by_dtype
        self.size, self.bins = size, bins
        self.clip = -1.0 if clip is None else float(clip)
        self.hint = hint
        self.index: list = []            # step row of each native row
        self.recounts: dict = {}         # native row -> exact row (its sum was not finite)
        self.out = _Arena(OUT_WIDTH + bins + 2, hint.get("rows", 64))
        self.norm_buf = np.empty(hint.get("norms", 1024), np.float32)
        self.norm_addr = self.norm_buf.ctypes.data
        self.norm_used = 0               # values taken in norm_buf
        self.norm_total = 0              # values in the buffers before it
        self.samples: dict = {}          # step row -> float64 sample (rows recounted)
        self.norms: dict = {}            # step row -> float32 per-sample norms

    def __bool__(self):
        return bool(self.index)

    def add(self, i: int, t: torch.Tensor, shape=None, batch_dim: Optional[int] = None) -> bool:
        """Row I from T (CPU, contiguous, not empty; its memory is read, autograd or not);
        with SHAPE (T's) and BATCH_DIM its per-sample norms too. False, with nothing
        taken, when T has no memory of its own to read (torch's path then takes it)."""
        x = t if t.dtype in _NATIVE else t.detach().float()
        n = x.numel()
        if not x.is_contiguous():         # (the caller's promise: the kernel reads n in a row)
            return False
        ptr = readable_address(x)         # 0: no memory of its own to read
        if not ptr:
            return False
        chunk = nptr = 0
        if shape:                                       # per-sample norms wanted
            bd = batch_dim % len(shape)
            count = shape[bd]
            if bd == 0 or math.prod(shape[:bd]) == 1:   # samples one after another
                chunk = n // count
                o = self.norm_used
                if o + count > len(self.norm_buf):      # a new buffer
                    self.norm_buf = np.empty(max(count, 2 * len(self.norm_buf)), np.float32)
                    self.norm_addr = self.norm_buf.ctypes.data
                    self.norm_total += o
                    o = 0
                self.norm_used = o + count
                self.norms[i] = self.norm_buf[o:o + count]
                nptr = self.norm_addr + 4 * o
            else:
                self.norms[i] = per_sample_norms(x.view(shape), batch_dim).numpy()
        size = self.size
        if not size:
            m, iptr = 0, 0                              # no histograms
        elif n <= size:
            m, iptr = n, 0                              # every value
        else:                                           # (idx: alive through the call)
            idx = sample_index(n, size, "cpu")
            m, iptr = size, idx.data_ptr()
        out = self.out.take()
        j = len(self.index)
        self.index.append(i)        # (a row taken is a row indexed, whatever follows)
        if self.fns[x.dtype](ptr, n, chunk, nptr, iptr, m, self.bins, self.clip, out):
            self._recount(j, i, x)
        return True

    def _recount(self, j: int, i: int, x: torch.Tensor) -> None:
        """Native row J (step row I) had NaN/Inf or overflowed: exact counts, and its
        sample binned at the end of the step with the finite values' range."""
        x = x.detach().reshape(-1)
        self.recounts[j] = nonfinite_row(x)
        if self.size:
            self.samples[i] = sample_of(x, self.size).double().numpy()

    def fill(self, stats: np.ndarray, samples: dict, norms: dict) -> Optional[tuple]:
        """Rows into STATS, SAMPLES and NORMS ({step row: array}), and the hint for the
        next step; returns (step rows, their summaries, and for the rows binned here:
        their step rows, counts [R, bins + 2], lo [R], hi [R], sample sizes [R]), or
        None when there is no row."""
        m = len(self.index)
        if not m:
            return None
        wide = self.out.rows()
        index = np.asarray(self.index, np.int64)
        h = self.hint
        h["rows"] = max(h.get("rows", 0), m)
        h["norms"] = max(h.get("norms", 0), self.norm_total + self.norm_used)
        samples.update(self.samples)
        norms.update(self.norms)
        recounts = self.recounts
        if recounts:          # their exact rows, and summaries from those
            j = np.fromiter(recounts, np.int64, len(recounts))
            wide[j, :_NROW] = np.array(list(recounts.values()))
            wide[j, _SUMMARY] = describe_rows(wide[j, :_NROW])
        stats[index] = wide[:, :_NROW]
        summaries = wide[:, _SUMMARY]
        if not self.size:
            return index, summaries, None
        binned, b = index, wide
        if recounts:          # binned at the end of the step, not here
            keep = np.ones(m, bool)
            keep[j] = False
            binned, b = index[keep], wide[keep]
        sizes = np.minimum(b[:, 0], self.size).astype(np.int64)
        return index, summaries, (binned, b[:, OUT_WIDTH:].view(np.int64), b[:, _LO],
                                  b[:, _HI], sizes)
