"""A recorded run in the dashboards people already watch (TensorBoard, Weights & Biases):
what a step of the store becomes there, and the export of stored runs
(`python -m mldebug runs export`, after the fact). The live mirror (mirror.py) makes the
same items from each step it has just committed, so both give the same tags and numbers.

Tags (one scheme in TensorBoard and in W&B)
    mldebug/<module>/<kind>[<i>]/<stat>   a module's input/output (and their gradients':
                                          input_grad, output_grad); <module> is the module
                                          path, '(root)' for the model itself
    mldebug/<param>/param/<stat>          a parameter (its dotted name), param_grad its .grad
    mldebug/<name>/tensor/<stat>          `mldebug.log_tensor(name, t)`
      <stat>: numel, mean, abs_mean, std, abs_max, min, max (of the finite values; NaN when
      there is none), nan, posinf, neginf (counts), hist_below, hist_above (sampled values
      outside the histogram's clipped range)
    mldebug/<...>/hist                    the histogram: the stored bins over [lo, hi]
    mldebug/kpi/<name>                    `mldebug.log_scalar(name, v)`
    mldebug/notes, mldebug/stops          notes, and the stops of the program (text)
A module called several times in a step gives its first call, as the Timeline draws it.
TensorBoard keeps scalars as float32; W&B keeps one value a key and step (the last).
Full tensors (`capture=`) and per-sample gradient norms stay in the store.
"""
from __future__ import annotations

import bisect
import math
import os
from typing import Iterator, Optional

import numpy as np

from .sinks import StepItems, TensorBoardSink, WandbSink, close_all
from .store import STAT_COLUMNS, Run, list_runs, open_run, run_path

STOP_NOTE = "[stop] "            # a stop's note in the store starts so (recorder.py)


def series_base(key: str) -> str:
    """The tag prefix of series KEY ('MODULE:KIND[I]', 'NAME:param', 'NAME:tensor')."""
    name, _, role = key.rpartition(":")
    return f"mldebug/{name or '(root)'}/{role}"


def add_series(items: StepItems, keys: list, rows: dict) -> int:
    """The stats and histograms of a step's rows (`store.unpack_step`, KEYS their series
    keys) into ITEMS; the number of series added."""
    calls = rows["calls"]
    first: dict = {}                    # key -> the row of its first call
    for i, key in enumerate(keys):
        j = first.get(key)
        if j is None or calls[i] < calls[j]:
            first[key] = i
    if not first:
        return 0
    pick = np.fromiter(first.values(), np.int64, len(first))
    bases = [series_base(key) for key in first]
    scalars = items.scalars
    for base, row in zip(bases, rows["stats"][pick].tolist()):
        scalars += [(f"{base}/{name}", v) for name, v in zip(STAT_COLUMNS, row)]
    bins = rows["hist"].shape[1]
    if not bins:
        return len(first)
    for base, (below, above) in zip(bases, rows["outside"][pick].tolist()):
        scalars += [(f"{base}/hist_below", below), (f"{base}/hist_above", above)]
    lo, hi = rows["ranges"][pick].T
    counts = rows["hist"][pick].astype(np.int64)
    # (what the Timeline draws: a finite range holding a sampled value)
    with np.errstate(invalid="ignore", over="ignore"):
        drawn = np.isfinite(lo) & np.isfinite(hi) & (hi >= lo) & (counts.sum(1) > 0)
        edges = lo[:, None] + (hi - lo)[:, None] * (np.arange(bins + 1) / bins)
    edges[:, -1] = hi
    for j in np.nonzero(drawn)[0].tolist():
        items.histograms[f"{bases[j]}/hist"] = (edges[j], counts[j])
    return len(first)


def add_scalars_and_notes(items: StepItems, scalars: list, notes: list) -> None:
    """KPIs [(name, value or None)] and note texts of one step into ITEMS."""
    items.scalars += [(f"mldebug/kpi/{name}", math.nan if v is None else float(v))
                      for name, v in scalars]
    stops = [t[len(STOP_NOTE):] for t in notes if t.startswith(STOP_NOTE)]
    plain = [t for t in notes if not t.startswith(STOP_NOTE)]
    # (TensorBoard's text is markdown: a blank line between two notes of one step)
    if plain:
        items.texts["mldebug/notes"] = "\n\n".join(plain)
    if stops:
        items.texts["mldebug/stops"] = "\n\n".join(stops)


