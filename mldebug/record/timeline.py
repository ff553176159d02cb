"""JSON-able reads of stored runs for a timeline view (the browser view's panel, or any
other front end): per-module histograms over steps (TorchExplorer style), stat lines over
steps, KPI curves, and two runs side by side. Plain dicts and lists only; every number
is finite or None (`json.dumps(d, allow_nan=False)` works).

    timeline(run, modules=None, kinds=None, max_steps=200) -> dict
    compare(run_a, run_b, **same) -> {'runs': [timeline_a, timeline_b], 'common': [keys]}
    resample_hist(lo, hi, counts, edges) -> counts on EDGES   (pure numpy)
    hist_grid(series, bins=64) -> a series' histograms over steps on one value grid

`run` is a Run, a path to a .sqlite file, or a (run_dir, name) pair. For a module called
several times in one step, its first call is shown (`calls` says how many there were).

    {"name": "baseline", "path": ..., "status": "closed", "steps": [0, 10, ...],
     "meta": {...}, "rank": 1 (the rank of a job that recorded it; None: one process),
     "world_size": 2,
     "series": [{"key": "fc:output[0]", "module": "fc", "kind": "output", "idx": 0,
                 "name": "", "role": "", "shape": [64, 10], "dtype": "float32",
                 "steps": [...], "calls": max invocations in a step,
                 "stats": {"mean": [...], "abs_mean": [...], "std": [...],
                           "abs_max": [...], "min": [...], "max": [...],
                           "nan": [...], "posinf": [...], "neginf": [...], "numel": [...]},
                 "hist": {"lo": [...], "hi": [...], "counts": [[...], ...],
                          "below": [...], "above": [...], "sample_n": [...]}}],
     "scalars": {"loss": {"steps": [...], "values": [...]}},
     "notes": [{"step": 3, "text": "..."}]}
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Optional

import numpy as np

from .store import STAT_COLUMNS, Run, open_run


def _open(run):
    if isinstance(run, Run):
        return run, False
    if isinstance(run, tuple) and len(run) == 2:
        return open_run(run[1], run_dir=run[0]), True
    return open_run(os.fspath(run)), True


def _num(v):
    v = float(v)
    return v if math.isfinite(v) else None


def _thin(n: int, max_points: Optional[int]) -> np.ndarray:
    """Indices of at most MAX_POINTS evenly spread items of N, first and last included."""
    if max_points is None or n <= max_points:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_points).round().astype(np.int64))


def timeline(run, modules: Optional[Iterable[str]] = None,
             kinds: Optional[Iterable[str]] = None, max_steps: Optional[int] = 200) -> dict:
    """The run's series (optionally only MODULES / KINDS), at most MAX_STEPS steps each."""
    run, owned = _open(run)
    try:
        mods = set(modules) if modules is not None else None
        kset = set(kinds) if kinds is not None else None
        series = [s for s in run.series()
                  if (mods is None or s["module"] in mods) and (kset is None or s["kind"] in kset)]
        table = run.table([s["key"] for s in series]) if series else {}
        out_series = []
        for s in series:
            t = table[s["key"]]
            # the first call of each step: rows by (step, call), as gradients are stored
            # in the order backward reaches them (a module's later call first)
            order = np.lexsort((t["calls"], t["steps"]))
            first = np.ones(len(order), bool)
            if len(order):
                first[1:] = t["steps"][order][1:] != t["steps"][order][:-1]
            calls = int(t["calls"].max()) + 1 if len(t["calls"]) else 0
            idx = order[first]
            idx = idx[_thin(len(idx), max_steps)]
            st = t["stats"][idx]
            stats = {}
            for j, name in enumerate(STAT_COLUMNS):
                col = st[:, j] if len(idx) else np.zeros(0)
                if name in ("numel", "nan", "posinf", "neginf"):
                    stats[name] = [int(v) for v in col]
                else:
                    stats[name] = [_num(v) for v in col]
            hist = {"lo": [_num(v) for v in t["ranges"][idx, 0]] if len(idx) else [],
                    "hi": [_num(v) for v in t["ranges"][idx, 1]] if len(idx) else [],
                    "counts": t["hist"][idx].astype(int).tolist() if len(idx) else [],
                    "below": [int(v) for v in t["outside"][idx, 0]] if len(idx) else [],
                    "above": [int(v) for v in t["outside"][idx, 1]] if len(idx) else [],
                    "sample_n": [int(v) for v in t["sample_n"][idx]]}
            out_series.append(dict(s, steps=[int(v) for v in t["steps"][idx]], calls=calls,
                                   stats=stats, hist=hist))
        scalars = {}
        for name, points in run.scalars().items():
            keep = _thin(len(points), max_steps * 5 if max_steps else None)
            scalars[name] = {"steps": [int(points[i][0]) for i in keep],
                             "values": [_num(points[i][1]) for i in keep]}
        meta = {k: v for k, v in run.meta.items()
                if isinstance(v, (str, int, float, bool, list, type(None)))}
        return {"name": run.name, "path": run.path, "status": run.status,
                "steps": run.steps(), "meta": meta, "series": out_series,
                "rank": meta.get("rank"), "world_size": meta.get("world_size"),
                "scalars": scalars,
                "notes": [{"step": s, "text": t} for s, t in run.notes()]}
    finally:
        if owned:
            run.close()


