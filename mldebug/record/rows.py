"""Row arithmetic on the host, shared by the torch path (stats.py) and the C kernel's
(native.py, nativebatch.py), which must agree with it bit for bit: the fixed-position
sample of a tensor, the summary of a row of raw statistics, and the histogram of the
samples of many rows in one pass. Below both, so each imports it at its top."""
from __future__ import annotations

import numpy as np
import torch

from .store import STAT_COLUMNS
from .tensorbatch import sample_index

SUMMARY = STAT_COLUMNS    # describe_rows' columns are the store's


def sample_of(flat: torch.Tensor, size: int) -> torch.Tensor:
    """A copy of SIZE elements at fixed random positions (every element if fewer)."""
    n = flat.numel()
    if n <= size:
        return flat.clone()
    return flat.index_select(0, sample_index(n, size, flat.device))


_OFFSETS: dict = {}     # (lengths, bins) -> each sample's first class index (+1)


def bin_rows(x: np.ndarray, lengths: np.ndarray, lo: np.ndarray, hi: np.ndarray,
             bins: int) -> np.ndarray:
    """Counts [K, bins + 2] of X (float64, the K rows' samples one after another, LENGTHS
    each) in BINS equal bins over [LO, HI] per row (HI itself in the last bin); column 0
    counts values below LO, the last those above HI; NaN/Inf are not counted. In place on
    one temporary, with a mask only when something is not finite."""
    k = len(lengths)
    key = (lengths.tobytes(), bins)
    off = _OFFSETS.get(key)
    if off is None:
        if len(_OFFSETS) > 64:
            _OFFSETS.clear()
        off = _OFFSETS[key] = np.repeat(np.arange(k, dtype=np.int64) * (bins + 2) + 1, lengths)
    width = hi - lo
    scale = np.where(width > 0, bins / np.where(width > 0, width, 1.0), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        t = x - np.repeat(lo, lengths)
        t *= np.repeat(scale, lengths)
        ok = None if np.isfinite(t.sum()) else np.isfinite(t)
        if ok is not None:
            t[~ok] = 0.0
        # class 0: below the range, 1..bins: the bins (hi itself in the last), bins+1: above
        t[t == bins] = bins - 1
        np.floor(t, out=t)
        np.clip(t, -1, bins, out=t)
        b = t.astype(np.int64)
    b += off
    if ok is not None:
        b = b[ok]
    return np.bincount(b, minlength=k * (bins + 2)).reshape(k, bins + 2)


def describe_rows(stats: np.ndarray) -> np.ndarray:
    """Vectorized summaries of host rows [K, 9] (`ROW`): [K, 10] float64 in `SUMMARY`
    order (NaN where undefined: no finite value, std of one)."""
    n, s, a, ss, lo, hi = stats[:, :6].T
    out = np.empty((len(stats), len(SUMMARY)))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        safe = np.maximum(n, 1.0)
        mean = s / safe
        var = (ss - s * mean) / np.maximum(n - 1, 1.0)
        std = np.sqrt(np.maximum(var, 0.0))
        std[np.isinf(ss)] = np.inf
        std[n <= 1] = np.nan
        out[:, 0] = n + stats[:, 6:].sum(1)
        out[:, 1] = mean
        out[:, 2] = a / safe
        out[:, 3] = std
        out[:, 4] = np.maximum(np.abs(lo), np.abs(hi))
        out[:, 5] = lo
        out[:, 6] = hi
        out[n <= 0, 1:7] = np.nan
        out[:, 7:] = stats[:, 6:]
    return out