def run_items(run: Run) -> Iterator[StepItems]:
    """The run's steps as items, ascending: recorded steps with their KPIs and notes, and
    the steps that hold only KPIs or notes. Wall times: the store's, else the latest
    earlier one (a step of KPIs only has none of its own)."""
    extra: dict = {}                      # step -> ([(name, value)], [note])
    for name, points in run.scalars().items():
        for step, value in points:
            extra.setdefault(step, ([], []))[0].append((name, value))
    for step, text in run.notes():
        extra.setdefault(step, ([], []))[1].append(text)
    times = run.step_times()
    known = sorted(times)

    def when(step: int) -> Optional[float]:
        i = bisect.bisect_right(known, step)
        return times[known[i - 1]] if i else (times[known[0]] if known else None)

    def item(step: int, rows: Optional[dict]) -> StepItems:
        out = StepItems(step, walltime=when(step))
        if rows is not None:
            add_series(out, rows["keys"], rows)
        scalars, notes = extra.pop(step, ([], []))
        add_scalars_and_notes(out, scalars, notes)
        return out

    pending, p = sorted(extra), 0         # the steps of KPIs or notes, ascending
    for step, rows in run.step_rows():
        while p < len(pending) and pending[p] <= step:
            if pending[p] < step:
                yield item(pending[p], None)
            p += 1
        yield item(step, rows)
    for step in pending[p:]:
        yield item(step, None)


def export_run(run: Run, sinks: list) -> dict:
    """Write RUN's steps into every sink (flushed, not closed); what was written:
    {steps, series, scalars, histograms, texts, stops}."""
    counts = {"steps": 0, "series": len(run.series()), "scalars": 0, "histograms": 0,
              "texts": 0, "stops": 0}
    for items in run_items(run):
        if not items:
            continue
        for sink in sinks:
            sink.write(items)
        counts["steps"] += 1
        counts["scalars"] += len(items.scalars)
        counts["histograms"] += len(items.histograms)
        counts["texts"] += len(items.texts)
        stops = items.texts.get("mldebug/stops")
        counts["stops"] += stops.count("\n\n") + 1 if stops else 0
    for sink in sinks:
        sink.flush()
    return counts


def runs_to_export(source: str, name: Optional[str] = None) -> list:
    """The store paths SOURCE names: a run directory (every run in it, or run NAME), or
    one .sqlite file. Raises FileNotFoundError / NotADirectoryError with the reason."""
    source = os.fspath(source)
    if os.path.isfile(source):
        if name is not None:
            raise NotADirectoryError(f"--run names a run of a directory; {source!r} is a file")
        return [source]
    if name is not None:
        path = run_path(source, name)
        if not os.path.isdir(source):
            list_runs(source)             # raises for a missing directory
        if not os.path.exists(path):
            names = [r["name"] for r in list_runs(source)]
            raise FileNotFoundError(f"no run {name!r} in {source!r} (runs: "
                                    f"{', '.join(names) if names else 'none'})")
        return [path]
    return [r["path"] for r in list_runs(source) if r["status"] != "unreadable"]


def export(source: str, name: Optional[str] = None, tensorboard: Optional[str] = None,
           wandb: bool = False, say=print) -> list:
    """Export the runs SOURCE names (`runs_to_export`) to TensorBoard (event files under
    TENSORBOARD/<run name>/) and/or to W&B (one new run each, named after the run);
    SAY(line) tells each one. Returns [{run, path, where: [...], steps, series, ...}]."""
    if tensorboard is None and not wandb:
        raise ValueError("export: name a target (tensorboard=DIR or wandb=True)")
    if tensorboard is not None and os.path.exists(tensorboard) and not os.path.isdir(tensorboard):
        raise NotADirectoryError(f"--tensorboard {tensorboard!r} is a file, not a directory")
    done = []
    for path in runs_to_export(source, name):
        with open_run(path) as run:
            sinks: list = []
            try:
                if tensorboard is not None:
                    sinks.append(TensorBoardSink.open(os.path.join(tensorboard, run.name),
                                                      what="runs export --tensorboard"))
                if wandb:
                    sinks.append(WandbSink.open(run.name, {"mldebug": run.meta},
                                                what="runs export --wandb",
                                                job_type="mldebug-export"))
                counts = export_run(run, sinks)
            finally:
                failed = close_all(sinks)
            if failed:
                sink, exc = failed[0]
                raise RuntimeError(f"closing {sink.where} failed: {type(exc).__name__}: {exc}")
            state = "" if run.status == "closed" else " (unclosed: what is committed)"
            counts.update(run=run.name, path=path, where=[s.where for s in sinks])
            say(f"{run.name}{state}: {counts['steps']} steps, {counts['series']} series, "
                f"{counts['stops']} stops -> {', '.join(counts['where'])}")
            done.append(counts)
    return done