def compare(run_a, run_b, **kwargs) -> dict:
    """Two runs side by side: both timelines, and the series keys they share (in A's
    order) so a view can line them up."""
    a = timeline(run_a, **kwargs)
    b = timeline(run_b, **kwargs)
    keys_b = {s["key"] for s in b["series"]}
    return {"runs": [a, b], "common": [s["key"] for s in a["series"] if s["key"] in keys_b],
            "scalars": sorted(set(a["scalars"]) & set(b["scalars"]))}


def resample_hist(lo, hi, counts, edges) -> np.ndarray:
    """The counts of a histogram of len(COUNTS) equal bins over [LO, HI], moved onto the
    bins between ascending EDGES (float64, len(EDGES) - 1 values). Each source bin's
    count is spread evenly over its width, so a target bin gets the overlapping share:
    target edges that are source edges give back the source's sums exactly; mass outside
    [EDGES[0], EDGES[-1]] is dropped. LO == HI (a constant tensor) puts every count in the
    target bin holding LO. Raises ValueError for unordered edges or HI < LO."""
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    if edges.ndim != 1 or len(edges) < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError(f"edges must be at least 2 increasing values, edges={edges!r}")
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        raise ValueError(f"the source range must be finite with lo <= hi, lo={lo}, hi={hi}")
    out = np.zeros(len(edges) - 1)
    total = counts.sum()
    if counts.size == 0 or total == 0:
        return out
    if hi == lo:
        j = np.searchsorted(edges, lo, side="right") - 1
        if lo == edges[-1]:
            j = len(out) - 1
        if 0 <= j < len(out):
            out[j] = total
        return out
    src = np.linspace(lo, hi, counts.size + 1)
    cdf = np.concatenate([[0.0], np.cumsum(counts)])
    return np.diff(np.interp(edges, src, cdf))   # interp clamps: 0 below, total above


def hist_grid(series: dict, bins: int = 64) -> dict:
    """The histograms of one `timeline()` series over its steps on a common value grid
    (each step's bins differ: each is resampled with resample_hist), for a
    TorchExplorer-style image: x = step, y = value, colour = share of the step's samples.

        {"steps": [...], "edges": [bins + 1 values], "lo", "hi",
         "share": [[...] * len(steps)] * bins     rows = value bins (low to high),
                                                  columns = steps; None where a step
                                                  has no histogram (non-finite range, or
                                                  nothing sampled)}
    Values below/above a step's clipped range (outliers) are not drawn."""
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, bins={bins!r}")
    h = series["hist"]
    steps = list(series["steps"])
    ok = [i for i in range(len(steps)) if h["lo"][i] is not None and h["hi"][i] is not None
          and h["hi"][i] >= h["lo"][i] and sum(h["counts"][i]) > 0]
    if ok:
        lo = min(h["lo"][i] for i in ok)
        hi = max(h["hi"][i] for i in ok)
    else:
        lo, hi = 0.0, 1.0
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    grid = np.full((bins, len(steps)), np.nan)
    for i in ok:
        col = resample_hist(h["lo"][i], h["hi"][i], h["counts"][i], edges)
        grid[:, i] = col / max(sum(h["counts"][i]), 1)
    return {"steps": steps, "edges": edges.tolist(), "lo": float(lo), "hi": float(hi),
            "share": [[None if math.isnan(v) else float(v) for v in r] for r in grid]}
